"""The CUDA device: the Device contract on cuda-python's driver bindings (``cuda.bindings``).

Nothing here touches the driver, or imports ``cuda.*``, until ``usable()`` / ``why_unusable()``
is asked or a ``CudaDevice`` is made: ``get_device("auto")`` imports this module on machines
without a GPU. Every failed driver call becomes ``DeviceError("CUDA_ERROR_X: explanation")``
(through ``check()``, or ``_fail()`` for the GIL-holding short calls); only the staging pool's
query of a chunk's event is read as done / not done. The primary context and raw driver handles
serve better than cuda.core's objects here: lanes drive one context from many threads, and the
launch path is measured against a raw ``cuLaunchKernel``.

Guarantees:
- any public entry may be called from any host thread: the device's context is made current on
  a thread before its first driver call there (once per thread, then a cheap check);
- ``copy_from_host``'s source may change as soon as the call returns, and the call does not
  wait for the stream (pinned staging, see ``_Staging``) unless more than the pool's 64 MiB
  are in flight: then it waits for the oldest staged copy; device-to-host copies into pageable
  memory do wait for the stream, as CUDA does;
- a thread's per-thread stream is drained when the thread ends (see ``_PerThreadStream``);
- foreign streams are never destroyed; created streams are destroyed once, by ``close()`` or
  their finalizer, and a finalizer never raises.
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from streamlane.kernels import KernelSpec

from .device import Device, PreparedLaunch, arity_error, bound_argument_error
from .errors import DeviceError, InvalidArgument, KernelCompileError
from .event import Event
from .memory import DeviceArray
from .stream import LEGACY, LEGACY_HANDLE, PER_THREAD, PER_THREAD_HANDLE, Stream

__all__ = ["CudaDevice", "check", "usable", "why_unusable"]

LATCH_TIMEOUT_US = 60_000_000

# Pageable host-to-device copies: measured on an H200 (driver 580) with the stream busy for
# 300 ms, cuMemcpyHtoDAsync from pageable memory returned in <0.25 ms with the source already
# consumed for sizes up to 1 MiB, but blocked for the whole 300 ms at 16 MiB (the driver's own
# staging ran out and it waited for the stream). Up to this size we rely on the driver's
# staging, well inside the measured safe range; above it we stage through our own pinned
# buffers, so the call never waits for the stream (a latch-held stream would hang it). The
# price, on an idle stream: 7.7-8.8 GB/s through our chunks against 8.7-12 GB/s for the driver's
# pageable path (1-64 MiB), since the host copy into a chunk is single-threaded.
DIRECT_H2D_MAX = 64 << 10
STAGING_CHUNK = 4 << 20
STAGING_MAX_CHUNKS = 16  # 64 MiB pinned at most in flight; more waits for the oldest chunk

_STICKY = ("CUDA_ERROR_ILLEGAL_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
           "CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_MISALIGNED_ADDRESS",
           "CUDA_ERROR_INVALID_ADDRESS_SPACE", "CUDA_ERROR_INVALID_PC",
           "CUDA_ERROR_HARDWARE_STACK_ERROR", "CUDA_ERROR_ASSERT")

# -- the driver, loaded on first use --------------------------------------------------------
_driver: Any = None  # cuda.bindings.driver
_SUCCESS: Any = None  # CUresult.CUDA_SUCCESS: the bindings return this very object
_NOT_READY: Any = None
_NOT_READY_CODE = 600  # CUDA_ERROR_NOT_READY, as a short call returns it
_context_lost = False  # a sticky error (a kernel fault) was seen: the context is unusable
_probe_lock = threading.Lock()
_probed = False
_reason: str | None = None


def why_unusable() -> str | None:
    """Why CUDA cannot be used here, or None when it can. Asked once per process."""
    global _probed, _reason
    if not _probed:
        with _probe_lock:
            if not _probed:
                _reason = _probe()
                _probed = True
    return _reason


def usable() -> bool:
    """Whether a CUDA device is usable (driver loads, initializes and sees a device)."""
    return why_unusable() is None


def _probe() -> str | None:
    global _driver, _SUCCESS, _NOT_READY
    try:
        from cuda.bindings import driver
    except Exception as exc:  # ImportError, or a broken install failing as it loads
        return (f"no CUDA driver bindings: cuda.bindings could not be imported "
                f"({type(exc).__name__}: {exc}); install cuda-python")
    try:
        result = driver.cuInit(0)
    except Exception as exc:  # cuda.pathfinder raises when libcuda.so cannot be found
        return f"no CUDA driver: libcuda could not be loaded ({exc})"
    _driver = driver
    _SUCCESS = driver.CUresult.CUDA_SUCCESS
    _NOT_READY = driver.CUresult.CUDA_ERROR_NOT_READY
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    hint = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
    if result[0] == driver.CUresult.CUDA_ERROR_NO_DEVICE:
        return f"no CUDA device: the driver found 0 devices{hint}"
    try:
        check(result)
        count = check(driver.cuDeviceGetCount())
    except DeviceError as exc:
        return f"the CUDA driver failed to initialize: {exc}"
    if count == 0:
        return f"no CUDA device: the driver found 0 devices{hint}"
    return None


def check(result: tuple[Any, ...]) -> Any:
    """The one checked path for every driver call: takes the tuple a ``cuda.bindings.driver``
    function returns, raises ``DeviceError`` (``code`` = ``CUDA_ERROR_X``) unless it succeeded,
    and returns the remaining values: None, the single value, or a tuple."""
    err = result[0]
    if err is not _SUCCESS and err != 0:
        raise _error(err)
    n = len(result)
    if n == 2:
        return result[1]
    return None if n == 1 else result[1:]


def _error(err: Any) -> DeviceError:
    name = getattr(err, "name", None) or f"CUDA_ERROR_{int(err)}"
    text = "unknown error"
    try:
        res, raw = _driver.cuGetErrorString(err)
        if res == 0 and raw:
            text = raw.decode(errors="replace")
    except Exception:  # the explanation is a nicety; the code alone still names the error
        pass
    if name in _STICKY:
        global _context_lost
        _context_lost = True
        text += ("; the CUDA context is now unusable (a kernel faulted): every later call on "
                 "this device fails, restart the process")
    elif name == "CUDA_ERROR_OUT_OF_MEMORY":
        text += "; free buffers you no longer need or use smaller shapes"
    return DeviceError(text, name)


# -- per-thread state ---------------------------------------------------------------------------
class _Bound(threading.local):
    context: Any = None  # the CUcontext streamlane last made current on this thread
    hold_gil = False  # make short driver calls without releasing the GIL (Device.hold_gil)


class _ShortCalls:
    """The driver calls that never wait for the device while its queue has room —
    ``cuLaunchKernel``, ``cuEventRecord``, ``cuEventQuery``, ``cuStreamWaitEvent``,
    ``cuEventElapsedTime`` — called
    through ``ctypes.PyDLL``, which keeps the GIL (torch and CuPy launch with the GIL held too).
    cuda.bindings releases the GIL around every call; from a lane that hands the GIL to the
    event loop at each launch, and the lane then waits for the loop to give it back (measured
    on an H200 with py-spy: most of a lane's time sat in the launch line). Loaded from the same
    libcuda cuda.bindings uses; None where that fails (the bindings path is used instead).

    This is the one place streamlane declares driver prototypes itself, against DESIGN.md's
    "no hand-written ctypes around the driver": cuda-python offers no call that keeps the GIL,
    and lanes ran 1.5-2.0x more programs per second with these five (one H200, alternating
    processes: bench/results/sched-throughput-hold-gil-*.json). The
    prototypes are the CUDA driver's stable C ABI, used only with handles cuda.bindings
    created; ``STREAMLANE_HOLD_GIL=0`` turns them off (README)."""

    def __init__(self) -> None:
        lib = ctypes.PyDLL("libcuda.so.1")
        vp, u = ctypes.c_void_p, ctypes.c_uint
        self.launch = lib.cuLaunchKernel
        self.launch.argtypes = [vp, u, u, u, u, u, u, u, vp, vp, vp]
        self.record = lib.cuEventRecord
        self.record.argtypes = [vp, vp]
        self.query = lib.cuEventQuery
        self.query.argtypes = [vp]
        self.wait = lib.cuStreamWaitEvent
        self.wait.argtypes = [vp, vp, u]
        # CUDA 13 headers map cuEventElapsedTime to its _v2 (same signature); older drivers
        # export only the first.
        self.elapsed = getattr(lib, "cuEventElapsedTime_v2", None) or lib.cuEventElapsedTime
        self.elapsed.argtypes = [ctypes.POINTER(ctypes.c_float), vp, vp]
        for fn in (self.launch, self.record, self.query, self.wait, self.elapsed):
            fn.restype = ctypes.c_int


def _max_connections(value: str | None) -> int:
    """The hardware queues the driver gives a context for CUDA_DEVICE_MAX_CONNECTIONS (read
    when the context is created: this is the value in the environment when streamlane opened
    the device, which is the driver's unless another library created the context earlier)."""
    try:
        n = int(value) if value is not None else 8
    except ValueError:
        return 8
    return min(n, 32) if n > 0 else 8  # the driver's default for 0 or less, at most 32


def _hold_gil_allowed(value: str | None) -> bool:
    """``STREAMLANE_HOLD_GIL``: ``0`` turns the GIL-holding short calls off, so every driver
    call goes through cuda.bindings (which releases the GIL) and ``hold_gil`` is a no-op;
    unset, empty or ``1`` leaves them on. Anything else is refused, never guessed."""
    text = "" if value is None else value.strip()
    if text in ("", "1"):
        return True
    if text == "0":
        return False
    raise InvalidArgument(f"STREAMLANE_HOLD_GIL must be 0 (every driver call through "
                          f"cuda.bindings, GIL released) or 1 (the default), got {value!r}")


def _short_calls() -> _ShortCalls | None:
    try:
        return _ShortCalls()
    except (OSError, AttributeError):
        return None


def _not_complete() -> InvalidArgument:
    return InvalidArgument("elapsed_ms: both events must have completed; synchronize the end "
                           "event first")


def _fail(rc: int) -> DeviceError:
    """The DeviceError for a nonzero CUresult returned by a short call."""
    return _error(_driver.CUresult(rc))


class _PerThreadStream:
    """A thread's per-thread Stream, kept in a thread-local. When the thread ends, CPython
    drops it in that very thread, before the driver's own thread cleanup runs: we wait there
    for the stream to drain. Measured on an H200 (driver 580): a thread that exits with work
    still queued on its per-thread stream (say, waiting on another stream's event) wedges the
    context, and later cuStreamCreate / cuCtxSynchronize calls from any thread never return.
    The wait is not counted in ``host_waits``: no caller asked for it."""

    __slots__ = ("stream",)

    def __init__(self, stream: Stream):
        self.stream = stream

    def __del__(self) -> None:
        self.stream._thread_ended()
        if _context_lost:
            return  # after a kernel fault nothing runs on it any more: nothing to drain
        try:
            device = self.stream.device
            check(_driver.cuCtxSetCurrent(device._context))
            check(_driver.cuStreamSynchronize(device._per_thread_impl))
        except Exception:  # the thread never used the device, or the interpreter is exiting
            pass


class _ThreadLocal(threading.local):
    holder: _PerThreadStream | None = None


_bound = _Bound()


SPARE_EVENTS_MAX = 1024  # CUevent handles a device keeps for reuse, per kind


class _CudaEvent:
    """A CUevent. With its last reference the handle goes back to its device's spares (no
    driver call: events die on whatever thread drops them, the event loop's included, and on
    the H200 a cuEventDestroy there waited behind a lane blocked in the driver), and the next
    event of that kind reuses it. A spare may still have a record pending; waits already
    enqueued on it are unaffected, and an Event that was never recorded is complete without
    asking the driver (Event's contract), so the stale record is never observed."""

    __slots__ = ("addr", "handle", "spares")

    def __init__(self, handle: Any, spares: list[Any]):
        self.handle = handle
        self.addr = int(handle)  # for the short calls
        self.spares = spares

    def __del__(self) -> None:
        if len(self.spares) < SPARE_EVENTS_MAX:
            self.spares.append(self.handle)
            return
        try:
            check(_driver.cuEventDestroy(self.handle))
        except Exception:  # interpreter shutdown, dead context: nothing left to free
            pass


class _LatchFlag:
    """One host-mapped uint32 of a latch; ``release()`` writes 1 into it (plain memory)."""

    __slots__ = ("_flag",)

    def __init__(self, host_ptr: int):
        self._flag = ctypes.c_uint32.from_address(host_ptr)
        self._flag.value = 0

    def release(self) -> None:
        self._flag.value = 1


class _FlagPages:
    """Latch flags carved out of pinned, device-mapped pages that are never freed.

    A released latch's kernel may still be queued behind other work and read its flag later;
    freeing the flag (cuMemFreeHost) when the Latch object dies would turn that read into an
    illegal-address fault that kills the context. So a flag is never freed nor reused: it costs
    4 bytes, and a 4 KiB page serves 1024 latches.
    """

    PAGE = 4096

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._host = self._dev = self._left = 0

    def take(self) -> tuple[int, int]:
        """(host address, device address) of a fresh flag."""
        with self._lock:
            if self._left == 0:
                flags = _driver.CU_MEMHOSTALLOC_DEVICEMAP | _driver.CU_MEMHOSTALLOC_PORTABLE
                host = check(_driver.cuMemHostAlloc(self.PAGE, flags))
                self._dev = int(check(_driver.cuMemHostGetDevicePointer(host, 0)))
                self._host, self._left = host, self.PAGE // 4
            offset = (self.PAGE // 4 - self._left) * 4
            self._left -= 1
            return self._host + offset, self._dev + offset


class _Chunk:
    __slots__ = ("array", "event", "host_ptr")

    def __init__(self) -> None:
        self.host_ptr = check(_driver.cuMemHostAlloc(STAGING_CHUNK,
                                                     _driver.CU_MEMHOSTALLOC_PORTABLE))
        raw = (ctypes.c_char * STAGING_CHUNK).from_address(self.host_ptr)
        self.array = np.frombuffer(raw, dtype=np.uint8)
        self.event = check(_driver.cuEventCreate(
            _driver.CUevent_flags.CU_EVENT_DISABLE_TIMING))


class _Staging:
    """Pinned staging buffers for pageable host-to-device copies above ``DIRECT_H2D_MAX``.

    Each chunk's reuse is guarded by an event recorded after the copy that reads it. Chunks go
    back in FIFO order, so the oldest (most likely finished) is tried first; a busy one is only
    waited for (a counted host wait) once ``STAGING_MAX_CHUNKS`` exist. Chunks live as long as
    the device (the process).
    """

    def __init__(self, device: CudaDevice):
        self._device = device
        self._lock = threading.Lock()
        self._idle: deque[_Chunk] = deque()
        self._total = 0

    def copy(self, dst_ptr: int, src: np.ndarray, nbytes: int, stream_impl: Any) -> None:
        data = src.reshape(-1).view(np.uint8)
        for offset in range(0, nbytes, STAGING_CHUNK):
            size = min(STAGING_CHUNK, nbytes - offset)
            chunk = self._acquire()
            np.copyto(chunk.array[:size], data[offset:offset + size])
            check(_driver.cuMemcpyHtoDAsync(dst_ptr + offset, chunk.host_ptr, size, stream_impl))
            check(_driver.cuEventRecord(chunk.event, stream_impl))
            # Only now may the chunk be reused; after a failure above it is dropped instead,
            # since a copy may still be reading it with no event to say when it is done.
            with self._lock:
                self._idle.append(chunk)

    def _acquire(self) -> _Chunk:
        chunk, must_wait = None, False
        with self._lock:
            if self._idle:
                done = _driver.cuEventQuery(self._idle[0].event)[0] is _SUCCESS
                if done or self._total >= STAGING_MAX_CHUNKS:
                    chunk, must_wait = self._idle.popleft(), not done
            if chunk is None:
                self._total += 1
        if chunk is None:
            try:
                return _Chunk()
            except BaseException:
                with self._lock:
                    self._total -= 1
                raise
        if must_wait:
            self._device._count_wait()
            check(_driver.cuEventSynchronize(chunk.event))
        return chunk


# -- the device -------------------------------------------------------------------------------
class CudaDevice(Device):
    """One CUDA GPU through its primary context (shared with torch / CuPy in this process)."""

    kind = "cuda"

    def __init__(self, index: int = 0):
        reason = why_unusable()
        if reason is not None:
            raise DeviceError(f"cannot use cuda:{index}: {reason}. On a machine without a "
                              f"usable GPU use get_device('host') (or STREAMLANE_DEVICE=host)")
        hold_gil = _hold_gil_allowed(os.environ.get("STREAMLANE_HOLD_GIL"))
        count = check(_driver.cuDeviceGetCount())
        if not 0 <= index < count:
            raise DeviceError(f"cuda:{index} does not exist: the driver found {count} "
                              f"device(s), cuda:0..cuda:{count - 1}")
        super().__init__(index)
        d = _driver
        self._cu_device = check(d.cuDeviceGet(index))
        # Retained for the life of the process: devices are cached by get_device and never
        # closed, and torch / CuPy share this same primary context.
        self._context = check(d.cuDevicePrimaryCtxRetain(self._cu_device))
        self._make_current()
        attr = d.CUdevice_attribute
        major = self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
        minor = self._attribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
        self.arch = f"sm_{major}{minor}"
        self.device_name = check(d.cuDeviceGetName(256, self._cu_device)).split(b"\0", 1)[0] \
            .decode(errors="replace").strip()
        self.total_memory = int(check(d.cuDeviceTotalMem(self._cu_device)))
        self._memory_pools = bool(self._attribute(attr.CU_DEVICE_ATTRIBUTE_MEMORY_POOLS_SUPPORTED))
        self._per_thread_impl = d.CUstream(d.CU_STREAM_PER_THREAD)
        self._legacy_impl = d.CUstream(d.CU_STREAM_LEGACY)
        self._legacy = Stream(self, LEGACY, LEGACY_HANDLE, self._legacy_impl)
        self._thread_local = _ThreadLocal()
        self._staging = _Staging(self)
        self._flags = _FlagPages()
        self._kernel_cache: Any = None
        self._modules: list[Any] = []  # loaded modules stay alive with the device
        self._module_of: dict[str, Any] = {}  # kernel name -> its module (entries share it)
        self._plans: dict[int, tuple[Any, ...]] = {}  # id(PreparedLaunch) -> launch plan
        self._cu_launch = d.cuLaunchKernel
        self._short = _short_calls() if hold_gil else None
        self._spare_events: dict[bool, list[Any]] = {True: [], False: []}  # by timing
        self.hardware_queues = _max_connections(os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))

    def hold_gil(self, enabled: bool) -> bool:
        """See ``Device.hold_gil``: on CUDA, the ``_ShortCalls`` from this thread keep the GIL
        while ``enabled`` (a no-op where libcuda could not be loaded through ctypes)."""
        previous = _bound.hold_gil
        _bound.hold_gil = bool(enabled) and self._short is not None
        return previous

    def _attribute(self, which: Any) -> int:
        return int(check(_driver.cuDeviceGetAttribute(which, self._cu_device)))

    def _make_current(self) -> None:
        # A thread-local note of what we made current, so the hot path pays one identity check.
        # Code that switches this thread to another context behind our back (torch.cuda.
        # set_device(other GPU) in a callable step) must switch back before returning.
        check(_driver.cuCtxSetCurrent(self._context))
        _bound.context = self._context

    def __repr__(self) -> str:
        return (f"<CudaDevice {self.name} {self.device_name} {self.arch} "
                f"{self.total_memory / 2**30:.1f} GiB>")

    # -- streams ------------------------------------------------------------------------------
    _threads_hang_when_lost = True

    @property
    def lost(self) -> bool:
        # Process-wide: the driver offers no query for "this context hit a sticky error"
        # short of making a call and failing, so the first sticky error seen marks it.
        return _context_lost

    def per_thread_stream(self) -> Stream:
        holder = self._thread_local.holder
        if holder is None:
            holder = self._thread_local.holder = _PerThreadStream(Stream(
                self, PER_THREAD, PER_THREAD_HANDLE, self._per_thread_impl,
                owner_thread=threading.get_ident()))
        return holder.stream

    def legacy_stream(self) -> Stream:
        return self._legacy

    def _new_stream(self) -> tuple[int, Any]:
        if _bound.context is not self._context:
            self._make_current()
        stream = check(_driver.cuStreamCreate(_driver.CUstream_flags.CU_STREAM_NON_BLOCKING))
        return int(stream), stream

    def _destroy_stream(self, impl: Any) -> None:
        # Runs from close() or a finalizer (any thread, or interpreter shutdown). CUDA defers
        # the release until the stream's queued work is done.
        try:
            if _bound.context is not self._context:
                self._make_current()
            check(_driver.cuStreamDestroy(impl))
        except Exception:
            pass

    def _foreign_stream(self, handle: int) -> Any:
        if _bound.context is not self._context:
            self._make_current()
        stream = _driver.CUstream(handle)
        owner = check(_driver.cuStreamGetCtx(stream))
        if int(owner) != int(self._context):
            raise InvalidArgument(f"stream {handle:#x} belongs to another CUDA context than "
                                  f"{self.name}'s primary context (another GPU, or a context "
                                  f"created by hand); wrap it with the device it was made on")
        return stream

    def _stream_synchronize(self, impl: Any) -> None:
        if _bound.context is not self._context:
            self._make_current()
        self._count_wait()
        check(_driver.cuStreamSynchronize(impl))

    def _stream_wait(self, impl: Any, event: Event) -> None:
        if not event.recorded:
            return  # never recorded: complete (its handle may be a spare with a stale record)
        if _bound.context is not self._context:
            self._make_current()
        if _bound.hold_gil:
            rc = self._short.wait(int(impl), event._impl.addr, 0)  # type: ignore[union-attr]
            if rc:
                raise _fail(rc)
            return
        check(_driver.cuStreamWaitEvent(impl, event._impl.handle, 0))

    # -- events -------------------------------------------------------------------------------
    def _new_event(self, timing: bool) -> Any:
        if _bound.context is not self._context:
            self._make_current()
        # Default flags, not CU_EVENT_BLOCKING_SYNC: a host wait may spin, which answers in
        # microseconds instead of a scheduler wake-up; the waiting thread has released the GIL.
        spares = self._spare_events[timing]
        try:
            return _CudaEvent(spares.pop(), spares)
        except IndexError:
            flags = 0 if timing else _driver.CUevent_flags.CU_EVENT_DISABLE_TIMING
            return _CudaEvent(check(_driver.cuEventCreate(flags)), spares)

    def _record(self, event: Event, stream_impl: Any) -> None:
        if _bound.context is not self._context:
            self._make_current()
        if _bound.hold_gil:
            rc = self._short.record(event._impl.addr, int(stream_impl))  # type: ignore[union-attr]
            if rc:
                raise _fail(rc)
        else:
            check(_driver.cuEventRecord(event._impl.handle, stream_impl))
        event.recorded = True

    def _event_query(self, event: Event) -> bool:
        if not event.recorded:
            return True  # see _stream_wait
        if _bound.context is not self._context:
            self._make_current()
        if _bound.hold_gil:
            rc = self._short.query(event._impl.addr)  # type: ignore[union-attr]
            if rc == _NOT_READY_CODE:
                return False
            if rc:
                raise _fail(rc)
            return True
        result = _driver.cuEventQuery(event._impl.handle)
        if result[0] == _NOT_READY:
            return False
        check(result)
        return True

    def _event_synchronize(self, event: Event) -> None:
        if not event.recorded:
            return  # see _stream_wait
        if _bound.context is not self._context:
            self._make_current()
        self._count_wait()
        check(_driver.cuEventSynchronize(event._impl.handle))  # releases the GIL

    def _elapsed_ms(self, start: Event, end: Event) -> float:
        if _bound.context is not self._context:
            self._make_current()
        if _bound.hold_gil:
            ms = ctypes.c_float()
            rc = self._short.elapsed(ctypes.byref(ms), start._impl.addr,  # type: ignore[union-attr]
                                     end._impl.addr)
            if rc == _NOT_READY_CODE:
                raise _not_complete()
            if rc:
                raise _fail(rc)
            return float(ms.value)
        result = _driver.cuEventElapsedTime(start._impl.handle, end._impl.handle)
        if result[0] == _NOT_READY:
            raise _not_complete()
        return float(check(result))

    def _device_synchronize(self) -> None:
        if _bound.context is not self._context:
            self._make_current()
        check(_driver.cuCtxSynchronize())

    # -- memory -------------------------------------------------------------------------------
    def _alloc(self, nbytes: int, stream_impl: Any) -> tuple[int, Any]:
        if _bound.context is not self._context:
            self._make_current()
        if self._memory_pools:
            stream = self._legacy_impl if stream_impl is None else stream_impl
            return int(check(_driver.cuMemAllocAsync(nbytes, stream))), True
        return int(check(_driver.cuMemAlloc(nbytes))), False

    def _free_memory(self, ptr: int, impl: Any, stream_impl: Any, after: list[Event]) -> None:
        if _bound.context is not self._context:
            self._make_current()
        stream = self._legacy_impl if stream_impl is None else stream_impl
        for event in after:  # every stream that used the buffer has passed its use (rule 8)
            check(_driver.cuStreamWaitEvent(stream, event._impl.handle, 0))
        if impl:  # stream-ordered: reusable once the stream passes this point
            check(_driver.cuMemFreeAsync(ptr, stream))
        else:
            if after:
                check(_driver.cuStreamSynchronize(stream))
            check(_driver.cuMemFree(ptr))

    def _copy_h2d(self, dst: DeviceArray, src: np.ndarray, stream_impl: Any) -> None:
        if _bound.context is not self._context:
            self._make_current()
        nbytes = dst.nbytes
        if nbytes <= DIRECT_H2D_MAX:
            check(_driver.cuMemcpyHtoDAsync(dst.ptr, src.ctypes.data, nbytes, stream_impl))
        else:
            self._staging.copy(dst.ptr, src, nbytes, stream_impl)

    def _copy_d2h(self, dst: np.ndarray, src: DeviceArray, stream_impl: Any) -> None:
        if _bound.context is not self._context:
            self._make_current()
        check(_driver.cuMemcpyDtoHAsync(dst.ctypes.data, src.ptr, src.nbytes, stream_impl))

    def _copy_d2d(self, dst: DeviceArray, src: DeviceArray, stream_impl: Any) -> None:
        if _bound.context is not self._context:
            self._make_current()
        check(_driver.cuMemcpyDtoDAsync(dst.ptr, src.ptr, src.nbytes, stream_impl))

    # -- kernels ------------------------------------------------------------------------------
    def _load_kernel(self, spec: KernelSpec, entry: str) -> Any:
        from streamlane.kernels import CompileError, KernelCache, NvrtcUnavailable

        if _bound.context is not self._context:
            self._make_current()
        module = self._module_of.get(spec.name)
        if module is None:  # one module per kernel, whichever of its entries comes first
            if self._kernel_cache is None:
                self._kernel_cache = KernelCache()
            try:
                cubin = self._kernel_cache.get_or_compile(spec, self.arch)
            except CompileError as exc:
                raise KernelCompileError(exc.kernel, exc.code, exc.log) from exc
            except NvrtcUnavailable as exc:
                raise DeviceError(f"cannot compile kernel {spec.name!r}: {exc}") from exc
            module = self._module_of[spec.name] = check(_driver.cuModuleLoadData(cubin))
            self._modules.append(module)
        return check(_driver.cuModuleGetFunction(module, entry.encode()))

    def _plan(self, prepared: PreparedLaunch) -> tuple[Any, ...]:
        """Everything a launch of ``prepared`` needs but its arrays, computed once.

        Pointers travel as c_void_p from plain ints (no CUdeviceptr object per launch). The
        plan is keyed by id(): PreparedLaunch hashes by value and its params dict is not
        hashable; the weakref callback drops the entry before that id can be reused.
        """
        cfg = prepared.config
        n_ptrs = prepared.spec.n_in + prepared.spec.n_out
        values = tuple(value for value, _ in cfg.scalars)
        types = (ctypes.c_void_p,) * n_ptrs + tuple(ctype for _, ctype in cfg.scalars)
        plan = (prepared.function, *cfg.grid, *cfg.block, cfg.shared_mem, values, types)
        key = id(prepared)
        self._plans[key] = plan
        weakref.finalize(prepared, self._plans.pop, key, None)
        return plan

    def _launch(self, prepared: PreparedLaunch, stream_impl: Any, ins: Sequence[DeviceArray],
                outs: Sequence[DeviceArray]) -> None:
        if _bound.context is not self._context:
            self._make_current()
        plan = self._plans.get(id(prepared)) or self._plan(prepared)
        fn, gx, gy, gz, bx, by, bz, shared, scalars, types = plan
        values = tuple([a.ptr for a in (*ins, *outs)]) + scalars
        if len(values) != len(types):
            raise arity_error(prepared, ins, outs)
        check(self._cu_launch(fn, gx, gy, gz, bx, by, bz, shared, stream_impl,
                              (values, types), 0))

    def _bind(self, prepared: PreparedLaunch) -> _BoundLaunch:
        return _BoundLaunch(self, prepared, self._plans.get(id(prepared)) or self._plan(prepared))

    def _new_latch(self) -> tuple[dict[str, Any], Any]:
        if _bound.context is not self._context:
            self._make_current()
        host_ptr, dev_ptr = self._flags.take()
        return {"flag_ptr": dev_ptr, "timeout_us": LATCH_TIMEOUT_US}, _LatchFlag(host_ptr)


class _BoundLaunch:
    """``PreparedLaunch.bind()`` on CUDA: the kernel's parameters live in one block of 8-byte
    slots, scalars written once, pointers per call, and the driver gets the block's address:
    no per-launch conversion of a (values, types) tuple. Not thread-safe (see ``bind``)."""

    __slots__ = ("_addr", "_args", "_argv", "_device", "_fn", "_head", "_n_in", "_n_ptrs",
                 "_prepared")

    def __init__(self, device: CudaDevice, prepared: PreparedLaunch, plan: tuple[Any, ...]):
        fn, gx, gy, gz, bx, by, bz, shared, scalars, types = plan
        self._device, self._prepared = device, prepared
        self._n_ptrs = n_ptrs = len(types) - len(scalars)
        self._n_in = prepared.spec.n_in  # the split is checked too, as the host device does
        self._args = args = (ctypes.c_uint64 * max(len(types), 1))()
        base = ctypes.addressof(args)
        for i, (value, ctype) in enumerate(zip(scalars, types[n_ptrs:], strict=True)):
            scalar = ctype(value)
            ctypes.memmove(base + 8 * (n_ptrs + i), ctypes.addressof(scalar),
                           ctypes.sizeof(scalar))
        self._argv = (ctypes.c_void_p * max(len(types), 1))(
            *[base + 8 * i for i in range(len(types))])
        self._head = (fn, gx, gy, gz, bx, by, bz, shared)
        self._addr = ctypes.addressof(self._argv)
        self._fn = int(fn)  # the CUfunction's address, for the short call

    def __call__(self, stream: Stream, ins: Sequence[DeviceArray],
                 outs: Sequence[DeviceArray]) -> None:
        device = self._device
        args = self._args
        try:  # (free in CPython when nothing is raised)
            impl = stream._usable()
            if len(ins) != self._n_in or len(ins) + len(outs) != self._n_ptrs:
                raise arity_error(self._prepared, ins, outs)
            i = 0
            for a in ins:
                if type(a) is not DeviceArray:  # a Buffer has a .ptr too, and no size
                    raise TypeError
                args[i] = a.ptr
                i += 1
            for a in outs:
                if type(a) is not DeviceArray:
                    raise TypeError
                args[i] = a.ptr
                i += 1
        except (AttributeError, TypeError):  # not a Stream, or not DeviceArrays
            raise bound_argument_error(self._prepared, stream, ins, outs) from None
        if _bound.context is not device._context:
            device._make_current()
        fn, gx, gy, gz, bx, by, bz, shared = self._head
        if _bound.hold_gil:
            rc = device._short.launch(self._fn, gx, gy, gz, bx, by, bz,  # type: ignore[union-attr]
                                      shared, stream.handle, self._addr, None)
            if rc:
                raise _fail(rc)
            return
        check(device._cu_launch(fn, gx, gy, gz, bx, by, bz, shared, impl, self._addr, 0))


DEVICE_CLASS = CudaDevice

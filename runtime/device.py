"""The Device contract and ``get_device``.

A Device is an abstract class of a few primitives (``_new_stream``, ``_record``, ``_alloc``,
``_launch``, ...) that the ``cuda`` and ``host`` backends fill in. This base class owns every
check and every error message, so the backends stay small and behave alike on bad input.
"""

from __future__ import annotations

import inspect
import math
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from streamlane.kernels import (
    KernelSpec,
    KernelSpecError,
    LaunchConfig,
    UnknownKernel,
    get_kernel,
    kernel_names,
)

from .dtypes import DTYPES, as_host_array
from .errors import InvalidArgument
from .event import Event
from .memory import Buffer, DeviceArray
from .stream import FOREIGN, LEGACY_HANDLE, OWNED, PER_THREAD_HANDLE, Stream, foreign_stream_handle

if TYPE_CHECKING:
    from .host import HostDevice

__all__ = ["Device", "DeviceStats", "Latch", "PreparedLaunch", "get_device"]

MAX_ALLOCATION = 1 << 40  # 1 TiB: anything larger is a mistake, not a request


@dataclass
class DeviceStats:
    """Counters for tests and benchmarks: host waits (event/stream/device synchronizations),
    allocations and frees of device memory."""

    host_waits: int = 0
    allocations: int = 0
    frees: int = 0

    def snapshot(self) -> DeviceStats:
        return DeviceStats(self.host_waits, self.allocations, self.frees)


@dataclass(frozen=True)
class PreparedLaunch:
    """A kernel launch validated once (kernel, shapes, params): ``run`` then only enqueues."""

    device: Device
    spec: KernelSpec
    config: LaunchConfig
    params: Mapping[str, Any]
    function: Any  # the backend's loaded kernel
    in_shapes: tuple[tuple[int, ...], ...] = ()  # what it was prepared for (run() checks)
    out_shapes: tuple[tuple[int, ...], ...] = ()
    dtype: np.dtype = DTYPES["float32"]  # every argument's, for a public kernel (run() checks)

    def run(self, stream: Stream, ins: Sequence[DeviceArray], outs: Sequence[DeviceArray]) -> None:
        """Enqueue the launch on ``stream``, after checking what the kernel will read: arrays
        in native byte order, aligned to their elements (a misaligned load is a CUDA fault),
        and outputs that overlap no other argument (``KernelSpec.in_place`` allows an output
        to be exactly an input)."""
        impl = self.device._stream_impl(stream, f"run({self.spec.name})")
        ins, outs = _check_arrays(self.device, self.spec.name, ins, outs)
        if len(ins) != len(self.in_shapes) or len(outs) != len(self.out_shapes):
            raise arity_error(self, ins, outs)
        shapes = (tuple(a.shape for a in ins), tuple(a.shape for a in outs))
        if shapes != (self.in_shapes, self.out_shapes):  # its grid covers those
            raise InvalidArgument(
                f"run({self.spec.name}): prepared for inputs {[list(s) for s in self.in_shapes]}"
                f" and outputs {[list(s) for s in self.out_shapes]}, got "
                f"{[list(s) for s in shapes[0]]} and {[list(s) for s in shapes[1]]}; prepare() "
                f"a launch for these (device.launch() does it for you)")
        if not self.spec.internal:  # (strided_copy takes bytes and int64 strides)
            want = self.dtype
            for i, a in enumerate((*ins, *outs)):
                # float64 bits read as float32, or int8 read past the end. (A dtype is compared
                # by identity first: dtype.name builds a str, 5 us a launch on the H200; another
                # byte order is the byte-order check's, below.)
                if a.dtype is not want and a.dtype.newbyteorder("=") != want:
                    raise InvalidArgument(
                        f"run({self.spec.name}): prepared for {want.name} arguments, argument "
                        f"{i} is {a.dtype.name}; prepare(..., dtype={a.dtype.name!r}) a launch "
                        f"for it, if {self.spec.name} takes it (device.launch() does it for you)")
        _check_memory(self.spec, ins, outs)
        self.device._launch(self, impl, ins, outs)

    def bind(self) -> Callable[[Stream, Sequence[DeviceArray], Sequence[DeviceArray]], None]:
        """A launcher of this launch with its own argument block: ``bound(stream, ins, outs)``
        enqueues it as ``run`` does, cheaper: only the pointers are written per call (on CUDA
        the driver reads the block in place). It checks the argument counts and kinds only,
        not ``run``'s shapes, dtypes and memory: the caller gives it the arrays it was
        prepared for (a method step gives its own buffers). One caller at a time."""
        return self.device._bind(self)


class Device(ABC):
    """One device: its streams, events, memory and kernels. Get one with ``get_device``."""

    kind: str = ""
    # Whether a thread that waited on this device once it is lost may hang as it ends (CUDA on
    # driver 580: the scheduler parks its lane threads then, instead of ending them).
    _threads_hang_when_lost = False
    # How many hardware queues feed this device's streams, or None where streams never share
    # one (the host device). On CUDA, CUDA_DEVICE_MAX_CONNECTIONS (default 8, at most 32): with
    # more streams busy than queues, streams share them, and a command at a queue's head that
    # must wait for a running kernel (a dependent kernel, a stream wait, or an event record with
    # timing) holds up every stream behind it (bench/queue_probe.py).
    hardware_queues: int | None = None

    def __init__(self, index: int = 0):
        self.index = index
        self.name = f"{self.kind}:{index}"
        self.stats = DeviceStats()
        self._stats_lock = threading.Lock()
        self._functions: dict[tuple[str, str], Any] = {}  # (kernel, entry) -> loaded
        self._functions_lock = threading.Lock()
        self._launch_cache: dict[Any, PreparedLaunch] = {}  # checked launches, by signature

    # -- streams ----------------------------------------------------------------------------
    @abstractmethod
    def per_thread_stream(self) -> Stream:
        """The calling thread's per-thread default stream (one per host thread)."""

    @abstractmethod
    def legacy_stream(self) -> Stream:
        """The legacy default stream."""

    def create_stream(self) -> Stream:
        """A new stream owned by the caller: ``close()`` it (or use it as a context manager)."""
        handle, impl = self._new_stream()
        return Stream(self, OWNED, handle, impl)

    def wrap_stream(self, obj: Any) -> Stream:
        """Borrow the stream of any object exposing ``__cuda_stream__`` (torch, CuPy, cuda.core,
        streamlane). The wrapper never destroys it."""
        if isinstance(obj, Stream):
            if obj.device is not self:
                raise InvalidArgument(f"{obj!r} belongs to {obj.device.name}, not {self.name}")
            return obj
        handle = foreign_stream_handle(obj)
        return self.stream_from_handle(handle, keepalive=obj)

    def stream_from_handle(self, handle: int, keepalive: Any = None) -> Stream:
        """The stream a raw CUDA handle names (0/1: legacy, 2: this thread's per-thread
        stream, else a borrowed foreign stream kept with ``keepalive``)."""
        if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < 1 << 64:
            raise InvalidArgument(f"invalid stream handle {handle!r}")
        if handle in (0, LEGACY_HANDLE):
            return self.legacy_stream()
        if handle == PER_THREAD_HANDLE:
            return self.per_thread_stream()
        return Stream(self, FOREIGN, handle, self._foreign_stream(handle), keepalive=keepalive)

    # -- events -----------------------------------------------------------------------------
    @property
    def lost(self) -> bool:
        """True once an error has made the device unusable for the rest of the process (CUDA:
        a kernel fault poisons the context; every later call fails; the host device: a fault
        of its worker threads, such as a callable step's exception)."""
        return False

    def hold_gil(self, enabled: bool) -> bool:
        """For the calling thread: make the short driver calls (kernel launch, event record,
        query and elapsed time, stream wait) without releasing the GIL, as torch and CuPy do.
        Other Python threads then cannot take the GIL in the middle of a launch, which costs a
        thread that launches often the wait to get it back (the scheduler's lanes turn it on).
        A launch or record blocks while its stream's queue is full (about a thousand pending
        launches): with the GIL held that would stall every Python thread, so turn it on only
        while the thread's queued work is bounded. Host waits always release the GIL. Returns
        the thread's previous setting, to restore it. A no-op on the host device (returns
        False)."""
        return False

    def create_event(self, *, timing: bool = False) -> Event:
        """A new event to ``record`` on a stream; ``timing=True`` for ``elapsed_ms``."""
        if not isinstance(timing, bool):  # "no" would make a timing event (rule 5's spirit)
            raise InvalidArgument(f"create_event(timing=...) takes True or False, got "
                                  f"{type(timing).__name__} {timing!r}")
        return Event(self, self._new_event(timing), timing)

    def synchronize(self) -> None:
        """Wait for all work on the device (a host wait; prefer waiting for one event)."""
        self._count_wait()
        self._device_synchronize()

    # -- memory -----------------------------------------------------------------------------
    def alloc(self, nbytes: int, stream: Stream | None = None,
              uses: dict[Any, Any] | None = None) -> Buffer:
        """``nbytes`` of device memory, stream-ordered on ``stream`` where supported; ``uses``
        shares one record of stream uses between buffers (see ``Buffer``)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, np.integer)):
            raise InvalidArgument(f"allocation size must be an int, got {type(nbytes).__name__}")
        nbytes = int(nbytes)
        if nbytes <= 0 or nbytes > MAX_ALLOCATION:
            raise InvalidArgument(f"allocation size must be in 1..{MAX_ALLOCATION} bytes, got "
                                  f"{nbytes}")
        ptr, impl = self._alloc(nbytes, None if stream is None else
                                self._stream_impl(stream, "alloc"))
        with self._stats_lock:
            self.stats.allocations += 1
        return Buffer(self, ptr, nbytes, impl, uses)

    def empty(self, shape: Sequence[int], dtype: Any = "float32",
              stream: Stream | None = None, uses: dict[Any, Any] | None = None) -> DeviceArray:
        """An uninitialized device array."""
        shape = _check_shape(shape)
        dt = _check_dtype(dtype)
        return self.alloc(max(1, math.prod(shape) * dt.itemsize), stream, uses).view(dt, shape)

    def copy_from_host(self, dst: DeviceArray, src: np.ndarray, stream: Stream) -> None:
        """Enqueue a copy of host ``src`` into ``dst`` (same dtype and shape). ``src`` may be
        changed as soon as this returns."""
        self._check_array(dst, "dst")
        src = as_host_array(src, "copy_from_host")
        if src.dtype != dst.dtype or src.shape != dst.shape:
            raise InvalidArgument(f"copy_from_host: source {src.dtype}{list(src.shape)} does not "
                                  f"match destination {dst.dtype}{list(dst.shape)}")
        self._copy_h2d(dst, np.asarray(src, order="C"),
                       self._stream_impl(stream, "copy_from_host"))

    def copy_to_host(self, dst: np.ndarray, src: DeviceArray, stream: Stream) -> None:
        """Enqueue a copy of ``src`` into host ``dst``; valid once ``stream`` has passed it."""
        self._check_array(src, "src")
        if (not isinstance(dst, np.ndarray) or dst.dtype != src.dtype or dst.shape != src.shape
                or not dst.flags.c_contiguous or not dst.flags.writeable):
            raise InvalidArgument(f"copy_to_host: destination must be a writable C-contiguous "
                                  f"{src.dtype}{list(src.shape)} array")
        self._copy_d2h(dst, src, self._stream_impl(stream, "copy_to_host"))

    def copy(self, dst: DeviceArray, src: DeviceArray, stream: Stream) -> None:
        """Enqueue a device-to-device copy (same byte size)."""
        self._check_array(dst, "dst")
        self._check_array(src, "src")
        if dst.nbytes != src.nbytes:
            raise InvalidArgument(f"copy: {src.nbytes} B into {dst.nbytes} B")
        if dst.ptr < src.ptr + src.nbytes and src.ptr < dst.ptr + dst.nbytes:
            raise InvalidArgument("copy: the source and destination overlap; a device copy of "
                                  "overlapping memory is undefined on CUDA (copy through a "
                                  "temporary array)")
        self._copy_d2d(dst, src, self._stream_impl(stream, "copy"))

    def to_device(self, array: Any, stream: Stream) -> DeviceArray:
        """A new device array holding a copy of host ``array``, enqueued on ``stream``."""
        self._stream_impl(stream, "to_device")
        array = as_host_array(array, "to_device", order="C")
        dst = self.empty(array.shape, array.dtype, stream)
        self.copy_from_host(dst, array, stream)
        return dst

    def to_host(self, src: DeviceArray, stream: Stream) -> np.ndarray:
        """Copy ``src`` to a new host array, waiting for ``stream`` (one host wait)."""
        self._check_array(src, "src")
        out = np.empty(src.shape, src.dtype)
        self.copy_to_host(out, src, stream)
        stream.record().synchronize()
        return out

    # -- kernels ----------------------------------------------------------------------------
    def prepare(self, kernel: str, in_shapes: Sequence[Sequence[int]],
                out_shapes: Sequence[Sequence[int]] | None = None,
                params: Mapping[str, Any] | None = None, *, dtype: str = "float32",
                extra: Mapping[str, Any] | None = None) -> PreparedLaunch:
        """Validate a launch once; raises ``InvalidArgument`` saying what is wrong.
        ``extra``: host-side objects a kernel's twin needs beyond its params, under names
        starting with ``_`` (the latch's release event)."""
        spec = _public_kernel(kernel)
        return self._prepare(spec, in_shapes, out_shapes, params, dtype, extra)

    def _prepare(self, spec: KernelSpec, in_shapes: Sequence[Sequence[int]],
                 out_shapes: Sequence[Sequence[int]] | None,
                 params: Mapping[str, Any] | None, dtype: str = "float32",
                 extra: Mapping[str, Any] | None = None) -> PreparedLaunch:
        """``prepare`` for the runtime itself: internal kernels (``strided_copy``) too."""
        kernel = spec.name
        _check_params(params, kernel)
        if extra is not None and not isinstance(extra, Mapping):
            raise InvalidArgument(f"prepare({kernel!r}): extra must be a mapping of name to "
                                  f"value (or None), got {type(extra).__name__}")
        for key in extra or ():  # never a param: it would replace the value just checked
            if not isinstance(key, str) or not key.startswith("_"):
                raise InvalidArgument(f"prepare({kernel!r}): extra holds host-side objects "
                                      f"under names starting with '_', got {key!r}; kernel "
                                      f"parameters go in params, where they are checked")
        for what, shapes in (("in_shapes", in_shapes), ("out_shapes", out_shapes)):
            listed = (isinstance(shapes, Sequence) and not isinstance(shapes, (str, bytes))) \
                or (isinstance(shapes, np.ndarray) and shapes.ndim > 0)
            if not listed and not (shapes is None and what == "out_shapes"):
                raise InvalidArgument(f"prepare({kernel!r}): {what} must be a list of shapes, "
                                      f"got {type(shapes).__name__}")
        if dtype not in spec.dtypes:
            raise InvalidArgument(f"kernel {kernel!r} takes {'/'.join(spec.dtypes)}, got {dtype}")
        ins = [_check_shape(s) for s in in_shapes]
        try:
            resolved = spec.resolve_params(params)
            if len(ins) != spec.n_in:
                raise KernelSpecError("in", f"{spec.n_in} inputs", len(ins))
            inferred = spec.infer(ins, resolved)
            outs = [_check_shape(s) for s in out_shapes] if out_shapes is not None else inferred
            if len(outs) != spec.n_out or any(o is None for o in outs):
                raise KernelSpecError("out", f"{spec.n_out} outputs with known shapes", outs)
            for i, (want, got) in enumerate(zip(inferred, outs, strict=True)):
                if want is not None and tuple(want) != tuple(got):
                    raise KernelSpecError(f"out[{i}]", f"shape {list(want)}", list(got))
            resolved.update(extra or {})
            config = spec.configure(ins, outs, resolved)
            self._check_launch(spec, resolved)
        except KernelSpecError as exc:
            raise InvalidArgument(f"kernel {kernel!r}: {exc}") from None
        return PreparedLaunch(self, spec, config, resolved,
                              self._function(spec, config.entry or spec.entry),
                              tuple(tuple(s) for s in ins), tuple(tuple(s) for s in outs),
                              DTYPES[dtype])

    def launch(self, kernel: str, stream: Stream, ins: Sequence[DeviceArray],
               outs: Sequence[DeviceArray], params: Mapping[str, Any] | None = None) -> None:
        """Check and enqueue one kernel launch on ``stream``."""
        impl = self._stream_impl(stream, f"launch({kernel!r})")
        ins, outs = _check_arrays(self, kernel, ins, outs)
        _check_params(params, kernel)
        dtypes = {a.dtype.name for a in (*ins, *outs)}
        if len(dtypes) > 1:
            raise InvalidArgument(f"kernel {kernel!r}: arguments mix dtypes {sorted(dtypes)}")
        dtype = dtypes.pop() if dtypes else "float32"
        try:  # a signature validated once is not validated again (params are plain scalars)
            key = (kernel, dtype, tuple(a.shape for a in ins), tuple(a.shape for a in outs),
                   tuple(sorted((k, *_param_key(v)) for k, v in params.items())) if params
                   else ())
            prepared = self._launch_cache.get(key)
        except TypeError:  # unhashable params: validate and report below
            key, prepared = None, None
        if prepared is None:
            prepared = self._prepare(_public_kernel(kernel), [a.shape for a in ins],
                                     [a.shape for a in outs], params, dtype)
            if key is not None and len(self._launch_cache) < 4096:
                self._launch_cache[key] = prepared
        _check_memory(prepared.spec, ins, outs)  # PreparedLaunch.run without its first checks
        self._launch(prepared, impl, ins, outs)

    def enqueue_callable(self, stream: Stream, fn: Any, ins: Sequence[DeviceArray],
                         outs: Sequence[DeviceArray]) -> None:
        """Run a callable step in ``stream``'s order: ``fn(stream, ins, outs)``. On CUDA it is
        called now and must enqueue its work on ``stream`` (arrays expose
        ``__cuda_array_interface__``); on the host device it runs when the stream reaches it,
        with numpy arrays."""
        self._enqueue_callable(self._stream_impl(stream, "enqueue_callable"), stream, fn, ins,
                               outs)

    def _enqueue_callable(self, stream_impl: Any, stream: Stream, fn: Any,
                          ins: Sequence[DeviceArray], outs: Sequence[DeviceArray]) -> None:
        check_step_result(fn, fn(stream, list(ins), list(outs)))

    def create_latch(self) -> Latch:
        """A latch: ``hold(stream)`` blocks that stream on the device until ``release()``."""
        return Latch(self)

    def _check_launch(self, spec: KernelSpec, params: Mapping[str, Any]) -> None:  # noqa: B027
        """Raise ``KernelSpecError`` for a launch this backend could not run (``prepare``)."""

    def _function(self, spec: KernelSpec, entry: str) -> Any:
        key = (spec.name, entry)
        fn = self._functions.get(key)
        if fn is None:
            with self._functions_lock:
                fn = self._functions.get(key)
                if fn is None:
                    fn = self._functions[key] = self._load_kernel(spec, entry)
        return fn

    # -- shared checks ----------------------------------------------------------------------
    def _stream_impl(self, stream: Any, what: str) -> Any:
        """``stream._usable()`` for a Stream of this device; anything else is refused."""
        if not isinstance(stream, Stream):
            raise InvalidArgument(f"{what}: stream must be a Stream of {self.name} "
                                  f"(device.create_stream(), device.per_thread_stream()), got "
                                  f"{type(stream).__name__}")
        if stream.device is not self:
            raise InvalidArgument(f"{what}: {stream!r} belongs to {stream.device.name}, not "
                                  f"{self.name}")
        return stream._usable()

    def _check_array(self, a: Any, what: str) -> None:
        if not isinstance(a, DeviceArray):
            raise InvalidArgument(f"{what} must be a DeviceArray, got {type(a).__name__}")
        if a.buffer.device is not self:
            raise InvalidArgument(f"{what} lives on {a.buffer.device.name}, not {self.name}; "
                                  f"copy it to {self.name} first")
        if a.buffer.freed:
            raise InvalidArgument(f"{what} refers to freed memory")

    def _count_wait(self) -> None:
        with self._stats_lock:
            self.stats.host_waits += 1

    def _free_quiet(self, ptr: int, impl: Any, uses: dict[Any, Any]) -> None:
        try:
            self._free(ptr, impl, None, uses)
        except Exception:  # a finalizer must never raise (interpreter shutdown, dead context)
            pass

    def _free(self, ptr: int, impl: Any, stream_impl: Any, uses: dict[Any, Any]) -> None:
        with self._stats_lock:
            self.stats.frees += 1
        self._free_memory(ptr, impl, stream_impl, list(uses.copy().values()))

    def __repr__(self) -> str:
        return f"<Device {self.name}>"

    # -- primitives the backends fill in ---------------------------------------------------
    @abstractmethod
    def _new_stream(self) -> tuple[int, Any]: ...
    @abstractmethod
    def _destroy_stream(self, impl: Any) -> None: ...
    @abstractmethod
    def _foreign_stream(self, handle: int) -> Any: ...
    @abstractmethod
    def _stream_synchronize(self, impl: Any) -> None: ...
    @abstractmethod
    def _stream_wait(self, impl: Any, event: Event) -> None: ...
    @abstractmethod
    def _new_event(self, timing: bool) -> Any: ...
    @abstractmethod
    def _record(self, event: Event, stream_impl: Any) -> None: ...
    @abstractmethod
    def _event_query(self, event: Event) -> bool: ...
    @abstractmethod
    def _event_synchronize(self, event: Event) -> None: ...
    @abstractmethod
    def _elapsed_ms(self, start: Event, end: Event) -> float: ...
    @abstractmethod
    def _device_synchronize(self) -> None: ...
    @abstractmethod
    def _alloc(self, nbytes: int, stream_impl: Any) -> tuple[int, Any]: ...
    @abstractmethod
    def _free_memory(self, ptr: int, impl: Any, stream_impl: Any, after: list[Event]) -> None:
        """Free after ``stream_impl`` (None: the legacy stream) has waited for ``after``."""
    @abstractmethod
    def _copy_h2d(self, dst: DeviceArray, src: np.ndarray, stream_impl: Any) -> None: ...
    @abstractmethod
    def _copy_d2h(self, dst: np.ndarray, src: DeviceArray, stream_impl: Any) -> None: ...
    @abstractmethod
    def _copy_d2d(self, dst: DeviceArray, src: DeviceArray, stream_impl: Any) -> None: ...
    @abstractmethod
    def _load_kernel(self, spec: KernelSpec, entry: str) -> Any: ...
    @abstractmethod
    def _launch(self, prepared: PreparedLaunch, stream_impl: Any, ins: Sequence[DeviceArray],
                outs: Sequence[DeviceArray]) -> None: ...
    def _bind(self, prepared: PreparedLaunch) -> Callable[
            [Stream, Sequence[DeviceArray], Sequence[DeviceArray]], None]:
        launch = self._launch
        n_in, n_out = prepared.spec.n_in, prepared.spec.n_out

        def bound(stream: Stream, ins: Sequence[DeviceArray], outs: Sequence[DeviceArray]) -> None:
            try:
                if len(ins) != n_in or len(outs) != n_out:  # a kernel would index past them
                    raise arity_error(prepared, ins, outs)
                impl = stream._usable()
            except (AttributeError, TypeError):
                raise bound_argument_error(prepared, stream, ins, outs) from None
            if not all(type(a) is DeviceArray for a in (*ins, *outs)):
                raise bound_argument_error(prepared, stream, ins, outs)
            launch(prepared, impl, ins, outs)

        return bound

    @abstractmethod
    def _new_latch(self) -> tuple[dict[str, Any], Any]:
        """Kernel params for the ``latch`` kernel and a backend object with ``release()``."""


class Latch:
    """Holds streams on the device until the host releases it (the ``latch`` kernel).

    Use it as a context manager so a failing test never leaves a stream held:
    ``with dev.create_latch() as latch: latch.hold(s); ...; latch.release()``.
    """

    def __init__(self, device: Device):
        self.device = device
        self._params, self._impl = device._new_latch()
        self._prepared = device._prepare(get_kernel("latch"), [], [],
                                         {k: v for k, v in self._params.items()
                                          if not k.startswith("_")},
                                         extra={k: v for k, v in self._params.items()
                                                if k.startswith("_")})
        self.released = False

    def hold(self, stream: Stream) -> None:
        """Enqueue the latch on ``stream``: later work there waits until ``release()``."""
        self._prepared.run(stream, (), ())

    def release(self) -> None:
        """Let every stream it holds go on (idempotent)."""
        self.released = True
        self._impl.release()

    def __repr__(self) -> str:
        return f"<Latch {self.device.name} {'released' if self.released else 'holding'}>"

    def __enter__(self) -> Latch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


# -- helpers ---------------------------------------------------------------------------------
def _public_kernel(name: str) -> KernelSpec:
    """The kernel a caller names for ``prepare`` / ``launch``: not one only the runtime may
    launch, with arguments it derives itself."""
    try:
        spec = get_kernel(name)
    except UnknownKernel:
        public = [n for n in kernel_names() if not get_kernel(n).internal]
        raise InvalidArgument(f"unknown kernel {name!r}; valid kernels: "
                              f"{', '.join(public)}") from None
    if spec.internal:
        raise InvalidArgument(f"kernel {name!r} is launched by the runtime only (its arguments "
                              f"are not checked against the memory they reach); {spec.instead}")
    return spec


MAX_DIM = 1 << 31


def _check_shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise InvalidArgument(f"a shape must be a sequence of ints, got {shape!r}") from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or not 0 < d < MAX_DIM:
            raise InvalidArgument(f"shape {list(dims)}: every dimension must be an int in "
                                  f"1..{MAX_DIM - 1}, got {d!r}")
    dims = tuple(int(d) for d in dims)
    if math.prod(dims) > MAX_ALLOCATION:
        raise InvalidArgument(f"shape {list(dims)} has more than {MAX_ALLOCATION} elements")
    return dims


def _check_dtype(dtype: Any) -> np.dtype:
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise InvalidArgument(f"unknown dtype {dtype!r}") from None
    if dt.hasobject:
        raise InvalidArgument(f"dtype {dt} holds Python objects, which device memory cannot; "
                              f"convert the array to a numeric dtype first")
    if dt.kind in "cSUVMm" and dt != DTYPES["bfloat16"]:  # complex, text, void / records,
        # datetimes: nothing reads them (ml_dtypes' bfloat16 is a numpy "V" kind too)
        raise InvalidArgument(f"dtype {dt} is not one device memory holds; give a numeric "
                              f"dtype (supported by programs and Results: "
                              f"{', '.join(DTYPES)})")
    return dt


def bound_argument_error(prepared: PreparedLaunch, stream: Any, ins: Any,
                         outs: Any) -> InvalidArgument:
    """A bound launcher's refusal of what is not a Stream and lists of DeviceArrays."""
    def kinds(arrays: Any) -> str:
        try:
            return f"[{', '.join(type(a).__name__ for a in arrays)}]"
        except TypeError:
            return type(arrays).__name__
    return InvalidArgument(f"bound {prepared.spec.name} launcher: takes (Stream, [DeviceArray, "
                           f"...], [DeviceArray, ...]), got ({type(stream).__name__}, "
                           f"{kinds(ins)}, {kinds(outs)})")


def arity_error(prepared: PreparedLaunch, ins: Sequence[DeviceArray],
                outs: Sequence[DeviceArray]) -> InvalidArgument:
    spec = prepared.spec
    return InvalidArgument(f"kernel {spec.name!r} takes {spec.n_in} inputs and {spec.n_out} "
                           f"outputs, got {len(ins)} and {len(outs)}")


def _check_arrays(device: Device, kernel: str, ins: Any, outs: Any
                  ) -> tuple[tuple[DeviceArray, ...], tuple[DeviceArray, ...]]:
    """A launch's ``ins`` and ``outs``: sequences (lists, tuples, ...) of DeviceArrays of
    ``device``; returned as tuples."""
    for what, arrays in (("ins", ins), ("outs", outs)):
        if not isinstance(arrays, Sequence) or isinstance(arrays, (str, bytes)):
            raise InvalidArgument(f"{kernel}: {what} must be a list of DeviceArrays, got "
                                  f"{type(arrays).__name__}")
    ins, outs = tuple(ins), tuple(outs)
    for i, a in enumerate((*ins, *outs)):
        device._check_array(a, f"argument {i} of {kernel}")
    return ins, outs


def _param_key(value: Any) -> tuple[Any, Any]:
    """A param as ``launch``'s cache tells it apart: -0.0 == 0.0, but fill and scale write the
    sign (a float's hex keeps it)."""
    if isinstance(value, (float, np.floating)):
        return type(value), float(value).hex()
    return type(value), value


def _check_params(params: Any, kernel: str) -> None:
    if params is not None and not isinstance(params, Mapping):
        raise InvalidArgument(f"{kernel}: params must be a mapping of name to scalar (or "
                              f"None), got {type(params).__name__}")


# -- selection -------------------------------------------------------------------------------
_devices: dict[str, Device] = {}
_devices_lock = threading.Lock()
BACKENDS = ("auto", "host", "cuda", "cuda:N")


def check_step_result(fn: Any, result: Any) -> None:
    """A callable step returns nothing that matters, but an awaitable means its work never
    ran (an ``async def`` called, not awaited: its outputs would be left unwritten)."""
    if inspect.isawaitable(result):
        close = getattr(result, "close", None)
        if close is not None:
            close()  # no "never awaited" warning on top of this error
        raise InvalidArgument(f"the callable step {getattr(fn, '__name__', fn)!r} returned an "
                              f"awaitable: a step runs synchronously and must enqueue its work "
                              f"before it returns (an async def is not a step)")


def is_auto(name: object) -> bool:
    """Whether ``name`` asks for the automatic choice (case and spaces ignored, as for every
    device name)."""
    return isinstance(name, str) and name.strip().lower() == "auto"


@overload
def get_device(name: Literal["host"]) -> HostDevice: ...
@overload
def get_device(name: str | None = None) -> Device: ...


def get_device(name: str | None = None) -> Device:
    """The device named ``"auto" | "host" | "cuda" | "cuda:N"`` (default: env
    ``STREAMLANE_DEVICE``, else ``"auto"``). ``auto`` picks cuda when a GPU is usable, else host.
    Forcing cuda without a usable GPU raises ``DeviceError`` saying why; never a fallback."""
    source = ""
    if name is None or is_auto(name):  # "AUTO" and " auto " too, as "HOST" is host
        name = os.environ.get("STREAMLANE_DEVICE") or "auto"
        source = " (from $STREAMLANE_DEVICE)" if name != "auto" else ""
    if not isinstance(name, str):
        raise InvalidArgument(f"device name must be a str, got {type(name).__name__}")
    key = name.strip().lower()
    if key == "auto":
        from . import cuda

        key = "cuda:0" if cuda.usable() else "host:0"
    elif key == "cuda":
        key = "cuda:0"
    elif key == "host":
        key = "host:0"
    kind, _, idx = key.partition(":")
    # ASCII digits only ("²".isdigit() is true), and one name per device: "cuda:01" is cuda:1
    # (no int() of the name: it refuses 4,300 digits)
    idx = (idx.lstrip("0") or "0") if idx.isascii() and idx.isdigit() else ""
    if kind not in ("host", "cuda") or not idx or len(idx) > 6:
        raise InvalidArgument(f"unknown device {name[:40]!r}{source}; valid names: "
                              f"{', '.join(BACKENDS)}")
    key = f"{kind}:{idx}"
    with _devices_lock:
        dev = _devices.get(key)
        if dev is None:
            if kind == "host":
                if idx != "0":
                    raise InvalidArgument("the host device has only index 0")
                from .host import HostDevice

                dev = HostDevice()
            else:
                from .cuda import CudaDevice

                dev = CudaDevice(int(idx))
            _devices[key] = dev
    return dev


def _check_memory(spec: KernelSpec, ins: Sequence[DeviceArray],
                  outs: Sequence[DeviceArray]) -> None:
    """``PreparedLaunch.run``'s checks (a method's steps, bound, skip them: its buffers are
    its own, and another library's arrays are checked as inputs)."""
    kernel = spec.name
    for i, a in enumerate((*ins, *outs)):
        if not a.dtype.isnative:  # the kernel would read the bytes as native values
            raise InvalidArgument(
                f"argument {i} of {kernel} is {a.dtype.str}, not in this machine's byte order; "
                f"copy it as array.astype({a.dtype.newbyteorder('=').str!r}) first")
        if a.ptr % a.dtype.itemsize:
            raise InvalidArgument(
                f"argument {i} of {kernel} starts at {a.ptr:#x}, not aligned to its "
                f"{a.dtype.itemsize}-byte elements; view the buffer at a multiple of "
                f"{a.dtype.itemsize} bytes")
    for j, out in enumerate(outs):
        for i, other in enumerate((*ins, *outs[:j])):
            if other.ptr < out.ptr + out.nbytes and out.ptr < other.ptr + other.nbytes:
                same = (other.ptr, other.nbytes) == (out.ptr, out.nbytes)
                if same and spec.in_place and i < len(ins):
                    continue
                what = "an input" if i < len(ins) else "another output"
                rule = "may write over an input only where it is exactly that input" if \
                    spec.in_place and i < len(ins) else "cannot write over memory it also uses"
                raise InvalidArgument(
                    f"argument {len(ins) + j} of {kernel} (an output) "
                    f"{'is the same memory as' if same else 'overlaps'} argument {i} ({what}); "
                    f"{kernel} {rule}: give the output separate memory")

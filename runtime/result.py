"""Results: outputs over device memory, returned without a copy (rules 6 and 8).

A Result owns a *holder* of the buffer it views. While any Result or export (DLPack,
``__cuda_array_interface__`` consumer) keeps the holder alive, the producing method writes its
spare buffer instead; once the holder dies, the buffer returns to its pool.

Guarantees:
- ``to_host()`` is the one host wait: it copies on the calling thread's current stream (as
  torch's ``.cpu()``), after the work that produced this result, so it also waits for what
  that stream has queued before it; never for the whole device;
- a buffer read on another stream is rewritten only after that stream has passed the read
  (an event recorded there, waited on by the writer's stream on the device);
- a buffer handed to another library is rewritten only once the device work that library may
  have queued on it is known finished.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from .dlpack import read_host_bfloat16
from .dtypes import as_host_array, dtype_name
from .errors import DLPackUnsupported, InvalidArgument
from .memory import Buffer, DeviceArray, _reached, note_use
from .stream import LEGACY_HANDLE, Stream, current_stream

if TYPE_CHECKING:
    from .device import Device
    from .event import Event

__all__ = ["Result"]  # OutputPool and PooledBuffer are the runtime's own

TRIM_AFTER = 64  # the shortest window (executes) after which a pool frees idle extra buffers
_CHECK_EVERY = 8  # how often (in executes) a pool of more than two counts its held buffers


def mark_release(buffer: Buffer, consumer: Stream, blind: Callable[[], None] | None) -> None:
    """Another library that read ``buffer`` on ``consumer`` let go of it (a DLPack deleter, on
    any thread; never raises): an event recorded there now, after everything it queued, is
    noted among the buffer's readers (``uses``), which its rewrite and its free wait for
    (rule 8). The stream is marked now, never later: the library may destroy its stream as
    soon as it is done with it (CuPy's go with their object), and the driver may crash on a
    destroyed stream's handle rather than refuse it. A stream this thread cannot record on
    (another thread's per-thread stream) or that refuses calls ``blind()``, and so does an
    interrupt (Ctrl-C) that may have cut the mark short, which then goes on.

    It takes no lock: a garbage collection can run it on a thread inside any allocation."""
    try:
        device = consumer.device
        gil = device.hold_gil(False)  # a record may block on a full queue: not with the GIL
        try:
            mark = consumer.record()
        finally:
            device.hold_gil(gil)
        note_use(buffer.uses, consumer.key, mark)  # its latest let-go covers the earlier ones
    except BaseException as exc:
        if blind is not None:
            blind()
        if not isinstance(exc, Exception):  # an interrupt goes on (a deleter prints it)
            raise


_NO_POOL = [0]  # the let-go count of a PooledBuffer no pool has taken in (yet)


class PooledBuffer:
    """One output buffer of a method, with what a writer must wait for before reusing it."""

    __slots__ = ("__weakref__", "array", "blind", "event", "exported", "held", "lets_go",
                 "unsure")

    def __init__(self, array: DeviceArray, event: Event):
        self.array = array
        # Its pool's count of buffers let go (OutputPool.let_go): one list shared by the pool's
        # buffers, so that no buffer refers back to its pool (set by the pool that grows it).
        self.lets_go = _NO_POOL
        # Recorded after each execute that writes the buffer and reads no Result (methods of
        # one output), and reused: while a Result holds the buffer the writer takes another
        # one, so a live Result's event never moves. What else kept the event (the method's
        # last event, its own memory's uses) may see it re-recorded later on: it then waits
        # for later work of the same method, which it orders after anyway. Another method's
        # buffer never keeps it (Method._enqueue).
        self.event = event
        self.held = False  # a live holder (Result or export) references it
        self.exported = False  # handed to another library since its last write
        self.blind = False  # some consumer's work since then only a device-wide wait covers
        # A consumer on a per-thread stream: it becomes `blind` if it lets go on another thread
        # (which cannot mark that stream), perhaps only just before the rewrite. Counted as
        # blind by needs_device_wait, so that may_wait_on_host never says no too early.
        self.unsure = False
        # No lock: each flag is set by plain assignments (atomic under the GIL), the export's
        # and the let-go's only ever to True, and the rewrite clears them when no export is
        # left to set them. A lock here could deadlock a let-go that a garbage collection
        # runs inside it, on the thread that holds it.

    # Set once any buffer goes to a consumer whose work only a device-wide host wait covers:
    # until then Method.may_wait_on_host needs no scan.
    blind_exports_seen = False

    def export_to(self, consumer: Stream | None) -> Callable[[], None] | None:
        """Note an export of the buffer to another library, whose stream is ``consumer`` (None:
        unknown, so the rewrite waits for the whole device). Returns what to call when that
        consumer lets go (``mark_release``; None for an unknown stream)."""
        self.exported = True
        if consumer is None:
            self._blind()
            return None
        if consumer.owner_thread is not None:
            self.unsure = True
            PooledBuffer.blind_exports_seen = True
        return functools.partial(mark_release, self.array.buffer, consumer, self._blind)

    def _blind(self) -> None:
        self.blind = True
        PooledBuffer.blind_exports_seen = True

    @property
    def needs_device_wait(self) -> bool:
        """Whether rewriting it may need a device-wide host wait: a consumer's stream is
        unknown, could not be marked when the consumer let go, or is a per-thread stream
        (which a let-go on another thread cannot mark)."""
        return self.exported and (self.blind or self.unsure)

    def settle_exports(self, stream: Stream) -> None:
        """The part of ``prepare_write`` for consumers in other libraries: a consumer nobody
        could mark (``blind``) is covered by a device-wide wait; the marked ones are among the
        buffer's ``uses``."""
        if self.exported:
            if self.blind:  # a consumer nobody could mark: only a device-wide wait covers it
                stream.device.synchronize()  # (interrupted, the buffer stays blind)
            self.exported = self.blind = self.unsure = False

    def prepare_write(self, stream: Stream) -> None:
        """Order ``stream`` after every use of this buffer elsewhere (rule 8), consumers in
        other libraries included; called by the writer just before it writes the buffer
        again. No Result or export holds the buffer now, so no new use can appear while this
        runs."""
        self.settle_exports(stream)
        uses = self.array.buffer.uses
        if uses:
            if len(uses) > 1 or stream.key not in uses:  # else only our own stream used it
                key = stream.key
                for k, event in uses.copy().items():  # (prune_uses: why a copy)
                    if k != key:
                        stream.wait(event)
            uses.clear()


class OutputPool:
    """The buffers of one method output: two take turns; more only while more Results are held.

    A pool grows when every buffer is held (a lane with many jobs of one method in flight holds
    one per job). It shrinks by windows: a window lasts ``max(TRIM_AFTER, size)`` executes (a
    pool of n buffers has seen n jobs in flight, so a cycle of demand can be that long), every
    ``_CHECK_EVERY``-th execute counts the buffers held, and a window with no growth ends by
    freeing the idle buffers beyond twice its most held (at least two stay), stream-ordered:
    demand comes in spikes the sampling misses, and each allocation costs driver calls. Steady
    concurrency, even in waves, allocates nothing, and a burst's buffers are returned within
    two windows after it. With more than two buffers the search for a free one starts after
    the last one taken (Results are mostly dropped oldest first), so an execute does not rescan
    the held ones, and it passes by a free one still read on another stream if another is free
    (and a trim leaves such a one for a later window): the device would otherwise make the
    execute wait for that read. With two, the one free buffer is taken, with that wait."""

    __slots__ = ("all_held", "buffers", "let_go", "make", "most", "quiet", "turn")

    def __init__(self, make: Callable[[Stream], PooledBuffer]):
        self.make = make  # allocates one more buffer, stream-ordered
        self.buffers: list[PooledBuffer] = []
        self.turn = 0  # where the next search starts (pools of more than two)
        self.quiet = 0  # executes in this window (it restarts when the pool grows)
        self.most = 0  # the most buffers counted held in this window
        # Buffers let go so far (a Result dropped), counted by _Holder.__del__ on any thread,
        # and (that count, the pool's size) when a search last found every buffer held: until
        # one is let go, the next execute grows the pool without searching again, so that
        # holding thousands of Results (submit them all, then gather) costs no search each.
        self.let_go = [0]
        self.all_held: tuple[int, int] | None = None

    def __len__(self) -> int:
        return len(self.buffers)

    def take(self, stream: Stream) -> PooledBuffer:
        """A buffer no live Result holds, ready to be written on ``stream`` (rule 8)."""
        buffers = self.buffers
        n = len(buffers)
        if n <= 2:  # the steady state of a method called from one place: two take turns
            for pooled in buffers:
                if not pooled.held:
                    pooled.prepare_write(stream)
                    return pooled
            return self._grow(stream)
        let_go = self.let_go[0]  # before the search: a buffer let go later changes it
        if self.all_held is not None:
            seen, size = self.all_held
            # n < 1.25 size: a count that lost an increment (two threads' `+= 1` interleaved,
            # the GIL switching inside it) costs a few extra buffers, never a pool that grows
            # without looking for ever.
            if seen == let_go and n < size + (size >> 2) + 1:
                return self._grow(stream)
            self.all_held = None
        start = self.turn if self.turn < n else 0
        self.quiet += 1
        # Counting is a pass over the pool: in a pool of thousands (a burst's), every 64th of
        # its size, still 64 counts a window, so that an execute costs no pass of its own.
        check = self.quiet % (_CHECK_EVERY if n < _CHECK_EVERY << 6 else n >> 6) == 0
        fallback = -1
        for k in range(n):
            i = start + k if start + k < n else start + k - n
            pooled = buffers[i]
            if not pooled.held:
                # One whose readers on other streams are done, if any: the device would make
                # this execute wait for a read still queued elsewhere (behind a long kernel, a
                # held latch), while another buffer is free. None: the first, with that wait.
                if not _readers_done(pooled, stream.key):
                    if fallback < 0:
                        fallback = i
                    continue
                return self._write(i, check, stream)
        if fallback >= 0:
            return self._write(fallback, check, stream)
        self.all_held = (let_go, n)
        return self._grow(stream)

    def _write(self, i: int, check: bool, stream: Stream) -> PooledBuffer:
        pooled = self.buffers[i]
        self.turn = i + 1
        if check:
            self._check(pooled, stream)
        pooled.prepare_write(stream)
        return pooled

    def _grow(self, stream: Stream) -> PooledBuffer:
        pooled = self.make(stream)
        pooled.lets_go = self.let_go
        self.buffers.append(pooled)
        self.quiet = self.most = 0
        return pooled

    def _check(self, keep: PooledBuffer, stream: Stream) -> None:
        """Count the held buffers; at the end of a window, free the idle ones beyond its working
        set (stream-ordered), keeping ``keep``, which is about to be written."""
        buffers = self.buffers
        idle = [b for b in buffers if not b.held and b is not keep]
        self.most = max(self.most, len(buffers) - len(idle) - 1)  # ``keep`` is not held
        if self.quiet < max(TRIM_AFTER, len(buffers)):
            return
        # Freed on this stream, after its readers: not one still read elsewhere (this execute
        # would wait for that read though it writes another buffer); a later window takes it.
        idle = [b for b in idle if _readers_done(b, stream.key)]
        freed = idle[:len(buffers) - max(2, 2 * self.most)]
        if freed:
            # Consumers nobody could mark are waited for while the buffers are still in the
            # pool: one an interrupt (Ctrl-C) takes out before its wait would be freed by its
            # finalizer with no such wait.
            for pooled in freed:
                pooled.settle_exports(stream)
            gone = set(map(id, freed))  # one pass, not a remove() each: a burst frees thousands
            # Out of the pool before any is freed, and the pool whole again (its turn too)
            # before the first free: an interrupt in between left a freed buffer listed as
            # free, which the next execute wrote into, or a turn past the end.
            buffers[:] = [b for b in buffers if id(b) not in gone]
        self.turn = buffers.index(keep) + 1
        self.quiet = self.most = 0
        for pooled in freed:
            # free() orders the free after every use of the buffer (rule 8); its uses are kept
            # until then (prepare_write would clear them), so that one an interrupt leaves
            # unfreed is freed by its finalizer after them too.
            pooled.array.buffer.free(stream)


def _readers_done(pooled: PooledBuffer, key: Any) -> bool:
    """Whether every use of ``pooled`` on a stream other than ``key`` has been reached (one
    event query each; none for a buffer used on ``key`` only, the common case)."""
    uses = pooled.array.buffer.uses
    if not uses or (len(uses) == 1 and key in uses):
        return True
    return all(k == key or _reached(e) for k, e in uses.copy().items())


class _Holder:
    """Kept alive by Results and exports; its death returns the buffer to the pool."""

    __slots__ = ("__weakref__", "pooled")

    def __init__(self, pooled: PooledBuffer):
        self.pooled = pooled
        pooled.held = True

    def __del__(self) -> None:  # cheaper than weakref.finalize on the per-call path
        pooled = self.pooled
        pooled.held = False
        pooled.lets_go[0] += 1  # after the flag: a search that misses the flag sees the count


class Result:
    """An output (or uploaded input) in device memory.

    ``to_host()`` returns a numpy array (the one host sync); ``shape``, ``dtype``, ``dtype_name``
    and ``device`` describe it; ``Result.from_host(array, device)`` uploads host data. Results
    are accepted as inputs by any method, zero-copy."""

    __slots__ = ("__weakref__", "_complete", "_holder", "array", "event", "stream_key",
                 "view_only")

    def __init__(self, array: DeviceArray, event: Event | None, stream_key: Any,
                 holder: _Holder | None = None, view_only: bool = False):
        self.array = array
        # Never re-recorded while this Result lives (a fresh event, or its held buffer's), so
        # once seen complete it stays complete:
        self.event = event
        self._complete = event is None
        self.stream_key = stream_key
        self._holder = holder
        self.view_only = view_only

    # -- description ----------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        """The output's shape, as the method declares it."""
        return self.array.shape

    @property
    def dtype(self) -> np.dtype:
        """The numpy dtype (bfloat16 is ml_dtypes')."""
        return self.array.dtype

    @property
    def dtype_name(self) -> str:
        """The dtype as a manifest names it: ``"float32"``, ``"bfloat16"``, ..."""
        return dtype_name(self.array.dtype)

    @property
    def device(self) -> Device:
        """The device whose memory holds it."""
        return self.array.buffer.device

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return self.array.nbytes

    def ready(self) -> bool:
        """True when the work producing this result has finished (never blocks)."""
        if not self._complete:
            assert self.event is not None  # _complete starts True without an event
            self._complete = self.event.query()
        return self._complete

    # -- data -----------------------------------------------------------------------------
    def wait_on(self, stream: Stream) -> None:
        """Make ``stream`` wait on the device until this result is ready (nothing to do once
        it is known ready, e.g. a model input read back or checked with ``ready()``)."""
        if not self._complete and stream.key != self.stream_key:
            assert self.event is not None
            stream.wait(self.event)

    def to_host(self) -> np.ndarray:
        """A numpy copy of the result, read on this thread's current stream: it waits (one
        host wait) for the work producing the result and for whatever was queued on that stream
        before, as torch's ``.cpu()`` and CuPy's ``.get()`` do."""
        device = self.device
        stream = current_stream(device)
        self.wait_on(stream)
        out = np.empty(self.array.shape, self.array.dtype)
        source, staged = self.array, None
        if self.view_only:
            # Its method rewrites it at its next execute, which must wait for this read once
            # it is enqueued (rule 8), as for a consumer method's (a held Result's buffer is
            # not reused). A copy into numpy (pageable) memory returns only once done, so the
            # read could be noted only after it: the view is copied on the device first, and
            # that copy is what its next execute waits for.
            source = staged = device.empty(self.array.shape, self.array.dtype, stream)
            device.copy(staged, self.array, stream)
            note_use(self.array.buffer.uses, stream.key, stream.record())
        device.copy_to_host(out, source, stream)
        stream.record().synchronize()
        if staged is not None:
            staged.buffer.free(stream)
        self._complete = True
        return out

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        """Refused: numpy would otherwise wrap the Result in a 0-d object array, silently. A
        Result is device memory; reading it is a host wait, which streamlane makes explicit."""
        raise InvalidArgument(f"{self!r} is device memory: read it with result.to_host() (one "
                              f"host wait), or share it zero-copy with np.from_dlpack(result) "
                              f"(host device) or torch / CuPy (CUDA)")

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused with a message saying what to do (pickle would otherwise fail inside, on a
        lock): a Result names device memory of this process."""
        raise TypeError(f"{self!r} is device memory of this process and does not pickle or "
                        f"deep-copy: send result.to_host() (a numpy array) and upload it again "
                        f"with Result.from_host(array, device)")

    def __copy__(self) -> Result:
        return self  # immutable: the same memory, the same event

    def __deepcopy__(self, memo: Any) -> Result:
        return self.__reduce_ex__(4)

    @classmethod
    def from_host(cls, array: Any, device: Device | str | None = None) -> Result:
        """Upload ``array`` (numpy, anything numpy can read, or a Result) to ``device``, keeping
        its dtype (bfloat16 included; a big-endian array arrives in native byte order). The
        copy is ordered on this thread's current stream."""
        from .device import Device, get_device

        if not isinstance(device, Device):
            device = get_device(device)
        if isinstance(array, Result):
            array = array.to_host()
        elif not isinstance(array, np.ndarray) and hasattr(array, "__dlpack__"):
            array = _from_dlpack(array)
        host = as_host_array(array, "from_host", order="C")
        if host.dtype.hasobject:
            what = "an object array" if isinstance(array, np.ndarray) else \
                f"{type(array).__name__} (numpy reads it as an object array)"
            cuda = " (it is CUDA memory: copy it to the host first)" if hasattr(
                array, "__cuda_array_interface__") else ""
            raise InvalidArgument(f"from_host: {what} cannot go to a device{cuda}; pass a "
                                  f"numpy array of one of the supported dtypes, or a list of "
                                  f"numbers")
        dtype_name(host.dtype)  # raises InvalidArgument for an unsupported dtype
        if not host.dtype.isnative:  # the copy is of bytes: kernels read native order
            host = host.astype(host.dtype.newbyteorder("="))
        stream = current_stream(device)
        dst = device.empty(host.shape if host.ndim else (), host.dtype, stream)
        device.copy_from_host(dst, host, stream)
        event = dst.buffer.uses[stream.key] = stream.record()
        return cls(dst, event, stream.key)

    # -- interop (zero-copy; see _dlpack and _cuda_array_interface below) -----------------
    def __dlpack__(self, *, stream: Any = None, max_version: Any = None, dl_device: Any = None,
                   copy: bool | None = None) -> Any:
        return _dlpack(self, stream=stream, max_version=max_version, dl_device=dl_device,
                       copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return _dlpack_device(self)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return _cuda_array_interface(self)

    def __repr__(self) -> str:
        try:
            state = "ready" if self.ready() else "pending"
        except Exception:
            state = "failed"
        kind = " view" if self.view_only else ""
        return (f"<Result {self.dtype_name}{list(self.shape)} on {self.device.name} "
                f"{state}{kind}>")


# -- interop ---------------------------------------------------------------------------------

def _dlpack_device(self: Result) -> tuple[int, int]:
    from .dlpack import KDL_CPU, KDL_CUDA

    dev = self.device
    return (KDL_CUDA, dev.index) if dev.kind == "cuda" else (KDL_CPU, 0)


def _from_dlpack(value: Any) -> Any:
    """``from_host``'s reading of an object that offers DLPack: numpy's own reading first when
    it has one (``__array__``: torch's; one export less), our reader for a host bfloat16
    tensor (numpy has no DLPack code for it; torch's ``__array__`` refuses it), else
    ``np.from_dlpack`` (numpy would make a DLPack-only object a 0-d object array)."""
    if hasattr(value, "__array__") or hasattr(value, "__array_interface__"):
        try:
            return np.asarray(value)
        except Exception:  # torch's bfloat16: read below
            pass
    try:
        return read_host_bfloat16(value)
    except MemoryError:
        raise
    except Exception:  # not a host bfloat16 tensor
        pass
    try:
        return np.from_dlpack(value)
    except Exception as exc:
        raise InvalidArgument(f"from_host: {type(value).__name__} cannot be read on the host "
                              f"(numpy, DLPack): {exc}") from None


def _dlpack(self: Result, *, stream: Any = None, max_version: Any = None,
            dl_device: Any = None, copy: bool | None = None) -> Any:
    """DLPack export, zero-copy. ``stream`` is the consumer's stream (DLPack protocol): it is
    made to wait for this result on the device; ``-1`` means the consumer synchronizes itself.
    The buffer is not rewritten until the consumer lets go of it and its queued work is done."""
    if dl_device is not None:
        try:  # any iterable of two ints, numpy integers too (operator.index), never bools
            given = tuple(dl_device)
            wanted = tuple(operator.index(v) for v in given
                           if not isinstance(v, (bool, np.bool_)))
            if len(wanted) != len(given):
                wanted = ()
        except TypeError:
            wanted = ()
        if len(wanted) != 2:
            raise InvalidArgument(f"__dlpack__(dl_device=...) takes a (device type, device id) "
                                  f"pair such as {_dlpack_device(self)}, got {dl_device!r}")
        if wanted != _dlpack_device(self):
            raise DLPackUnsupported(f"Result on {self.device.name} cannot be exported to "
                                    f"DLPack device {wanted}; call to_host() first")
    _check_dlpack_args(stream, max_version, copy)
    if copy and self.device.kind == "cuda":
        raise DLPackUnsupported("Result.__dlpack__(copy=True) is not supported on a GPU; "
                                "export it without a copy, or call to_host() for a host copy")
    holder = self._holder if self._holder is not None else self
    from .dlpack import KDL_CPU, KDL_CUDA, export

    if self.device.kind != "cuda":
        if self.event is not None:
            self.event.synchronize()  # host consumers read at once
        view = _host_view(self, holder)
        if copy and max_version is not None and self.dtype_name != "bfloat16":
            try:  # numpy (>= 2.1) copies, and its versioned capsule says so (IS_COPIED, and
                return view.__dlpack__(max_version=max_version, copy=True)  # writable)
            except TypeError:
                pass
        if copy:  # the consumer asked for memory of its own (DLPack: copy=True)
            view = view.copy()
        if self.dtype_name == "bfloat16":  # numpy has no DLPack code for it; ours does
            return export(view.ctypes.data, self.shape, self.dtype, KDL_CPU, 0, view)
        return view.__dlpack__()

    consumer = _consumer_stream(self, stream)
    if self._holder is not None:
        release = self._holder.pooled.export_to(consumer)
    else:  # memory of its own (Result.from_host): its free waits for the consumer's work
        release = None if consumer is None else functools.partial(
            mark_release, self.array.buffer, consumer, None)
    return export(self.array.ptr, self.shape, self.dtype, KDL_CUDA, self.device.index, holder,
                  on_release=release)


def _check_dlpack_args(stream: Any, max_version: Any, copy: Any) -> None:
    """``__dlpack__``'s arguments as the protocol has them, on every device alike (the host
    device took any int as a stream, where CUDA refuses it)."""
    if stream is not None:
        if isinstance(stream, bool) or not isinstance(stream, int) or stream < -1 \
                or stream >= 1 << 64:
            raise InvalidArgument(f"__dlpack__(stream=...) takes None, -1 or a stream handle "
                                  f"(an int from 1), got {stream!r}")
        if stream == 0:
            raise InvalidArgument("__dlpack__(stream=0) is ambiguous by the DLPack protocol; "
                                  "pass 1 (legacy) or 2 (per-thread)")
    if max_version is not None and not (
            isinstance(max_version, tuple) and len(max_version) == 2 and all(
                isinstance(v, int) and not isinstance(v, bool) for v in max_version)):
        raise InvalidArgument(f"__dlpack__(max_version=...) takes None or a (major, minor) "
                              f"pair of ints, got {max_version!r}")
    if copy is not None and not isinstance(copy, bool):
        raise InvalidArgument(f"__dlpack__(copy=...) takes None, True or False, got {copy!r}")


def _consumer_stream(self: Result, stream: Any) -> Stream | None:
    """Order the consumer's stream after this result; return it (None: unknown)."""
    if stream == -1 or self.event is None:
        if stream == -1 and self.event is not None:
            self.event.synchronize()
        return None
    if stream is None:
        stream = LEGACY_HANDLE  # DLPack: None means the legacy default stream on CUDA
    consumer = self.device.stream_from_handle(stream)
    self.wait_on(consumer)
    return consumer


def _cuda_array_interface(self: Result) -> dict[str, Any]:
    """CUDA array interface v3 (CUDA results only). The data is ready when it is read (one host
    wait if the producing work is still running), so ``stream`` is None."""
    if self.device.kind != "cuda":
        raise AttributeError("__cuda_array_interface__ exists only for results on a CUDA device")
    if self.event is not None and not self.event.query():
        self.event.synchronize()
    if self._holder is not None:
        self._holder.pooled.export_to(None)
    typestr = self.dtype.str if self.dtype_name != "bfloat16" else "<V2"
    return {"shape": self.shape, "typestr": typestr, "data": (self.array.ptr, False),
            "version": 3, "strides": None, "stream": None}


class _Export:
    """An ``__array_interface__`` carrier whose lifetime pins the result's holder."""

    def __init__(self, array: np.ndarray, holder: Any):
        self.__array_interface__ = array.__array_interface__
        self._array = array
        self._holder = holder


def _host_view(self: Result, holder: Any) -> np.ndarray:
    from .host import HostDevice

    view = HostDevice.view(self.array)
    return np.asarray(_Export(view, holder))


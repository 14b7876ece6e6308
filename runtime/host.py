"""The host device: an emulated GPU for machines without one (CI, laptops).

Each stream is a worker thread draining a FIFO; events are markers in those FIFOs; memory is host
memory; kernels run their numpy twins. Every ordering rule holds exactly as on CUDA, so the same
tests prove the same contract — and ``inject_delay`` makes a race reproducible by stalling one
stream.

Guarantees:
- work enqueued on one stream runs in enqueue order, one item at a time;
- a stream wait blocks only that stream's worker, never the thread that enqueued it;
- a failing kernel makes the device's error sticky (as a CUDA context error is): later waits on
  any stream raise ``DeviceError`` instead of hanging, and later kernels are skipped.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from streamlane.kernels import KernelSpec

from .device import Device, PreparedLaunch, check_step_result
from .dtypes import real_in
from .errors import DeviceError, InvalidArgument, InvalidState, StreamClosed
from .event import Event
from .memory import DeviceArray
from .stream import LEGACY, LEGACY_HANDLE, PER_THREAD, PER_THREAD_HANDLE, Stream

__all__ = ["HostDevice"]

_POISON = 0xFF  # fresh memory reads as NaN in float32, so an unwritten output is visible
MAX_INJECTED_DELAY_S = 86_400.0  # a day: anything longer is a mistake (time.sleep overflows)


# This process's id, kept current in a forked child: os.getpid() is a system call (0.25 us),
# and put() runs for every piece of host work.
_PROCESS = [os.getpid()]
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=lambda: _PROCESS.__setitem__(0, os.getpid()))


class _Worker:
    """One host stream: a daemon thread running queued callables in order."""

    _ids = itertools.count(16)

    def __init__(self, device: HostDevice, name: str):
        self.id = next(self._ids)
        self.device = device
        self.queue: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self.stopped = False
        self.drained = threading.Event()  # set when its thread has run everything and ends
        self.pid = _PROCESS[0]  # a forked child has no such thread (put, _drain)
        # A per-thread stream's worker: the Stream a callable step running on it is handed
        # (HostDevice._enqueue_callable)
        self.handed: Stream | None = None
        # put() and stop(): nothing lands behind the sentinel. Re-entrant: a signal handler
        # may run on this thread inside put() and give this stream work of its own.
        self._lock = threading.RLock()
        self.thread = threading.Thread(target=self._run, name=f"streamlane-host-{name}",
                                       daemon=True)
        with device._every_lock:  # until its thread ends (the thread holds it)
            device._every_worker.add(self)
        self.thread.start()

    def put(self, item: Callable[[], None]) -> None:
        if self.pid != _PROCESS[0]:  # a forked child: this stream's thread is not here
            raise StreamClosed(f"host stream {self.id:#x} belongs to the parent process (a "
                               f"fork copies only the forking thread); its work would never "
                               f"run here")
        # Work that a step running on this stream adds to it (a callable step recording an
        # event on the stream it is handed) still runs once the stream is stopping (_run)
        own = threading.current_thread() is self.thread
        with self._lock:  # a stop() between the check and the put would strand the item
            if self.stopped and not own:
                # a borrowed handle of a stream its owner closed, or a close() on another
                # thread after this work's own check of the stream: it is lost
                raise StreamClosed(f"host stream {self.id:#x} was destroyed by its owner (a "
                                   f"close() of it, perhaps on another thread while this work "
                                   f"was being queued); work given to it would never run")
            self.queue.put(item)

    def stop(self) -> None:
        """Finish the queued work, then end the thread."""
        with self._lock:
            self.stopped = True
            self.queue.put(None)

    def _run(self) -> None:
        device = self.device
        stopping = False
        try:
            while True:
                try:
                    item = self.queue.get_nowait() if stopping else self.queue.get()
                except queue.Empty:  # stopping, and nothing left behind the sentinel
                    break
                if item is None:  # the sentinel; what its own steps put behind it still runs
                    stopping = True
                    continue
                try:
                    item()
                except BaseException as exc:  # the emulated device faults; never silently
                    device._fault(exc)
        finally:
            self.drained.set()


class _Marker:
    """One record of a host event: set when its stream reaches it."""

    __slots__ = ("done", "time_ns", "worker")

    def __init__(self, worker: _Worker | None = None) -> None:
        self.done = threading.Event()
        self.time_ns = 0
        self.worker = worker  # the stream it was put on (None: the complete marker)

    def reach(self) -> None:
        self.time_ns = time.perf_counter_ns()
        self.done.set()


_COMPLETE = _Marker()
_COMPLETE.reach()


class _HostEvent:
    __slots__ = ("marker",)

    def __init__(self) -> None:
        self.marker = _COMPLETE  # never recorded: complete, as in CUDA


class _ThreadStream:
    """Holder in a thread-local: when the thread ends, the holder dies, and the thread's
    stream is drained before the thread is done (its ``join`` returns after the queued work,
    as CUDA's per-thread stream is drained at a thread's end: ``cuda._PerThreadStream``)."""

    def __init__(self, stream: Stream, worker: _Worker):
        self.stream = stream
        weakref.finalize(self, _drain, worker, stream)


def _drain(worker: _Worker, stream: Stream) -> None:
    stream._thread_ended()
    # (os.getpid(): at a fork, the child drops the other threads' holders before _PROCESS is
    # brought up to date)
    if worker.pid != os.getpid():  # a forked child's copy of a thread: its worker was not
        return  # copied (only the forking thread is), so nothing runs there to wait for
    worker.stop()
    # Its own event, not Thread.join(): this runs as the thread is torn down, where join()'s
    # current_thread() would register a dummy thread that stays in threading.enumerate().
    if worker.thread.ident != threading.get_ident():
        worker.drained.wait()


class HostDevice(Device):
    kind = "host"

    def __init__(self) -> None:
        super().__init__(0)
        self._local = threading.local()
        # Every stream's worker, other threads' per-thread streams and closed streams still
        # draining included: synchronize() waits for them all, as cuCtxSynchronize does.
        self._every_worker: weakref.WeakSet[_Worker] = weakref.WeakSet()
        self._every_lock = threading.Lock()
        self._legacy_worker = _Worker(self, "legacy")
        self._legacy = Stream(self, LEGACY, LEGACY_HANDLE, self._legacy_worker)
        self._workers: weakref.WeakValueDictionary[int, _Worker] = weakref.WeakValueDictionary()
        self._fault_cause: BaseException | None = None  # what a step raised: the fault

    # -- test hooks ---------------------------------------------------------------------------
    def inject_delay(self, stream: Stream, seconds: float) -> None:
        """Stall ``stream`` for ``seconds`` at this point of its queue (test hook). A bad
        ``seconds`` is refused here: on the stream's worker it faulted the whole device."""
        impl = self._stream_impl(stream, "inject_delay")
        delay = real_in(seconds, 0.0, MAX_INJECTED_DELAY_S)
        if delay is None:
            raise InvalidArgument(f"inject_delay: seconds must be a number in [0, "
                                  f"{MAX_INJECTED_DELAY_S:g}], got {seconds!r}")
        impl.put(lambda: time.sleep(delay))

    def inject_failure(self, stream: Stream, message: str = "injected failure") -> None:
        """Make the device fault when ``stream`` reaches this point (test hook)."""
        impl = self._stream_impl(stream, "inject_failure")
        if not isinstance(message, str):  # it becomes the fault's text, as inject_delay checks
            raise InvalidArgument(f"inject_failure: message must be a str, got "
                                  f"{type(message).__name__}")

        def fail() -> None:
            raise RuntimeError(message)

        impl.put(fail)

    def reset_error(self) -> None:
        """Clear a sticky fault (tests only: a real CUDA context cannot be recovered)."""
        self._fault_cause = None

    @property
    def lost(self) -> bool:
        """True once a fault (an exception on a stream's worker thread) has made the device
        unusable, as a kernel fault does a CUDA context (``reset_error`` is for tests)."""
        return self._fault_cause is not None

    # -- streams ------------------------------------------------------------------------------
    def per_thread_stream(self) -> Stream:
        holder = getattr(self._local, "holder", None)
        if holder is None:
            worker = _Worker(self, f"thread-{threading.get_ident()}")
            stream = Stream(self, PER_THREAD, PER_THREAD_HANDLE, worker,
                            owner_thread=threading.get_ident())
            holder = self._local.holder = _ThreadStream(stream, worker)
        return holder.stream

    def legacy_stream(self) -> Stream:
        return self._legacy

    def _new_stream(self) -> tuple[int, Any]:
        worker = _Worker(self, "owned")
        self._workers[worker.id] = worker
        return worker.id, worker

    def _destroy_stream(self, impl: _Worker) -> None:
        self._workers.pop(impl.id, None)
        impl.stop()

    def _foreign_stream(self, handle: int) -> Any:
        worker = self._workers.get(handle)
        if worker is None:
            raise InvalidArgument(f"stream handle {handle:#x} names no stream of the host device")
        return worker

    def _stream_synchronize(self, impl: _Worker) -> None:
        self._count_wait()
        if impl.thread.ident == threading.get_ident():  # a callable step waiting for its own
            self._raise_if_faulted()  # stream: all before it has run (on CUDA it would wait
            return  # for those steps); a marker put behind it would never be reached
        marker = _Marker(impl)
        impl.put(marker.reach)
        self._wait_marker(marker)

    def _stream_wait(self, impl: _Worker, event: Event) -> None:
        marker = event._impl.marker  # the latest record at the time of the call, as in CUDA
        if marker is not _COMPLETE:
            impl.put(marker.done.wait)

    # -- events -------------------------------------------------------------------------------
    def _new_event(self, timing: bool) -> Any:
        return _HostEvent()

    def _record(self, event: Event, stream_impl: _Worker) -> None:
        marker = _Marker(stream_impl)
        stream_impl.put(marker.reach)  # first: a record that fails leaves the event as it was
        event._impl.marker = marker  # (as on CUDA), not waiting for a marker nothing reaches
        event.recorded = True

    def _event_query(self, event: Event) -> bool:
        if not event.recorded:  # complete, touching nothing (as on CUDA: no driver call)
            return True
        self._raise_if_faulted()
        return event._impl.marker.done.is_set()

    def _event_synchronize(self, event: Event) -> None:
        if not event.recorded:  # nothing to wait for: no host wait counted (as on CUDA)
            return
        self._count_wait()
        self._wait_marker(event._impl.marker)

    def _elapsed_ms(self, start: Event, end: Event) -> float:
        a, b = start._impl.marker, end._impl.marker
        if not (a.done.is_set() and b.done.is_set()):
            raise InvalidArgument("elapsed_ms: both events must have completed; synchronize the "
                                  "end event first")
        return (b.time_ns - a.time_ns) / 1e6

    def _device_synchronize(self) -> None:
        with self._every_lock:
            workers = list(self._every_worker)
        markers, ending = [], []
        me = threading.current_thread()
        for w in workers:
            if w.thread is me:  # called from a step running on this stream: not behind itself
                continue
            m = _Marker()
            try:
                w.put(m.reach)
            except StreamClosed:  # a closed stream, an ended thread's (perhaps since the list
                ending.append(w.thread)  # was taken): it ends once drained
                continue
            markers.append(m)
        for m in markers:
            self._wait_marker(m)
        for thread in ending:
            while thread.is_alive():
                thread.join(0.05)
                self._raise_if_faulted()

    def _wait_marker(self, marker: _Marker) -> None:
        worker = marker.worker
        if worker is not None and worker.thread.ident == threading.get_ident() \
                and not marker.done.is_set():
            raise InvalidState(
                "a callable step waited for an event recorded on its own stream after it: on "
                "the host device that stream runs the step, so the event cannot be reached "
                "until the step returns. Wait for events recorded before the step, or after "
                "the execute")
        while not marker.done.wait(0.05):
            self._raise_if_faulted()
        self._raise_if_faulted()

    def _fault(self, exc: BaseException) -> None:
        if self._fault_cause is None:
            self._fault_cause = exc

    def _raise_if_faulted(self) -> None:
        cause = self._fault_cause
        if cause is not None:  # a new error each time (one raised again and again grew its
            # traceback and kept every caller's frame alive), caused by what the step raised
            raise DeviceError(f"host device fault: {cause!r}; the device is unusable until "
                              f"the process restarts", "HOST_DEVICE_FAULT") from cause

    # -- memory -------------------------------------------------------------------------------
    def _alloc(self, nbytes: int, stream_impl: Any) -> tuple[int, Any]:
        try:
            storage = np.full(nbytes, _POISON, np.uint8)
        except MemoryError:  # as CUDA reports it: a DeviceError, the device still usable
            raise DeviceError(f"out of memory: the host device could not allocate {nbytes} "
                              f"bytes; free buffers you no longer need or use smaller shapes",
                              "CUDA_ERROR_OUT_OF_MEMORY") from None
        return storage.ctypes.data, storage

    def _free_memory(self, ptr: int, impl: Any, stream_impl: Any, after: list[Event]) -> None:
        pass  # the storage goes with the last reference to it (queued work holds views)

    @staticmethod
    def view(array: DeviceArray) -> np.ndarray:
        """The numpy view of a host-device array (for host kernels and tests)."""
        storage = array.buffer._impl
        if storage is None:  # borrowed memory (another library's array): view it in place
            storage = np.ctypeslib.as_array(
                (ctypes.c_uint8 * array.buffer.nbytes).from_address(array.buffer.ptr))
        raw = storage[array.offset:array.offset + array.nbytes]
        return raw.view(array.dtype).reshape(array.shape)

    def _copy_h2d(self, dst: DeviceArray, src: np.ndarray, stream_impl: _Worker) -> None:
        snapshot = src.copy()  # pageable-copy semantics: the source is free once we return
        view = self.view(dst)
        stream_impl.put(lambda: np.copyto(view, snapshot))

    def _copy_d2h(self, dst: np.ndarray, src: DeviceArray, stream_impl: _Worker) -> None:
        """Returns once the copy is done, as CUDA's copy into pageable (numpy) memory does:
        code tested here must not count on it returning while the stream is held (a latch).
        Not counted in ``host_waits`` (no caller asked for the wait; as on CUDA)."""
        view = self.view(src)
        marker = _Marker(stream_impl)

        def copy() -> None:
            np.copyto(dst, view)
            marker.reach()

        stream_impl.put(copy)
        self._wait_marker(marker)

    def _copy_d2d(self, dst: DeviceArray, src: DeviceArray, stream_impl: _Worker) -> None:
        d = dst.buffer._impl[dst.offset:dst.offset + dst.nbytes]
        s = src.buffer._impl[src.offset:src.offset + src.nbytes]
        stream_impl.put(lambda: np.copyto(d, s))

    # -- kernels ------------------------------------------------------------------------------
    def _check_launch(self, spec: KernelSpec, params: Mapping[str, Any]) -> None:
        if spec.host_check is not None:  # what the numpy twin needs beyond the CUDA kernel
            spec.host_check(params)

    def _load_kernel(self, spec: KernelSpec, entry: str) -> Any:
        return spec.host  # one numpy twin, whatever the CUDA entry

    def _launch(self, prepared: PreparedLaunch, stream_impl: _Worker,
                ins: Sequence[DeviceArray], outs: Sequence[DeviceArray]) -> None:
        fn, params = prepared.function, prepared.params
        in_views = [self.view(a) for a in ins]
        out_views = [self.view(a) for a in outs]

        def run() -> None:
            if self._fault_cause is None:  # a faulted device runs no more kernels
                # IEEE results (inf, NaN) as on CUDA: numpy's RuntimeWarnings, turned into
                # errors by a warnings filter (python -W error), would fault the device.
                with np.errstate(all="ignore"):
                    fn(in_views, out_views, params)

        stream_impl.put(run)

    def _enqueue_callable(self, stream_impl: _Worker, stream: Stream, fn: Any,
                          ins: Sequence[DeviceArray], outs: Sequence[DeviceArray]) -> None:
        """The step runs on the stream's worker, in stream order. It is handed a Stream that
        thread may use: the caller's per-thread Stream refuses every thread but its owner's,
        so a step touching it (``record()``) faulted the device where CUDA runs it. Inputs
        are read-only views (they may be constants, or another method's Result)."""
        in_views = []
        for a in ins:
            view = self.view(a)[...]  # a view of its own, so the flag stays with the step
            view.flags.writeable = False
            in_views.append(view)
        out_views = [self.view(a) for a in outs]
        handed = stream
        if stream.owner_thread is not None:  # a per-thread stream: the same queue, usable by
            handed = stream_impl.handed  # its worker (made once: a worker has one such Stream)
            if handed is None:
                handed = stream_impl.handed = Stream(self, stream.kind, stream.handle,
                                                     stream_impl,
                                                     owner_thread=stream_impl.thread.ident)
                handed.key = stream.key

        def run() -> None:
            if self._fault_cause is None:
                check_step_result(fn, fn(handed, in_views, out_views))

        stream_impl.put(run)

    def _new_latch(self) -> tuple[dict[str, Any], Any]:
        release = threading.Event()

        class _Release:
            def release(self) -> None:
                release.set()

        return {"flag_ptr": 0, "_release": release}, _Release()


DEVICE_CLASS = HostDevice

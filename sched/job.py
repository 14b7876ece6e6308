"""Jobs: one submitted execution of a method, awaitable, carrying its event and outputs.

A job lives on two threads. Its *lane* (a host thread) enqueues it on the device, then
*publishes* what later jobs need: the completion event and the output Results. A thread that
must wait for that (rarely: a dependent on another lane) waits on a ``threading.Event`` made
only for it. The *loop* owns the rest: the awaitable state, set once by the completion path and
never touched by other threads.

Guarantees:
- ``event`` and ``results`` are written once, by the lane, before the job is published; a
  thread that saw it published reads them complete;
- a job finishes exactly once (done, failed or cancelled); later attempts are ignored, so the
  completion path and a scheduler breaking can race harmlessly;
- cancelling an ``await job`` only stops that await: the device work, the job's buffers and the
  job's outcome are untouched, and another ``await`` sees the outcome.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal, SupportsIndex, overload

import anyio

from streamlane.runtime.errors import InvalidArgument, InvalidState

from .errors import DependencyFailed

if TYPE_CHECKING:
    from collections.abc import Generator

    from streamlane.runtime import Event, Method, Result

    from .lane import Lane

__all__ = ["Job", "JobOutput", "JobOutputs"]

# Guards the hand-over between a publishing lane and a thread about to wait (no lost wake-up);
# held for a few bytecodes, so one lock serves every job.
_PUBLISH_LOCK = threading.Lock()

JobState = Literal["queued", "running", "done", "failed", "cancelled"]
QUEUED: JobState = "queued"
RUNNING: JobState = "running"
DONE: JobState = "done"
FAILED: JobState = "failed"
CANCELLED: JobState = "cancelled"


class JobOutput:
    """Output ``index`` of a job, usable as an input of later submits before the job has run.

    The lane that consumes it waits (on the host, off the event loop) until the producing job is
    enqueued, then passes its ``Result`` zero-copy; the consumer's stream waits on the producer's
    event on the device (implicitly, as with ``after=``).
    """

    __slots__ = ("index", "job")

    def __init__(self, job: Job, index: int):
        self.job = job
        self.index = index

    @property
    def result(self) -> Result:
        """The ``Result`` (available once the job is enqueued; it may still be pending on the
        device: ``await job`` first to read it on the host). Raises ``InvalidState`` while the
        job waits for its lane, or once it failed.

        A lone job held back for its await (``Scheduler``: inline) is enqueued now, by the
        loop thread, so its outputs exist as soon as ``submit`` returns."""
        job = self.job
        if job._parked and job.lane._core.waker.on_loop() and job.lane._core.may_update():
            job.lane._core.start_parked()
        results = job.results
        if results is None:
            if job._finished or job._enqueue_error is not None:  # it will never have one
                state = f"ended {job._state}" if job._finished else \
                    "failed before reaching the device"
                raise InvalidState(f"output {self.index} of {job!r}: the job {state}, so it "
                                   f"has no Result; await the job to see why")
            raise InvalidState(f"output {self.index} of {job!r}: the job waits for its lane, "
                               f"so it has no Result yet; await the job, or pass this "
                               f"JobOutput as an input of a later submit")
        return results[self.index]

    def __repr__(self) -> str:
        return f"<JobOutput {self.index} of {self.job!r}>"

    def __array__(self, dtype: Any = None, copy: Any = None) -> Any:
        """Refused, as a Result's: numpy would otherwise wrap it in a 0-d object array."""
        raise InvalidArgument(f"{self!r} is a job's output on the device: await the job and "
                              f"read its Result with to_host(), or pass it to a later submit")

    def __copy__(self) -> Any:  # as a Result's: the object itself
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_PICKLED.format(what=repr(self)))


_NOT_PICKLED = ("{what} belongs to a scheduler of this process and does not pickle or "
                "deep-copy: await the job and send its outputs' to_host() (numpy arrays)")


class JobOutputs(Sequence[JobOutput]):
    """The outputs of a job, one ``JobOutput`` per output of the method."""

    __slots__ = ("_items",)

    def __init__(self, job: Job, count: int):
        self._items = tuple(JobOutput(job, i) for i in range(count))

    @overload
    def __getitem__(self, index: SupportsIndex) -> JobOutput: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[JobOutput, ...]: ...

    def __getitem__(self, index: SupportsIndex | slice) -> JobOutput | tuple[JobOutput, ...]:
        return self._items[index]

    def __len__(self) -> int:
        return len(self._items)

    def __copy__(self) -> JobOutputs:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_PICKLED.format(what="a job's outputs"))

    def __iter__(self) -> Iterator[JobOutput]:
        return iter(self._items)

    def __repr__(self) -> str:
        return f"JobOutputs({list(self._items)!r})"


class Job:
    """One submitted execution. ``await job`` gives its outputs (a list of ``Result``) once the
    device has finished it. Created by ``Scheduler.submit``, never directly."""

    __slots__ = (
        "__weakref__",
        "_accounted",
        "_busy_key",
        "_calls",
        "_claimed",
        "_counted",
        "_device_waits",
        "_done",
        "_enqueue_error",
        "_error",
        "_error_tb",
        "_finished",
        "_host_waits",
        "_inputs",
        "_is_published",
        "_loop_owned",
        "_not_run_state",
        "_parked",
        "_pin",
        "_publish_event",
        "_retrieved",
        "_span",
        "_span_unread",
        "_start_event",
        "_state",
        "_stream_key",
        "_taken",
        "_track_handle",
        "event",
        "id",
        "lane",
        "method",
        "name",
        "results",
        "stream",
    )

    def __init__(self, id: int, method: Method, inputs: list[Any], lane: Lane, stream: Any,
                 host_waits: tuple[Job, ...], device_waits: tuple[Job, ...],
                 pin: object = None):
        self.id = id
        self.method = method
        self.name: str = method.name
        self.lane = lane
        self.stream = stream
        # Written by the lane before it publishes the job (None until then: a lone job held
        # back for its await, Scheduler._enqueue, is published once it starts):
        self.event: Event | None = None
        self.results: list[Result] | None = None
        self._span: tuple[float, float] | None = None  # read from its timing events (span)
        self._span_unread = False  # settled, its timing events not read yet (Lane.read_spans)
        self._track_handle: int | None = None  # the caller stream's handle, once enqueued
        self._start_event: Event | None = None  # timing=True: the lane's to reuse once read
        self._stream_key: Any = None
        self._busy_key: Any = None  # the stream it counts as busy (Scheduler._count_stream)
        self._enqueue_error: BaseException | None = None
        self._not_run_state = ""  # with _enqueue_error: how it settles (failed or cancelled)
        self._calls = 0  # driver calls it queues on the device, about (set by the scheduler)
        self._claimed = False  # settled by a thread of its lane (or the loop: Lane.poll)
        self._counted = False  # in its lane's queued count (Lane.put / park, Lane._uncount)
        self._loop_owned = False  # kept by the loop for its poll, not yet given to the waiter
        self._parked = False  # held back for the loop thread to enqueue (Scheduler._enqueue)
        self._pin = pin  # the token of its caller stream's pin (Scheduler._submit), or None
        self._is_published = False
        self._taken = False  # its fate decided: a lane runs it, or the loop abandoned it
        self._publish_event: threading.Event | None = None  # made only if someone must wait
        # Read by the lane, dropped once enqueued, so a long chain of after= jobs does not keep
        # every earlier job (and its buffers) alive:
        self._inputs: list[Any] | None = inputs
        self._host_waits = host_waits
        self._device_waits = device_waits
        # Loop side:
        self._done: anyio.Event | None = None  # made only if someone waits before the end
        self._finished = False
        self._accounted = False  # its room, count and pin given back (Scheduler.finish)
        self._state = QUEUED
        self._error: BaseException | None = None
        self._error_tb: Any = None  # its traceback as it was settled
        self._retrieved = False

    # -- public state ---------------------------------------------------------------------
    @property
    def track(self) -> str | None:
        """The job's timeline row once enqueued: ``"lane 0"``, or ``"lane 0 stream 0x10"``
        under a caller stream (None before)."""
        if not self._is_published or self._enqueue_error is not None:
            return None
        if self._track_handle is None:
            return f"lane {self.lane.index}"
        return f"lane {self.lane.index} stream {self._track_handle:#x}"

    @property
    def span(self) -> tuple[float, float] | None:
        """The job's device start and end, in seconds after the scheduler's reference event
        (timing events; None without ``timing``, or until the job has finished)."""
        self._observe()  # settled here if the device has finished it (started, if held back)
        if self._span_unread and self.lane._core.may_update():
            self.lane.read_spans()
        return self._span

    @property
    def outputs(self) -> JobOutputs:
        """The job's outputs as ``JobOutput``s, usable as inputs of later submits right away.

        Made on each access, so a job and its outputs form no reference cycle: a finished job
        is freed as soon as nobody holds it, and its output buffers go back to their method's
        pool at once instead of at the next garbage collection."""
        return JobOutputs(self, len(self.method.definition.outputs))

    @property
    def state(self) -> JobState:
        """``queued`` (waiting for its lane), ``running`` (enqueued on the device), ``done``,
        ``failed`` or ``cancelled`` (never ran: the scheduler left on an error)."""
        self._observe()
        if self._finished:
            return self._state
        return RUNNING if self._is_published and self._enqueue_error is None else QUEUED

    def _observe(self) -> None:
        """Let the lane settle this job if the device has finished it (``Lane.observe``),
        unless called from inside the scheduler (a raw signal handler): then only read."""
        core = self.lane._core
        if core.may_update():
            finished = self._finished
            self.lane.observe(self)
            if self._finished and not finished:  # settled here: its await must hear of it
                core.observed()

    def done(self) -> bool:
        """True once the job has finished, whatever the outcome (never blocks). Agrees with the
        device: a job the device has finished is done even if its completion has not reached
        the loop yet."""
        self._observe()
        return self._finished

    def exception(self) -> BaseException | None:
        """The error of a finished job, or None (raises ``InvalidState`` while it runs)."""
        self._observe()
        if not self._finished:
            raise InvalidState(f"{self!r} has not finished; await it first")
        self._seen()
        return self._error

    def _seen(self) -> None:
        """Its error reached the caller: leaving the scheduler need not raise it. Nor the
        errors of the jobs a ``DependencyFailed`` goes back to: it carries them (its
        ``__cause__``, and its message names the first)."""
        self._retrieved = True
        error = self._error
        while isinstance(error, DependencyFailed) and error.dependency is not None:
            error.dependency._retrieved = True
            error = error.dependency._error

    async def wait(self) -> list[Result]:
        """``await job`` and ``await job.wait()`` are equivalent: wait until the device has
        finished the job and return its outputs.

        Raises the job's error: ``DeviceError`` (``SchedulerBroken``) if the device failed,
        ``SchedulerClosed`` if it was cancelled before running, ``DependencyFailed``, or the
        runtime's error (e.g. ``InvalidInput``) if its inputs were refused.

        **Cancellation**: cancelling this await only stops waiting. The job is not cancelled:
        its device work runs to completion, its buffers stay alive until then, and the
        scheduler releases them in the background.
        """
        waker = self.lane._core.waker
        if not waker.on_loop():  # a finished job may be awaited from any loop, any thread:
            if not self._finished:  # nothing of its scheduler is touched then
                self.lane._core.check_loop_thread(  # raises
                    f"await {self.label} before it finished (once finished, any loop may)")
            await anyio.lowlevel.checkpoint()
            return self._outcome()
        return await self._wait_on_loop()

    async def _wait_on_loop(self) -> list[Result]:
        """``wait()`` called in its scheduler's loop (``Scheduler.run``, which checked that)."""
        if self._parked:  # a lone job the loop enqueues now, at its first await
            self.lane._core.start_parked()
        if self._finished:
            await self.lane._core.checkpoint()
        else:
            checked = False  # whether this await has passed a cancellation point
            if self._is_published and self._enqueue_error is None:  # in flight: a short
                # poll may beat the waiter's wakeup (and gives a job the loop kept to the
                # waiter)
                checked = await self.lane.poll(self)
            if not self._finished and self._claimed:  # counted as done, its settle
                self.lane.observe(self)  # posted (or cut short by a Ctrl-C): settled here
            if not self._finished:
                await self._wait_done()
            elif not checked:  # settled just now (observe): `await job` is still always a
                await self.lane._core.checkpoint()  # cancellation point, as when finished
        return self._outcome()

    def _outcome(self) -> list[Result]:
        """A finished job's outputs (a new list each time), or its error raised."""
        self._seen()
        if self._error is not None:  # each await adds only its own frames (as a Future)
            raise self._error.with_traceback(self._error_tb)
        assert self.results is not None
        return list(self.results)

    def __await__(self) -> Generator[Any, None, list[Result]]:
        return self.wait().__await__()

    # -- lane side ------------------------------------------------------------------------
    def _published(self, timeout: float | None) -> bool:
        if self._is_published:
            return True
        with _PUBLISH_LOCK:
            if self._is_published:
                return True
            if self._publish_event is None:
                self._publish_event = threading.Event()
            event = self._publish_event
        return event.wait(timeout)

    def _take(self) -> bool:
        """The lane (or the loop's inline enqueue) takes the job to run it; False if the loop
        abandoned it first (``_abandon``)."""
        with _PUBLISH_LOCK:
            if self._taken:
                return False
            self._taken = True
            return True

    def _abandon(self, error: BaseException) -> bool:
        """Loop thread: publish ``error`` as the job's outcome unless a lane has taken it.
        For a job whose hand-over to its lane an exception interrupted: it may sit in the
        lane's queue or nowhere; either way no lane runs it now, and jobs ordered after it see
        it failed instead of waiting for it forever."""
        with _PUBLISH_LOCK:
            if self._taken:
                return False
            self._taken = True
        self._publish(None, None, error)
        return True

    def _publish(self, event: Event | None, results: list[Result] | None,
                 error: BaseException | None) -> None:
        self.event = event
        self.results = results
        self._enqueue_error = error
        self._inputs = None
        self._host_waits = self._device_waits = ()
        with _PUBLISH_LOCK:
            self._is_published = True
            event = self._publish_event
        if event is not None:
            event.set()
        pin = self._pin
        if pin is not None:  # pinned at submit (Scheduler._submit)
            try:
                self.stream.unpin(pin)
            except BaseException:  # a Ctrl-C as unpin() began: give the pin back all the same
                self.stream._release_pin(pin)
                raise

    # -- loop side ------------------------------------------------------------------------
    def _finish(self, state: JobState, error: BaseException | None = None) -> bool:
        """Settle the job (loop thread only). Returns False if it was already settled."""
        if self._finished:
            if self._state != DONE:  # failed while its lane's thread was enqueuing it (the
                self.results = None  # device broke): outputs it published since are garbage
            return False
        self._finished = True
        self._state = state
        self._error = error
        self._error_tb = error.__traceback__ if error is not None else None
        if state != DONE:
            self.results = None  # a failed job's outputs are garbage: let their buffers go
        self._start_event = None
        if self._done is not None:
            self._done.set()
        return True

    async def _wait_done(self) -> None:
        """Wait until the job is settled (loop thread; without the poll's fast path)."""
        if self._done is None:
            self._done = self.lane._core.waker.new_event()
        await self._done.wait()
        self.lane._core.yielded()

    def __repr__(self) -> str:
        return f"{self.label[:-1]} {self.state}>"

    def __copy__(self) -> Any:  # as a Result's: the object itself
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(_NOT_PICKLED.format(what=repr(self)))

    @property
    def label(self) -> str:
        """The job without its state (``<Job #3 enc.forward lane=0>``, ``#3`` its submit
        order): for messages written before the job settles, which a state would contradict
        once it has."""
        where = f"lane={self.lane.index}"
        if self.stream is not None:
            where += " caller-stream"
        return f"<Job #{self.id} {self.name} {where}>"


def check_jobs(after: Any, device: Any) -> tuple[Job, ...]:
    """Validate ``after=``: an iterable of Jobs on ``device``."""
    if type(after) is tuple and not after:  # the default, on every submit
        return ()
    if isinstance(after, Job):
        after = (after,)
    try:
        jobs = tuple(after)
    except TypeError:
        raise InvalidArgument(f"after= takes an iterable of Jobs, got "
                              f"{type(after).__name__}") from None
    for i, job in enumerate(jobs):
        if not isinstance(job, Job):
            raise InvalidArgument(f"after[{i}] must be a Job (from Scheduler.submit), got "
                                  f"{type(job).__name__}")
        if job.method.device is not device:
            raise InvalidArgument(f"after[{i}] is {job!r} on {job.method.device.name}, but this "
                                  f"job runs on {device.name}; a stream can only wait on events "
                                  f"of its own device (await that job instead)")
    return jobs


"""The scheduler: await device programs from asyncio, uvloop or trio (through anyio).

::

    async with Scheduler(device=dev, lanes=2) as sched:
        enc = await sched.submit(encoder, [x], lane=0)            # a Job, once queued
        out = await sched.run(decoder, [enc.outputs[0]], lane=1, after=[enc])
        print(sched.timeline().overlap())

Guarantees:
- the event loop never blocks on the device or on a lane: submitting puts a job on a lane's
  queue, and completions come back through one coalesced thread-safe wakeup (``LoopWaker``);
- a lone caller-stream job (nothing else pending) that cannot block (kernel steps only, inputs
  already on the device) is enqueued by the loop thread itself, sparing the hop to the lane
  thread: by ``run`` at once; after ``submit``, at the job's first ``await`` or the loop's next
  turn, whichever comes first. A submit before then makes it the head of a burst and gives it
  to the lane thread, which enqueues while the loop submits the rest (``inline=False`` gives
  every job to the lane thread);
- ``await job`` on the scheduler's only pending job polls its event on the loop for up to
  ``poll_us``, yielding between queries, before falling back to the waiter's wakeup;
- ``await job`` is always a cancellation point, and yields to the loop at least once per
  ``YIELD_EVERY_S`` even when every job it awaits is already finished, so a task awaiting small
  jobs back to back never starves the loop's other tasks; while other tasks awaiting jobs are
  ready to run, at least once per ``YIELD_SHARED_S``, so they take turns in short slices;
- a method stays on the lane it was first submitted to, so its executes keep one thread's order;
  ``lane=`` moves it explicitly, and the move waits (host side, off the loop) until the method's
  previous job is enqueued, after which the runtime's rule 4 orders it on the device;
- a job that consumes another job's output (``JobOutput``) waits for it on the device, as if the
  producer were in ``after=``;
- each lane holds at most ``queue_size`` jobs (queued or in flight): a full lane makes
  ``submit`` wait;
- a device error fails every pending job with ``DeviceError`` (``SchedulerBroken``), and every
  later ``submit`` raises it at once;
- leaving the ``async with`` block drains pending jobs (or, on an error, cancels those not yet
  enqueued and waits for those on the device), then joins every thread it started.
"""

from __future__ import annotations

import atexit
import contextlib
import inspect
import itertools
import math
import operator
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from types import TracebackType
from typing import Any, SupportsFloat, SupportsIndex

import anyio
from anyio.lowlevel import checkpoint_if_cancelled

from streamlane.runtime import Device, Event, Method, Result, Stream, get_device
from streamlane.runtime.dtypes import int_in, real_in
from streamlane.runtime.errors import (
    InvalidArgument,
    InvalidInput,
    InvalidState,
    MethodBusy,
    NotSupported,
    StreamClosed,
)
from streamlane.runtime.stream import (
    PER_THREAD_HANDLE,
    foreign_stream_handle,
    offers_stream_protocol,
)
from streamlane.sched._reentry import reentered, streamlane_frame

from ._wakeup import LoopWaker, _nothing
from .errors import ClosedStreamGiven, SchedulerBroken, SchedulerClosed, TimingStallWarning
from .job import CANCELLED, DONE, FAILED, Job, JobOutput, JobState, check_jobs
from .lane import UNREAD_MAX, Lane, LaneStatistics
from .timeline import Span, Timeline

__all__ = ["Scheduler"]

_NEW, _OPEN, _CLOSING, _CLOSED = "new", "open", "closing", "closed"
_ENTERING = threading.Lock()  # __aenter__'s check and change of the state, as one step

# ``await job`` is always a cancellation point, and a schedule point (a yield to the event loop)
# at least once per YIELD_EVERY_S of awaits that found their job finished without waiting: a
# cooperative budget, as in Tokio. A yield costs an event-loop iteration (~9 us on an H200 host,
# bench/NOTES.md), a quarter of a small job's whole await, so not every await yields. The budget
# is also each task's time slice when many tasks await small jobs: a task that yields goes to
# the back of the loop's queue and runs again after every other ready task has had its slice,
# so with N such tasks an await waits about N x the budget (at 0.5 ms, 1,000 tasks: a p99 of
# ~0.5 s against a median of 30 us). So the slice shrinks to YIELD_SHARED_S while another task
# is waiting in one of these yields (ready to run again): a task alone keeps the long budget,
# which a yield every 0.1 ms would cost 3-4 us per await (H200, bench/NOTES.md).
YIELD_EVERY_S = 0.0005
YIELD_SHARED_S = 0.0001
# Leaving the scheduler waits for each pending job's settle; one not settled within this long
# is looked at directly, in case its settle callback was lost (``Scheduler._recover``).
_RECOVER_AFTER_S = 0.1
# Failed jobs whose error nobody has seen yet, kept for leaving to raise the first: the first
# this many of them (a service whose clients give up on failed requests must not keep all).
UNOBSERVED_KEPT = 32
# The most lanes a scheduler starts (each is a lane thread and a waiter thread).
MAX_LANES = 1024


async def _wait_shielded(wait: Callable[[], Any], timeout: float,
                         deferred: list[BaseException]) -> None:
    """``await wait()`` for at most ``timeout`` seconds, inside the caller's shielded scope.
    anyio's shield stops anyio's and trio's cancellation but not asyncio's own ``task.cancel()``
    (``asyncio.timeout``, ``wait_for``, a ``TaskGroup`` sibling failing), which cut a close
    short: it returned with lane threads running and jobs pending. Such a cancellation is kept
    in ``deferred`` for the caller to raise once nothing is left running."""
    try:
        with anyio.move_on_after(timeout):
            await wait()
    except anyio.get_cancelled_exc_class() as exc:
        if not deferred:
            deferred.append(exc)


# How far _forget_locals looks: the frames that hold a job's inputs are streamlane's own,
# near the head of its error's traceback (the lane's, the method's, set_inputs'); a shared
# exception re-raised for every job grows its traceback each time, so the walk is bounded.
_FORGET_FRAMES = 16
_FORGET_ERRORS = 4
# Frames that belong to a generator or coroutine: clearing one finalizes it, even suspended
# (a task's frame may sit in a traceback raised twice, as Future.result() re-raises).
_SUSPENDABLE = inspect.CO_GENERATOR | inspect.CO_COROUTINE | inspect.CO_ASYNC_GENERATOR


def _forget_locals(error: BaseException | None, tb: TracebackType | None) -> None:
    """Let go of the local variables of streamlane's own finished frames in the first frames of
    ``error``'s traceback ``tb`` and of its first causes and contexts (the lines stay for the
    report). A job's inputs are held there; frames of user code (an exception the user still
    holds and inspects) and of generators and coroutines (clearing one finalizes it) are left
    as they are."""
    seen: set[int] = set()
    pending: list[tuple[BaseException | None, TracebackType | None]] = [(error, tb)]
    while pending and len(seen) < _FORGET_ERRORS:
        exc, tb = pending.pop()
        for _ in range(_FORGET_FRAMES):
            if tb is None:
                break
            frame = tb.tb_frame
            if streamlane_frame(frame) and not frame.f_code.co_flags & _SUSPENDABLE:
                try:
                    frame.clear()
                except RuntimeError:  # still running (on some thread's stack): left alone
                    pass
            tb = tb.tb_next
        for nxt in (exc.__cause__, exc.__context__) if exc is not None else ():
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                pending.append((nxt, nxt.__traceback__))


# Schedulers entered and not closed yet. Their lane threads are daemons (an unclosed scheduler
# never holds up the interpreter's exit), so one left open when the process exits is only seen
# here: a ResourceWarning, as Python gives for an unclosed file or event loop.
_open_schedulers: weakref.WeakSet[Scheduler] = weakref.WeakSet()


class _Claim:
    """Which scheduler a method's jobs go to now (``Scheduler._claim``): one per method, shared
    by every scheduler's ``_MethodState`` of it, so a submit checks it with one comparison."""

    __slots__ = ("owner",)

    def __init__(self) -> None:
        self.owner: weakref.ref[Scheduler] | None = None


_claims: weakref.WeakKeyDictionary[Method, _Claim] = weakref.WeakKeyDictionary()


@atexit.register
def _warn_unclosed() -> None:
    first: Exception | None = None
    for sched in list(_open_schedulers):
        try:  # under -W error each one raises: report them all, raise the first
            warnings.warn(f"{sched!r} (at {id(sched):#x}) was never closed: leave its async "
                          f"with block (or await aclose()) before the event loop ends; its "
                          f"lane threads end with the process, and device work they queued "
                          f"may not have finished", ResourceWarning, stacklevel=1)
        except Exception as exc:
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
            first = first or exc
    if first is not None:
        raise first


_HERE = os.path.dirname(os.path.abspath(__file__))


# How many pending jobs statistics() and timeline() look at per call on the loop thread (one
# event query each): code polling them without yielding sees its jobs finish, up to this many
# a call, and a call costs no more with thousands pending (5,000: 14.7 ms when it looked at
# every one, and submitting 5,000 jobs with a statistics() after each took 17 s, not 0.5).
OBSERVE_AT_MOST = 64


def _count(name: str, value: Any, low: int) -> int:
    """A ``Scheduler`` count: an int >= ``low``, numpy's too, else ``InvalidArgument``."""
    number = int_in(value, low)
    if number is None:
        raise InvalidArgument(f"Scheduler: {name} must be an int >= {low}, got {value!r}")
    return number


def _seconds(name: str, us: Any) -> float:
    """A ``Scheduler`` wait given in microseconds, in seconds: any real number in [0, 1e6],
    numpy's too (``np.int64(2)`` was refused), else ``InvalidArgument``."""
    number = real_in(us, 0.0, 1e6)
    if number is None:
        raise InvalidArgument(f"Scheduler: {name} must be a number of microseconds in [0, 1e6] "
                              f"(an int or a float, numpy's too), got {us!r}")
    return number / 1e6


def _caller_level() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside this package
    (the user's ``submit`` or ``run``, through any number of our own frames)."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.dirname(frame.f_code.co_filename) == _HERE:
        frame, level = frame.f_back, level + 1
    return level


def _busy_key(job: Job) -> Any:
    """The stream ``job`` keeps busy, for counting streams against hardware queues: its lane,
    or its caller stream's driver handle (one stream passed through several wrapper objects,
    as torch's ``current_stream()`` returns, counts once). A foreign object whose
    ``__cuda_stream__`` fails here counts by identity: its lane reports the error."""
    stream = job.stream
    if stream is None:
        return job.lane
    if isinstance(stream, Stream):
        return stream.handle
    try:
        return foreign_stream_handle(stream)
    except InvalidArgument:
        return ("object", id(stream))  # hashable whatever the object (a key of a dict)


def _closed_stream_given(stream: Stream) -> ClosedStreamGiven:
    return ClosedStreamGiven(f"stream= {stream!r} is closed; pass an open stream "
                             f"(device.create_stream())")


_JOB_ID = operator.attrgetter("job")


class _MethodState:
    __slots__ = ("calls", "claim", "kernels_only", "lane", "last")

    def __init__(self, lane: Lane, last: weakref.ref[Job], kernels_only: bool, calls: int,
                 claim: _Claim):
        self.lane = lane
        self.last = last
        self.claim = claim
        self.kernels_only = kernels_only  # no user callable (which could block) among its steps
        # An estimate of the driver calls one job queues on the device: a launch per step, the
        # method's event record, two timing records and a stream wait (Lane.HOLD_GIL_BELOW).
        self.calls = calls


class Scheduler:
    """Lanes (dedicated host threads) that run methods on a device, awaited from async code.

    ``device``: a Device or a name for ``get_device`` (default: auto). ``lanes``: how many lane
    threads (1 to ``MAX_LANES``, 1024). ``queue_size``: the most jobs one lane holds, queued or
    in flight. ``timing``: record timing events around every job (``timeline()``,
    ``busy_time_s``); turn it off to shave two event records per job, and for overlap across
    more streams than the device has hardware queues (8 on CUDA by default): the timing event
    after a job holds up the streams that share its queue (``TimingStallWarning`` says when).
    ``spin_us``: how long a waiter polls an event before blocking on it. ``poll_us``: how long
    ``await job`` polls the job's event on the event loop (yielding between queries) before
    waiting for the waiter's wakeup, only while that job is the only one pending; 0 turns it
    off. ``inline``: let the event loop thread enqueue a lone caller-stream job that cannot
    block itself instead of handing it to the lane thread; False keeps every launch and execute
    off the loop thread (its remaining driver calls, event queries and elapsed times, never
    wait). ``timeline_size``: how many spans ``timeline()`` keeps: of those recorded last (as
    jobs settle), the latest submitted.
    """

    def __init__(self, device: Device | str | None = None, lanes: SupportsIndex = 2, *,
                 queue_size: SupportsIndex = 1024, timing: bool = True,
                 spin_us: SupportsFloat = 0.0, poll_us: SupportsFloat = 50.0,
                 inline: bool = True, timeline_size: SupportsIndex = 100_000):
        self.device: Device = device if isinstance(device, Device) else get_device(device)
        lanes, queue_size = _count("lanes", lanes, 1), _count("queue_size", queue_size, 1)
        timeline_size = _count("timeline_size", timeline_size, 0)
        if lanes > MAX_LANES:  # two threads each: 10**6 lanes took minutes before any error
            raise InvalidArgument(f"Scheduler: lanes must be at most {MAX_LANES} (each is two "
                                  f"host threads), got {lanes}; for wide overlap give jobs "
                                  f"caller streams (submit(stream=...)) on fewer lanes")
        spin_s, poll_s = _seconds("spin_us", spin_us), _seconds("poll_us", poll_us)
        for name, flag in (("timing", timing), ("inline", inline)):
            if not isinstance(flag, bool):
                raise InvalidArgument(f"Scheduler: {name} must be a bool, got {flag!r}")
        # Read by the lanes as they run: fixed here (read-only properties below).
        self._queue_size = queue_size
        self._timing = timing
        self._inline = inline
        self._spin_s = spin_s
        self._poll_s = poll_s
        self.reference: Event | None = None
        self.lanes: tuple[Lane, ...] = tuple(Lane(self, i, self.device, queue_size)
                                             for i in range(lanes))
        self.waker: LoopWaker  # set on entry, inside the running loop
        self._state = _NEW
        self._closed: anyio.Event | None = None  # set once a close has joined every thread
        self._cancelling = False
        self._broken: SchedulerBroken | None = None
        self._broken_lock = threading.Lock()
        self._pending: set[Job] = set()
        self._loop_job: Job | None = None  # a lone job the loop kept for its poll (Lane.poll)
        self._parked: Job | None = None  # a lone job held back for the loop to enqueue
        # The last stream= that passed _check_stream (a weak reference: never keeps it open).
        self._checked_stream: Callable[[], Any] = _nothing
        self._yielded_at = 0.0  # when an await last yielded to the loop (YIELD_EVERY_S)
        self._yielding = 0  # tasks suspended in yield_to_loop: ready to run (YIELD_SHARED_S)
        self._unobserved: list[Job] = []  # failed jobs whose error nobody may have seen
        self._unobserved_next = 2 * UNOBSERVED_KEPT  # its length at which it is pruned
        self._let_go: Job | None = None  # the first unseen failed job a pruning let go of
        self._methods: weakref.WeakKeyDictionary[Method, _MethodState] = \
            weakref.WeakKeyDictionary()
        self._ids = itertools.count()
        self._ref = weakref.ref(self)  # what a method's _Claim names
        # Spans are recorded as they are read, which may come after a later job's (a job the
        # loop settles waits for its read: Lane.read_spans): a little more is kept, and
        # timeline() gives the timeline_size latest submitted of those. (A job that settles
        # long after later ones, on another lane, may still fall out first.)
        self._timeline_size = timeline_size
        # (a timeline_size past what a deque can bound, 2**63 - 1 on 64-bit: keep them all)
        self._spans: deque[Span] = deque(maxlen=min(
            timeline_size + lanes * (4 * UNREAD_MAX + 64), sys.maxsize))
        # Lane._read's last step: a C append, where an interrupt cannot cut it in two.
        self.record_span: Callable[[Span], None] = self._spans.append
        # With timing events on a device whose streams share hardware queues, the streams with
        # jobs pending (by id: a lane's own stream, or a caller stream), until more of them than
        # queues call for a TimingStallWarning; then no longer counted.
        self._queues = self.device.hardware_queues if timing else None
        self._busy_streams: dict[int, int] = {}

    # The settings it was made with (read-only: the lanes read them as they run).
    @property
    def queue_size(self) -> int:
        """Each lane's bound on jobs queued or in flight (``queue_size=``)."""
        return self._queue_size

    @property
    def timing(self) -> bool:
        """Whether jobs record timing events for ``timeline()`` (``timing=``)."""
        return self._timing

    @property
    def inline(self) -> bool:
        """Whether the loop thread may enqueue a lone caller-stream job itself (``inline=``)."""
        return self._inline

    @property
    def spin_s(self) -> float:
        """``spin_us=`` in seconds."""
        return self._spin_s

    @property
    def poll_s(self) -> float:
        """``poll_us=`` in seconds."""
        return self._poll_s

    # -- context ----------------------------------------------------------------------------
    async def __aenter__(self) -> Scheduler:
        """``async with Scheduler(...) as sched:`` is equivalent to ``sched = await
        Scheduler(...).__aenter__()``: start the lane and waiter threads and return once every
        lane is ready.

        **Cancellation**: if cancelled while lanes start, the threads are stopped and joined
        before the cancellation propagates.
        """
        with _ENTERING:  # two threads entering at once: one gets the refusal, not half a start
            if self._state != _NEW:
                done = "was closed" if self._state == _CLOSED else "was already entered"
                raise InvalidState(f"{self!r} {done}; create a new Scheduler")
            self.waker = LoopWaker()
            self._state = _OPEN
        _open_schedulers.add(self)
        for lane in self.lanes:
            lane.slots = anyio.Semaphore(self._queue_size)
            lane.ready, lane.exited = anyio.Event(), anyio.Event()
        try:  # an interrupt while a thread starts (Thread.start waits for it) stops them all
            for lane in self.lanes:
                lane.start()
            for lane in self.lanes:
                await lane.ready.wait()
            errors = [lane.startup_error for lane in self.lanes if lane.startup_error]
            if errors:
                raise errors[0]
        except BaseException:
            await self._close(error=True)
            raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        """Leaving ``async with`` normally is equivalent to ``await sched.aclose()``; leaving on
        an error cancels the jobs not yet enqueued, waits for those on the device, joins the
        threads and lets the error go on.

        **Cancellation**: shielded (asyncio's own ``task.cancel()`` too: it is raised once the
        exit is done). Enqueued device work cannot be recalled, so exit waits for it before
        joining the threads; a cancelled exit still leaves nothing running.
        """
        await self._close(error=exc_type is not None)

    async def aclose(self) -> None:
        """``await sched.aclose()`` is equivalent to leaving ``async with sched:`` normally:
        drain every pending job, then stop and join every thread. A second call is a no-op.

        Raises the first error of a failed job that nobody observed (by awaiting the job or
        calling ``job.exception()``), so a device failure is never lost silently.

        **Cancellation**: shielded: it returns (or raises the cancellation, asyncio's own
        ``task.cancel()`` included) only once every thread has been joined.
        """
        await self._close(error=False)

    async def _close(self, error: bool) -> None:
        if self._state == _CLOSED:
            return
        if self._state == _CLOSING:  # another task is closing: return when it is done
            # (its event is the closing loop's: from another thread or loop, refuse now)
            self.check_loop_thread("closing the scheduler")
            if error:
                self._cancelling = True
            assert self._closed is not None
            deferred: list[BaseException] = []
            with anyio.CancelScope(shield=True):
                while not self._closed.is_set():
                    await _wait_shielded(self._closed.wait, math.inf, deferred)
            if deferred:
                raise deferred[0]
            return
        if self._state == _NEW:
            self._state = _CLOSED
            return
        self.check_loop_thread("closing the scheduler")
        self._closed = anyio.Event()
        deferred: list[BaseException] = []  # a native asyncio cancel: raised once all is joined
        with anyio.CancelScope(shield=True):
            try:
                try:  # from here on, whatever is raised, the lanes are stopped and joined
                    self._state = _CLOSING
                    if error:
                        self._cancelling = True  # before the parked job reaches the lane
                        # thread, which would otherwise run it: a job not yet enqueued is
                        # cancelled
                    self._unpark(inline=False)
                    self._release_loop_job()
                    while self._pending:
                        job = next(iter(self._pending))
                        if job._finished:  # its settle was cut short after it marked the job
                            self.finish(job, job._state, job._error)
                            self._pending.discard(job)
                            continue
                        await _wait_shielded(job._wait_done, _RECOVER_AFTER_S, deferred)
                        self._recover(job)
                        if not job._finished and not job._is_published:
                            break  # queued behind others, or lost (_settle_lost): the lanes
                        del job     # run what they hold before they exit
                finally:  # whatever the drain raised, nothing is left running
                    for lane in self.lanes:
                        lane.stop()
                    for lane in self.lanes:
                        if lane.waiter.ident is not None:  # started (an interrupt in
                            assert lane.exited is not None  # __aenter__ may stop short)
                            while not lane.exited.is_set():  # posted by its waiter thread
                                await _wait_shielded(lane.exited.wait, _RECOVER_AFTER_S,
                                                     deferred)
                                self.waker.flush()  # in case that post's drain was lost
                        lane.join()
                    self._settle_lost()
            finally:
                self._state = _CLOSED
                _open_schedulers.discard(self)
                self.waker.close()
                self._closed.set()
        unobserved = self._take_unobserved() if not error else None
        if deferred:  # the cancellation goes on (asyncio counts it: a task that went on
            if unobserved is not None:  # would be cancelled for good), the failure with it
                deferred[0].add_note(f"the scheduler closed before the cancellation was "
                                     f"raised, and a job nobody awaited had failed: the "
                                     f"cause ({type(unobserved).__name__})")
                raise deferred[0] from unobserved
            raise deferred[0]
        if unobserved is not None:
            raise unobserved

    def _take_unobserved(self) -> BaseException | None:
        """The first error of a failed job nobody observed (noted so), once the scheduler has
        closed normally; None if every failure was seen."""
        unobserved = [job for job in self._unobserved if not job._retrieved]
        self._unobserved.clear()
        if not unobserved and self._let_go is not None and not self._let_go._retrieved:
            unobserved = [self._let_go]  # those kept were all seen later: one let go
        if unobserved:
            first = unobserved[0]
            first._retrieved = True
            error = first._error
            assert error is not None
            note = (f"raised on leaving the scheduler: {first.label} failed and nobody "
                    f"awaited it or called its exception()")
            if note not in getattr(error, "__notes__", ()):
                error.add_note(note)
            return error
        return None

    def _recover(self, job: Job) -> None:
        """Settle ``job`` here if its settle callback was lost: an exception raised into the
        loop thread (a signal handler's ``sys.exit``, a second Ctrl-C) as the waker's drain
        began, or while the callback ran, ends it midway. The callbacks posted so far run now
        (``LoopWaker.flush``); then a job done on the device, or failed or cancelled before
        reaching it, is settled as its settle would have (a late one then finds it settled)."""
        if job._finished:
            return
        self.waker.flush()
        if job._finished:
            return
        if job._is_published and job._enqueue_error is not None:
            self.finish(job, job._not_run_state, job._enqueue_error)
        else:
            job.lane.observe(job)

    def _settle_lost(self) -> None:
        """Once the lanes have exited: a job still pending that no lane published never reached
        one, or its enqueue was cut short. An exception raised into the loop thread between a
        submit counting the job and handing it over (where ``_abandon`` did not get to run)
        left it so, or one inside the loop's own enqueue of a lone job; the exit waited for it
        forever. One never taken did not run: settled as cancelled; one taken, as failed."""
        for job in list(self._pending):
            self._recover(job)
            if job._finished:
                self.finish(job, job._state, job._error)  # gives back what a cut-short one kept
                continue
            if job._abandon(SchedulerClosed(
                    f"{job.label} was cancelled before it ran: an exception interrupted its submit "
                    f"(or the close) before it reached lane {job.lane.index}")):
                self.finish(job, CANCELLED, job._enqueue_error)
                continue
            # Taken to run, and cut short before it was published: as the lane reports a job
            # that failed while it was enqueued (its stream unpinned, jobs after it released).
            error = SchedulerClosed(f"{job.label} failed: an exception interrupted lane "
                                    f"{job.lane.index} while it enqueued the job; part of its "
                                    f"work may have reached the device")
            if not job._is_published:
                job._publish(None, None, error)
            self.finish(job, FAILED, error)

    # -- submitting ---------------------------------------------------------------------------
    async def submit(self, method: Method, inputs: Sequence[Any], *,
                     lane: SupportsIndex | None = None, after: Iterable[Job] | Job = (),
                     stream: Any = None) -> Job:
        """``job = await sched.submit(m, xs, lane=i)`` is equivalent to ``m.set_inputs(xs);
        m.execute()`` run by lane ``i``'s thread, without waiting for the device: it queues one
        execution of ``method`` and returns its ``Job``.

        ``lane=None`` keeps the method on its lane (or picks the least loaded lane for a new
        method); ``lane=i`` moves it. ``after=[jobs]`` makes the job's stream wait on those jobs
        on the device (no host round trip). ``stream=`` runs it under ``CallerStream(stream)``
        (a Stream of this device, or any object with ``__cuda_stream__``). Inputs are numpy
        arrays (copied now, so the caller may reuse them), Results, or ``JobOutput``s of
        earlier jobs (``job.outputs[i]``), which are ordered like ``after=``; all three, and
        the count, are checked now (``Method.check_inputs``: ``InvalidInput``, nothing
        submitted). Any other input the method takes (DLPack, ``__array__``,
        ``__cuda_array_interface__`` objects) is read and checked when the lane runs the job,
        so it must stay unchanged until the job is awaited. A method made with
        ``clone_outputs=False`` is refused (``NotSupported``).

        Returns once the job is queued for its lane, waiting while the lane is full. A lone
        caller-stream job that cannot block (see the module's guarantees) is enqueued by the
        event loop thread, at its first ``await`` or the loop's next turn, unless another
        submit comes first (then its lane thread does it) or the scheduler was made with
        ``inline=False``.

        **Cancellation**: if cancelled while waiting for room on the lane, nothing was
        submitted. Once it returns, the job is the scheduler's: it will run, unless the
        scheduler is left on an error before the job reached the device (then it is cancelled,
        ``SchedulerClosed``), or a dependency fails.
        """
        return await self._submit(method, inputs, lane, after, stream, False)

    async def _submit(self, method: Method, inputs: Sequence[Any], lane: SupportsIndex | None,
                      after: Iterable[Job] | Job, stream: Any, awaited: bool) -> Job:
        """``submit``; ``awaited``: the caller awaits the job at once (``run``), so no burst
        can follow it and a lone job is enqueued by the loop here, not held back."""
        if self._state is _OPEN and self.waker.on_loop():
            await self.waker.checkpoint_if_cancelled()
            if self._state is not _OPEN or self._broken is not None:
                self._check_open(awaited)
        else:  # raises: not open, or not this scheduler's loop
            await checkpoint_if_cancelled()
            self._check_open(awaited)
        if not isinstance(method, Method):
            raise InvalidArgument(f"submit() takes a Method (program.method(name, device=...)), "
                                  f"got {type(method).__name__}")
        if method.device is not self.device:
            raise InvalidArgument(f"{method.name} is bound to {method.device.name}, but this "
                                  f"scheduler runs {self.device.name}; bind it with "
                                  f"program.method(name, device=scheduler.device)")
        if not method.clone_outputs:
            raise NotSupported(
                f"submit({method.name}): the method was made with clone_outputs=False, so its "
                f"outputs are views that each execute overwrites; the scheduler decides when "
                f"each job's execute runs, so a job's outputs could be overwritten before its "
                f"await or a job reading them got to them. Make the method with "
                f"clone_outputs=True (the default): outputs then take turns in two buffers")
        if not isinstance(inputs, (list, tuple)):  # a JobOutputs (job.outputs) too
            if not isinstance(inputs, Sequence) or isinstance(inputs, (str, bytes)):
                raise InvalidArgument(f"submit({method.name}): inputs must be a list (or "
                                      f"another sequence, such as job.outputs), got "
                                      f"{type(inputs).__name__}")
            inputs = list(inputs)
        # Checked now, as the lane's set_inputs() will (count, dtype, shape), where they can
        # be: a bad input is the submit's error, not a job failing later.
        values = method.check_inputs(inputs, unchecked=JobOutput)
        for i, v in enumerate(values):
            if type(v) is not Result or v.view_only:
                self._check_input(method, i, v)
        after_jobs = check_jobs(after, self.device)
        if stream is not None and (stream is not self._checked_stream() or stream.closed):
            self._check_stream(stream)
        state = self._methods.get(method)
        if state is None or state.claim.owner is not self._ref:  # new here, or another took it
            self._claim(method)
        while True:  # again only when the method moved while this submit waited for room
            target = self._pick_lane(method, lane, state)
            slots = target.slots
            assert slots is not None
            if self._loop_job is not None:
                self._settle_loop_job()
            # The room taken and the stream's pin belong to this submit until _enqueue puts the
            # job in `ticket`; from then on to the job (its settle gives them back), so that
            # neither is lost to an error (a Ctrl-C) in between. `held` is set before the room
            # is taken where an error cannot make that wrong: at worst a cut-short take gives
            # back one slot too many (more room on the lane), never one too few (a submit
            # waiting forever).
            ticket: list[Job] = []
            pin = object() if isinstance(stream, Stream) else None
            held = False
            try:
                try:
                    held = True
                    slots.acquire_nowait()
                except anyio.WouldBlock:
                    try:  # held stays True: an interrupt as the wait ends may come with the room
                        await slots.acquire()
                    except anyio.get_cancelled_exc_class():
                        held = False  # a cancelled wait gives its room back itself (anyio)
                        raise
                    self._check_open(awaited)  # it may have closed or broken while we waited
                    # Other submits may have bound or moved the method meanwhile: its lane and
                    # its last job are read again (a stale "new method" would let two lanes
                    # drive it at once), and a submit that asked for no lane follows the method
                    # to its lane, with the inputs and after= checked (and copied, consumed)
                    # before the wait: the caller may have reused them since.
                    state = self._methods.get(method)
                    if state is None or state.claim.owner is not self._ref:
                        self._claim(method)  # another scheduler may have taken it meanwhile
                    if lane is None and state is not None and state.lane is not target:
                        slots.release()
                        held = False
                        continue
                if pin is not None:
                    try:  # the job will run on it: a close() from now on waits for its enqueue
                        stream.pin(pin)
                    except StreamClosed:  # closed meanwhile (while we waited, or elsewhere)
                        raise _closed_stream_given(stream) from None
                return self._enqueue(method, values, target, after_jobs, stream, state, awaited,
                                     ticket, pin)
            except BaseException:
                if not ticket:
                    if held:
                        slots.release()
                    if pin is not None:
                        stream._release_pin(pin)
                raise

    async def run(self, method: Method, inputs: Sequence[Any], *, lane: SupportsIndex | None = None,
                  after: Iterable[Job] | Job = (), stream: Any = None) -> list[Result]:
        """``await sched.run(m, xs, **kw)`` is equivalent to ``await (await sched.submit(m, xs,
        **kw))``: submit and wait for the outputs. (A lone caller-stream job is enqueued by the
        loop at once: no burst can follow it.)

        **Cancellation**: cancelled before the job is queued, nothing runs; cancelled after,
        the job runs to completion in the background and its buffers are released then.
        """
        job = await self._submit(method, inputs, lane, after, stream, True)
        return await job._wait_on_loop()  # (_submit checked that this is the loop)

    def _enqueue(self, method: Method, values: list[Any], lane: Lane, after: tuple[Job, ...],
                 stream: Any, state: _MethodState | None, awaited: bool,
                 ticket: list[Job], pin: object) -> Job:
        if self._parked is not None:  # a burst (or a job parked while this submit waited for
            self._unpark(inline=False)  # room): it goes to the lane thread, ahead of this job
        producers: tuple[Job, ...] = ()
        for v in values:  # (a loop: most submits have no JobOutput, and no generator to make)
            if type(v) is JobOutput:
                producers = tuple(v.job for v in values if type(v) is JobOutput)
                break
        if after or producers:
            device_waits = tuple(dict.fromkeys((*after, *producers)))
            host_waits = [j for j in device_waits if j.lane is not lane]
        else:
            device_waits, host_waits = (), []
        previous = state.last() if state is not None else None
        if previous is not None and previous.lane is not lane and previous not in host_waits:
            host_waits.append(previous)  # one thread at a time drives a method
        job = Job(next(self._ids), method, values, lane, stream, tuple(host_waits), device_waits,
                  pin)
        lone = not self._pending
        lane.outstanding += 1
        try:  # an exception from here on (Ctrl-C) must not leave the job counted and stranded
            ticket.append(job)  # the job holds the submit's room and pin from here on
            self._pending.add(job)
            if state is None:
                state = self._methods[method] = _MethodState(
                    lane, weakref.ref(job), all(step.kind == "kernel" for step in
                                                method.definition.steps),
                    len(method.definition.steps) + 4, _claims[method])
                lane.methods.add(method)
            else:
                if state.lane is not lane:
                    state.lane.methods.discard(method)
                    lane.methods.add(method)
                    state.lane = lane
                state.last = weakref.ref(job)
            job._calls = state.calls
            # Nothing pending here does not mean nothing to wait for: a dependency may be a job
            # of another scheduler, not yet enqueued; the loop must never wait for it.
            inline = stream is not None and self._inline and lone and \
                self._can_run_inline(method, values, state.kernels_only) and \
                (not host_waits or all(dep._is_published for dep in host_waits))
            stall = self._count_stream(job, 1) if self._queues is not None else None
            if inline:
                lane.park(job)
                if awaited:
                    self._run_inline(job)
                else:
                    # Held back until its await (or the loop's next turn): if another submit
                    # comes first, this was the head of a burst, better enqueued by the lane
                    # thread while the loop submits the rest (bench/NOTES.md).
                    job._parked = True
                    self._parked = job
                    self.waker.call_soon(self.start_parked)
            else:
                lane.put(job)
                self._check_loop_job_slot(lane)
        except BaseException:
            if ticket:
                self._abandon(job)  # its settle gives back the count, the room and the pin
            else:
                lane.outstanding -= 1  # the submit gives back the room and the pin
            raise
        if stall is not None:
            self._stall_warning(stall)
        return job

    def _abandon(self, job: Job) -> None:
        """An exception (Ctrl-C, a signal handler's ``sys.exit``) interrupted the loop while
        it handed ``job`` to its lane: the job may sit in the lane's queue or nowhere. Unless a
        lane took it (it runs) or it is parked (it starts as parked jobs do), it is settled as
        cancelled now and no lane will run it; an await of it, or a job ordered after it,
        would otherwise have waited for it forever."""
        if self._parked is job or job._finished:
            return
        job._parked = False
        error = SchedulerClosed(f"{job.label} was cancelled before it ran: an exception "
                                f"interrupted its hand-over to lane {job.lane.index}")
        if job._abandon(error):
            job._not_run_state = CANCELLED
            job.lane.not_run_here(job)  # parked, no lane will take it (queued: its lane skips it)
            self.finish(job, CANCELLED, error)

    def _check_loop_job_slot(self, lane: Lane) -> None:
        """A job the loop keeps for its poll never holds a full lane's slot: a submit may be
        waiting for room (or come to wait), and only a settle frees it."""
        kept = self._loop_job
        if kept is not None and kept.lane is lane and lane.outstanding >= lane.queue_size:
            self._release_loop_job()

    @staticmethod
    def _can_run_inline(method: Method, values: list[Any], kernels_only: bool) -> bool:
        """Whether the loop thread can enqueue a lone caller-stream job itself, sparing the hop
        to the lane thread, without ever blocking: only kernel steps (a user callable may
        wait), inputs already on the device (an upload from host memory may wait), and no
        output buffer that another library took on an unknown stream (its reuse waits for the
        whole device). The caller checked that nothing else is pending: nothing is queued
        ahead of it, everything it depends on is done, and no stream queue is full of this
        scheduler's work.

        Only lone jobs, and only once the loop is sure no burst follows (``start_parked``): for
        a burst the lane thread enqueuing while the loop submits the next job spreads the
        burst's device starts less than the loop doing both (H200 figures in
        bench/NOTES.md)."""
        if not kernels_only:
            return False
        for v in values:
            if not isinstance(v, (Result, JobOutput)):
                return False
        return not method.may_wait_on_host()

    def _count_stream(self, job: Job, delta: int) -> int | None:
        """Count ``job`` in (+1) or out (-1) of the streams with jobs pending. Returns the
        device's hardware queues, once, when they are outnumbered: ``_stall_warning``."""
        busy = self._busy_streams
        if delta > 0:
            key = job._busy_key = _busy_key(job)
        else:
            key = job._busy_key
        count = busy.get(key, 0) + delta
        if count > 0:
            busy[key] = count
        else:
            busy.pop(key, None)
        queues = self._queues
        if delta > 0 and queues is not None and len(busy) > queues:
            self._queues = None
            busy.clear()
            return queues
        return None

    def _stall_warning(self, queues: int) -> None:
        """``TimingStallWarning``: issued by a submit once its job is queued, so that a warnings
        filter turning it into an error leaves nothing half done (the job runs). A hook that
        shows the warning runs inside the scheduler, where observers only read
        (``_reentry``): what they read is brought up to date first, every job the device
        has finished settled."""
        self._bring_up_to_date(at_most=None)
        warnings.warn(
            f"{queues + 1} streams have timed jobs pending on {self.device.name}, more than "
            f"its {queues} hardware queues (CUDA_DEVICE_MAX_CONNECTIONS): streams now share "
            f"queues, and the timing event after each job holds up the streams behind it, "
            f"so overlap stops near {queues}x. For wider overlap create the Scheduler with "
            f"timing=False (no timeline), or set CUDA_DEVICE_MAX_CONNECTIONS=32 before CUDA "
            f"initializes", TimingStallWarning, stacklevel=_caller_level())

    def _claim(self, method: Method) -> None:
        """Make this scheduler the one whose lanes run ``method`` now, unless another has jobs
        of it not yet enqueued (``_runs``): each scheduler gives a method to a lane of its
        own, and two lanes calling one method at once is a ``MethodBusy`` for whichever comes
        second (half the jobs of two schedulers sharing a method failed so, at random, at
        their await).
        One after the other, two schedulers may share it (rule 4 orders the hand-over)."""
        claim = _claims.get(method)
        if claim is None:
            claim = _claims[method] = _Claim()
        other = claim.owner() if claim.owner is not None else None
        if other is not None and other is not self and other._runs(method):
            raise MethodBusy(
                f"submit({method.name}): the method has jobs not yet enqueued on {other!r}; "
                f"two schedulers' lanes would call it at once. Await those first, or bind one "
                f"method per scheduler (program.method(name, device=...))")
        claim.owner = self._ref

    def _runs(self, method: Method) -> bool:
        """Whether a lane of this scheduler may still call ``method`` (any thread): its last
        job here is neither finished nor enqueued (a lane enqueues a method's jobs in order;
        once enqueued, rule 4 orders the next caller after them on the device). A job
        enqueued by a scheduler whose loop has ended does not hold the method for ever."""
        state = self._methods.get(method)
        last = state.last() if state is not None else None
        return last is not None and not last._finished and not last._is_published

    def _pick_lane(self, method: Method, lane: SupportsIndex | None,
                   state: _MethodState | None) -> Lane:
        if lane is not None:
            index = lane if type(lane) is int else int_in(lane, 0)  # np.argmin's int64 too
            if index is None or not 0 <= index < len(self.lanes):
                raise InvalidArgument(f"lane must be an int in 0..{len(self.lanes) - 1} (or None "
                                      f"to keep the method's lane), got {lane!r}")
            return self.lanes[index]
        if state is not None:
            return state.lane
        return min(self.lanes, key=lambda ln: (ln.outstanding, len(ln.methods), ln.index))

    def _check_input(self, method: Method, index: int, value: Any) -> None:
        """What ``Method.check_inputs`` leaves to the scheduler: views and job outputs."""
        if isinstance(value, Result) and value.view_only:
            raise NotSupported(
                f"input {index} of {method.name}: a view (an output of a method made with "
                f"clone_outputs=False), which that method's next execute overwrites; the lane "
                f"reads it only when it runs the job. Pass a copy "
                f"(Result.from_host(r.to_host(), device)) or use clone_outputs=True")
        if isinstance(value, JobOutput):
            job, at = getattr(value, "job", None), getattr(value, "index", None)
            if type(value) is not JobOutput or not isinstance(job, Job) or \
                    type(at) is not int or not 0 <= at < len(job.method.definition.outputs):
                raise InvalidInput(method.name, index, "a Result, or a JobOutput from "
                                   "job.outputs", f"{type(value).__name__} naming no output "
                                   f"of a job", "take it from job.outputs[i]")
            producer = job.method
            if producer.device is not self.device:
                raise InvalidInput(method.name, index, f"an input on {self.device.name}",
                                   f"{value!r} on {producer.device.name}")
            want = method.definition.inputs[index]
            got = producer.definition.outputs[at]
            if (got.dtype, got.shape) != (want.dtype, want.shape):
                raise InvalidInput(method.name, index, f"{want.dtype}{list(want.shape)}",
                                   f"{value!r}, {got.dtype}{list(got.shape)}",
                                   f"pass an output declared {want.dtype}"
                                   f"{list(want.shape)}, or reshape it with a method of yours")

    def _check_stream(self, stream: Any) -> None:
        """Validate ``stream=``. The last streamlane Stream that passed is remembered (weakly):
        ``submit`` then re-checks only whether it closed."""
        if isinstance(stream, Stream):
            if stream.device is not self.device:
                raise InvalidArgument(f"stream= {stream!r} belongs to {stream.device.name}, "
                                      f"but this scheduler runs {self.device.name}")
            if stream.kind == "per-thread":
                raise InvalidArgument(f"stream= {stream!r} is a per-thread stream, usable only "
                                      f"from its own thread; pass device.create_stream()")
            if stream.closed:
                raise _closed_stream_given(stream)
            self._checked_stream = weakref.ref(stream)
            return
        if not offers_stream_protocol(stream):  # (CallerStream's message offers None)
            raise InvalidArgument(
                f"stream= takes a Stream of this device (device.create_stream()) or an object "
                f"with __cuda_stream__ (torch, CuPy, cuda.core), got {type(stream).__name__}; "
                f"leave it None to run the job on its lane's own stream")
        # What is wrong with it is refused here, not when its job fails (its lane reads it
        # again, and a stream that went bad since fails the job).
        handle = foreign_stream_handle(stream)
        if handle == PER_THREAD_HANDLE:  # refused, as a per-thread Stream is
            raise InvalidArgument(
                f"stream= {type(stream).__name__} names the per-thread default stream (handle "
                f"{PER_THREAD_HANDLE}), a different stream on each thread: the job would run "
                f"on whichever thread enqueues it, unordered with the caller's own work there; "
                f"pass a created stream (device.create_stream(), torch.cuda.Stream(), "
                f"cupy.cuda.Stream())")

    def _check_open(self, awaited: bool = False) -> None:
        what = "run()" if awaited else "submit()"  # as the caller called it
        if self._broken is not None:
            raise self.broken_error() from self._broken.__cause__
        if self._state == _NEW:
            raise InvalidState(f"{what} before the scheduler started: use "
                               f"`async with Scheduler(...) as sched:`")
        if self._state != _OPEN:
            raise SchedulerClosed(f"{self!r} is closed; no new work is accepted")
        self.check_loop_thread(what)

    def check_loop_thread(self, what: str) -> None:
        """Raise ``InvalidState`` unless called in the event loop that entered the scheduler
        (on its thread, while it runs): its jobs and queues belong to that loop."""
        if not self.waker.on_loop():
            where = "another thread" if threading.get_ident() != self.waker.loop_thread else \
                "another event loop (the one that entered it has ended, or is not this one)"
            raise InvalidState(
                f"{what} from {where} than the event loop that entered {self!r}; call it from "
                f"that loop (from another thread: anyio.from_thread.run, or "
                f"asyncio.run_coroutine_threadsafe / trio.from_thread.run with its loop), and "
                f"leave the scheduler (async with) before that loop ends")

    def start_parked(self) -> None:
        """Enqueue the parked job from the loop thread: its first ``await``, the loop's next
        turn (``call_soon``), or user code looking at it, whichever comes first."""
        self._unpark(inline=True)

    def _unpark(self, inline: bool) -> None:
        """Start the parked job (loop thread): on the loop (``inline``) unless it may now wait
        on the host (its output went to another library meanwhile) or has already failed (the
        scheduler broke); else on its lane thread, which enqueues or refuses it."""
        job = self._parked
        if job is None:
            return
        try:
            self._parked = None
            job._parked = False
            if inline and not job._finished and not job.method.may_wait_on_host():
                self._run_inline(job)
            else:
                job.lane.unpark(job)
        except BaseException:
            self._abandon(job)
            raise

    def _run_inline(self, job: Job) -> None:
        """Enqueue a lone job from the loop thread, and keep it for its await's poll."""
        try:
            job.lane.run_inline(job)
        except BaseException:  # Ctrl-C on the loop thread, inside its own enqueue of the job
            if not job._is_published:  # cut short after the lane's own handling: as it would
                error = SchedulerClosed(f"{job.label} failed: an exception interrupted the event "
                                        f"loop while it enqueued the job; part of its work may "
                                        f"have reached the device")
                job._publish(None, None, error)
                job._retrieved = True  # the caller gets the interrupt: not this from aclose()
                job.lane.not_run_here(job)
                self.finish(job, FAILED, error)
            elif job._enqueue_error is None and not job._finished and not job._claimed \
                    and not job._loop_owned:  # in flight, but neither kept for the poll nor
                job.lane._hand(job)  # with the waiter: nobody would settle it
            raise
        if job._loop_owned:
            self._loop_job = job
            self._check_loop_job_slot(job.lane)

    def _settle_loop_job(self) -> None:
        """Before another submit: settle the lone job the loop kept if it has completed (the
        new job may then be lone in turn). If it has not, leave it to its ``await``: handing it
        to the waiter now would wake that thread in the middle of a burst (H200: up to ~8% of a
        burst's wall time). It never holds a slot a submit could wait for (``_enqueue``)."""
        job = self._loop_job
        if job is None:
            return
        if job._loop_owned and not job.lane.settle_if_complete(job):
            return
        self._loop_job = None

    def _release_loop_job(self) -> None:
        """Settle the lone job the loop kept for its poll, or hand it to the waiter
        (``Lane.release``: loop thread only)."""
        job = self._loop_job
        if job is not None:
            job.lane.release(job)
            if not job._loop_owned:
                self._loop_job = None

    # -- called by lanes and jobs --------------------------------------------------------------
    def count_pending(self) -> int:
        return len(self._pending)

    async def checkpoint(self) -> None:
        """A cancellation point, and a yield to the loop unless one came within
        ``YIELD_EVERY_S``, or within ``YIELD_SHARED_S`` while another task waits in a yield
        (loop thread)."""
        since = time.perf_counter() - self._yielded_at
        if since >= YIELD_EVERY_S or (self._yielding and since >= YIELD_SHARED_S):
            await self.yield_to_loop()
        else:
            await self.waker.checkpoint_if_cancelled()

    async def yield_to_loop(self) -> None:
        self._yielding += 1
        try:
            await self.waker.checkpoint()
        finally:
            self._yielding -= 1
        self._yielded_at = time.perf_counter()

    def yielded(self) -> None:
        """Note that the loop just ran other tasks (an await that waited)."""
        self._yielded_at = time.perf_counter()

    @property
    def cancelling(self) -> bool:
        return self._cancelling

    def broken_error(self) -> SchedulerBroken | None:
        """A fresh copy of the error that broke the scheduler, or None (thread-safe)."""
        broken = self._broken
        if broken is None:
            return None
        copy = SchedulerBroken(str(broken))
        copy.code = broken.code
        copy.__cause__ = broken.__cause__
        return copy

    def break_(self, error: BaseException, job: Job, doing: str) -> None:
        """Mark the scheduler broken by ``error`` (any thread), which a lane saw while
        ``doing`` ("enqueuing" / "waiting for") ``job``; fails every pending job."""
        with self._broken_lock:
            if self._broken is not None:
                return
            broken = SchedulerBroken(
                f"the scheduler is broken: the device failed ({error}); lane {job.lane.index} "
                f"saw it while {doing} {job.name} (job {job.id}), but a device fault stops all "
                f"of its work, so another job may have caused it. Every pending job failed and "
                f"no new work is accepted; leave the scheduler and recover the device (a CUDA "
                f"context error needs a new process)")
            broken.code = getattr(error, "code", None)
            broken.__cause__ = error
            self._broken = broken
        self.waker.post(self._fail_pending)

    def _fail_pending(self) -> None:
        for job in list(self._pending):
            error = self.broken_error()
            # Counted as completed now, not when its lane's threads get to it, so that
            # statistics() agree with the jobs' states at once.
            if job._abandon(error):  # no lane had taken it: none will run it now
                job._not_run_state = FAILED
                job.lane.not_run_here(job)
            else:  # in flight, or being enqueued by its lane's thread: claimed here
                job.lane.claim_taken(job, error)
            self.finish(job, FAILED, error)

    def finish(self, job: Job, state: JobState, error: BaseException | None) -> None:
        """Settle ``job`` (loop thread). Its room, count and pin are given back once, even
        if an exception (a Ctrl-C) cuts ``Job._finish`` short after it marked the job."""
        try:
            job._finish(state, error)
        finally:
            if job._finished and not job._accounted:
                job._accounted = True
                self._account_finished(job)

    def _account_finished(self, job: Job) -> None:
        self._pending.discard(job)
        if self._loop_job is job:  # kept for its poll: let go of it (and its outputs) now
            self._loop_job = None
        if job._loop_owned:  # finished before its poll claimed it (failed by a device break):
            job.lane.release(job)  # claimed and counted here, or by the waiter
        if self._queues is not None:
            self._count_stream(job, -1)
        lane = job.lane
        lane.outstanding -= 1
        assert lane.slots is not None
        lane.slots.release()
        if job._error is not None and job._state != CANCELLED:
            # Its traceback's finished frames let go of their locals (the job's inputs among
            # them): a failed job a client gave up on keeps its error, not its data.
            _forget_locals(job._error, job._error_tb)
            # Kept until its error has been seen (an await, exception()): leaving raises the
            # first error nobody saw. Those seen are dropped now and then, and of those unseen
            # only the first UNOBSERVED_KEPT, so a long-lived scheduler whose clients give up
            # on failed jobs does not keep every one of them.
            unobserved = self._unobserved
            unobserved.append(job)
            if len(unobserved) >= self._unobserved_next:
                unseen = [j for j in unobserved if not j._retrieved]
                # The first few and the latest, and the first of those let go (again once
                # that one is seen): should all those kept be seen later, leaving still has
                # one nobody saw to raise.
                let_go = unseen[UNOBSERVED_KEPT:-1]
                if let_go and (self._let_go is None or self._let_go._retrieved):
                    self._let_go = let_go[0]
                unobserved[:] = unseen[:UNOBSERVED_KEPT] + unseen[UNOBSERVED_KEPT:][-1:]
                self._unobserved_next = 2 * UNOBSERVED_KEPT

    def finish_batch(self, jobs: list[Job], error: BaseException | None) -> None:
        for job in jobs:
            if error is None:
                self.finish(job, DONE, None)
            else:
                self.finish(job, FAILED, self.broken_error() or error)

    # -- observing ----------------------------------------------------------------------------
    @property
    def broken(self) -> SchedulerBroken | None:
        """The error that broke the scheduler, or None."""
        return self._broken

    @property
    def pending(self) -> int:
        """Jobs submitted and not yet finished. On the loop thread it settles those the device
        has finished first (one event query per pending job), as ``job.done()`` does, so it
        agrees with ``statistics()`` and reaches 0 for code that polls it without yielding.
        Not so once the device has failed: the failure of the pending jobs is settled on the
        loop's next turn, after the reports the lanes made before it (``break_``)."""
        if self.may_update():
            self._settle_finished()
            self.observed()
        return len(self._pending)

    def statistics(self) -> tuple[LaneStatistics, ...]:
        """A frozen snapshot of every lane's counters. On the loop thread it first settles the
        jobs the device has finished among up to ``OBSERVE_AT_MOST`` pending ones (one event
        query each; a held-back job is started), so code polling it without yielding sees its
        jobs completed."""
        fresh = self._bring_up_to_date()  # busy time: every job settled so far
        return tuple(lane.statistics(locked=fresh) for lane in self.lanes)

    def timeline(self) -> Timeline:
        """The device spans of the recent jobs (up to ``timeline_size``), as a ``Timeline``.
        A scheduler made with ``timing=False`` records none: it raises ``InvalidState`` (an
        empty timeline's ``overlap()`` of 0.0 would read as "no overlap", not "not measured")."""
        if not self._timing:
            raise InvalidState(f"{self!r} was made with timing=False: it records no timing "
                               f"events, so there is no timeline to measure overlap from; make "
                               f"it with timing=True (the default) to get one")
        self._bring_up_to_date()  # as statistics()
        spans = list(self._spans)
        if len(spans) > self._timeline_size:  # recorded nearly in submit order: a quick sort
            spans.sort(key=_JOB_ID)
            spans = spans[len(spans) - self._timeline_size:]
        return Timeline._recorded(spans, self.device.name)

    def clear_timeline(self) -> None:
        """Forget the spans recorded so far (to measure one phase of a longer run): those of
        the jobs settled when it is called (awaited, or reported by their lane). A job still
        running then, or finished on the device but not yet reported, is recorded in the next
        phase: await a phase's jobs before clearing."""
        if not self.may_update():
            self._spans.clear()
            return
        self._release_loop_job()
        with contextlib.ExitStack() as held:  # no span is recorded between the read and the cut
            for lane in self.lanes:
                held.enter_context(lane.span_lock)
            self._read_spans()
            self._spans.clear()
        self.observed()

    def _settle_finished(self, at_most: int | None = None) -> None:
        """Settle every pending job the device has finished (a lane reports its jobs in order,
        so one may wait behind a slower one, for milliseconds on another stream), or with
        ``at_most`` only among that many of them, on the loop thread (a held-back job is
        started); elsewhere, none. One event query per job looked at."""
        if self._state is _NEW or not self.waker.on_loop():  # (observe() would do nothing)
            return
        self._release_loop_job()
        if self._parked is not None:
            self.start_parked()
        for job in list(itertools.islice(self._pending, at_most)):
            job.lane.observe(job)

    def _bring_up_to_date(self, at_most: int | None = OBSERVE_AT_MOST) -> bool:
        """Before an observer reads: settle the jobs the device has finished, among at most
        ``at_most`` of those pending (None: all; from a task of the loop; the lone job the loop
        kept is handed to the waiter, a held-back one started; from the loop's own code, a
        raw signal handler landing there, only the hand-over: settling there more than
        ``pending`` and ``done()`` do lost a wakeup, 1 run in 40 of the signal test),
        and read the spans of the jobs settled so far, unless ``may_update()`` says no; then
        the observer reads what was settled before, taking no lock. Returns whether it
        brought the scheduler up to date."""
        if not self.may_update():
            return False
        if self._state is not _NEW and self.waker.on_loop() and self.waker.in_task():
            self._settle_finished(at_most)
        else:  # the loop's own code (a raw signal handler landing there), another thread
            self._release_loop_job()
        self._read_spans()
        self.observed()
        return True

    def may_update(self) -> bool:
        """Whether an observer called now may settle jobs and read spans. Not from inside the
        scheduler (a raw signal handler landing in it, ``_reentry``): the interrupted frame
        may be changing that very state, or hold a lock. Nor, on trio, from the loop thread
        outside any task (a raw signal handler landing in trio's own run loop, say as it
        cancels a task): waking a task there broke trio's invariants (TrioInternalError)."""
        if reentered():
            return False
        if self._state == _NEW or self.waker.backend != "trio" or not self.waker.on_loop():
            return True
        return self.waker.in_task()

    def observed(self) -> None:
        """After an observer (user code) may have settled jobs on the loop thread: see
        ``LoopWaker.wake_if_outside_task`` (a raw signal handler in the loop's selector)."""
        if self._state != _NEW and self.waker.on_loop():  # (no waker before the entry)
            self.waker.wake_if_outside_task()

    def _read_spans(self) -> None:
        for lane in self.lanes:
            lane.read_spans()

    def __repr__(self) -> str:
        state = "broken" if self._broken is not None else self._state
        lanes = len(self.lanes)
        return (f"<Scheduler {self.device.name}, {lanes} lane{'' if lanes == 1 else 's'}, {state}, "
                f"{len(self._pending)} pending>")

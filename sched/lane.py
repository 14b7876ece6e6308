"""Lanes: one dedicated host thread that enqueues jobs, and one that waits for them.

The *lane thread* takes jobs from its queue in submission order and runs each on its per-thread
stream (``current_stream`` with no caller stream), or under ``CallerStream(job.stream)``. Before a
job runs it waits, on the host and off the event loop, until every job it depends on has been
*enqueued* (not completed) and then makes its stream wait for their events on the device.

The *loop thread* may do both threads' parts itself for a lone caller-stream job that cannot
block (``run_inline``; ``Scheduler._can_run_inline`` says when): it enqueues the job, and
``await job`` polls its event (``poll``) before giving it to the waiter (``release``). It may
also settle any job it sees complete while it polls; a job is settled once, by whichever thread
claims it first.

The *waiter thread* waits for the lane's jobs to complete, in order, with the GIL released
(``Event.synchronize``), then hands every job it finds complete to the loop in one wakeup. Jobs
on one lane's stream complete in order, so waiting in order never holds a finished job behind an
unfinished one; jobs under a caller stream may finish out of order and are reported once the
jobs before them on the lane are.

Guarantees:
- no Python runs inside a driver callback: every wait happens on the waiter thread;
- a lane thread never blocks on the event loop, and the loop never blocks on a lane;
- a job's dependencies are enqueued before it (``after=`` jobs and the producers of its inputs are
  submitted first, and a lane runs its queue in order), so the host-side wait always ends;
- a job that fails before reaching the device publishes its error, so its dependents fail with
  ``DependencyFailed`` instead of waiting forever.
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from streamlane.runtime import CallerStream, Device, Event, Method, current_stream
from streamlane.runtime.errors import DeviceError, MethodBusy
from streamlane.runtime.stream import no_caller_stream

from .errors import DependencyFailed, SchedulerClosed
from .job import CANCELLED, DONE, FAILED, Job, JobOutput, JobState
from .timeline import Span

if TYPE_CHECKING:
    import anyio

    from ._wakeup import LoopWaker

__all__ = ["Lane", "LaneStatistics"]

_POLL_S = 0.05  # how often a blocked lane re-checks whether the scheduler is closing
# A lane keeps the GIL through its launches (Device.hold_gil) while fewer driver calls than this
# are queued on the device by its jobs in flight: a stream's queue holds about a thousand before
# a launch blocks, and a blocked launch must not hold the GIL.
HOLD_GIL_BELOW = 512


@dataclass(frozen=True)
class LaneStatistics:
    """One lane's counters: jobs ``queued`` for the lane thread, ``in_flight`` on the device,
    ``completed`` (finished, whatever the outcome), and ``busy_time_s``, the sum of its jobs'
    device durations (timing events; 0 when the scheduler runs with ``timing=False``)."""

    lane: int
    queued: int
    in_flight: int
    completed: int
    busy_time_s: float


class _Core(Protocol):
    """What a lane needs from its scheduler (see ``Scheduler``)."""

    waker: LoopWaker
    reference: Event | None

    @property
    def timing(self) -> bool: ...
    @property
    def spin_s(self) -> float: ...
    @property
    def poll_s(self) -> float: ...
    @property
    def cancelling(self) -> bool: ...
    @property
    def broken(self) -> BaseException | None: ...
    def count_pending(self) -> int: ...
    def start_parked(self) -> None: ...
    async def checkpoint(self) -> None: ...
    async def yield_to_loop(self) -> None: ...
    def yielded(self) -> None: ...
    def broken_error(self) -> BaseException | None: ...
    def break_(self, error: BaseException, job: Job, doing: str) -> None: ...
    def finish(self, job: Job, state: JobState, error: BaseException | None) -> None: ...
    def finish_batch(self, jobs: list[Job], error: BaseException | None) -> None: ...
    def record_span(self, span: Span) -> None: ...
    def may_update(self) -> bool: ...
    def observed(self) -> None: ...
    def check_loop_thread(self, what: str) -> None: ...


# Timed jobs the loop settles itself may wait this many for their spans to be read (~5-10 us
# each) before the loop reads them at its next turn; fewer are read while it polls.
UNREAD_MAX = 32

# The waiter reports a lane's jobs in order: a job done on one caller stream behind one still
# running on another stream of the lane would wait for that one. While such jobs are in
# flight, an idle lane thread looks at them itself after LOOK_AFTER_S, then doubling up to
# every LOOK_EVERY_S, and reports those done (Lane._look_behind_head); a busy one, at most every
# LOOK_EVERY_S between two jobs.
LOOK_AFTER_S = 0.001
LOOK_EVERY_S = 0.016
_LOOK = object()  # put in the lane's queue: look again at what is in flight


class Lane:
    """A lane of a ``Scheduler``: ``sched.lanes[i]``. Its repr shows its state."""

    def __init__(self, core: _Core, index: int, device: Device, queue_size: int):
        self.index = index
        self.device = device
        self.queue_size = queue_size
        self._core = core
        self._jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._completions: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._queued = self._in_flight = self._completed = 0
        # Jobs given to the waiter thread and not yet settled by it, in its order (_lock)
        self._handed_jobs: deque[Job] = deque()
        self._looked = 0.0  # when the lane thread last looked behind the head (monotonic)
        self._queued_calls = 0  # driver calls of the jobs in flight (see HOLD_GIL_BELOW)
        self._park = threading.Event()  # what threads wait on once the device is lost
        self._busy_s = 0.0
        self._events: list[Event] = []  # start timing events to reuse (taken by the lane thread)
        # Timed jobs settled whose spans are not read yet (read_spans), and the lock held while
        # they are taken and read, so an observer never sees a job half read.
        # Taken after _lock, never before it. Re-entrant: read_spans takes the pending notes
        # before reading them, so a nested read on the same thread finds none.
        self._unread: list[_Unread] = []
        self._span_lock = threading.RLock()
        self._read_scheduled = False  # the loop has a read_spans queued (call_soon)
        self.stream_handle: int | None = None
        self.startup_error: BaseException | None = None
        # Loop side (set up by the scheduler inside the running loop):
        self.slots: anyio.Semaphore | None = None
        self.ready: anyio.Event | None = None
        self.exited: anyio.Event | None = None
        self.outstanding = 0
        # The live methods bound to this lane (a dropped method leaves it by itself): new
        # methods go to the least loaded lane, then the one with the fewest
        self.methods: weakref.WeakSet[Method] = weakref.WeakSet()
        self.thread = threading.Thread(target=self._run_lane, daemon=True,
                                       name=f"streamlane-lane-{index}")
        self.waiter = threading.Thread(target=self._run_waiter, daemon=True,
                                       name=f"streamlane-wait-{index}")

    # -- loop side --------------------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()
        self.waiter.start()

    def put(self, job: Job) -> None:
        with self._lock:  # counted and queued together (an interrupt between left it counted)
            self._queued += 1
            job._counted = True
            self._jobs.put(job)

    def park(self, job: Job) -> None:
        """Count ``job`` as queued for this lane while the scheduler holds it back for the loop
        thread (``Scheduler._enqueue``); ``unpark`` then starts it one way or the other."""
        with self._lock:
            self._queued += 1
            job._counted = True

    def _uncount(self, job: Job) -> bool:
        """Under ``_lock``: take ``job`` out of the queued count, once, whoever decides its fate
        (this lane's thread, or the loop settling a job no lane will run). True if it was in."""
        if not job._counted:
            return False
        job._counted = False
        self._queued -= 1
        return True

    def not_run_here(self, job: Job) -> None:
        """Loop thread: ``job`` was settled without this lane running it (abandoned, or failed
        as the loop's own enqueue was cut short): out of the queued count, into completed."""
        with self._lock:
            if self._uncount(job):
                self._completed += 1

    def claim_taken(self, job: Job, error: BaseException) -> None:
        """Loop thread, the device broke: count as completed a ``job`` this lane's thread has
        taken (in flight, or inside its enqueue), so that ``statistics()`` agree at once with
        the job's settling as failed. Whoever gets to it later counts nothing more: the lane
        thread finds it out of the queued count (``_not_run``) or claimed (``_execute``
        counts no flight), the waiter finds it claimed. One refused by its lane
        (``_not_run``) is claimed already."""
        with self._lock:
            if job._claimed:
                return
            if self._uncount(job):  # still counted queued: its thread is enqueuing it
                self._completed += 1
                job._claimed = True
                return
        self._settle([job], error)  # counted in flight: as the waiter would

    def unpark(self, job: Job) -> None:
        """Give a parked job to the lane thread, behind anything queued before it (else the
        loop thread enqueues it: ``run_inline``)."""
        self._jobs.put(job)

    def run_inline(self, job: Job) -> None:
        """Enqueue a parked ``job`` from the loop thread (no lane hop) and keep it for ``poll``.

        Only for a lone job that cannot block: nothing else pending (so nothing is queued
        ahead of it, its dependencies are done, and no stream queue is full of our work),
        kernel steps on a caller stream, inputs already on the device
        (``Scheduler._can_run_inline`` decides)."""
        # The loop thread's calls release the GIL as usual (Device.hold_gil off): nothing else
        # is pending, so no other thread is waiting for it, and on the H200 the GIL-holding
        # calls cost more than the releasing ones when nobody contends (11.4 vs 9.8 us).
        if self._execute(job, None, on_loop=True):
            if self._core.poll_s > 0:
                # A lone job: the loop keeps it for ``await job`` to poll. Handing it to the
                # waiter too would race the poll for the GIL the moment the event completes and
                # put the thread hop back on the await's path. ``release`` hands it over once
                # the poll gives up or anything else needs it settled
                # (``Scheduler._settle_loop_job``, ``_release_loop_job``, ``_enqueue``).
                job._loop_owned = True
            else:
                self._hand(job)

    async def poll(self, job: Job) -> bool:
        """Loop thread, ``await job``: while ``job`` is the scheduler's only pending job, poll
        its event for up to ``poll_us``, yielding to the loop between queries, and settle it
        here the moment it completes; the waiter's wakeup (a thread hop) would come later.
        Returns when the job has finished, or has been given to the waiter (the budget is
        spent, or the await was cancelled): True if it passed a cancellation point."""
        core = self._core
        try:
            if core.poll_s <= 0 or core.count_pending() > 1:
                return False
            deadline = time.perf_counter() + core.poll_s
            await core.checkpoint()  # yields only if the loop has not had a yield lately
            while not job._finished and not self._complete_on_loop(job):
                if self._unread:  # earlier jobs' spans, read while the device runs this one
                    self.read_spans()
                if time.perf_counter() >= deadline:
                    return True
                await core.yield_to_loop()
            return True
        finally:
            self.release(job)

    def release(self, job: Job) -> None:
        """If the loop kept ``job`` for its poll (``run_inline``): settle it if it has
        completed, else give it to the waiter; from then on it completes in the background.
        Only in the scheduler's loop; elsewhere (a repr in a lane thread's message,
        ``statistics()`` from another thread or loop) it does nothing."""
        if not job._loop_owned or not self._core.waker.on_loop():
            return
        try:
            job._loop_owned = False
            if not self._complete_on_loop(job):
                self._hand(job)
        except BaseException:
            # A Ctrl-C: the loop has let go of the job, so the waiter must have it unless it
            # was settled (else it would hold its lane's room until the scheduler closes).
            with self._lock:
                handed = job in self._handed_jobs
            if not job._claimed and not job._finished and not handed:
                self._hand(job)
            raise

    def observe(self, job: Job) -> None:
        """Loop thread, when user code looks at ``job`` (``done()``, ``state``,
        ``exception()``): settle it here if the device has finished it, so what the loop sees
        agrees with the device. Without this, a job could look unfinished after a job ordered
        after it (``after=``, another lane) had been settled, until its own waiter reported it.
        A job held back for its await (``Scheduler.start_parked``) is started here, so code that
        polls ``done()`` without letting the loop turn still sees it finish. Elsewhere (a repr
        in a lane thread's message, another thread or loop) it does nothing."""
        if not self._core.waker.on_loop():
            return
        if job._parked:  # looked at before its await: start it (a caller may poll done())
            self._core.start_parked()
        self.release(job)
        if job._finished or not job._is_published:
            return
        if job._enqueue_error is not None:  # failed or cancelled before reaching the device:
            # its lane has counted it and posted its settle, which the loop has not run yet
            self._core.finish(job, job._not_run_state or FAILED, job._enqueue_error)
            return
        if not job._claimed and self.settle_if_complete(job):
            return
        if job._claimed and not job._finished and _complete(job):
            # Claimed by a lane's thread (perhaps since the line above, which then found
            # nothing to settle): it has counted the job and posted its settle, which the loop
            # has not run yet (a busy loop). Finish it now; the posted call then finds it
            # finished. First let the claim's critical section end, which notes the job's span
            # (Lane._settle).
            with self._lock:
                pass
            self._core.finish(job, DONE, None)

    def settle_if_complete(self, job: Job) -> bool:
        """Loop thread, at a later submit: settle a job the loop kept for its poll if it has
        completed. The query keeps the GIL (``Device.hold_gil``): a lane thread woken by this
        burst's earlier submits would take it at a release and run a whole job before giving
        it back, once per submit."""
        previous = self.device.hold_gil(True)
        try:
            return self._complete_on_loop(job)
        finally:
            self.device.hold_gil(previous)

    def _complete_on_loop(self, job: Job) -> bool:
        if not _complete(job):
            return False
        report = self._settle([job], None)
        if report is not None:
            # Claimed here: nothing left to hand to the waiter. Cleared before the report, whose
            # settle would otherwise come back here (Scheduler._account_finished) to find that.
            job._loop_owned = False
            try:
                report()  # on the loop: settle it here, now
            finally:
                # Cut short (a Ctrl-C) before it settled the job it claimed: nobody else will,
                # and the job would hold its lane's room until the scheduler closes.
                if not job._finished:
                    self._core.finish(job, DONE, None)
            # Its span is read later (read_spans): while the loop polls its next job, by the
            # lane's threads, or when asked; at the loop's next turn once many are waiting
            # (again past 4x that, should an interrupt have lost the queued read).
            waiting = len(self._unread)
            if waiting >= UNREAD_MAX and (not self._read_scheduled or
                                          waiting >= 4 * UNREAD_MAX):
                self._core.waker.call_soon(self._read_spans_soon)
                self._read_scheduled = True
        job._loop_owned = False  # settled: nothing left to hand to the waiter
        return job._finished

    def _read_spans_soon(self) -> None:
        self._read_scheduled = False
        self.read_spans()

    def _read_spans_here(self) -> None:
        """``read_spans`` on a lane's own thread: a failure there is a streamlane bug, reported
        on the loop as a callback's would be, and must not end the thread (every later job of
        the lane would hang)."""
        try:
            self.read_spans()
        except Exception as exc:
            self._core.waker.post(_Call(_reraise, exc))

    def read_spans(self) -> None:
        """Read the spans of the timed jobs settled so far (any thread): their device start and
        end, ``job.span``, the scheduler's timeline and this lane's busy time. Settling a job
        only notes its events; the thread that settled it reads them once the loop has been
        told (the waiter, the lane thread) or at the loop's next turn (the loop), off the
        await's path. ``job.span``, ``timeline()`` and ``statistics()`` read what is left.

        An interrupt (a Ctrl-C on the loop) may cut it short anywhere: the notes not read yet
        are put back, except one whose span was being recorded (``_Unread.started``), which is
        never read twice (its start event would go back to the pool twice, and two later jobs
        would share it)."""
        with self._span_lock:
            if not self._unread:
                return
            unread: list[_Unread] = []
            done = 0
            busy = [0.0]
            try:
                unread, self._unread = self._unread, []
                ref = self._core.reference
                for note in unread:
                    self._read(note, ref, busy)
                    done += 1
            finally:
                rest = unread[done:]
                if rest and rest[0].started:
                    del rest[0]
                if rest:
                    self._unread[:0] = rest
                # Under the span lock (an observer that waited for it sees the busy time of
                # the spans it sees), which guards _busy_s; not _lock, taken before it.
                self._busy_s += busy[0]

    def stop(self) -> None:
        """Let the threads exit once the queue is empty (they post ``exited``)."""
        self._jobs.put(None)

    def join(self) -> None:
        """Join both threads, those started, unless the device is lost: then they park (see
        ``_parking``)."""
        if self._parking() is None:
            for thread in (self.thread, self.waiter):
                if thread.ident is not None:
                    thread.join()

    @property
    def span_lock(self) -> Any:
        """Held while spans are noted and read: ``Scheduler.clear_timeline`` holds every
        lane's so that no span is recorded between its read and its cut."""
        return self._span_lock

    def statistics(self, locked: bool = True) -> LaneStatistics:
        """The lane's counters, read under its locks (one consistent snapshot); without
        ``locked``, read as they stand: for an observer called from inside the scheduler (a
        raw signal handler, ``_reentry``), which must not wait for a lock. Its thread may
        hold one of them, and the lane's other threads the other, waiting for it."""
        if not locked:
            return LaneStatistics(self.index, self._queued, self._in_flight, self._completed,
                                  self._busy_s)
        with self._lock:
            counts = self._queued, self._in_flight, self._completed
        with self._span_lock:
            busy = self._busy_s
        return LaneStatistics(self.index, *counts, busy)

    def __repr__(self) -> str:
        queued, in_flight = self._queued, self._in_flight  # no lock: a repr may come from
        # anywhere (a message, a signal handler inside the scheduler: _reentry)
        state = f"{queued} queued"
        if in_flight:
            state += f", {in_flight} in flight"
        if not self.thread.is_alive() and self.thread.ident is not None:
            state += ", stopped"
        return f"<Lane {self.index} {self.device.name}, {state}>"

    # -- lane thread ------------------------------------------------------------------------
    def _run_lane(self) -> None:
        core = self._core
        try:
            with no_caller_stream():
                try:
                    stream = current_stream(self.device)
                    self.stream_handle = stream.handle
                    if self.index == 0 and core.timing:
                        # The common origin of every span: complete before any job runs.
                        ref = stream.record(self.device.create_event(timing=True))
                        ref.synchronize()
                        core.reference = ref
                except BaseException as exc:  # reported by Scheduler.__aenter__
                    self.startup_error = exc
                    return
                finally:
                    assert self.ready is not None
                    core.waker.post(self.ready.set)
                holding = False
                while (job := self._next_job()) is not None:
                    if job is _LOOK:
                        continue
                    if holding != (self._queued_calls < HOLD_GIL_BELOW):
                        holding = not holding
                        self.device.hold_gil(holding)
                    report = None
                    if self._execute(job, stream):
                        report = self._complete_here(job)
                        if report is None:
                            self._hand(job)
                    del job  # not held while waiting for the next one (see _run_waiter)
                    if report is not None:
                        core.waker.post(report)
                        self._read_spans_here()  # while the loop wakes up
        finally:
            park = self._parking()
            self._completions.put(None)
            if park:
                park.wait()

    def _next_job(self) -> Any:
        """Lane thread: the next job to enqueue (None: stop). While jobs of more than one stream
        are in flight on the lane, waiting for it is cut short now and then to report those
        done behind a job of another stream (``_look_behind_head``), and a lane that other
        submits keep busy looks at most every ``LOOK_EVERY_S`` between two jobs."""
        now = time.monotonic()  # a steady flow of jobs may never leave the lane idle for
        if now - self._looked >= LOOK_EVERY_S:  # LOOK_AFTER_S: it still looks this often
            self._looked = now
            if self._streams_in_flight() > 1:
                self._look_behind_head()
        if not self._jobs.empty():  # more to enqueue (a burst): no scan
            return self._jobs.get()
        timeout = LOOK_AFTER_S
        while self._streams_in_flight() > 1:
            try:
                return self._jobs.get(timeout=timeout)
            except queue.Empty:
                self._looked = time.monotonic()
                self._look_behind_head()
                timeout = min(2 * timeout, LOOK_EVERY_S)
        return self._jobs.get()

    def _streams_in_flight(self) -> int:
        """How many streams the jobs given to the waiter and not settled yet are on (1 once
        they share one; those already settled out of order wait only for the waiter to pass
        them, and are nothing to look for)."""
        with self._lock:
            jobs = [job for job in self._handed_jobs if not job._claimed]
        if len(jobs) < 2:
            return len(jobs)
        first = jobs[0]._stream_key
        return 2 if any(job._stream_key != first for job in jobs) else 1

    def _look_behind_head(self) -> None:
        """Lane thread: settle the jobs given to the waiter that the device has finished on
        another stream than the one the waiter waits for (the first), out of order: the
        waiter would report them only after that one. The waiter skips them later (claimed),
        as it does those the loop settles when asked (``observe``)."""
        with self._lock:
            jobs = list(self._handed_jobs)
        if len(jobs) < 2:
            return
        head = jobs[0]._stream_key
        done = [job for job in jobs[1:]
                if job._stream_key != head and not job._claimed and _complete(job)]
        del jobs
        if not done:
            return
        report = self._settle(done, None)
        del done  # not held while the loop runs the report (see _run_waiter)
        if report is not None:
            self._core.waker.post(report)
            self._read_spans_here()

    def _execute(self, job: Job, lane_stream: Any, on_loop: bool = False) -> bool:
        """Enqueue ``job`` on the device and publish it; True once it is in flight (False: it
        failed or was cancelled before reaching the device, and is reported as such).
        ``on_loop``: the loop thread enqueues it (``run_inline``), where a ``KeyboardInterrupt``
        or ``SystemExit`` (a signal handler) may land: the job fails with it, and it goes on."""
        core = self._core
        if not job._take():  # abandoned by the loop (Scheduler._abandon), which settled it
            with self._lock:
                self._uncount(job)
            return False
        if self._refused(job):
            return False
        guard = None
        try:
            for dep in job._host_waits:  # jobs of other lanes (and a moved method's last job)
                self._wait_published(dep)
            if job._host_waits and self._refused(job):  # it may have broken or closed meanwhile
                return False
            inputs = job._inputs
            assert inputs is not None
            device_waits = job._device_waits  # after= and the producers of its JobOutputs
            if device_waits:
                for dep in device_waits:  # all enqueued by now (this lane runs in order)
                    if dep._enqueue_error is not None:
                        raise DependencyFailed(job, dep, dep._enqueue_error) \
                            from dep._enqueue_error
                inputs = [_produced(job, v) if type(v) is JobOutput else v for v in inputs]
            stream = lane_stream
            if job.stream is not None:
                guard = CallerStream(job.stream)
                guard.__enter__()
                stream = current_stream(self.device)
            for dep in device_waits:  # no host round trip: the stream waits on the device
                if dep.event is not None and dep._stream_key != stream.key:
                    stream.wait(dep.event)
            # The start event is recorded by execute, after its own device waits (a rule-4
            # handoff, inputs from other streams): a span covers the job's work, not its waits.
            start = self._timing_event() if core.timing else None
            job._start_event = start
            job._stream_key = stream.key
            if job.stream is not None:
                job._track_handle = stream.handle
            method = job.method
            # One call, under the method's guard throughout: another thread's use of the method
            # (another scheduler's lane, a direct m(x)) between set_inputs and execute would
            # run this job on its inputs; it is refused with MethodBusy instead (rule 4).
            results = method(inputs, start=start)
            # Without timing, the method's own end-of-execute event (recorded last on this
            # stream; it does not move while the job holds the outputs) marks completion. With
            # timing, a timing event recorded after it does (public: a new one per job).
            end = stream.record(self.device.create_event(timing=True)) if core.timing \
                else method.last_event
        except DeviceError as exc:
            core.break_(exc, job, "enqueuing")
            self._not_run(job, FAILED, core.broken_error() or exc)
            return False
        except BaseException as exc:  # the job's own error (bad input, closed stream, ...)
            # This frame stays in the error's traceback once it returns: it lets go of the
            # inputs (the frames below it are cleared when the job settles, this one is
            # still running then: Scheduler._account_finished).
            inputs = None
            if on_loop and not isinstance(exc, Exception):
                # Ctrl-C on the loop thread: the caller gets it, once (it was swallowed into
                # the job); the job fails with an error of its own, not the interrupt again.
                self._not_run(job, FAILED, SchedulerClosed(
                    f"{job.label} failed: a {type(exc).__name__} interrupted the event loop while "
                    f"it enqueued the job; part of its work may have reached the device"))
                job._retrieved = True
                raise
            if isinstance(exc, MethodBusy):  # the runtime's words are for threads; its
                busy = MethodBusy(  # type stays, for `except MethodBusy` (retry later)
                    f"{job.label} was not run: its method {job.method.name} was in use by "
                    f"another thread at that moment (another scheduler's lane, or a direct "
                    f"call such as m(x)); a method is driven by one scheduler at a time: bind "
                    f"one method per scheduler (program.method(name, device=...)), or let the "
                    f"other use finish first")
                busy.__cause__ = exc
                exc = busy
            self._not_run(job, FAILED, exc)
            return False
        else:
            with self._lock:
                self._uncount(job)
                if not job._claimed:  # else counted as completed already (claim_taken)
                    self._in_flight += 1
                    self._queued_calls += job._calls
            job._publish(end, results, None)
            if job._claimed:  # failed by a device break as it was enqueued (claim_taken):
                # nothing else settles it again, which lets go of the outputs just published
                core.waker.post(_Call(core.finish, job, FAILED, core.broken_error()))
        finally:
            if guard is not None:
                try:
                    guard.__exit__(None, None, None)
                except BaseException:  # a Ctrl-C as it began (the loop's own enqueue): the
                    guard._leave()  # loop thread must not keep the job's stream selected
                    raise
        return True

    def _refused(self, job: Job) -> bool:
        """Report ``job`` as not run if the scheduler broke or is cancelling its queue."""
        core = self._core
        if not core.cancelling and core.broken is None:  # the common case: no copy made
            return False
        broken = core.broken_error()
        if broken is not None:
            self._not_run(job, FAILED, broken)
            return True
        if core.cancelling:
            self._not_run(job, CANCELLED, SchedulerClosed(
                f"{job.label} was cancelled before it ran: the scheduler left its async with block "
                f"on an error"))
            return True
        return False

    def _hand(self, job: Job) -> None:
        """Give a job in flight to the waiter thread."""
        with self._lock:  # one order for both: the waiter's (_look_behind_head)
            self._handed_jobs.append(job)
            self._completions.put(job)
            several = len(self._handed_jobs) > 1
        if several and threading.get_ident() != self.thread.ident:
            self._jobs.put(_LOOK)  # the loop's own job: an idle lane thread looks again

    def _timing_event(self) -> Event:
        """A timing event to record a job's start on: one a settled job gave back, or new."""
        try:
            return self._events.pop()
        except IndexError:
            return self.device.create_event(timing=True)

    def _complete_here(self, job: Job) -> Callable[[], object] | None:
        """Settle ``job`` on the lane thread itself, skipping the hop to the waiter thread,
        when the lane has nothing else to do and the job completes within the spin budget;
        returns the report for the caller to post to the loop (None: hand it to the waiter).

        Only when the waiter holds no job of this lane, so the waiter's reports stay in order
        (jobs on other streams than the waiter's first are reported by ``_look_behind_head``)."""
        if self._handed_jobs or not self._jobs.empty():
            return None
        event = job.event
        assert event is not None
        try:
            if not event.query():
                deadline = time.perf_counter() + self._core.spin_s
                while True:
                    if time.perf_counter() >= deadline or not self._jobs.empty():
                        return None
                    time.sleep(0)  # queries keep the GIL (hold_gil): let the loop run between
                    if event.query():
                        break
        except Exception:  # a device error: the waiter's blocking wait reports it
            return None
        return self._settle([job], None)

    def _settle(self, batch: list[Job], error: BaseException | None
                ) -> Callable[[], object] | None:
        """Count ``batch`` as completed and return the report that settles it on the loop
        (None: another thread claimed every job first; a job is settled once). The loop thread
        runs the report itself (``poll``); a lane thread posts it once it has dropped its own
        references to the jobs (the loop may run the report, and the user drop the outputs,
        before this thread runs again: a job it still held kept its buffers out of the
        method's pool)."""
        core = self._core
        timed = error is None and core.timing and core.reference is not None
        with self._lock:
            claimed = []
            for job in batch:  # claimed and counted together: an interrupt between two jobs
                if job._claimed:  # (a backward jump) leaves no job claimed but uncounted
                    continue
                job._claimed = True
                self._in_flight -= 1
                self._completed += 1
                self._queued_calls -= job._calls
                claimed.append(job)
            batch = claimed
            if timed and batch:
                # Its span is read after the loop has been told (read_spans, ~5-10 us a job).
                # Noted while claimed: once the lock is let go, the loop may settle the job
                # (observe), which drops its start event.
                noted = [job for job in batch if job._start_event is not None]
                notes = [_Unread(job) for job in noted]
                with self._span_lock:
                    self._unread += notes
                for job in noted:  # after the notes are pending: job.span then reads them
                    job._span_unread = True
        if not batch:
            return None
        if error is not None:
            core.break_(error, batch[0], "waiting for")
            error = core.broken_error() or error
        return _Call(core.finish_batch, batch, error)

    def _wait_published(self, dep: Job) -> None:
        core = self._core
        while not dep._published(_POLL_S):
            error = core.broken_error()
            if error is not None:
                raise error
            if core.cancelling:  # the job is refused next (_refused): its dependency may be
                return  # another scheduler's job, which our error exit does not cancel

    def _not_run(self, job: Job, state: JobState, error: BaseException) -> None:
        with self._lock:
            if self._uncount(job):  # else the loop has counted it (not_run_here, claim_taken)
                self._completed += 1
            job._claimed = True  # counted: a device break's claim_taken, until the publish
            # below, must not take it for a job counted in flight
        job._not_run_state = state
        job._publish(None, None, error)
        self._core.waker.post(_Call(self._core.finish, job, state, error))

    # -- waiter thread ----------------------------------------------------------------------
    def _run_waiter(self) -> None:
        core = self._core
        self.device.hold_gil(True)  # it only queries (never blocks) and synchronizes (releases)
        held: Any = _NOTHING  # a job (or the stop sentinel None) taken ahead of its turn
        try:
            while True:
                job = held if held is not _NOTHING else self._completions.get()
                held = _NOTHING
                if job is None:
                    break
                error: BaseException | None = None
                try:
                    self._wait(job)
                except BaseException as exc:
                    error = exc
                batch = [job]
                if error is None:  # everything else already complete rides the same wakeup
                    while True:
                        try:
                            nxt = self._completions.get_nowait()
                        except queue.Empty:
                            break
                        if nxt is None or not _complete(nxt):
                            held = nxt
                            break
                        batch.append(nxt)
                report = self._settle(batch, error)
                with self._lock:
                    for _ in range(len(batch)):  # the same jobs, first in line
                        self._handed_jobs.popleft()
                # Not held once reported, nor while waiting for the next job: a finished job's
                # Results keep its buffers out of the method's pool.
                job = batch = nxt = None
                if report is not None:
                    core.waker.post(report)
                    report = None
                    self._read_spans_here()  # while the loop wakes up
        finally:
            park = self._parking()
            if self.exited is not None:
                core.waker.post(self.exited.set)
            if park:
                park.wait()

    def _parking(self) -> threading.Event | None:
        """After the device is lost (a kernel fault), the calling thread is parked instead of
        ended: on an H200 (driver 580) a thread that had waited on the faulted context spun in
        the driver's thread teardown forever, and process exit hung behind it. A parked daemon
        thread costs nothing and lets the process exit. Returns the event to wait on forever
        (``join`` does not wait for a parked thread)."""
        device = self.device
        if device._threads_hang_when_lost and device.lost:
            return self._park  # never set, but by tests
        return None

    def _wait(self, job: Job) -> None:
        event = job.event
        assert event is not None
        spin_s = self._core.spin_s
        if spin_s > 0:  # a short spin lowers latency where the wake-up of a blocked wait is slow
            deadline = time.perf_counter() + spin_s
            while time.perf_counter() < deadline:
                if event.query():
                    return
                time.sleep(0)  # queries keep the GIL (hold_gil): let the others run between
        event.synchronize()

    def _read(self, note: _Unread, ref: Event, busy: list[float]) -> None:
        """Read one note's span (``read_spans``, under ``_span_lock``), adding its duration to
        ``busy[0]``. Everything that can be cut short by an interrupt (Python calls) comes
        before ``note.started``; after it, only assignments and C appends."""
        job = note.job()
        try:
            t0 = ref.elapsed_ms(note.start) / 1e3
            t1 = ref.elapsed_ms(note.end) / 1e3
        except Exception:  # timing is best effort; it never fails a job
            note.started = True  # done with: not read again
            if job is not None:
                job._span_unread = False
            return
        span = Span(note.id, note.name, self.index, note.track, t0, t1)
        record = self._core.record_span
        note.started = True  # from here on it is never read again, even if cut short
        busy[0] += t1 - t0
        if job is not None:
            job._span = (t0, t1)
            job._span_unread = False  # after its span: observers look at this without the lock
        self._events.append(note.start)  # complete, read and private: free to record again
        record(span)


class _Unread:
    """A settled timed job whose span is not read yet. It holds the job's two events, never the
    job: a finished job's Results keep its buffers out of the method's pool."""

    __slots__ = ("end", "id", "job", "name", "start", "started", "track")

    def __init__(self, job: Job):
        self.started = False  # its span is being recorded (Lane._read)
        self.job = weakref.ref(job)
        self.id, self.name, self.track = job.id, job.name, job.track
        self.start, self.end = job._start_event, job.event


_NOTHING = object()


def _reraise(exc: Exception) -> None:
    raise exc


def _produced(job: Job, output: JobOutput) -> Any:
    """The Result behind ``output``, an input of ``job``; its producer is enqueued."""
    producer = output.job
    results = producer.results
    if results is None:  # it failed after reaching the device: its outputs were let go
        error = producer._error or DeviceError(f"{producer!r} left no outputs")
        raise DependencyFailed(job, producer, error) from error
    return results[output.index]


def _complete(job: Job) -> bool:
    try:
        return job.event is not None and job.event.query()
    except Exception:  # a device error: the blocking wait reports it
        return False


class _Call:
    """A callback with its arguments (cheaper and clearer than a closure per job)."""

    __slots__ = ("args", "fn")

    def __init__(self, fn: Callable[..., object], *args: Any):
        self.fn = fn
        self.args = args

    def __call__(self) -> None:
        self.fn(*self.args)

"""Waking the event loop from other threads: the one bridge from the lanes to async code.

The backend's own thread-safe call is used (asyncio and uvloop: ``loop.call_soon_threadsafe``;
trio: ``TrioToken.run_sync_soon``), never a ``BlockingPortal`` round trip, and wakeups are
coalesced: however many threads post callbacks while the loop is busy, the loop is woken once and
runs them all in one batch.

Guarantees:
- ``post`` is safe to call from any thread, any number of threads at once, and never blocks on
  the loop;
- callbacks run on the loop thread, in the order they were posted;
- once the loop is gone (closed, or the trio run finished), ``post`` drops callbacks silently, as
  anyio's worker threads do;
- a callback that raises an ``Exception`` is reported (asyncio: the loop's exception handler;
  trio: ``sys.excepthook``) and does not stop the batch (trio would otherwise crash the whole
  run from a ``run_sync_soon`` callback);
- ``KeyboardInterrupt`` and ``SystemExit`` (a signal handler's ``sys.exit``, say) are never
  swallowed: they propagate to the loop as its own callbacks' do, and the callbacks after them
  are posted again first, so no job's completion is lost (asyncio's exit runs them).

``call_soon`` is the loop thread's own, cheaper way to run a callback at the loop's next turn
(asyncio: ``loop.call_soon``, ~1 us; trio: a system task rescheduled, ~3 us, where
``run_sync_soon`` writes to the wakeup socket: ~14 us on the 2-core VM).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import anyio
from anyio import lowlevel

from streamlane.runtime.errors import NotSupported

try:  # anyio's backend class for the running loop: its checkpoints without the per-call lookup
    from anyio._core._eventloop import get_async_backend as _async_backend
except ImportError:  # (private in anyio 4: the public functions do the same, looked up each time)
    _async_backend = None

__all__ = ["LoopWaker"]


class LoopWaker:
    """Created on the loop thread, inside a running asyncio or trio loop."""

    __slots__ = ("_call_soon", "_closed_errors", "_current", "_identity", "_lock", "_loop",
                 "_loop_soon", "_pending", "_scheduled", "_soon", "_soon_closing", "_soon_running",
                 "_soon_task", "backend", "checkpoint", "checkpoint_if_cancelled", "loop_thread",
                 "new_event")

    def __init__(self) -> None:
        self.backend = current_async_library()
        if self.backend == "asyncio":
            import asyncio

            loop = self._loop = asyncio.get_running_loop()
            self._identity: object = loop
            self._current: Callable[[], object] = asyncio._get_running_loop
            self._call_soon = loop.call_soon_threadsafe
            self._loop_soon: Callable[[Callable[[], object]], object] = loop.call_soon
            self._closed_errors: tuple[type[BaseException], ...] = (RuntimeError,)
        elif self.backend == "trio":
            import trio

            self._loop = None
            token = self._identity = trio.lowlevel.current_trio_token()
            self._current = trio.lowlevel.current_trio_token
            self._call_soon = token.run_sync_soon
            self._loop_soon = self._trio_soon
            # OSError: a run that ended abnormally can leave its wakeup socket closed before
            # it counts as finished
            self._closed_errors = (trio.RunFinishedError, OSError)
        else:
            raise NotSupported(f"the streamlane scheduler runs on asyncio (uvloop too) and trio, "
                               f"not on {self.backend!r}")
        # anyio.lowlevel's checkpoint() and checkpoint_if_cancelled(), and anyio.Event(), for
        # this loop's thread only: each call of those looks the backend up again (~1 us on the
        # 2-core VM).
        if _async_backend is not None:
            backend = _async_backend()
            self.checkpoint: Callable[[], Any] = backend.checkpoint
            self.checkpoint_if_cancelled: Callable[[], Any] = backend.checkpoint_if_cancelled
            self.new_event: Callable[[], anyio.Event] = backend.create_event
        else:
            self.checkpoint = lowlevel.checkpoint
            self.checkpoint_if_cancelled = lowlevel.checkpoint_if_cancelled
            self.new_event = anyio.Event
        self.loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._pending: list[Callable[[], object]] = []
        self._scheduled = False
        self._soon: list[Callable[[], object]] = []  # trio: call_soon's callbacks
        self._soon_task: Any = None  # trio: the system task that runs them, while it waits
        self._soon_running = False  # trio: that task exists (waiting, ready or running)
        self._soon_closing = False

    def on_loop(self) -> bool:
        """Whether the caller runs on this waker's thread and in its event loop (not in another
        loop run on the same thread after this one ended)."""
        try:  # the running loop (trio: run token) is per thread: one check covers both
            return self._current() is self._identity
        except RuntimeError:  # trio's, outside a trio run
            return False

    def post(self, callback: Callable[[], object]) -> None:
        """Run ``callback()`` on the loop thread soon (thread-safe, coalesced)."""
        with self._lock:
            self._pending.append(callback)
            if self._scheduled:
                return
            self._scheduled = True
        self._schedule_drain()

    def _schedule_drain(self) -> None:
        try:
            self._call_soon(self._drain)
        except self._closed_errors:
            with self._lock:  # the loop is gone: nobody is left to run these
                self._pending.clear()
                self._scheduled = False

    def wake_if_outside_task(self) -> None:
        """After the loop thread settled jobs outside any task, make the loop turn. There a
        raw signal handler may have interrupted the loop waiting in its selector: the tasks
        it woke were scheduled with the loop's own calls, which a loop waiting in its
        selector does not see, and nothing else might come to wake it (the lane's waiter,
        finding the job settled, posts nothing). The thread-safe (signal-safe) call does."""
        if self.in_task():
            return
        self.post(_nothing)

    def in_task(self) -> bool:
        """Whether the caller runs inside one of the loop's tasks (loop thread)."""
        if self._loop is not None:
            import asyncio

            return asyncio.current_task(self._loop) is not None
        import trio

        try:
            trio.lowlevel.current_task()
        except RuntimeError:
            return False
        return True

    def call_soon(self, callback: Callable[[], object]) -> None:
        """Run ``callback()`` at the loop's next turn, after the tasks ready now have run (loop
        thread only, while the loop runs: not thread-safe, and cheaper than ``post``)."""
        self._loop_soon(callback)

    def close(self) -> None:
        """End the trio task that runs ``call_soon``'s callbacks once it has run those already
        posted (a later ``call_soon`` starts a new one); nothing to do on asyncio."""
        self._soon_closing = True
        self._wake_soon_task()

    def _trio_soon(self, callback: Callable[[], object]) -> None:
        self._soon.append(callback)
        if self._soon_task is not None:
            self._wake_soon_task()
        elif not self._soon_running:
            import trio

            self._soon_running = True
            self._soon_closing = False
            trio.lowlevel.spawn_system_task(self._run_soon, name="streamlane-call-soon")
        # else: the task is about to run and takes the callback with the others

    def _wake_soon_task(self) -> None:
        task, self._soon_task = self._soon_task, None
        if task is not None:  # waiting (a task is rescheduled once per wait)
            import trio

            trio.lowlevel.reschedule(task)

    async def _run_soon(self) -> None:
        import trio

        def abort(_: object) -> trio.lowlevel.Abort:  # the run is ending
            self._soon_task = None
            return trio.lowlevel.Abort.SUCCEEDED

        try:
            while True:
                batch, self._soon = self._soon, []
                self._run(batch, self._requeue_soon)
                if self._soon:
                    continue
                if self._soon_closing:
                    return
                self._soon_task = trio.lowlevel.current_task()
                await trio.lowlevel.wait_task_rescheduled(abort)
        finally:
            self._soon_running = False

    def flush(self) -> None:
        """Run the callbacks posted so far, now (loop thread only). A drain already scheduled
        then finds nothing to do; one that was lost (an exception raised into the loop thread as
        the drain began, before it could take the batch) is made up for."""
        self._drain()

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        self._run(batch, self._repost)

    def _run(self, batch: list[Callable[[], object]],
             requeue: Callable[[Sequence[Callable[[], object]]], None]) -> None:
        """Run ``batch`` in order. An ``Exception`` is reported and the batch goes on; anything
        else (KeyboardInterrupt, SystemExit) propagates once the callbacks not yet run are
        queued again (``requeue``), whether it came from a callback or between two."""
        done = 0  # callbacks called, whether they returned or raised
        try:
            for callback in batch:
                try:
                    callback()
                except Exception as exc:
                    self._report(exc, callback)
                finally:
                    done += 1
        finally:
            if done < len(batch):
                requeue(batch[done:])

    def _repost(self, callbacks: Sequence[Callable[[], object]]) -> None:
        with self._lock:
            self._pending[:0] = callbacks
            if self._scheduled:
                return
            self._scheduled = True
        self._schedule_drain()

    def _requeue_soon(self, callbacks: Sequence[Callable[[], object]]) -> None:
        self._soon[:0] = callbacks

    def _report(self, exc: Exception, callback: Callable[[], object]) -> None:
        """A failing callback, reported where the loop reports its own (it is a streamlane
        bug: every callback is the scheduler's)."""
        message = f"Exception in a streamlane scheduler callback {callback!r}"
        if self._loop is not None:
            self._loop.call_exception_handler({"message": message, "exception": exc})
        else:
            print(message, file=sys.stderr)
            sys.excepthook(type(exc), exc, exc.__traceback__)


def _nothing() -> None:
    """A callback whose only effect is the loop's turn (and a default that gives None)."""


def current_async_library() -> str:
    """``asyncio`` or ``trio`` (sniffio, which trio always brings; without it, only asyncio can
    be running)."""
    try:
        import sniffio
    except ImportError:
        return "asyncio"
    return sniffio.current_async_library()

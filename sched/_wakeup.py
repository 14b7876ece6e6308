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
- a callback that raises is reported through ``sys.unraisablehook`` and does not stop the batch
  (trio would otherwise crash the whole run from a ``run_sync_soon`` callback).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable

from streamlane.runtime.errors import NotSupported

__all__ = ["LoopWaker"]


class LoopWaker:
    """Created on the loop thread, inside a running asyncio or trio loop."""

    __slots__ = ("_call_soon", "_closed_errors", "_lock", "_pending", "_scheduled", "backend",
                 "loop_thread")

    def __init__(self) -> None:
        self.backend = current_async_library()
        if self.backend == "asyncio":
            import asyncio

            self._call_soon = asyncio.get_running_loop().call_soon_threadsafe
            self._closed_errors: tuple[type[BaseException], ...] = (RuntimeError,)
        elif self.backend == "trio":
            import trio

            self._call_soon = trio.lowlevel.current_trio_token().run_sync_soon
            self._closed_errors = (trio.RunFinishedError,)
        else:
            raise NotSupported(f"the streamlane scheduler runs on asyncio (uvloop too) and trio, "
                               f"not on {self.backend!r}")
        self.loop_thread = threading.get_ident()
        self._lock = threading.Lock()
        self._pending: list[Callable[[], object]] = []
        self._scheduled = False

    def post(self, callback: Callable[[], object]) -> None:
        """Run ``callback()`` on the loop thread soon (thread-safe, coalesced)."""
        with self._lock:
            self._pending.append(callback)
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._call_soon(self._drain)
        except self._closed_errors:
            with self._lock:  # the loop is gone: nobody is left to run these
                self._pending.clear()
                self._scheduled = False

    def _drain(self) -> None:
        with self._lock:
            batch, self._pending = self._pending, []
            self._scheduled = False
        for callback in batch:
            try:
                callback()
            except BaseException as exc:
                sys.unraisablehook(_Unraisable(exc, callback))


def current_async_library() -> str:
    """``asyncio`` or ``trio`` (sniffio, which trio always brings; without it, only asyncio can
    be running)."""
    try:
        import sniffio
    except ImportError:
        return "asyncio"
    return sniffio.current_async_library()


class _Unraisable:
    """The shape ``sys.unraisablehook`` expects."""

    def __init__(self, exc: BaseException, obj: object):
        self.exc_type = type(exc)
        self.exc_value = exc
        self.exc_traceback = exc.__traceback__
        self.err_msg = "Exception in a streamlane scheduler callback"
        self.object = obj

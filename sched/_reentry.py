"""Whether the calling thread is already inside streamlane: a raw signal handler.

Python runs a ``signal.signal`` handler on the main thread between two bytecodes of whatever
that thread was running, which may be the scheduler itself (a submit, a settle, a span read),
halfway through changing its state or holding a lane's lock. A handler that then looks at the
scheduler (``statistics()``, ``timeline()``, ``job.done()``) must neither wait for that lock
(it would wait forever: the holder is the frame it interrupted) nor change the state the
interrupted frame is changing. The observers ask ``reentered()`` and, when it says so, only
read: they report what was settled before the interrupt.

The test is the call stack: below the observer's own frames, a frame of streamlane's runtime,
kernels or scheduler code means the observer was called from inside it. A signal handler's
frame sits directly on the frame it interrupted; the same holds for user code that streamlane
calls on the loop thread (a ``__cuda_stream__`` property, a warnings hook), which gets the
same read-only view. Frames are known by their module's name, not their file, so that any
layout works (a zip, compiled files only, a path with ``..``). ``demo`` and ``cli`` are users
of the scheduler, not part of it.
"""

from __future__ import annotations

import sys
from types import FrameType

_INSIDE = ("streamlane.runtime", "streamlane.kernels", "streamlane.sched")
_OUTSIDE = frozenset({"streamlane.sched.cli", "streamlane.sched.demo"})


def _streamlane(frame: FrameType) -> bool:
    name = frame.f_globals.get("__name__")
    return isinstance(name, str) and name.startswith(_INSIDE) and name not in _OUTSIDE


def reentered() -> bool:
    """True if streamlane code is on the calling thread's stack below the caller's own
    streamlane frames (see the module's docstring)."""
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and _streamlane(frame):  # the observer's own frames
        frame = frame.f_back
    while frame is not None:
        if _streamlane(frame):
            return True
        frame = frame.f_back
    return False

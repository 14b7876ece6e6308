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
# The event loop's own dispatch: a task's frames sit above it, so streamlane frames below it
# were not interrupted by code running in a task, and the walk stops there (cheap for the
# usual call from a task, whose stack is mostly the loop's).
_LOOP = frozenset({"asyncio.events", "asyncio.base_events", "asyncio.runners",
                   "trio._core._run", "anyio._core._eventloop"})
_OTHER, _STREAMLANE, _DISPATCH = 0, 1, 2
# What each file seen so far holds, decided by its module's name the first time it is seen (a
# file is one module; the name's hash is cached in the string).
_SEEN: dict[str, int] = {}


def _classify(frame: FrameType) -> int:
    name = frame.f_globals.get("__name__")
    kind = _OTHER
    if isinstance(name, str):
        if name.startswith(_INSIDE) and name not in _OUTSIDE:
            kind = _STREAMLANE
        elif name in _LOOP:
            kind = _DISPATCH
    _SEEN[frame.f_code.co_filename] = kind
    return kind


def streamlane_frame(frame: FrameType) -> bool:
    """Whether ``frame`` runs streamlane's own code (runtime, kernels, scheduler; not the CLI
    or the demo, its users). One dictionary lookup once its file has been seen."""
    kind = _SEEN.get(frame.f_code.co_filename)
    if kind is None:
        kind = _classify(frame)
    return kind == _STREAMLANE


def reentered() -> bool:
    """True if streamlane code is on the calling thread's stack below the caller's own
    streamlane frames and above the event loop's dispatch (see the module's docstring). One
    dictionary lookup per frame."""
    seen = _SEEN
    frame: FrameType | None = sys._getframe(1)
    own = True  # still in the observer's own streamlane frames
    while frame is not None:
        kind = seen.get(frame.f_code.co_filename)
        if kind is None:
            kind = _classify(frame)
        if kind == _STREAMLANE:
            if not own:
                return True
        elif kind == _DISPATCH:
            return False
        else:
            own = False
        frame = frame.f_back
    return False

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
same read-only view. ``demo`` and ``cli`` are users of the scheduler, not part of it.
"""

from __future__ import annotations

import os
import sys

_OUTSIDE = {"cli.py", "demo.py", "__main__.py"}


def _package_files() -> frozenset[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    import streamlane.kernels
    import streamlane.runtime

    folders = [here, os.path.dirname(os.path.abspath(streamlane.runtime.__file__)),
               os.path.dirname(os.path.abspath(streamlane.kernels.__file__))]
    files = set()
    for folder in folders:
        for name in os.listdir(folder):
            if name.endswith(".py") and not (folder == here and name in _OUTSIDE):
                files.add(os.path.join(folder, name))
    return frozenset(files)


_FILES: frozenset[str] | None = None


def reentered() -> bool:
    """True if streamlane code is on the calling thread's stack below the caller's own
    streamlane frames (see the module's docstring)."""
    global _FILES
    files = _FILES
    if files is None:
        files = _FILES = _package_files()
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename in files:  # the observer's own frames
        frame = frame.f_back
    while frame is not None:
        if frame.f_code.co_filename in files:
            return True
        frame = frame.f_back
    return False

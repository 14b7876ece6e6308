"""Helpers for the scheduler tests (tests/test_sched*.py): small programs, a host-side gate,
polling with a deadline, the thread-count baseline."""

from __future__ import annotations

import linecache
import sys
import threading
import time
from collections.abc import Callable

import anyio
import numpy as np
import pytest

from streamlane.runtime import Program

# Every async test runs on asyncio, uvloop and trio.
BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop"),
    pytest.param("trio", id="trio"),
]

SHAPE = (4, 8)


def double_program(name: str = "double") -> Program:
    """``forward(x) -> x + x``."""
    b = Program.build(name)
    m = b.method("forward", x=("float32", list(SHAPE)))
    m.output(m.step("add", "x", "x", out="y"))
    return b.finish()


def spin_program(us: int, name: str = "spin") -> Program:
    """``forward(x) -> x`` after one single-block spin of ``us`` microseconds."""
    b = Program.build(name)
    m = b.method("forward", x=("float32", list(SHAPE)))
    m.step("spin", us=us)
    m.output(m.step("copy", "x", out="y"))
    return b.finish()


def data(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


class LateBad:
    """A host array read only when its lane runs the job (``__array__``, as a torch CPU tensor
    is read), with the wrong shape (3x3, not SHAPE) unless given another array: the job fails
    there (``InvalidInput`` at its await, ``DependencyFailed`` at its dependents'), where a
    bad numpy array is the ``submit()``'s error."""

    def __init__(self, array: np.ndarray | None = None):
        self.array = np.zeros((3, 3), np.float32) if array is None else array

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        return self.array


class Gate:
    """An input whose conversion to numpy blocks until ``open()``: it holds a lane *thread*
    inside ``set_inputs`` (a latch holds a *stream*)."""

    def __init__(self, array: np.ndarray, timeout: float = 20.0):
        self.array = array
        self.entered = threading.Event()
        self._opened = threading.Event()
        self._timeout = timeout

    def open(self) -> None:
        self._opened.set()

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        self.entered.set()
        self._opened.wait(self._timeout)
        return self.array


async def wait_until(predicate: Callable[[], bool], timeout: float = 5.0,
                     what: str = "condition") -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.002)


def wait_threads(baseline: int, timeout: float = 5.0) -> int:
    """Wait until the process is back to ``baseline`` threads (host-device stream workers stop
    just after their lane thread); returns the final count."""
    deadline = time.monotonic() + timeout
    while threading.active_count() > baseline and time.monotonic() < deadline:
        time.sleep(0.01)
    return threading.active_count()


class Interrupt(BaseException):
    """What a signal handler's Ctrl-C is to the code it lands in, without pytest's own handling
    of ``KeyboardInterrupt`` (which ends the session)."""


class RaiseAt:
    """Raise ``Interrupt`` as ``function`` reaches, the ``nth`` time, the line ``offset`` lines
    after the first of its own holding ``text`` (before that line runs), on the thread that
    uses it: ``with RaiseAt(Lane._read, "t1 = ref"): ...``. ``hits`` counts the line's runs."""

    def __init__(self, function: Callable[..., object], text: str, *, offset: int = 0,
                 nth: int = 1):
        self.code = function.__code__
        lines = linecache.getlines(self.code.co_filename)
        self.line = offset + next(i for i, line in enumerate(lines, 1)
                                  if i > self.code.co_firstlineno and text in line)
        self.nth, self.hits = nth, 0

    def _local(self, frame, event, arg):
        if event == "line" and frame.f_lineno == self.line:
            self.hits += 1
            if self.hits == self.nth:
                raise Interrupt
        return self._local

    def _trace(self, frame, event, arg):
        return self._local if frame.f_code is self.code else None

    def __enter__(self) -> RaiseAt:
        sys.settrace(self._trace)
        return self

    def __exit__(self, *exc: object) -> None:
        sys.settrace(None)

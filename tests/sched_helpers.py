"""Helpers for the scheduler tests (tests/test_sched*.py): small programs, a host-side gate,
polling with a deadline, the thread-count baseline."""

from __future__ import annotations

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

"""Running a function on a fresh thread from a test."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


def in_thread(fn: Callable[[], Any], timeout: float = 30) -> Any:
    """``fn()`` run on a new thread; its result, or its exception re-raised here."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # surfaced to the test thread
            box["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "the thread did not finish"
    if "error" in box:
        raise box["error"]
    return box["value"]


def waits_until_released(fn: Callable[[], Any], release: Callable[[], None], what: str,
                         held_s: float = 0.2, timeout: float = 10) -> None:
    """``fn()`` on a new thread must still be running ``held_s`` after it starts (it waits
    for something held), and end once ``release()`` is called."""
    t = threading.Thread(target=fn)
    t.start()
    t.join(held_s)
    assert t.is_alive(), f"{what} did not wait"
    release()
    t.join(timeout)
    assert not t.is_alive(), f"{what} did not end once released"

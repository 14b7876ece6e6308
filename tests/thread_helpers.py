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

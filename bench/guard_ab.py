"""The method guard's take and give-back, old (a Lock taken before the ``try``) against new
(an RLock taken inside it, with an owner check first), interleaved in one process: medians
of 15 rounds of 200,000, the order alternating each round. What f8c2c59 added to every
``m(x)``, ``set_inputs``, ``execute`` and ``get_outputs``."""

from __future__ import annotations

import statistics
import threading
import time

LOCK, RLOCK = threading.Lock(), threading.RLock()


def old() -> None:
    if not LOCK.acquire(blocking=False):
        raise RuntimeError
    try:
        pass
    finally:
        LOCK.release()


def new() -> None:
    guard = RLOCK
    if guard._is_owned():
        raise RuntimeError
    try:
        if not guard.acquire(blocking=False):
            raise RuntimeError
    finally:
        try:
            guard.release()
        except RuntimeError:
            pass


def per_call(fn, n: int = 200_000) -> float:
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    got: dict[str, list[float]] = {"old": [], "new": []}
    for r in range(15):
        for name in (("old", "new") if r % 2 else ("new", "old")):
            got[name].append(per_call(old if name == "old" else new))
    for name, xs in got.items():
        print(f"{name}: {statistics.median(xs):.3f} us median, {min(xs):.3f} min")


if __name__ == "__main__":
    main()

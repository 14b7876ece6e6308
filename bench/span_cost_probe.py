"""Probe: what reading one job's span costs, the part of a timed job's settle that an untimed
job skips (``Lane._spans``): two ``elapsed_ms`` against the reference event and a ``Span``.

- warm: each piece in a tight loop on events already complete (``elapsed_ms`` both through the
  ctypes call that keeps the GIL, as the waiter makes it, and cuda.bindings', which releases it);
- in a burst (``--in-burst``): the same pieces timed where they are read (``Lane._spans`` as it
  stands, timed), during ``burst_phases_probe.py --n 4`` (its own output is printed too).
  Percentiles over every job read.

Usage: ``python bench/span_cost_probe.py [--device cuda|host] [--in-burst]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from streamlane.runtime import get_device
from streamlane.sched import lane as lane_module
from streamlane.sched.timeline import Span


def per_call(fn: Callable[[int], object], n: int = 2000, reps: int = 5) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        for i in range(n):
            fn(i)
        times.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(times)


def warm(device: str) -> None:
    dev = get_device(device)
    s = dev.create_stream()
    ref = s.record(dev.create_event(timing=True))
    ref.synchronize()
    pairs = [(s.record(dev.create_event(timing=True)), s.record(dev.create_event(timing=True)))
             for _ in range(2000)]
    s.synchronize()
    for hold in (True, False):
        previous = dev.hold_gil(hold)
        one = per_call(lambda i: ref.elapsed_ms(pairs[i][0]))
        two = per_call(lambda i: (ref.elapsed_ms(pairs[i][0]), ref.elapsed_ms(pairs[i][1])))
        dev.hold_gil(previous)
        print(f"warm, hold_gil={hold}: ref.elapsed_ms(start) {one:.2f} us; "
              f"two per job {two:.2f} us")
    span = per_call(lambda i: Span(i, "forward", 0, "lane 0 stream 0x10", 0.1, 0.2))
    track = per_call(lambda i: f"lane {0} stream {0x7F00:#x}")
    print(f"warm: Span(...) {span:.2f} us, the track's f-string {track:.2f} us")


def in_burst(device: str) -> None:
    """``Lane._spans`` as it stands, with a timer around each piece."""
    parts: dict[str, list[float]] = defaultdict(list)
    clock = time.perf_counter

    def timed_spans(self: Any, unread: list[Any]) -> float:
        core = self._core
        ref = core.reference
        busy = 0.0
        for note in unread:
            job = note.job()
            a = clock()
            t0 = ref.elapsed_ms(note.start) / 1e3
            b = clock()
            t1 = ref.elapsed_ms(note.end) / 1e3
            c = clock()
            self._events.append(note.start)
            busy += t1 - t0
            if job is not None:
                job._span = (t0, t1)
                job._span_unread = False
            d = clock()
            span = Span(note.id, note.name, self.index, note.track, t0, t1)
            e = clock()
            core.record_span(span)
            for key, took in (("elapsed_ms(start)", b - a), ("elapsed_ms(end)", c - b),
                              ("bookkeeping", d - c), ("Span(...)", e - d)):
                parts[key].append(took * 1e6)
        return busy

    lane_module.Lane._spans = timed_spans  # type: ignore[method-assign]
    sys.path.insert(0, os.path.dirname(__file__))
    import burst_phases_probe

    burst_phases_probe.main(["--device", device, "--n", "4", "--bursts", "15"])
    for key, values in parts.items():
        values.sort()
        print(f"in a burst: {key} p50 {values[len(values) // 2]:.2f} "
              f"p90 {values[int(len(values) * 0.9)]:.2f} max {values[-1]:.1f} us "
              f"({len(values)} jobs)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--in-burst", action="store_true")
    args = parser.parse_args(argv)
    warm(args.device)
    if args.in_burst:
        in_burst(args.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The Python cost of Method.execute() alone, on a device whose primitives do nothing.

Runs anywhere (no GPU): what it measures is the runtime's own bookkeeping per call, the part a
GPU run cannot separate from driver calls. CPU figures; compare versions in the same run.

Usage: python bench/bench_overhead.py [--out F]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import Report

from streamlane.runtime import Program, Result
from streamlane.runtime.host import HostDevice


class NullDevice(HostDevice):
    """The host device with its enqueueing primitives turned into no-ops."""

    def _record(self, event: Any, stream_impl: Any) -> None:
        event.recorded = True

    def _launch(self, prepared: Any, stream_impl: Any, ins: Any, outs: Any) -> None:
        pass

    def _stream_wait(self, impl: Any, event: Any) -> None:
        pass

    def _copy_h2d(self, dst: Any, src: Any, stream_impl: Any) -> None:
        pass


def chain(device: Any, steps: int) -> Any:
    b = Program.build(f"chain{steps}")
    m = b.method("forward", x=("float32", [1024]))
    h = "x"
    for i in range(steps):
        h = m.step("scale", h, out="y" if i == steps - 1 else None, factor=1.0)
    m.output("y")
    return b.finish().method("forward", device=device)


def per_call_us(fn: Any, calls: int = 5000, repeats: int = 21) -> tuple[float, float]:
    """(min, median) per call over ``repeats`` batches: on a shared VM the minimum is the
    steadier figure for pure CPU work."""
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return min(samples), statistics.median(samples)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = NullDevice()
    rep = Report("overhead", dev, quick=False)
    x = Result.from_host(np.ones(1024, np.float32), dev)
    rows = []
    for steps in (1, 8):
        m = chain(dev, steps)
        m.set_inputs([x])
        m.execute()
        e_min, e_med = per_call_us(m.execute)
        c_min, c_med = per_call_us(lambda m=m: m([x]))
        rows.append({"steps": steps, "execute_min_us": e_min, "execute_median_us": e_med,
                     "call_min_us": c_min, "call_median_us": c_med})
    rep.section("Python cost per call (null device)", rows,
                "no driver work: the runtime's bookkeeping only")
    rep.write(args.out)


if __name__ == "__main__":
    main()

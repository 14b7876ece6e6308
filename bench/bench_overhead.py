"""The Python cost of Method.execute() and of the scheduler, on a device whose primitives do
nothing (events complete at once).

Runs anywhere (no GPU): what it measures is streamlane's own bookkeeping per call and the
scheduler's thread hand-offs, the part a GPU run cannot separate from driver calls. CPU
figures; compare versions in the same run.

Usage: python bench/bench_overhead.py [--out F]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import RESULTS, Report

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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(RESULTS / "overhead-cpu.json"),
                    help="the JSON to write (default: %(default)s, the file kept in git; the "
                         "null device reports its kind as host, whose files git ignores)")
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
    backends = [b for b in BACKENDS if importlib.util.find_spec(b if b != "asyncio" else "anyio")]
    for b in BACKENDS:
        if b not in backends:
            rep.absent(f"the {b} event loop", f"{b} is not installed (pip install {b})")
    rep.section("scheduler on the null device", [sched_row(dev, b) for b in backends],
                "await latency of sched.run (1 lane, sequential) and throughput (4 lanes, 500 "
                "tasks x 10 runs): thread hand-offs and Python only")
    rep.write(args.out)


BACKENDS = ("asyncio", "uvloop", "trio")


def sched_row(dev: Any, backend: str) -> dict[str, Any]:
    import anyio

    from streamlane.sched import Scheduler

    x = Result.from_host(np.ones(1024, np.float32), dev)

    async def main() -> dict[str, Any]:
        m = chain(dev, 1)
        async with Scheduler(dev, lanes=1, timing=False) as sched:
            for _ in range(200):
                await sched.run(m, [x])
            lat = []
            for _ in range(2000):
                t = time.perf_counter()
                await sched.run(m, [x])
                lat.append(time.perf_counter() - t)
        lat.sort()
        methods = [chain(dev, 1) for _ in range(4)]
        async with Scheduler(dev, lanes=4, timing=False) as sched:
            async def worker(i: int) -> None:
                for _ in range(10):
                    await sched.run(methods[i % 4], [x])

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(500):
                    tg.start_soon(worker, i)
            wall = time.perf_counter() - t
        return {"loop": backend, "p50_us": lat[len(lat) // 2] * 1e6, "min_us": lat[0] * 1e6,
                "p99_us": lat[int(len(lat) * 0.99)] * 1e6, "programs_per_s": 5000 / wall}

    if backend == "uvloop":
        return anyio.run(main, backend="asyncio", backend_options={"use_uvloop": True})
    return anyio.run(main, backend=backend)


if __name__ == "__main__":
    main()

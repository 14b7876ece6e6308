"""Probe: a burst of N caller-stream jobs, the loop enqueuing the lone first one vs the lane
thread enqueuing all of them (``Scheduler(inline=False)``), in one run.

``bench_sched.py`` (b) gives the speedups; this shows where a burst's time goes: the wall time
of submitting N 2-ms spin programs (one per caller stream) and awaiting them, how long the N
submits took on the loop, and each job's device start after the first one's (timing events).
Median of 7 bursts per configuration.

Usage: ``python bench/burst_probe.py [--device cuda]``; prints one line per configuration.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_sched import spin_program

from streamlane.runtime import Result, get_device
from streamlane.sched import Scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    dev = get_device(args.device)
    counts = (2, 4, 8)
    program = spin_program(2000)
    methods = [program.method("forward", device=dev) for _ in range(max(counts))]
    x = Result.from_host(np.ones(1, np.float32), dev)
    x.to_host()
    streams = [dev.create_stream() for _ in range(max(counts))]

    async def bursts(n: int, inline: bool, reps: int = 7) -> tuple[float, float, Any]:
        starts, walls, submits = [], [], []
        async with Scheduler(dev, lanes=1, timing=True, inline=inline) as sched:
            await sched.run(methods[0], [x])
            for _ in range(reps):
                sched.clear_timeline()
                t = time.perf_counter()
                jobs = [await sched.submit(methods[i], [x], stream=streams[i]) for i in range(n)]
                submits.append((time.perf_counter() - t) * 1e6)
                for job in jobs:
                    await job
                walls.append(time.perf_counter() - t)
                device = sorted(span.start_s for span in sched.timeline().spans)
                starts.append([round((s - device[0]) * 1e6) for s in device])
        return statistics.median(walls) * 1e3, statistics.median(submits), starts[reps // 2]

    for n in counts:
        for name, inline in (("the loop enqueues the lone first job", True),
                             ("inline=False", False)):
            wall, submit, starts = anyio.run(bursts, n, inline)
            print(f"N={n} {name:37s} wall {wall:.2f} ms, submits {submit:.0f} us, device "
                  f"starts (us after the first) {starts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe: which event records stall a GPU hardware queue behind a running kernel.

The GPU feeds streams through ``CUDA_DEVICE_MAX_CONNECTIONS`` hardware queues (8 by default);
with more streams than queues, streams share them. A command that must wait for the kernel
before it, at the head of a shared queue, holds up every stream behind it. This probe runs N
single-block 2-ms spins, one per stream, each followed by one kind of event record, in raw
cuda-python, and then the scheduler on N caller streams with and without timing events.

Usage: ``python bench/queue_probe.py`` (run it again with ``CUDA_DEVICE_MAX_CONNECTIONS=32``
to compare); prints one line per case: the speedup over running the N spins on one stream.
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
from _raw_cuda import RawCuda
from bench_sched import spin_program

from streamlane.runtime import Result, get_device
from streamlane.sched import Scheduler

SPIN_US, REPS, COUNTS = 2000, 3, (8, 16, 32, 128)

# What each stream gets around its spin: (a timing event before it?, a timing event after it?
# else a plain one, created with CU_EVENT_DISABLE_TIMING).
CASES = {
    "spin, plain event after": (False, False),
    "spin, timing event after": (False, True),
    "timing event before, spin, plain event after": (True, False),
    "timing events before and after (the scheduler's timed job)": (True, True),
}


def raw_case(raw: RawCuda, streams: list[Any], n: int, before: bool, timing_after: bool) -> float:
    starts = [raw.event(timing=True) for _ in range(n)]
    ends = [raw.event(timing=timing_after) for _ in range(n)]
    walls = []
    for _ in range(REPS):
        t = time.perf_counter()
        for i in range(n):
            if before:
                raw.record(starts[i], streams[i])
            raw.spin(streams[i], SPIN_US)
            raw.record(ends[i], streams[i])
        for event in ends:
            raw.sync(event)
        walls.append(time.perf_counter() - t)
    return statistics.median(walls)


def main() -> int:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help
    dev = get_device("cuda")
    raw = RawCuda()
    streams = [raw.stream() for _ in range(max(COUNTS))]
    print(f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS')}")
    raw_case(raw, streams, 2, True, True)  # warm
    for n in COUNTS:
        serial = raw_case(raw, streams[:1] * n, n, False, False)
        for name, (before, timing_after) in CASES.items():
            wall = raw_case(raw, streams, n, before, timing_after)
            print(f"N={n:<4} raw: {name:<60} {serial / wall:6.2f}x")

    methods = [spin_program(SPIN_US).method("forward", device=dev) for _ in range(max(COUNTS))]
    x = Result.from_host(np.ones(1, np.float32), dev)
    x.to_host()
    ours = [dev.create_stream() for _ in range(max(COUNTS))]

    async def scheduled(n: int, timing: bool, on_streams: bool) -> float:
        async with Scheduler(dev, lanes=1, timing=timing) as sched:
            await sched.run(methods[0], [x])
            walls = []
            for _ in range(REPS):
                t = time.perf_counter()
                jobs = [await sched.submit(methods[i], [x],
                                           stream=ours[i] if on_streams else None)
                        for i in range(n)]
                for job in jobs:
                    await job
                walls.append(time.perf_counter() - t)
            return statistics.median(walls)

    for n in COUNTS:
        for timing in (True, False):
            one = anyio.run(scheduled, n, timing, False)
            wall = anyio.run(scheduled, n, timing, True)
            print(f"N={n:<4} scheduler, caller streams, timing={timing!s:<5}"
                  f"{'':<32} {one / wall:6.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())

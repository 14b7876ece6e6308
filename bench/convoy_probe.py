"""Probe: what the GIL release inside every driver call costs the scheduler.

cuda.bindings releases the GIL around each driver call, and a lane thread makes several per job;
each release lets the loop or a waiter thread take the GIL, and the lane then waits to get it
back. This runs the null device (no-op primitives) with primitives that keep the GIL, that
release it around a syscall (``os.stat``, like a driver call), and that release it and yield the
CPU (``time.sleep(0)``), under the throughput pattern of bench_sched (c), with the default and a
short GIL switch interval. CPU figures: compare rows of one run only.

Usage: python bench/convoy_probe.py [--out F]
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
from _common import Report
from bench_overhead import NullDevice, chain

from streamlane.runtime import Result
from streamlane.sched import Scheduler


class SyscallNull(NullDevice):
    """Each primitive releases the GIL around a syscall, as a driver call does."""

    def _launch(self, prepared: Any, stream_impl: Any, ins: Any, outs: Any) -> None:
        os.stat(".")

    def _record(self, event: Any, stream_impl: Any) -> None:
        os.stat(".")
        event.recorded = True

    def _stream_wait(self, impl: Any, event: Any) -> None:
        os.stat(".")


class YieldingNull(NullDevice):
    """Each primitive releases the GIL and yields the CPU."""

    def _launch(self, prepared: Any, stream_impl: Any, ins: Any, outs: Any) -> None:
        time.sleep(0)

    def _record(self, event: Any, stream_impl: Any) -> None:
        time.sleep(0)
        event.recorded = True

    def _stream_wait(self, impl: Any, event: Any) -> None:
        time.sleep(0)


async def throughput(dev: Any, lanes: int, tasks: int = 500, per: int = 10) -> float:
    methods = [chain(dev, 1) for _ in range(lanes)]
    x = Result.from_host(np.ones(1024, np.float32), dev)
    async with Scheduler(dev, lanes=lanes, timing=False) as sched:
        async def worker(i: int) -> None:
            for _ in range(per):
                await sched.run(methods[i % lanes], [x])

        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(tasks):
                tg.start_soon(worker, i)
        return tasks * per / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rep = Report("convoy", NullDevice(), quick=False)
    rows = []
    for interval in (0.005, 0.0002):
        sys.setswitchinterval(interval)
        for cls, label in ((NullDevice, "keep the GIL"), (SyscallNull, "release (syscall)"),
                           (YieldingNull, "release + yield")):
            dev = cls()
            row: dict[str, Any] = {"primitives": label, "switch_interval_ms": interval * 1e3}
            for lanes in (1, 4):
                row[f"programs_per_s_{lanes}_lane"] = statistics.median(
                    anyio.run(throughput, dev, lanes) for _ in range(3))
            rows.append(row)
    sys.setswitchinterval(0.005)
    rep.section("scheduler throughput on the null device, by what its primitives do with the GIL",
                rows, "500 tasks x 10 runs of a 1-step method; median of 3")
    rep.write(args.out)


if __name__ == "__main__":
    main()

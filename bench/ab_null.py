"""A/B of scheduler versions on the null device (no driver work): CPU time per lone ``run()``
and per ``submit()`` then ``await`` through a caller stream, two versions interleaved in one
process, order alternating each round. It prices the scheduler's Python alone, which the H200
A/B (``ab_sched.py``) cannot separate from a machine's spread.

    git archive 75a783d sched | (mkdir -p /tmp/s75 && tar -x -C /tmp/s75 --strip-components=1)
    python bench/ab_null.py --version base=/tmp/s75 --backend trio

Prints, per version and path, the median and the minimum over the rounds (µs of CPU per job).
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
from ab_sched import load
from bench_overhead import NullDevice
from bench_sched import tiny_program

import streamlane.sched
from streamlane.runtime import Result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", required=True, metavar="LABEL=PATH",
                        help="a sched/ tree to compare with the working tree's")
    parser.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--jobs", type=int, default=3000, help="jobs per measurement")
    args = parser.parse_args(argv)
    label, _, path = args.version.partition("=")
    versions: dict[str, Any] = {label: load(label, path), "work": streamlane.sched.Scheduler}
    dev = NullDevice()
    method = tiny_program(256).method("forward", device=dev)
    x = Result.from_host(np.ones(256, np.float32), dev)
    x.to_host()
    stream = dev.create_stream()

    async def cpu_per_job(scheduler: Any, via_submit: bool) -> float:
        async with scheduler(dev, lanes=1, timing=False) as sched:
            for _ in range(300):
                await sched.run(method, [x], stream=stream)
            t = time.process_time()
            for _ in range(args.jobs):
                if via_submit:
                    await (await sched.submit(method, [x], stream=stream))
                else:
                    await sched.run(method, [x], stream=stream)
            return (time.process_time() - t) / args.jobs * 1e6

    async def rounds() -> dict[tuple[str, str], list[float]]:
        res: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            order = list(versions) if r % 2 else list(reversed(versions))
            for path_name, via_submit in (("run", False), ("submit, await", True)):
                for name in order:
                    res.setdefault((name, path_name), []).append(
                        await cpu_per_job(versions[name], via_submit))
        return res

    res = anyio.run(rounds, backend=args.backend)
    for (name, path_name), values in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        print(f"{args.backend:8} {path_name:14} {name:6} median {statistics.median(values):6.2f} "
              f"min {min(values):6.2f} us CPU per job")
    return 0


if __name__ == "__main__":
    sys.exit(main())

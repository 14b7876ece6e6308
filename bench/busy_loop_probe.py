"""Probe: how fast a lane thread enqueues while one task submits to it without ever letting the
event loop idle (``await sched.submit(...)`` then ``await anyio.sleep(0)``, in a loop).

Every driver call gives up the GIL (cuda.bindings); a lane thread then waits for it while the
loop thread, never blocked in its selector, keeps it between its own short releases. The
bounded queue (``queue_size``, default 1024) is what lets the lane in: a full lane makes
``submit`` wait, the loop idles, the lane runs. This probe runs the pattern for ``--seconds``
with a queue the feeder fills (the default) and one it never fills, and reports jobs
submitted, jobs the lane enqueued, and jobs completed, beside a feeder that awaits each job.

Usage: ``python bench/busy_loop_probe.py [--device cuda] [--seconds 1] [--out F]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import Report
from bench_sched import tiny_program

from streamlane.runtime import get_device
from streamlane.sched import Scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--out", default=None, help="the JSON to write (default: "
                        "bench/results/busy-loop-probe-<device kind>.json)")
    args = parser.parse_args(argv)
    dev = get_device(None if args.device == "auto" else args.device)
    method = tiny_program(256).method("forward", device=dev)
    x = np.ones(256, np.float32)
    stream = dev.create_stream()

    async def feed(queue_size: int, awaiting: bool) -> dict[str, Any]:
        async with Scheduler(dev, lanes=1, queue_size=queue_size, timing=False) as sched:
            await sched.run(method, [x], stream=stream)  # warm
            submitted = 0
            start = time.perf_counter()
            while time.perf_counter() - start < args.seconds:
                job = await sched.submit(method, [x], stream=stream)
                submitted += 1
                if awaiting:
                    await job
                else:
                    await anyio.sleep(0)
            elapsed = time.perf_counter() - start
            (stats,) = sched.statistics()
            enqueued = submitted - stats.queued  # in flight or completed: on the device
            completed = stats.completed - 1  # not the warm-up job
            row = {"queue_size": queue_size, "feeder": "awaits each job" if awaiting
                   else "submit, sleep(0)", "seconds": round(elapsed, 3),
                   "submitted": submitted, "enqueued": enqueued, "completed": completed,
                   "enqueued_per_s": round(enqueued / elapsed)}
            drain = time.perf_counter()
        row["drain_s"] = round(time.perf_counter() - drain, 3)  # leaving waits for the rest
        return row

    async def all_rows() -> list[dict[str, Any]]:
        return [await feed(1024, False), await feed(1_000_000, False),
                await feed(1024, True)]

    rep = Report("busy-loop-probe", dev, quick=False)
    rep.section("a lane fed by a loop that never idles", anyio.run(all_rows),
                "enqueued = submitted - still queued at the end of the feeding")
    rep.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

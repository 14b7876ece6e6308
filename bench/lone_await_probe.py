"""Probe: the await latency distribution of a lone caller-stream job (DESIGN.md "Measuring").

The path ``bench_sched.py`` (a) calls "caller stream": nothing else pending, inputs on the
device, so the loop thread enqueues the job and ``await`` polls its event (``poll_us``). This
probe looks at its tail, which (a) summarizes in one p99: every percentile up to 99.9, how many
awaits took over 3x the median and how far apart they came (a periodic stall shows as regular
gaps), with the cyclic GC on and off, and which thread settled each job (the loop's poll or a
lane's waiter).

Usage: ``python bench/lone_await_probe.py [--device cuda] [--awaits 4000]``; prints one line per
configuration.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_sched import tiny_program

import streamlane.sched.lane as lane_module
from streamlane.runtime import Result, get_device
from streamlane.sched import Scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--awaits", type=int, default=4000)
    args = parser.parse_args(argv)
    dev = get_device(args.device)
    method = tiny_program(256).method("forward", device=dev)
    x = Result.from_host(np.ones(256, np.float32), dev)
    x.to_host()
    stream = dev.create_stream()
    settled = {"loop": 0, "waiter": 0}
    real_settle = lane_module.Lane._settle

    def settle(self: Any, batch: list[Any], error: Any) -> Any:
        # Lane._settle runs on a lane's waiter (or lane) thread only: what it claims was not
        # settled by the loop's poll (the rest of the awaits were).
        settled["waiter"] += sum(1 for job in batch if not job._claimed)
        return real_settle(self, batch, error)

    lane_module.Lane._settle = settle  # type: ignore[method-assign]

    async def awaits(poll_us: float) -> list[int]:
        async with Scheduler(dev, lanes=1, timing=False, poll_us=poll_us) as sched:
            ns = []
            for i in range(args.awaits + 200):
                t = time.perf_counter_ns()
                await sched.run(method, [x], stream=stream)
                if i >= 200:
                    ns.append(time.perf_counter_ns() - t)
            return ns

    for poll_us in (50.0, 200.0):
        for collect in (True, False):
            settled.update(loop=0, waiter=0)
            if not collect:
                gc.disable()
            try:
                us = np.asarray(anyio.run(awaits, poll_us)) / 1e3
            finally:
                gc.enable()
            settled["loop"] = args.awaits + 200 - settled["waiter"]
            slow = np.nonzero(us > 3 * np.median(us))[0]
            gaps = np.diff(slow)[:15].tolist() if len(slow) > 1 else []
            print(f"poll {poll_us:g} us, gc {'on' if collect else 'off'}: p50/90/99/99.9 "
                  f"{np.percentile(us, [50, 90, 99, 99.9]).round(1).tolist()} us; "
                  f"over 3x the median: {len(slow)}, gaps {gaps}; settled by {settled}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe: what the event loop's sleeping costs the overlap and latency goals (issue 5).

The sixth and twelfth sessions' NOTES put most of the N = 8 burst's loss against raw streams at
its two ends, both wake-ups: the loop wakes from its selector after the spins (~66 µs on these
hosts), and the next burst's first submit runs on a core that slept (75-166 µs for a ~35 µs
submit). Raw cuda-python never sleeps: one thread launches, then spins in cuEventSynchronize.

Hypothesis: a loop that never sleeps while jobs are pending recovers both ends. Test: the same
caller-stream bursts with and without a *keep-awake task* beside them (a task that only yields,
``anyio.lowlevel.checkpoint()`` in a loop, so the loop's selector is always asked with a zero
timeout), interleaved rounds in one process, raw cuda-python streams in the same run. If the
hypothesis holds, N = 8 moves from ~0.8 of raw to within 10% of it, and the lone await loses
the wake-up share of its p50. Nothing in the library changes; the keep-awake task is the
probe's. The price is a busy core while it runs, as raw's spinning wait costs one.

A third configuration, *polled*, has the awaiting task itself query each job
(``while not job.done(): await checkpoint()``, which settles a job the device has finished on
the loop) before its ``await``: completion with no thread hop at all, the loop busy. A fourth,
*runtime on the loop, polled*, uses no scheduler: the loop thread calls each method under its
caller stream and polls its event, the bound for any design that launches and settles there.

Usage: ``python bench/awake_probe.py [--device cuda] [--rounds 5]``; prints a table per part
and writes JSON (``--out``).
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
from bench_sched import spin_program, tiny_program

from streamlane.runtime import CallerStream, Result, get_device
from streamlane.sched import Scheduler


async def _with_keep_awake(awake: bool, body: Any, *args: Any) -> Any:
    if not awake:
        return await body(*args)
    stop = False
    spins = 0

    async def keep_awake() -> None:
        nonlocal spins
        while not stop:
            await anyio.lowlevel.checkpoint()
            spins += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(keep_awake)
        try:
            return await body(*args)
        finally:
            stop = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--counts", default="1,2,4,8,16")
    parser.add_argument("--awaits", type=int, default=2000)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    dev = get_device(args.device)
    counts = [int(c) for c in args.counts.split(",")]
    spin_us, reps = 2000, 3
    methods = [spin_program(spin_us).method("forward", device=dev) for _ in range(max(counts))]
    x = Result.from_host(np.ones(1, np.float32), dev)
    x.to_host()
    streams = [dev.create_stream() for _ in range(max(counts))]
    raw = None
    if dev.kind == "cuda":
        from _raw_cuda import RawCuda
        raw = RawCuda(dev.index)
        raw_streams = [raw.stream() for _ in range(max(counts))]
        raw_events = [raw.event() for _ in range(max(counts))]

    async def burst(n: int, on_streams: bool, timing: bool, polled: bool = False) -> float:
        async with Scheduler(dev, lanes=1, timing=timing) as sched:
            await sched.run(methods[0], [x])  # warm
            walls = []
            for _ in range(reps):
                t = time.perf_counter()
                jobs = [await sched.submit(methods[i], [x],
                                           stream=streams[i] if on_streams else None)
                        for i in range(n)]
                for job in jobs:
                    while polled and not job.done():  # the loop queries, settles, yields
                        await anyio.lowlevel.checkpoint()
                    await job
                walls.append(time.perf_counter() - t)
            return statistics.median(walls)

    events = [dev.create_event() for _ in range(max(counts))]

    async def bound(n: int) -> float:
        """No scheduler: the loop thread calls the runtime under a caller stream per job and
        polls each job's event, yielding between queries. No thread hop, no wake-up: the best
        any design that launches and settles on the loop could do."""
        walls = []
        for _ in range(reps + 1):
            t = time.perf_counter()
            for i in range(n):
                with CallerStream(streams[i]):
                    methods[i]([x])
                streams[i].record(events[i])
            for i in range(n):
                while not events[i].query():
                    await anyio.lowlevel.checkpoint()
            walls.append(time.perf_counter() - t)
        return statistics.median(walls[1:])

    def raw_wall(n: int, parallel: bool) -> float:
        return raw.spin_walls(raw_streams, raw_events, n, parallel, spin_us, reps)

    rep = Report("awake-probe", dev, quick=False)
    samples: dict[tuple[int, str], list[float]] = {}
    for _ in range(args.rounds):
        for n in counts:
            for timing in (True, False):
                for awake in (False, True):
                    key = "timed" if timing else "untimed"
                    key += ", awake" if awake else ""
                    samples.setdefault((n, "one lane " + key), []).append(
                        anyio.run(_with_keep_awake, awake, burst, n, False, timing))
                    samples.setdefault((n, "streams " + key), []).append(
                        anyio.run(_with_keep_awake, awake, burst, n, True, timing))
                key = "timed" if timing else "untimed"
                samples.setdefault((n, f"streams {key}, polled"), []).append(
                    anyio.run(burst, n, True, timing, True))
            samples.setdefault((n, "runtime on the loop, polled"), []).append(
                anyio.run(bound, n))
            if raw is not None:
                samples.setdefault((n, "raw serial"), []).append(raw_wall(n, False))
                samples.setdefault((n, "raw streams"), []).append(raw_wall(n, True))
    rows = []
    for n in counts:
        med = {k: statistics.median(v) for (m, k), v in samples.items() if m == n}
        raw_speedup = med["raw serial"] / med["raw streams"] if raw is not None else None
        if raw is not None:
            rows.append({"N": n, "config": "raw streams", "ms": med["raw streams"] * 1e3,
                         "speedup": raw_speedup, "vs_raw": 1.0})
        speedup = med["one lane untimed"] / med["runtime on the loop, polled"]
        rows.append({"N": n, "config": "runtime on the loop, polled",
                     "ms": med["runtime on the loop, polled"] * 1e3, "speedup": speedup,
                     "vs_raw": speedup / raw_speedup if raw_speedup else None})
        for key in ("timed", "timed, awake", "timed, polled", "untimed", "untimed, awake",
                    "untimed, polled"):
            # the denominator is always the plain one lane (as bench_sched's), so an awake
            # loop's gain on the serial baseline cannot inflate its speedup
            plain = "timed" if key.startswith("timed") else "untimed"
            speedup = med["one lane " + plain] / med["streams " + key]
            rows.append({"N": n, "config": "streams " + key, "ms": med["streams " + key] * 1e3,
                         # (no one-lane run "polled": None, which JSON can hold; NaN not)
                         "one_lane_ms": (med["one lane " + key] * 1e3
                                         if "one lane " + key in med else None),
                         "speedup": speedup,
                         "vs_raw": speedup / raw_speedup if raw_speedup else None})
    rep.section(f"overlap of N single-block {spin_us}-us spins on caller streams, with and "
                f"without a keep-awake task (medians of {args.rounds} interleaved rounds of "
                f"{reps})", rows,
                "speedup over the plain one lane (timed or untimed as the row); raw: a spin and "
                "an event per stream, one thread spinning in cuEventSynchronize")

    tiny = tiny_program(256).method("forward", device=dev)
    xt = Result.from_host(np.ones(256, np.float32), dev)
    xt.to_host()
    stream = dev.create_stream()

    async def lone(timing: bool) -> list[int]:
        async with Scheduler(dev, lanes=1, timing=timing) as sched:
            ns = []
            for i in range(args.awaits + 200):
                t = time.perf_counter_ns()
                await sched.run(tiny, [xt], stream=stream)
                if i >= 200:
                    ns.append(time.perf_counter_ns() - t)
            return ns

    lat: dict[str, list[float]] = {}
    for _ in range(args.rounds):
        for backend in ("asyncio", "trio"):
            for timing in (False, True):
                for awake in (False, True):
                    key = (f"{backend}, {'timed' if timing else 'untimed'}"
                           + (", awake" if awake else ""))
                    us = np.asarray(anyio.run(_with_keep_awake, awake, lone, timing,
                                              backend=backend)) / 1e3
                    lat.setdefault(key, []).append(float(np.median(us)))
    rows = [{"config": k, "p50_us": statistics.median(v), "rounds": [round(u, 1) for u in v]}
            for k, v in lat.items()]
    rep.section(f"lone caller-stream await of a 1-kernel program, p50 of {args.awaits} "
                f"(median over {args.rounds} rounds)", rows, "")
    rep.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

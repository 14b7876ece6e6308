"""Probe: where the wall time of a burst of caller-stream jobs goes, on the host clock.

A burst is N 2-ms single-block spins submitted back to back from one task, one caller stream
each, then awaited in order (``bench_sched.py`` (b)). Against raw streams the burst loses
~0.5 ms at N = 8; this splits that into phases, from host timestamps taken around the lane's
(or the loop's) enqueue of each job and the loop's settling of each job, relative to the first
submit:

- ``first enqueued``: when the first job's enqueue returned (its spin starts then, ~µs later);
- ``last enqueued``: the same for the last job (the dispatch spread is the difference);
- ``settled``: when the loop settled each job, minus when its spin ended (enqueue + 2 ms): the
  completion path's lag per job;
- ``wall``: the burst's wall time, against 2 ms + the last enqueue (no lag at all).

``--split`` divides each job's lag into its hops: ``seen`` (the waiter's wait returned, minus
enqueue + 2 ms: the device and the driver), ``posted`` (the waiter's report posted to the loop,
after the spans are read) and ``ran`` (the loop ran it: its wake-up). A job the loop settles
itself (its poll, or a later submit's query) has no waiter hops and counts only in ``lag``.

Medians of 15 bursts. Usage:
``python bench/burst_phases_probe.py [--device cuda] [--n 8] [--split]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_sched import spin_program

from streamlane.runtime import Result, get_device
from streamlane.sched import Scheduler
from streamlane.sched import lane as lane_module
from streamlane.sched import scheduler as scheduler_module

SPIN_US = 2000


def wake_latencies(idle_s: float = 0.002, reps: int = 200) -> str:
    """The host's cost of waking a sleeping thread after ``idle_s`` of idleness, the shape of a
    burst's hand-overs, without streamlane: a thread blocked in ``threading.Event.wait``, and an
    asyncio loop asleep in its selector woken by ``call_soon_threadsafe``. Medians, µs."""
    import asyncio
    import threading

    go, ack, woke = threading.Event(), threading.Event(), []

    def sleeper() -> None:
        for _ in range(reps):
            go.wait()
            woke.append(time.perf_counter())
            go.clear()
            ack.set()

    thread = threading.Thread(target=sleeper)
    thread.start()
    sets = []
    for _ in range(reps):
        time.sleep(idle_s)
        sets.append(time.perf_counter())
        go.set()
        ack.wait()  # without holding the GIL, which the woken thread needs
        ack.clear()
    thread.join()
    event_us = statistics.median((w - s) * 1e6 for s, w in zip(sets, woke, strict=True))

    async def loop_side() -> float:
        loop = asyncio.get_running_loop()
        lags: list[float] = []
        done = asyncio.Event()

        def arrived(posted: float) -> None:
            lags.append(time.perf_counter() - posted)
            if len(lags) == reps:
                done.set()

        def poster() -> None:
            for _ in range(reps):
                time.sleep(idle_s)
                loop.call_soon_threadsafe(arrived, time.perf_counter())

        thread = threading.Thread(target=poster)
        thread.start()
        await done.wait()  # the loop sleeps in its selector between posts
        thread.join()
        return statistics.median(lags) * 1e6

    loop_us = asyncio.run(loop_side())
    return (f"host wake-ups after {idle_s * 1e3:.0f} ms idle (no streamlane): a thread in "
            f"threading.Event.wait {event_us:.0f} us, an asyncio loop through "
            f"call_soon_threadsafe {loop_us:.0f} us (medians of {reps})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=15)
    parser.add_argument("--split", action="store_true",
                        help="split each job's lag into the waiter's hops (see above)")
    args = parser.parse_args(argv)
    dev = get_device(args.device)
    n = args.n
    methods = [spin_program(SPIN_US).method("forward", device=dev) for _ in range(n)]
    x = Result.from_host(np.ones(1, np.float32), dev)
    x.to_host()
    streams = [dev.create_stream() for _ in range(n)]

    enqueued: dict[int, float] = {}
    settled: dict[int, float] = {}
    seen: dict[int, float] = {}  # --split: the waiter's wait returned
    posted: dict[int, float] = {}  # --split: the waiter posted the report
    execute = lane_module.Lane._execute
    finish = scheduler_module.Scheduler.finish
    wait = lane_module.Lane._wait
    settle = lane_module.Lane._settle

    def timed_execute(self: Any, job: Any, lane_stream: Any, on_loop: bool = False) -> bool:
        ok = execute(self, job, lane_stream, on_loop)
        enqueued[job.id] = time.perf_counter()
        return ok

    def timed_finish(self: Any, job: Any, state: str, error: Any) -> None:
        settled.setdefault(job.id, time.perf_counter())
        finish(self, job, state, error)

    def timed_wait(self: Any, job: Any) -> None:
        wait(self, job)
        seen[job.id] = time.perf_counter()

    def timed_settle(self: Any, batch: list[Any], error: Any) -> Any:
        report = settle(self, batch, error)  # reads the spans; the waiter posts it right after
        if report is not None and threading.get_ident() != loop_thread[0]:
            now = time.perf_counter()
            for job in batch:
                posted[job.id] = now
        return report

    lane_module.Lane._execute = timed_execute  # type: ignore[method-assign]
    scheduler_module.Scheduler.finish = timed_finish  # type: ignore[method-assign]
    loop_thread = [0]
    if args.split:
        lane_module.Lane._wait = timed_wait  # type: ignore[method-assign]
        lane_module.Lane._settle = timed_settle  # type: ignore[method-assign]

    async def bursts(inline: bool, timing: bool) -> dict[str, float]:
        rows: list[dict[str, float]] = []
        loop_thread[0] = threading.get_ident()
        async with Scheduler(dev, lanes=1, timing=timing, inline=inline) as sched:
            await sched.run(methods[0], [x])
            for _ in range(args.bursts):
                for stamps in (enqueued, settled, seen, posted):
                    stamps.clear()
                t0 = time.perf_counter()
                jobs = [await sched.submit(methods[i], [x], stream=streams[i])
                        for i in range(n)]
                submitted = time.perf_counter()
                for job in jobs:
                    await job
                wall = time.perf_counter() - t0
                ids = [job.id for job in jobs]
                enq = [(enqueued[i] - t0) * 1e6 for i in ids]
                lag = [(settled[i] - t0) * 1e6 - (e + SPIN_US) for i, e in zip(ids, enq,
                                                                               strict=True)]
                row = {"submits": (submitted - t0) * 1e6, "first enqueued": enq[0],
                       "last enqueued": enq[-1], "lag first": lag[0],
                       "lag median": statistics.median(lag), "lag last": lag[-1],
                       "wall": wall * 1e6,
                       "wall - (last enqueued + spin)": wall * 1e6 - enq[-1] - SPIN_US}
                if args.split:
                    hops = [(i, e) for i, e in zip(ids, enq, strict=True)
                            if i in seen and i in posted]
                    row["by waiter"] = len(hops)
                    if hops:
                        row["seen"] = statistics.median(
                            (seen[i] - t0) * 1e6 - e - SPIN_US for i, e in hops)
                        row["posted"] = statistics.median((posted[i] - seen[i]) * 1e6
                                                          for i, _ in hops)
                        row["ran"] = statistics.median((settled[i] - posted[i]) * 1e6
                                                       for i, _ in hops)
                rows.append(row)
        keys = dict.fromkeys(k for r in rows for k in r)  # a burst the loop settled alone
        return {k: statistics.median(r[k] for r in rows if k in r) for k in keys}  # lacks hops

    print(wake_latencies())
    print(f"N={n} caller streams, {SPIN_US} us spins, medians of {args.bursts} bursts, "
          f"host microseconds after the first submit")
    for inline in (True, False):
        for timing in (True, False):
            result = anyio.run(bursts, inline, timing)
            cells = ", ".join(f"{k} {v:.0f}" for k, v in result.items())
            print(f"inline={inline!s:<5} timing={timing!s:<5} {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Benchmark of the async scheduler against its peers, in one run (DESIGN.md "Measuring").

(a) await latency of a 1-kernel program: the scheduler from asyncio / uvloop / trio, vs the floor
    (raw cuda-python launch + cuEventSynchronize, no asyncio), vs the runtime called directly,
    vs a torch op + asyncio.to_thread(event.synchronize);
(b) overlap of N independent single-block spin programs (~2 ms each), N = 1, 2, 4, ..., 128: one
    lane (serial) vs N caller streams vs N lanes, beside raw cuda-python streams;
(c) throughput: 1,000 concurrent tasks awaiting tiny programs on 4 lanes;
(d) the cost of a cross-lane after=: a two-job chain on two lanes vs on one lane.

Usage: ``python bench/bench_sched.py [--device auto|host|cuda] [--quick]
[--only latency,overlap] [--out F]``
(sections: latency, overlap, throughput, after). It prints a table per section and writes every
figure, with the date, commit and device, to ``bench/results/sched-<kind>.json``. GPU figures
are absolute; host-device figures are only meaningful as ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import Report

from streamlane.runtime import Program, Result, get_device
from streamlane.sched import Scheduler

BACKENDS = {"asyncio": ("asyncio", {}), "uvloop": ("asyncio", {"use_uvloop": True}),
            "trio": ("trio", {})}


# -- helpers -----------------------------------------------------------------------------------
def tiny_program(n: int = 256) -> Program:
    b = Program.build("tiny")
    m = b.method("forward", x=("float32", [n]))
    m.output(m.step("scale", "x", out="y", factor=2.0))
    return b.finish()


def spin_program(us: int, n: int = 1) -> Program:
    """A single-block spin program: one kernel, no outputs (the job's event marks its end).

    Until 2026-11-29's sixth session it also copied ``x`` to an output after the spin. That
    second kernel waits for the spin, and a kernel waiting at the head of one of the GPU's 8
    hardware queues (``CUDA_DEVICE_MAX_CONNECTIONS``) holds up every stream mapped behind it:
    overlap stopped near 8x from N = 16 on, for raw streams running the same two kernels too
    (``raw_spin_then_kernel_speedup``, bench/NOTES.md)."""
    b = Program.build("spin")
    m = b.method("forward", x=("float32", [n]))
    m.step("spin", us=us)
    return b.finish()


def summary(ns: list[int]) -> dict[str, float]:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {"p50_us": float(np.percentile(us, 50)), "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()), "n": len(ns)}


def backends_available() -> list[str]:
    names = ["asyncio"]
    if importlib.util.find_spec("uvloop"):
        names.append("uvloop")
    if importlib.util.find_spec("trio"):
        names.append("trio")
    return names


def run_on(backend: str, fn: Any, *args: Any) -> Any:
    name, options = BACKENDS[backend]
    return anyio.run(fn, *args, backend=name, backend_options=options)


# -- (a) latency -------------------------------------------------------------------------------
def bench_latency(dev: Any, raw: Any, rep: Report, q: bool) -> None:
    iters = 200 if q else 2000
    n = 256
    method = tiny_program(n).method("forward", device=dev)
    x = Result.from_host(np.ones(n, np.float32), dev)
    x.to_host()
    out: dict[str, Any] = {"iterations": iters}
    warm = max(50, iters // 10)

    if raw is not None:  # the floor: launch + record + cuEventSynchronize, nothing else
        stream, event = raw.stream(), raw.event()
        xp, yp = raw.alloc(4 * n), raw.alloc(4 * n)
        ns = []
        for i in range(warm + iters):
            t = time.perf_counter_ns()
            raw.twice(stream, xp, yp, n)
            raw.record(event, stream)
            raw.sync(event)
            if i >= warm:
                ns.append(time.perf_counter_ns() - t)
        out["raw cuda-python (floor)"] = summary(ns)

    ns = []  # the runtime alone: execute + wait for its event on this thread
    for i in range(warm + iters):
        t = time.perf_counter_ns()
        method([x])
        method.last_event.synchronize()
        if i >= warm:
            ns.append(time.perf_counter_ns() - t)
    out["streamlane runtime, no asyncio"] = summary(ns)

    caller = dev.create_stream()

    async def through_scheduler(timing: bool, spin_us: float, poll_us: float,
                                stream: Any, inline: bool) -> list[int]:
        async with Scheduler(dev, lanes=1, timing=timing, spin_us=spin_us,
                             poll_us=poll_us, inline=inline) as sched:
            for _ in range(warm):
                await sched.run(method, [x], stream=stream)
            ns = []
            for _ in range(iters):
                t = time.perf_counter_ns()
                await sched.run(method, [x], stream=stream)
                ns.append(time.perf_counter_ns() - t)
            return ns

    # (timing events, waiter spin us, loop poll us, caller stream, inline): the lane's own
    # stream (the lane thread enqueues), then a caller stream (the loop enqueues: the inputs are
    # on the device), without the loop's poll, and with the lane thread enqueuing (inline=False)
    configs = [(False, 0.0, 50.0, None, True), (True, 0.0, 50.0, None, True),
               (False, 50.0, 50.0, None, True), (False, 0.0, 50.0, caller, True),
               (True, 0.0, 50.0, caller, True), (False, 0.0, 0.0, caller, True),
               (False, 0.0, 50.0, caller, False)]
    for backend in backends_available():
        for timing, spin, poll, stream, inline in configs:
            label = f"scheduler {backend}" + (", caller stream" if stream is not None else "") \
                + (", timing events" if timing else "") + (f", spin {spin:g} us" if spin else "") \
                + (", no poll" if not poll else "") + (", lane enqueues" if not inline else "")
            out[label] = summary(run_on(backend, through_scheduler, timing, spin, poll, stream,
                                        inline))

    if raw is not None and importlib.util.find_spec("torch"):
        import torch

        xt = torch.ones(n, device="cuda")

        async def torch_to_thread() -> list[int]:
            ns = []
            for i in range(warm + iters):
                t = time.perf_counter_ns()
                _ = xt * 2
                ev = torch.cuda.Event()
                ev.record()
                await asyncio.to_thread(ev.synchronize)
                if i >= warm:
                    ns.append(time.perf_counter_ns() - t)
            return ns

        for backend in ("asyncio", "uvloop"):
            if backend in backends_available():
                out[f"torch op + to_thread(sync) {backend}"] = summary(
                    run_on(backend, torch_to_thread))
    floor = out.get("raw cuda-python (floor)")
    rows = [{"path": k, "p50_us": v["p50_us"], "p99_us": v["p99_us"], "mean_us": v["mean_us"],
             "p50_vs_floor": v["p50_us"] / floor["p50_us"] if floor else None}
            for k, v in out.items() if isinstance(v, dict)]
    rep.section(f"(a) await latency of a 1-kernel program, {iters} awaits each", rows,
                "goal: scheduler p50 <= 1.5x the floor. Anchors (H200): floor 14.7 us, torch + "
                "to_thread 115 us, persistent waiter + call_soon_threadsafe 50 us (uvloop 39)")


# -- (b) overlap -------------------------------------------------------------------------------
def bench_overlap(dev: Any, raw: Any, rep: Report, q: bool) -> None:
    counts = [1, 2, 4, 8] if q else [1, 2, 4, 8, 16, 32, 64, 128]
    spin_us, reps = 2000, 2 if q else 3
    program = spin_program(spin_us)
    methods = [program.method("forward", device=dev) for _ in range(max(counts))]
    x = Result.from_host(np.ones(1, np.float32), dev)
    x.to_host()
    streams = [dev.create_stream() for _ in range(max(counts))]
    rows = []

    async def scheduled(n: int, mode: str, timing: bool) -> tuple[float, float, float]:
        lanes = n if mode == "lanes" else 1
        on_streams = mode.startswith("streams")
        async with Scheduler(dev, lanes=lanes, timing=timing,
                             inline=mode != "streams, lane enqueues") as sched:
            await sched.run(methods[0], [x])  # warm
            walls = []
            for _ in range(reps):
                sched.clear_timeline()
                t = time.perf_counter()
                jobs = [await sched.submit(methods[i], [x], lane=i if mode == "lanes" else 0,
                                           stream=streams[i] if on_streams else None)
                        for i in range(n)]
                for job in jobs:
                    await job
                walls.append(time.perf_counter() - t)
            if not timing:
                return statistics.median(walls), float("nan"), float("nan")
            starts = [span.start_s for span in sched.timeline().spans]  # the last repeat's
            return statistics.median(walls), sched.timeline().overlap(), max(starts) - min(starts)

    raw_streams = [raw.stream() for _ in range(max(counts))] if raw is not None else []
    raw_events = [raw.event() for _ in range(max(counts))] if raw is not None else []
    if raw is not None:
        xp, yp = raw.alloc(4), raw.alloc(4)

    def raw_wall(n: int, parallel: bool, then_kernel: bool) -> float:
        """Raw cuda-python: per stream a spin (the program's work; with ``then_kernel`` also a
        1-float kernel after it, which waits for the spin: the hardware-queue trap), then an
        event; then wait for every event."""
        then = (lambda s: raw.twice(s, xp, yp, 1)) if then_kernel else None
        return raw.spin_walls(raw_streams, raw_events, n, parallel, spin_us, reps, then)

    if raw is not None:
        raw_wall(2, True, True)  # warm
    for n in counts:
        one, one_overlap, _ = run_on("asyncio", scheduled, n, "one lane", True)
        streams_wall, streams_overlap, streams_spread = run_on("asyncio", scheduled, n, "streams",
                                                               True)
        lanes_wall, lanes_overlap, lanes_spread = run_on("asyncio", scheduled, n, "lanes", True)
        # The same caller streams with the lane thread enqueuing (Scheduler(inline=False)):
        via_lane_wall, _, via_lane_spread = run_on("asyncio", scheduled, n,
                                                  "streams, lane enqueues", True)
        # The same without timing events (Scheduler(timing=False), how to run for speed):
        untimed = {mode: run_on("asyncio", scheduled, n, mode, False)[0]
                   for mode in ("one lane", "streams", "lanes")}
        row: dict[str, Any] = {"N": n}
        if raw is not None:
            serial, parallel = raw_wall(n, False, False), raw_wall(n, True, False)
            serial2, parallel2 = raw_wall(n, False, True), raw_wall(n, True, True)
            row["raw_streams_speedup"] = serial / parallel
            row["raw_spin_then_kernel_speedup"] = serial2 / parallel2
        row.update({"streams_speedup": one / streams_wall, "lanes_speedup": one / lanes_wall,
                    "streams_lane_enqueues_speedup": one / via_lane_wall})
        row.update({"streams_speedup_untimed": untimed["one lane"] / untimed["streams"],
                    "lanes_speedup_untimed": untimed["one lane"] / untimed["lanes"]})
        if raw is not None:
            row["streams_vs_raw"] = row["streams_speedup"] / row["raw_streams_speedup"]
            row["streams_untimed_vs_raw"] = (row["streams_speedup_untimed"]
                                             / row["raw_streams_speedup"])
            row["lanes_vs_raw"] = row["lanes_speedup"] / row["raw_streams_speedup"]
        row.update({"streams_overlap": streams_overlap, "lanes_overlap": lanes_overlap,
                    "one_lane_ms": one * 1e3, "streams_ms": streams_wall * 1e3,
                    "lanes_ms": lanes_wall * 1e3, "one_lane_overlap": one_overlap,
                    # device start of the last job minus the first's: the dispatch stagger
                    "streams_start_spread_us": streams_spread * 1e6,
                    "streams_lane_enqueues_start_spread_us": via_lane_spread * 1e6,
                    "lanes_start_spread_us": lanes_spread * 1e6})
        if raw is not None:
            row.update({"raw_serial_ms": serial * 1e3, "raw_streams_ms": parallel * 1e3,
                        "raw_spin_then_kernel_serial_ms": serial2 * 1e3,
                        "raw_spin_then_kernel_streams_ms": parallel2 * 1e3})
        rows.append(row)
    rep.section(f"(b) overlap of N single-block spins of {spin_us} us (median of {reps})", rows,
                "speedups over serial (one lane; raw: one stream), with timing events and "
                "_untimed without (Scheduler(timing=False)); overlap from timing events; "
                "streams_lane_enqueues: caller streams with Scheduler(inline=False). "
                "raw: a spin and an event per stream, the program's work; raw spin then kernel: "
                "a 1-float kernel after each spin, which stalls a hardware queue. Goals: "
                ">= 1.9x at N=2, >= 7x at N=8, within 10% of raw streams for every N. "
                "CUDA_DEVICE_MAX_CONNECTIONS (hardware queues, default 8) is in the JSON's env")


# -- (c) throughput ----------------------------------------------------------------------------
def bench_throughput(dev: Any, raw: Any, rep: Report, q: bool) -> None:
    tasks, per_task, lanes = (200, 5, 4) if q else (1000, 20, 4)
    program = tiny_program(256)
    methods = [program.method("forward", device=dev) for _ in range(lanes)]
    x = Result.from_host(np.ones(256, np.float32), dev)
    x.to_host()

    streams = [dev.create_stream() for _ in range(lanes)]

    async def storm(timing: bool, n_lanes: int, on_streams: bool,
                    inline: bool) -> tuple[float, list[int]]:
        ns: list[int] = []
        async with Scheduler(dev, lanes=n_lanes, timing=timing, inline=inline) as sched:
            for i, m in enumerate(methods):
                await sched.run(m, [x], lane=i % n_lanes)

            async def worker(i: int) -> None:
                m = methods[i % lanes]
                stream = streams[i % lanes] if on_streams else None
                for _ in range(per_task):
                    t = time.perf_counter_ns()
                    await sched.run(m, [x], stream=stream)
                    ns.append(time.perf_counter_ns() - t)

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(tasks):
                    tg.start_soon(worker, i)
            return time.perf_counter() - t, ns

    rows = []
    # The configuration (4 lanes) on every loop, then fewer lanes for the same four
    # methods: each driver call hands the GIL to another thread (bench/convoy_probe.py).
    # Last, each method on its own caller stream: the loop thread enqueues (Lane.run_inline).
    # inline=False: the same caller streams, enqueued by the lane threads.
    configs = [(b, timing, lanes, False, True) for b in backends_available()
               for timing in (False, True)]
    configs += [("asyncio", False, n, False, True) for n in (1, 2)]
    configs += [(b, False, lanes, True, True) for b in backends_available()]
    configs += [("asyncio", False, lanes, True, False)]
    for backend, timing, n_lanes, on_streams, inline in configs:
        wall, ns = run_on(backend, storm, timing, n_lanes, on_streams, inline)
        rows.append({"loop": backend, "lanes": n_lanes, "timing_events": timing,
                     "caller_streams": on_streams, "inline": inline,
                     "programs_per_s": tasks * per_task / wall, "wall_s": wall, **summary(ns)})
    rep.section(f"(c) throughput: {tasks} tasks x {per_task} tiny programs, {lanes} methods",
                rows, "goal (4 lanes): >= 50,000 programs/s; latency per await of sched.run")


# -- (d) cross-lane after= -----------------------------------------------------------------------
def bench_after(dev: Any, raw: Any, rep: Report, q: bool) -> None:
    iters = 200 if q else 2000
    program = tiny_program(256)
    first, second = (program.method("forward", device=dev) for _ in range(2))
    x = Result.from_host(np.ones(256, np.float32), dev)
    x.to_host()

    async def chain(lanes: int) -> list[int]:
        async with Scheduler(dev, lanes=lanes, timing=False) as sched:
            ns = []
            for i in range(iters + 50):
                t = time.perf_counter_ns()
                a = await sched.submit(first, [x], lane=0)
                await sched.run(second, [a.outputs[0]], lane=lanes - 1, after=[a])
                if i >= 50:
                    ns.append(time.perf_counter_ns() - t)
            return ns

    one, two = summary(run_on("asyncio", chain, 1)), summary(run_on("asyncio", chain, 2))
    rows = [{"placement": "one lane (same stream)", **one},
            {"placement": "two lanes (after=, device-side wait)", **two},
            {"placement": "cross-lane cost", "p50_us": two["p50_us"] - one["p50_us"],
             "p99_us": two["p99_us"] - one["p99_us"]}]
    rep.section("(d) a two-job chain a -> b (b: after= a, reads its output), from asyncio",
                rows, "latency of submit(a) + run(b)")


# -- main --------------------------------------------------------------------------------------
SECTIONS = {"latency": bench_latency, "overlap": bench_overlap, "throughput": bench_throughput,
            "after": bench_after}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="auto", help="auto | host | cuda | cuda:N")
    parser.add_argument("--quick", action="store_true", help="small sizes: seconds, not minutes")
    parser.add_argument("--only", default="", help=f"comma-separated: {', '.join(SECTIONS)}")
    parser.add_argument("--out", default=None,
                        help="JSON path (default: bench/results/sched-<kind>.json)")
    args = parser.parse_args(argv)
    only = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        parser.error(f"--only: no section {', '.join(unknown)}; sections: {', '.join(SECTIONS)}")
    dev = get_device(args.device)
    rep = Report("sched", dev, args.quick)
    rep.data["loops"] = backends_available()
    for name in ("uvloop", "trio"):
        if name not in rep.data["loops"]:
            rep.absent(f"the {name} event loop", f"{name} is not installed")
    raw = None
    if dev.kind == "cuda":
        try:
            from _raw_cuda import RawCuda

            raw = RawCuda(dev.index)
        except Exception as exc:  # report streamlane's figures even if the peer breaks
            rep.error("raw cuda-python peer", exc)
            rep.absent("raw cuda-python (the floor, raw streams)", f"failed: {exc!r}")
    else:
        rep.absent("raw cuda-python (the floor, raw streams)",
                   f"needs a CUDA device; this run is on {dev.name}")
    if raw is None or not importlib.util.find_spec("torch"):
        rep.absent("torch + to_thread", "needs a CUDA device and torch" if raw is None
                   else "torch is not installed")
    for name in only:
        t = time.perf_counter()
        try:
            SECTIONS[name](dev, raw, rep, args.quick)
        except Exception as exc:  # one broken section must not lose the others' figures
            rep.error(name, exc)
        rep.data.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 2)
        gc.collect()
    rep.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A/B of scheduler versions in one process (DESIGN.md "Measuring": peers in the same run).

Each GPU call gets a fresh machine whose host speed differs by up to 1.5x, so two versions of
``sched/`` are compared in one process, interleaved, on one machine: the working tree's
(``work``) against others unpacked from git, loaded under their own package names (they import
``streamlane.runtime`` as usual, so only ``sched/`` differs). The order of the versions rotates
every round: the second of two identical versions ran up to 10% faster than the first in the
relay when the order was fixed (``sched-ab-cuda.txt``).

    git archive 45138ea sched | (mkdir -p /tmp/s45 && tar -x -C /tmp/s45 --strip-components=1)
    python bench/ab_sched.py --version base=/tmp/s45 --rounds 6

Measures, per loop: the p50 and mean await of a lone caller-stream job (``bench_sched.py``
(a), "caller stream"), through ``run`` and through ``submit`` then ``await``; the wall time of
bursts of 8 single-block 200 us spins on 8 caller streams (``--burst``, ``--spin-us``), with the
lane thread enqueuing them and by default; and the relay (500 tasks awaiting tiny programs on 4
caller streams, ``bench_sched.py`` (c)): programs/s and the p99 await. Timing events off, unless
``--timing``. Prints one line per figure: the median over the rounds for each version.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from bench_sched import BACKENDS, spin_program, tiny_program

import streamlane.sched
from streamlane.runtime import Result, get_device


def load(label: str, path: str) -> Any:
    """The Scheduler of the ``sched`` package unpacked at ``path``, as package ``ab_<label>``."""
    name = f"ab_{label}"
    spec = importlib.util.spec_from_file_location(name, os.path.join(path, "__init__.py"),
                                                  submodule_search_locations=[path])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module.Scheduler


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", action="append", default=[], metavar="LABEL=PATH",
                        help="a sched/ tree to compare with the working tree's (repeatable)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--loops", default="asyncio,trio")
    parser.add_argument("--only", default="lone,burst,relay")
    parser.add_argument("--spin-us", type=int, default=200,
                        help="each burst job's single-block spin (the overlap goal's: 2000)")
    parser.add_argument("--burst", default="8", metavar="N,N,...",
                        help="burst sizes (jobs on as many caller streams of one lane)")
    parser.add_argument("--timing", action="store_true",
                        help="schedulers with timing events on (the default's), not off")
    args = parser.parse_args(argv)
    versions: dict[str, Any] = {}
    for spec in args.version:
        label, _, path = spec.partition("=")
        versions[label] = load(label, path)
    versions["work"] = streamlane.sched.Scheduler

    dev = get_device(args.device)
    tiny = tiny_program(256).method("forward", device=dev)
    x = Result.from_host(np.ones(256, np.float32), dev)
    x.to_host()
    sizes = [int(n) for n in args.burst.split(",")]
    spins = [spin_program(args.spin_us).method("forward", device=dev) for _ in range(max(sizes))]
    one = Result.from_host(np.ones(1, np.float32), dev)
    one.to_host()
    streams = [dev.create_stream() for _ in range(max(8, *sizes))]

    async def lone(scheduler: Any, via_submit: bool) -> tuple[float, float]:
        async with scheduler(dev, lanes=1, timing=args.timing) as sched:
            for _ in range(200):
                await sched.run(tiny, [x], stream=streams[0])
            ns = []
            for _ in range(1500):
                t = time.perf_counter_ns()
                if via_submit:  # the job is held back for its await (since e69725b)
                    await (await sched.submit(tiny, [x], stream=streams[0]))
                else:
                    await sched.run(tiny, [x], stream=streams[0])
                ns.append(time.perf_counter_ns() - t)
            return float(np.percentile(ns, 50)) / 1e3, float(np.mean(ns)) / 1e3

    async def burst(scheduler: Any, inline: bool, n: int) -> float:
        async with scheduler(dev, lanes=1, timing=args.timing, inline=inline) as sched:
            walls = []
            for r in range(45):
                t = time.perf_counter_ns()
                jobs = [await sched.submit(spins[i], [one], stream=streams[i]) for i in range(n)]
                for job in jobs:
                    await job
                if r >= 5:
                    walls.append(time.perf_counter_ns() - t)
                await anyio.sleep(0.001)
            return float(np.median(walls)) / 1e3

    async def relay(scheduler: Any) -> tuple[float, float]:
        methods = [tiny_program(256).method("forward", device=dev) for _ in range(4)]
        async with scheduler(dev, lanes=4, timing=args.timing) as sched:
            for i, method in enumerate(methods):
                await sched.run(method, [x], stream=streams[i])

            ns: list[int] = []

            async def worker(i: int) -> None:
                for _ in range(10):
                    t = time.perf_counter_ns()
                    await sched.run(methods[i % 4], [x], stream=streams[i % 4])
                    ns.append(time.perf_counter_ns() - t)

            t = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(500):
                    tg.start_soon(worker, i)
            return 5000 / (time.perf_counter() - t), float(np.percentile(ns, 99)) / 1e6

    # Each figure's function returns one value per title (a tuple, or one float).
    figures = {"lone": [(("lone await p50 us", "lone await mean us"), lone, (False,)),
                        (("lone submit, await p50 us", "lone submit, await mean us"), lone,
                         (True,))],
               "burst": [figure for n in sizes for figure in (
                   ((f"burst of {n}, lane enqueues, wall us",), burst, (False, n)),
                   ((f"burst of {n}, default, wall us",), burst, (True, n)))],
               "relay": [(("relay programs/s", "relay p99 ms"), relay, ())]}
    labels = list(versions)
    for loop in args.loops.split(","):
        backend, options = BACKENDS[loop]
        for section in args.only.split(","):
            for titles, fn, extra in figures[section]:
                results: dict[str, list[Any]] = {label: [] for label in labels}
                for r in range(args.rounds):
                    order = labels[r % len(labels):] + labels[:r % len(labels)]
                    for label in order:
                        value = anyio.run(fn, versions[label], *extra, backend=backend,
                                          backend_options=options)
                        results[label].append(value if isinstance(value, tuple) else (value,))
                for k, title in enumerate(titles):
                    print(f"{loop:8s} {title:36s} " + "  ".join(
                        f"{label} {statistics.median(v[k] for v in values):9.1f}"
                        for label, values in results.items()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Random job graphs through the scheduler, checked against float64 references: a compact,
deterministic form of the scheduler fuzzer, so that a broken ordering rule fails here.

Each seed draws a scheduler (1-3 lanes, timing and inline on or off, sometimes a tiny queue)
and a graph of jobs over a few small programs. Several tasks submit the jobs on random lanes
or caller streams, with ``after=`` on earlier jobs and earlier jobs' outputs as inputs; others
await them in random order, some first under a short timeout (cancelled, the job runs on) and
again later. Spin kernels and delays injected into the caller streams keep producers on the
device while their dependents are enqueued, so a missing device-side wait shows. Checked:
every output against its reference, the final statistics, that a job ordered after another
(``after=`` or an input) starts on the device only once that one has ended, that leaving the
scheduler never hangs, and that every thread it started is gone."""

from __future__ import annotations

import gc
import random
import threading
from dataclasses import dataclass, field

import anyio
import numpy as np
import pytest
from sched_helpers import BACKENDS, SHAPE, data, double_program, spin_program, wait_threads

from streamlane.runtime import Program, Result
from streamlane.runtime.reference import run_reference
from streamlane.sched import Job, Scheduler

pytestmark = pytest.mark.anyio

SEEDS = range(12)
JOBS = 24  # per seed: 12 seeds x 3 backends take ~5 s on a 2-core machine


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


def programs(rng: random.Random) -> list[Program]:
    """Programs of one or two inputs and outputs whose values stay bounded however they are
    chained; the spin keeps its job on the device a while."""
    shape = list(SHAPE)
    w = np.random.default_rng(rng.randrange(2**32)).standard_normal((SHAPE[1], SHAPE[1]))
    b = Program.build("mm", constants={"w": (w / np.sqrt(SHAPE[1])).astype(np.float32)})
    m = b.method("forward", x=("float32", shape))
    m.output(m.step("gelu", m.step("matmul", "x", "w"), out="y"))
    mm = b.finish()
    b = Program.build("mix")
    m = b.method("forward", x=("float32", shape), y=("float32", shape))
    m.output(m.step("layernorm", m.step("add", "x", "y"), out="n"),
             m.step("softmax", "x", out="s"))
    return [mm, b.finish(), double_program(), spin_program(rng.choice([1000, 3000]))]


@dataclass
class Planned:
    """One job of a seed's graph, as drawn; ``want`` is the float64 reference of its outputs."""

    program: int
    inputs: list  # an array, or (j, k): the output k of the earlier job j
    after: list[int]
    lane: int | None
    stream: int | None  # a caller stream of the seed
    delay: float  # injected into that stream just before the submit
    task: int  # the submitter
    cancel: float | None  # awaited first under this short timeout
    want: list[np.ndarray]

    @property
    def deps(self) -> set[int]:
        return set(self.after) | {v[0] for v in self.inputs if isinstance(v, tuple)}


@dataclass
class Plan:
    lanes: int
    timing: bool
    inline: bool
    queue_size: int
    streams: int
    tasks: int
    awaiters: int
    programs: list[Program]
    order: list[int]  # in which the awaiters take the jobs
    jobs: list[Planned] = field(default_factory=list)


def draw(seed: int) -> Plan:
    """The scheduler and job graph of ``seed``, with the reference outputs of every job."""
    rng = random.Random(seed)
    lanes = rng.randint(1, 3)
    plan = Plan(lanes=lanes, timing=rng.random() < 0.75, inline=rng.random() < 0.5,
                queue_size=rng.choice([1, 2, 3]) if rng.random() < 0.3 else 1024,
                streams=rng.randint(1, 2), tasks=rng.randint(2, 4), awaiters=rng.randint(1, 3),
                programs=programs(rng), order=rng.sample(range(JOBS), JOBS))
    for i in range(JOBS):
        p = rng.randrange(len(plan.programs))
        inputs = []
        for _ in plan.programs[p].methods["forward"].inputs:
            if i and rng.random() < 0.5:
                j = rng.randrange(i)
                inputs.append((j, rng.randrange(len(plan.jobs[j].want))))
            else:
                inputs.append(data(rng.randrange(1000)))
        # after= on recent jobs, the likeliest to be still running
        after = rng.sample(range(max(0, i - 4), i), min(i, rng.randint(1, 2))) \
            if rng.random() < 0.4 else []
        stream = rng.randrange(plan.streams) if rng.random() < 0.4 else None
        ins = [plan.jobs[v[0]].want[v[1]].astype(np.float32) if isinstance(v, tuple) else v
               for v in inputs]
        plan.jobs.append(Planned(
            program=p, inputs=inputs, after=after, lane=rng.choice([None, *range(lanes)]),
            stream=stream, delay=rng.choice([0, 0.002, 0.005]) if stream is not None else 0,
            task=rng.randrange(plan.tasks),
            cancel=rng.choice([0, 0.0005]) if rng.random() < 0.25 else None,
            want=run_reference(plan.programs[p], "forward", ins)))
    return plan


async def run_plan(plan: Plan, methods: list, streams: list,
                   sched: Scheduler) -> tuple[list[Job], list[list[Result]]]:
    """Submit every job of ``plan`` from its submitter task and await it from a random
    awaiter task, in a random order; the jobs and their outputs."""
    n = len(plan.jobs)
    jobs: list = [None] * n
    outs: list = [None] * n
    submitted = [anyio.Event() for _ in range(n)]

    async def submitter(t: int) -> None:
        for i, p in enumerate(plan.jobs):
            if p.task != t:
                continue
            for d in p.deps:  # another task's job may not be submitted yet
                await submitted[d].wait()
            stream = None if p.stream is None else streams[p.stream]
            if p.delay:
                sched.device.inject_delay(stream, p.delay)
            inputs = [jobs[v[0]].outputs[v[1]] if isinstance(v, tuple) else v
                      for v in p.inputs]
            jobs[i] = await sched.submit(methods[p.program], inputs, lane=p.lane,
                                         after=[jobs[d] for d in p.after], stream=stream)
            submitted[i].set()

    async def awaiter(a: int) -> None:
        again = []
        for i in plan.order[a::plan.awaiters]:
            await submitted[i].wait()
            if plan.jobs[i].cancel is None:
                outs[i] = await jobs[i]
            else:  # cancelled or not, awaited again once the others are
                with anyio.move_on_after(plan.jobs[i].cancel):
                    await jobs[i]
                again.append(i)
        for i in again:
            outs[i] = await jobs[i]

    async with anyio.create_task_group() as tg:
        for t in range(plan.tasks):
            tg.start_soon(submitter, t)
        for a in range(plan.awaiters):
            tg.start_soon(awaiter, a)
    return jobs, outs


@pytest.mark.parametrize("seed", SEEDS)
async def test_random_job_graphs_keep_their_order_and_values(host, seed):
    plan = draw(seed)
    methods = [p.method("forward", device=host) for p in plan.programs]
    streams = [host.create_stream() for _ in range(plan.streams)]
    Result.from_host(data(0), host).to_host()  # this thread's stream worker: in the baseline
    await anyio.to_thread.run_sync(lambda: None)  # and anyio's worker thread
    gc.collect()  # streams other tests dropped stop their workers now, not mid-test
    baseline = threading.active_count()
    try:
        sched = Scheduler(host, lanes=plan.lanes, timing=plan.timing, inline=plan.inline,
                          queue_size=plan.queue_size)
        with anyio.fail_after(20):  # no hang: neither in the jobs nor on leaving
            async with sched:
                jobs, outs = await run_plan(plan, methods, streams, sched)
                stats = sched.statistics()
                assert sum(s.completed for s in stats) == JOBS, stats
                assert all(s.queued == 0 and s.in_flight == 0 for s in stats), stats
                assert sched.pending == 0
        assert wait_threads(baseline) <= baseline, [t.name for t in threading.enumerate()]
    finally:
        for s in streams:
            s.close()
    for i, (p, got) in enumerate(zip(plan.jobs, outs, strict=True)):
        for k, (y, want) in enumerate(zip(got, p.want, strict=True)):
            np.testing.assert_allclose(y.to_host(), want, rtol=1e-4, atol=1e-5,
                                       err_msg=f"seed {seed}: job {i} output {k}")
    # A job ordered after another starts on the device once that one has ended (an input is
    # also ordered by the runtime; a bare after= shows only here).
    if plan.timing:
        for i, p in enumerate(plan.jobs):
            for d in sorted(p.deps):
                start, end = jobs[i].span[0], jobs[d].span[1]
                assert start >= end, (f"seed {seed}: job {i} started {(end - start) * 1e3:.3f} ms "
                                      f"before job {d}, which it is ordered after, ended")

"""The scheduler's loop-thread fast paths: a lone caller-stream job that cannot block is enqueued
by the event loop thread itself (no hop to the lane thread), and ``await job`` polls a lone job's
event on the loop before falling back to the waiter's wakeup. Neither may change what a job
computes, the order jobs reach a stream, or what the lanes count. Every test runs on asyncio,
uvloop and trio."""

from __future__ import annotations

import contextlib
import fractions
import gc
import itertools
import statistics
import threading
import time

import anyio
import numpy as np
import pytest
from sched_helpers import (
    BACKENDS,
    Gate,
    LateBad,
    data,
    double_program,
    spin_program,
    wait_until,
)

from streamlane.runtime import Method, Program, Result
from streamlane.runtime.errors import InvalidArgument, InvalidInput, InvalidState
from streamlane.runtime.result import PooledBuffer
from streamlane.sched import DependencyFailed, Scheduler
from streamlane.sched.lane import Lane

pytestmark = pytest.mark.anyio


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


@pytest.fixture
def executing_threads(monkeypatch):
    """``{method name: [ident of each thread that executed it]}``."""
    seen: dict[str, list[int]] = {}
    real = Method._execute  # what execute() and m(xs) both run, the guard held

    def execute(self, *args):
        seen.setdefault(self.name, []).append(threading.get_ident())
        real(self, *args)

    monkeypatch.setattr(Method, "_execute", execute)
    return seen


@pytest.fixture
def loop_settles(monkeypatch):
    """How many jobs each ``Lane._settle`` call settled, split by who called it."""
    counts = {"loop": 0, "lane threads": 0}
    real = Lane._settle

    def settle(self, batch, error):
        fresh = sum(1 for job in batch if not job._claimed)
        on_loop = threading.get_ident() == self._core.waker.loop_thread
        counts["loop" if on_loop else "lane threads"] += fresh
        return real(self, batch, error)

    monkeypatch.setattr(Lane, "_settle", settle)
    return counts


def enqueue_now(sched: Scheduler) -> None:
    """Enqueue the lone job the scheduler holds back for its first await, as that await would
    (white box: these tests need a job complete before its await looks at it)."""
    sched.start_parked()


def on_device(array: np.ndarray, device) -> Result:
    result = Result.from_host(array, device)
    result.to_host()
    return result


async def test_only_a_caller_stream_job_that_cannot_block_is_enqueued_by_the_loop(
        device, executing_threads):
    """A lone job, device inputs, a caller stream: the loop enqueues it, at its await. A host
    input (its upload may wait), no caller stream (the lane's own stream is the lane thread's),
    or another job pending (here its producer, not yet enqueued): the lane thread does it."""
    names = ("inline", "host_input", "lane_stream", "producer", "consumer")
    methods = {n: double_program(n).method("forward", device=device) for n in names}
    stream = device.create_stream()
    x = on_device(data(0), device)
    loop = threading.get_ident()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            job = await sched.submit(methods["inline"], [x], stream=stream)
            outs = {"inline": await job}
            outs["host_input"] = await sched.run(methods["host_input"], [data(0)], stream=stream)
            outs["lane_stream"] = await sched.run(methods["lane_stream"], [x])
            gate = Gate(data(0))
            producer = await sched.submit(methods["producer"], [gate], lane=0)
            consumer = await sched.submit(methods["consumer"], [producer.outputs[0]], lane=1,
                                          stream=stream)
            assert consumer.state == "queued", "its producer was not enqueued yet"
            gate.open()
            outs["consumer"] = await consumer
    assert executing_threads["inline.forward"] == [loop]
    for name in ("host_input", "lane_stream", "producer", "consumer"):
        assert executing_threads[f"{name}.forward"] != [loop], f"{name} ran on the loop thread"
    np.testing.assert_allclose(outs["inline"][0].to_host(), 2 * data(0), rtol=1e-6)
    np.testing.assert_allclose(outs["host_input"][0].to_host(), 2 * data(0), rtol=1e-6)
    np.testing.assert_allclose(outs["lane_stream"][0].to_host(), 2 * data(0), rtol=1e-6)
    np.testing.assert_allclose(outs["consumer"][0].to_host(), 4 * data(0), rtol=1e-6)


class _Foreign:
    """A stream from another library: only ``__cuda_stream__``."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


async def test_a_lone_job_on_a_foreign_stream_is_ordered_on_that_stream(device,
                                                                         executing_threads):
    """The loop enqueues onto a foreign ``__cuda_stream__`` object too, in that stream's
    order: a latch held on the stream holds the job, which completes once it is released."""
    method = double_program().method("forward", device=device)
    owner = device.create_stream()
    x = on_device(data(5), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1000) as sched:
            with device.create_latch() as latch:
                latch.hold(owner)
                job = await sched.submit(method, [x], stream=_Foreign(owner.handle))
                await anyio.sleep(0.05)
                assert not job.done(), "the job ran ahead of the latch on its stream"
                latch.release()
            (y,) = await job
    assert executing_threads["double.forward"] == [threading.get_ident()]
    assert job.track == f"lane 0 stream {owner.handle:#x}"
    np.testing.assert_allclose(y.to_host(), 2 * data(5), rtol=1e-6)


async def test_inline_false_keeps_every_job_on_the_lane_thread(device, executing_threads):
    method = double_program().method("forward", device=device)
    x = on_device(data(0), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, inline=False) as sched:
            job = await sched.submit(method, [x], stream=device.create_stream())
            (y,) = await job
    assert executing_threads["double.forward"] != [threading.get_ident()]
    np.testing.assert_allclose(y.to_host(), 2 * data(0), rtol=1e-6)


async def test_a_method_with_a_callable_step_stays_on_the_lane_thread(host, executing_threads):
    """A user callable may wait on the host: never on the loop thread."""
    def triple(stream, ins, outs):
        outs[0][...] = ins[0] * 3

    b = Program.build("called")
    m = b.method("forward", x=("float32", [4]))
    m.call(triple, ["x"], [("y", "float32", [4])])
    m.output("y")
    method = b.finish().method("forward", device=host)
    x = on_device(np.arange(4, dtype=np.float32), host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1) as sched:
            (y,) = await sched.run(method, [x], stream=host.create_stream())
    assert executing_threads["called.forward"] != [threading.get_ident()]
    np.testing.assert_array_equal(y.to_host(), np.arange(4) * 3)


async def test_jobs_reach_a_caller_stream_in_submit_order(device):
    """A job the loop could enqueue itself must not overtake one submitted earlier to the same
    lane that the lane thread has not enqueued yet: both target one stream, whose order is the
    order they were submitted in."""
    first, second = (spin_program(2000, n).method("forward", device=device) for n in "ab")
    stream = device.create_stream()
    x = on_device(data(0), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            await sched.run(second, [x], stream=stream)  # warm, and proves it can go inline
            sched.clear_timeline()
            gate = Gate(data(1))
            a = await sched.submit(first, [gate], stream=stream)  # holds the lane thread
            await anyio.to_thread.run_sync(gate.entered.wait, 10)
            b = await sched.submit(second, [x], stream=stream)
            gate.open()
            await a
            await b
    assert a.span is not None and b.span is not None
    assert a.span[1] <= b.span[0], f"b {b.span} ran before a {a.span} on one stream"


async def test_the_head_of_a_burst_goes_to_the_lane_thread_in_submit_order(device,
                                                                           executing_threads):
    """Jobs submitted back to back: the first, lone when submitted, is held back for its
    await; the next submit makes it the head of a burst and gives it to the lane thread ahead
    of the rest, which then enqueues them in submit order while the loop submits (the loop
    enqueuing the head first delayed the rest: bench/NOTES.md). Awaited at once, a lone job
    is still the loop's."""
    burst = [spin_program(1000, f"burst{i}").method("forward", device=device) for i in range(3)]
    lone = double_program("lone").method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(3), device)
    loop = threading.get_ident()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            jobs = [await sched.submit(method, [x], stream=stream) for method in burst]
            outs = [await job for job in jobs]
            (y,) = await sched.run(lone, [x], stream=stream)
    for i in range(3):
        assert executing_threads[f"burst{i}.forward"] != [loop], f"burst{i} ran on the loop"
        np.testing.assert_array_equal(outs[i][0].to_host(), data(3))
    assert executing_threads["lone.forward"] == [loop]
    np.testing.assert_allclose(y.to_host(), 2 * data(3), rtol=1e-6)
    spans = [job.span for job in jobs]
    assert all(span is not None for span in spans)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"out of order: {spans}"


async def test_a_job_whose_producer_is_not_published_is_not_the_loops(
        device, executing_threads, monkeypatch):
    """A caller-stream job reading the output of a job its lane thread has enqueued but not
    yet published (the thread is between the two) is not the loop's to enqueue, though
    nothing is queued for that thread any more: the loop would read outputs that do not exist
    yet. (Guards any rule that lets the loop enqueue more than lone jobs: one such was tried,
    bench/NOTES.md, twenty-second session.)"""
    from streamlane.sched.job import Job

    producer_m = double_program("producer").method("forward", device=device)
    consumer_m = double_program("consumer").method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(6), device)
    between = threading.Event()
    go_on = threading.Event()
    real = Job._publish
    loop = threading.get_ident()

    def publish(self, *args):
        if self.name == "producer.forward" and threading.get_ident() != loop:
            between.set()
            go_on.wait(10)
        return real(self, *args)

    monkeypatch.setattr(Job, "_publish", publish)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            producer = await sched.submit(producer_m, [x])  # the lane's own stream: its thread
            await anyio.to_thread.run_sync(between.wait, 10)
            consumer = await sched.submit(consumer_m, [producer.outputs[0]], stream=stream)
            go_on.set()
            (y,) = await consumer
            await producer
    assert executing_threads["consumer.forward"] != [loop]
    np.testing.assert_allclose(y.to_host(), 4 * data(6), rtol=1e-6)


async def test_run_enqueues_a_lone_job_at_once_and_holds_nothing_back(device, monkeypatch,
                                                                       executing_threads):
    """``run`` awaits its job at once, so no burst can follow: the loop enqueues a lone job
    there and then, without the next-turn callback that a held-back job needs (~1-3 us on the
    lone await's path)."""
    from streamlane.sched._wakeup import LoopWaker

    callbacks = []
    real = LoopWaker.call_soon
    monkeypatch.setattr(LoopWaker, "call_soon",
                        lambda self, fn: (callbacks.append(fn), real(self, fn))[1])
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(2), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            for _ in range(3):
                (y,) = await sched.run(method, [x], stream=stream)
            assert callbacks == []
            await (await sched.submit(method, [x], stream=stream))
            assert len(callbacks) == 1
    assert executing_threads["double.forward"] == [threading.get_ident()] * 4
    np.testing.assert_allclose(y.to_host(), 2 * data(2), rtol=1e-6)


async def test_a_lone_job_not_awaited_is_enqueued_by_the_loop_at_its_next_turn(
        device, executing_threads):
    """A task that submits and then awaits something else: the job it holds back for the
    await is enqueued by the loop at its next turn, so the device works meanwhile. (Only
    attributes are read here: looking at the job, ``done()`` or ``state``, would start it.)"""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(2), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(method, [x], stream=stream)
            assert job.event is None, "held back, not enqueued inside submit"
            await wait_until(lambda: job.event is not None)  # other awaits only
            await wait_until(job.done)
            (y,) = await job
    assert executing_threads["double.forward"] == [threading.get_ident()]
    np.testing.assert_allclose(y.to_host(), 2 * data(2), rtol=1e-6)


async def test_a_lone_jobs_output_results_exist_when_submit_returns(device):
    """``job.outputs[i].result`` of a lone job held back for its await enqueues it there and
    then, as before the hold-back; a job still waiting for its lane thread has no Result yet:
    ``InvalidState``, not a crash."""
    lone = double_program("lone").method("forward", device=device)
    gated = double_program("gated").method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(4), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(lone, [x], stream=stream)
            result = job.outputs[0].result
            assert job.state != "queued"
            (y,) = await job
            assert y is result
            gate = Gate(data(5))
            waiting = await sched.submit(gated, [gate])
            with pytest.raises(InvalidState, match="waits for its lane"):
                _ = waiting.outputs[0].result
            gate.open()
            await waiting
            refused = await sched.submit(gated, [LateBad()])  # refused by its lane
            with pytest.raises(InvalidInput):
                await refused
            doomed = await sched.submit(lone, [refused.outputs[0]], stream=stream)  # held back
            assert doomed._parked
            with pytest.raises(InvalidState, match="failed before reaching the device"):
                _ = doomed.outputs[0].result
            with pytest.raises(DependencyFailed):
                await doomed
    np.testing.assert_allclose(result.to_host(), 2 * data(4), rtol=1e-6)


@pytest.mark.parametrize("error", [False, True], ids=["normal", "error"])
async def test_leaving_with_a_job_held_back_drains_or_cancels_it(device, error):
    """Leaving right after a lone submit: a normal exit runs the held job; an exit on an error
    cancels it, as any job not yet enqueued (it never reached the device)."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(1), device)
    with anyio.fail_after(30):
        with pytest.raises(RuntimeError) if error else contextlib.nullcontext():
            async with Scheduler(device, lanes=1) as sched:
                job = await sched.submit(method, [x], stream=stream)
                if error:
                    raise RuntimeError("leaving on an error")
    assert sched.pending == 0 and sched.statistics()[0].queued == 0
    assert job.state == ("cancelled" if error else "done")
    if not error:
        (y,) = await job
        np.testing.assert_allclose(y.to_host(), 2 * data(1), rtol=1e-6)


async def test_polling_done_without_yielding_starts_a_held_back_job(device):
    """Code that submits and then polls ``done()`` without letting the loop turn (a blocking
    wait, bad form on a loop but legal) must still see the job finish: looking at a job held
    back for its await starts it, as before the hold-back, when it ran inside submit."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(6), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(method, [x], stream=stream)
            deadline = time.monotonic() + 5
            while not job.done() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert job.done(), "the job never started while the loop did not turn"
            (y,) = await job
    np.testing.assert_allclose(y.to_host(), 2 * data(6), rtol=1e-6)


async def test_leaving_on_an_error_cancels_a_held_back_job_however_quick_the_lane_is(
        device, monkeypatch):
    """On an error exit the held-back job goes to its lane thread to be refused; the lane
    thread may take it at once, so the scheduler must be cancelling before it hands it over.
    Here ``unpark`` waits until the lane thread has dealt with the job: the quickest lane."""
    real = Lane.unpark

    def unpark_and_wait(self, job):
        real(self, job)
        assert job._published(10), "the lane thread never took the job"

    monkeypatch.setattr(Lane, "unpark", unpark_and_wait)
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(1), device)
    with anyio.fail_after(30), pytest.raises(RuntimeError):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(method, [x], stream=stream)
            raise RuntimeError("leaving on an error")
    assert job.state == "cancelled"
    assert sched.statistics()[0].queued == 0 and sched.statistics()[0].completed == 1


@pytest.mark.parametrize("repeat", range(2))
async def test_a_submit_that_waited_for_room_stays_behind_a_job_held_back_meanwhile(
        device, repeat):
    """X waits for room on a full lane; the jobs holding it finish in one batch, which wakes
    the task that awaited the first of them before X. That task submits P, lone (X is not
    pending yet), so P is held back; X then resumes. X was submitted after P, on the same
    stream: P goes to the lane thread first. (On trio the wake order is random: when X runs
    first there is nothing to check.)"""
    first, second = (double_program(n).method("forward", device=device) for n in ("j1", "j2"))
    late, early = (spin_program(3000, n).method("forward", device=device) for n in ("X", "P"))
    held, stream = device.create_stream(), device.create_stream()
    x = on_device(data(0), device)
    seen = {}
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, queue_size=2) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                j1 = await sched.submit(first, [x], stream=held)
                # Behind j1 on its stream, so both are reported in one batch once the latch
                # lets go (on a stream of its own its lane would report it as soon as done)
                await sched.submit(second, [x], stream=held)

                async def submit_late():
                    seen["X"] = await sched.submit(late, [x], stream=stream)  # waits for room
                    time.sleep(0.02)  # work on the loop: X's lane thread is first to the stream

                async def submit_early():
                    await j1
                    seen["P"] = await sched.submit(early, [x], stream=stream)
                    await anyio.sleep(0)  # anything but awaiting P at once
                    await seen["P"]

                async with anyio.create_task_group() as tg:
                    tg.start_soon(submit_late)
                    tg.start_soon(submit_early)
                    while sched.lanes[0].slots.statistics().tasks_waiting == 0:
                        await anyio.sleep(0.001)
                    await anyio.sleep(0.05)
                    latch.release()
                await seen["X"]
    p, late_job = seen["P"], seen["X"]
    if p.id > late_job.id:
        pytest.skip("X's submit resumed first (trio's random wake order): no hold-back")
    assert p.span is not None and late_job.span is not None
    assert p.span[1] <= late_job.span[0], f"X {late_job.span} overtook P {p.span}"


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_the_call_soon_task_ends_with_the_scheduler(device):
    """On trio the loop's next-turn callbacks run in a system task; closing the scheduler
    ends it, so schedulers opened and closed in one run leave no task behind."""
    import trio

    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(1), device)

    def call_soon_tasks() -> int:
        root = trio.lowlevel.current_root_task()
        return sum(task.name == "streamlane-call-soon" for nursery in root.child_nurseries
                   for task in nursery.child_tasks)

    with anyio.fail_after(30):
        for _ in range(3):
            async with Scheduler(device, lanes=1) as sched:
                job = await sched.submit(method, [x], stream=stream)
                assert call_soon_tasks() == 1
                await job
        await wait_until(lambda: call_soon_tasks() == 0)


@pytest.mark.parametrize("poll_us", [0.0, 1e6], ids=["no-poll", "poll"])
async def test_polling_settles_each_job_once(device, loop_settles, poll_us):
    """A lone job awaited while it runs is settled by the loop when polling is on (the waiter
    holds back meanwhile), and never twice: the lane's counters and the timeline count it
    once."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(2), device)
    count = 60
    with anyio.fail_after(60):
        async with Scheduler(device, lanes=1, poll_us=poll_us) as sched:
            for _ in range(count):
                (y,) = await sched.run(method, [x], stream=stream)
                np.testing.assert_allclose(y.to_host(), 2 * data(2), rtol=1e-6)
            await wait_until(lambda: sched.statistics()[0].in_flight == 0)
            (stats,) = sched.statistics()
            spans = sched.timeline().spans
    assert stats.completed == count and stats.queued == 0
    assert sorted(s.job for s in spans) == sorted({s.job for s in spans}), "a span twice"
    assert len(spans) == count
    assert loop_settles["loop"] + loop_settles["lane threads"] == count
    if poll_us:  # the waiter leaves a polled job to the loop for poll_us: no race for it
        assert loop_settles["loop"] == count, "the waiter took jobs the loop was polling"
    else:
        assert loop_settles["loop"] == 0


async def test_a_poll_yields_to_the_loop_and_cancelling_it_leaves_the_job_running(device):
    """While ``await job`` polls a held job, other tasks keep running; cancelling that await
    stops the poll only: the job completes, correct, and is counted once."""
    method = double_program().method("forward", device=device)
    held = device.create_stream()
    x = on_device(data(3), device)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.sleep(0.001)
            ticks += 1

    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1e6) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                job = await sched.submit(method, [x], stream=held)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(ticker)
                    t = time.perf_counter()
                    with anyio.move_on_after(0.2) as scope:
                        await job  # polls for up to 1 s: the latch holds the job
                    tg.cancel_scope.cancel()
                assert scope.cancelled_caught and not job.done()
                assert time.perf_counter() - t < 0.6
                assert ticks >= 20, f"the loop ran the ticker {ticks} times in 0.2 s of polling"
                latch.release()
            (y,) = await job
            np.testing.assert_allclose(y.to_host(), 2 * data(3), rtol=1e-6)
            await wait_until(lambda: sched.statistics()[0].in_flight == 0)
            assert sched.statistics()[0].completed == 1


@pytest.mark.parametrize("where", ["caller stream", "lane"])
async def test_awaits_of_jobs_the_device_already_finished_still_let_the_loop_run(device,
                                                                                 where):
    """``await job`` yields to the loop at least once per ``YIELD_EVERY_S`` even when every
    job is complete at its first look: a task awaiting small jobs back to back must not starve
    the loop's other tasks (without the yield, 0.1 s of awaits ran no other task at all)."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream() if where == "caller stream" else None
    x = on_device(data(4), device)
    ticks: list[float] = []

    async def ticker() -> None:
        while True:
            ticks.append(time.perf_counter())
            await anyio.sleep(0)

    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1e6) as sched, \
                anyio.create_task_group() as tg:
            tg.start_soon(ticker)
            await wait_until(lambda: len(ticks) > 0)
            # A collection of the test process's heap stalls every task for 30-50 ms: not the
            # scheduler's doing, so none runs inside the measured window.
            gc.collect()
            gc.disable()
            try:
                start = time.perf_counter()
                awaited: list[float] = []  # when each await returned
                while time.perf_counter() - start < 0.1:  # nothing but the awaits yields here
                    job = await sched.submit(method, [x], stream=stream)
                    enqueue_now(sched)
                    while job.event is None:  # a lane job: its lane thread enqueues it
                        time.sleep(0.0005)
                    job.event.synchronize()  # complete before the await looks at it
                    (y,) = await job
                    awaited.append(time.perf_counter())
                end = time.perf_counter()
            finally:
                gc.enable()
            tg.cancel_scope.cancel()
    np.testing.assert_allclose(y.to_host(), 2 * data(4), rtol=1e-6)
    during = [start] + [t for t in ticks if start < t < end] + [end]
    assert len(during) - 2 >= 10, f"the other task ran {len(during) - 2} times in 0.1 s"
    # A long gap between the other task's turns is a missing yield only if the awaits went on
    # meanwhile: a loaded machine can stall the whole process for tens of milliseconds, but
    # the first await after YIELD_EVERY_S (0.5 ms) must yield, so no gap holds 50 of them.
    gaps = [(b - a, sum(a < t < b for t in awaited)) for a, b in itertools.pairwise(during)]
    starved = [(gap, n) for gap, n in gaps if gap > 0.02 and n > 50]
    assert not starved, "the other task waited " + ", ".join(
        f"{gap * 1e3:.1f} ms while {n} awaits ran" for gap, n in starved)


async def test_a_method_whose_output_went_to_an_unknown_stream_is_not_executed_on_the_loop(
        device, executing_threads, monkeypatch):
    """Reusing an output buffer that another library took on an unknown stream (CUDA:
    ``__cuda_array_interface__``, DLPack with stream -1) waits for the whole device on the
    host (rule 8), so such a lone job goes to its lane thread: the loop never blocks on the
    device. Once an execute has rewritten the buffer, the fast path is back."""
    monkeypatch.setattr(PooledBuffer, "blind_exports_seen", False)  # restored after the test
    method = double_program("exported").method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(0), device)
    loop = threading.get_ident()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            (y,) = await sched.run(method, [x], stream=stream)
            assert method.may_wait_on_host() is False
            if device.kind == "cuda":
                interface = y.__cuda_array_interface__  # what CuPy or Numba read
                assert interface["stream"] is None
            else:  # the host device hands its memory out without tracking consumers
                y._holder.pooled.export_to(None)
            del y
            assert method.may_wait_on_host()
            # Until an execute rewrites that buffer. Usually the next one does; on a loaded
            # machine the thread that settled the first job may still hold its Result for a
            # moment, and the execute takes a fresh buffer instead (one run in ten).
            lane_runs = 0
            while method.may_wait_on_host():
                assert lane_runs < 5, "the exported buffer was never rewritten"
                (y,) = await sched.run(method, [x], stream=stream)
                lane_runs += 1
            (z,) = await sched.run(method, [x], stream=stream)
    threads = executing_threads["exported.forward"]
    assert threads[0] == loop and len(threads) == lane_runs + 2
    assert loop not in threads[1:-1], "a job that may wait on the host ran on the loop thread"
    assert threads[-1] == loop
    np.testing.assert_allclose(y.to_host(), 2 * data(0), rtol=1e-6)
    np.testing.assert_allclose(z.to_host(), 2 * data(0), rtol=1e-6)


def _runs(names: list[str]) -> list[int]:
    """The lengths of the runs of equal consecutive names."""
    return [len(list(group)) for _, group in itertools.groupby(names)]


async def test_tasks_awaiting_finished_jobs_take_turns_in_short_slices(device, monkeypatch):
    """Many tasks awaiting small finished jobs: each yields after ``YIELD_SHARED_S`` once
    another is waiting in such a yield, so a task's await waits for the others' short slices
    (at ``YIELD_EVERY_S`` 1,000 tasks gave a p99 of ~0.5 s); a task whose only company is an
    unrelated task keeps the long budget, which is cheaper per await. The scheduler's clock is
    the test's: each await counts as 40 us."""
    import streamlane.sched.scheduler as scheduler_module

    clock = [1.0]
    monkeypatch.setattr(scheduler_module, "time", type("Clock", (), {
        "perf_counter": staticmethod(lambda: clock[0])}))
    step = 40e-6
    shared = scheduler_module.YIELD_SHARED_S / step  # awaits per slice: 2.5
    alone = scheduler_module.YIELD_EVERY_S / step  # 12.5
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(4), device)
    order: list[str] = []

    async def relay(name: str, awaits: int) -> None:
        for _ in range(awaits):
            job = await sched.submit(method, [x], stream=stream)
            enqueue_now(sched)
            job.event.synchronize()  # finished before the await looks at it
            (y,) = await job
            clock[0] += step
            order.append(name)
        np.testing.assert_allclose(y.to_host(), 2 * data(4), rtol=1e-6)

    async def ticker(ticks: int) -> None:  # yields through anyio, not through the scheduler
        for _ in range(ticks):
            order.append("tick")
            await anyio.sleep(0)

    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1e6) as sched:
            async with anyio.create_task_group() as tg:
                for name in "abc":
                    tg.start_soon(relay, name, 60)
            # Steady state (every task has yielded once): slices of 3 awaits. Trio may run a
            # task first in one batch after running it last in the previous: two slices.
            runs = _runs(order)[3:-3]
            assert runs and statistics.median(runs) <= shared + 1, f"slices of {runs} awaits"
            assert max(runs) <= 2 * (shared + 1), f"slices of {runs} awaits"
            order.clear()
            async with anyio.create_task_group() as tg:
                tg.start_soon(relay, "a", 100)
                tg.start_soon(ticker, 1000)
            runs = [n for name, n in zip([k for k, _ in itertools.groupby(order)],
                                         _runs(order), strict=True) if name == "a"][1:-1]
            assert runs and min(runs) >= alone - 1, f"slices of {runs} awaits beside a ticker"


async def test_awaiting_a_finished_job_in_a_cancelled_scope_raises_the_cancellation(device):
    """``await job`` is always a cancellation point, also when it needs no yield; the job is
    not affected."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(5), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            await sched.run(method, [x], stream=stream)  # the last yield is recent
            job = await sched.submit(method, [x], stream=stream)
            enqueue_now(sched)
            job.event.synchronize()
            with anyio.CancelScope() as scope:
                scope.cancel()
                await job
            assert scope.cancelled_caught
            (y,) = await job
            np.testing.assert_allclose(y.to_host(), 2 * data(5), rtol=1e-6)


@pytest.mark.parametrize("poll_us", [0.0, 50.0])
async def test_awaiting_a_job_its_lane_settled_unseen_in_a_cancelled_scope_is_cancelled(
        device, poll_us):
    """A job its lane has finished (or refused: an input read late with the wrong shape) and
    counted, whose settle the loop has not run yet (the loop did not turn): the await settled
    it and gave its outcome with no cancellation point, so in a cancelled scope a refused job
    raised its own error (seen under ``python -X dev`` by a README test) and a finished one
    returned its outputs (with poll_us=0)."""
    method = double_program().method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=poll_us) as sched:
            for value in (LateBad(), data(3)):
                job = await sched.submit(method, [value])
                deadline = time.monotonic() + 10
                while not job._claimed and time.monotonic() < deadline:
                    time.sleep(0.001)  # the loop does not turn: its settle stays posted
                assert job._claimed and not job._finished
                with anyio.CancelScope() as scope:
                    scope.cancel()
                    await job
                assert scope.cancelled_caught, f"{job!r} was not cancelled"
                if isinstance(value, LateBad):
                    with pytest.raises(InvalidInput, match="shape"):
                        await job
                else:
                    (y,) = await job
                    np.testing.assert_allclose(y.to_host(), 2 * data(3), rtol=1e-6)


async def test_a_lone_job_nobody_awaits_still_finishes(device):
    """The loop keeps a lone caller-stream job for ``await job`` to poll; a job nobody awaits
    must finish all the same: when looked at, when the next job needs its slot (here a full
    lane, where the next submit would otherwise wait forever), and when the scheduler
    closes."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(4), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, queue_size=1) as sched:
            first = await sched.submit(method, [x], stream=stream)
            second = await sched.submit(method, [x], stream=stream)  # waits for first's slot
            await wait_until(second.done)
            assert first.done() and first.exception() is None
            third = await sched.submit(method, [x], stream=stream)
            await wait_until(third.done)  # looked at, never awaited
            last = await sched.submit(method, [x], stream=stream)
        assert last.done() and last.exception() is None, "closing left the lone job pending"
        assert sched.statistics()[0].completed == 4 and sched.statistics()[0].in_flight == 0
    (y,) = await last
    np.testing.assert_allclose(y.to_host(), 2 * data(4), rtol=1e-6)


async def test_a_submit_already_waiting_for_room_gets_it_when_a_lone_job_finishes(device):
    """queue_size=1: a and then b wait for room behind a held job. When it finishes, a gets
    the slot and, nothing else pending, is lone: had the loop kept it for a poll nobody does,
    its slot would never come free and b would wait forever."""
    held_method = double_program("held").method("forward", device=device)
    lone_method = double_program("lone").method("forward", device=device)
    other = double_program("other").method("forward", device=device)
    held, stream = device.create_stream(), device.create_stream()
    x = on_device(data(7), device)
    box = {}
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, queue_size=1) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                first = await sched.submit(held_method, [x], stream=held)

                async def submit_a():
                    box["a"] = await sched.submit(lone_method, [x], stream=stream)

                async def submit_b():
                    box["b"] = await sched.submit(other, [data(8)])

                async with anyio.create_task_group() as tg:
                    tg.start_soon(submit_a)
                    await anyio.sleep(0.02)  # a waits for room first
                    tg.start_soon(submit_b)
                    await anyio.sleep(0.02)
                    latch.release()
                    with anyio.fail_after(5):  # b gets its slot without anyone awaiting a
                        while "b" not in box:
                            await anyio.sleep(0.005)
            for job, want in ((first, x), (box["a"], x), (box["b"], data(8))):
                (y,) = await job
                np.testing.assert_allclose(y.to_host(), 2 * np.asarray(
                    want.to_host() if isinstance(want, Result) else want), rtol=1e-6)


async def test_a_dependency_on_another_schedulers_job_never_blocks_the_loop(device):
    """Nothing pending in this scheduler, but after= names a job of another one that its lane
    has not enqueued yet (a Gate holds that lane in set_inputs): the job must not be enqueued
    by the loop, which would wait for it there. A timer thread opens the gate after 1 s so the
    unfixed code ends instead of deadlocking."""
    first = double_program("first").method("forward", device=device)
    second = double_program("second").method("forward", device=device)
    stream = device.create_stream()
    gate = Gate(data(10))
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as one, Scheduler(device, lanes=1) as two:
            a = await one.submit(first, [gate])
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            timer = threading.Timer(1.0, gate.open)
            timer.start()
            t = time.perf_counter()
            b = await two.submit(second, [a.outputs[0]], after=[a], stream=stream)
            took = time.perf_counter() - t
            gate.open()
            timer.cancel()
            (y,) = await b
            await a
    assert took < 0.5, f"submit held the event loop for {took:.2f} s"
    np.testing.assert_allclose(y.to_host(), 4 * data(10), rtol=1e-6)


async def test_leaving_on_an_error_does_not_wait_for_another_schedulers_job(device):
    """On an error exit, a job waiting (on its lane thread) for a dependency of another
    scheduler is cancelled at once: the other scheduler's job is not ours to cancel, and
    may be held for as long as its owner likes (here a Gate, opened after 5 s)."""
    first = double_program("held").method("forward", device=device)
    second = double_program("waits").method("forward", device=device)
    gate = Gate(data(11), timeout=5)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as one:
            a = await one.submit(first, [gate])
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            with pytest.raises(RuntimeError, match="leaving"):
                async with Scheduler(device, lanes=1) as two:
                    b = await two.submit(second, [a.outputs[0]], after=[a])
                    await anyio.sleep(0.05)  # its lane thread waits for a to be enqueued
                    t = time.perf_counter()
                    raise RuntimeError("leaving on an error")
            took = time.perf_counter() - t
            gate.open()
            await a
    assert took < 1.0, f"the error exit waited {took:.2f} s for the other scheduler"
    assert b.state == "cancelled"


async def test_a_job_failed_before_the_device_is_seen_failed_without_a_loop_turn(device):
    """done(), state and exception() settle a job its lane refused (a bad input, a failed
    dependency) as they settle one the device finished: code polling without yielding sees
    it, and it never reads 'queued' beside a later job of its lane that reads 'done'."""
    method = double_program("refused").method("forward", device=device)
    other = double_program("after").method("forward", device=device)
    bad = LateBad()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            refused = await sched.submit(method, [bad], lane=0)
            dependent = await sched.submit(other, [refused.outputs[0]], lane=1)
            later = await sched.submit(method, [data(1)], lane=0)
            for job in (refused, dependent, later):
                deadline = time.monotonic() + 5
                while not job.done() and time.monotonic() < deadline:
                    time.sleep(0.001)  # the loop never turns
            assert (refused.state, dependent.state, later.state) == ("failed", "failed", "done")
            assert isinstance(refused.exception(), InvalidInput)
            assert type(dependent.exception()).__name__ == "DependencyFailed"
            with pytest.raises(InvalidInput):
                await refused
            (y,) = await later
    assert sched.pending == 0 and sched.statistics()[0].queued == 0
    np.testing.assert_allclose(y.to_host(), 2 * data(1), rtol=1e-6)


async def test_a_submit_settles_a_completed_lone_job_and_is_lone_in_turn(device,
                                                                         executing_threads):
    """Many tasks awaiting small jobs on caller streams relay through the lone-job path: a
    submit that finds the loop's lone job complete settles it, so the new job is lone too."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(6), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            first = await sched.submit(method, [x], stream=stream)
            # Enqueued by the loop at its next turn, then done on the device; nobody looked at
            # the job.
            await wait_until(lambda: first.event is not None and first.event.query())
            second = await sched.submit(method, [x], stream=stream)
            assert first._finished, "the submit did not settle the completed lone job"
            (y,) = await second
    assert executing_threads["double.forward"] == [threading.get_ident()] * 2
    np.testing.assert_allclose(y.to_host(), 2 * data(6), rtol=1e-6)


async def test_poll_spin_and_inline_settings_are_validated(device):
    for bad in (-1, True, "50", 2e6):
        with pytest.raises(InvalidArgument, match="poll_us must be a number of microseconds"):
            Scheduler(device, poll_us=bad)
        with pytest.raises(InvalidArgument, match="spin_us must be a number of microseconds"):
            Scheduler(device, spin_us=bad)
    with pytest.raises(InvalidArgument, match="inline must be a bool"):
        Scheduler(device, inline=1)
    for bad in (float("nan"), np.float64(-1.0), np.bool_(True), complex(1, 0),
                np.float16("inf"), np.float16(-1)):  # (float16: 1e6 is infinity there)
        with pytest.raises(InvalidArgument, match="poll_us must be a number of microseconds"):
            Scheduler(device, poll_us=bad)


@pytest.mark.parametrize("value", [np.int64(20), np.int32(20), np.float32(20.0),
                                   np.float64(20.0), np.float16(20), fractions.Fraction(20)])
def test_poll_and_spin_take_any_real_number_numpys_too(host, value):
    """np.int64(2) was refused as "must be a number of microseconds in [0, 1e6]" (a review):
    any real number in range is taken, as a float."""
    sched = Scheduler(host, poll_us=value, spin_us=value)
    assert sched.poll_s == sched.spin_s == 20e-6 and type(sched.poll_s) is float


async def test_a_lone_job_the_loop_polled_is_not_kept_once_finished(device):
    """The loop keeps a lone job for its await's poll; once the job has finished, the
    scheduler lets go of it (and of its outputs: their buffers go back to the method's pool)
    without waiting for another submit."""
    import gc
    import weakref

    method = double_program("kept").method("forward", device=device)
    stream = device.create_stream()
    x = on_device(data(6), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1e6) as sched:
            job = await sched.submit(method, [x], stream=stream)
            (y,) = await job
            np.testing.assert_allclose(y.to_host(), 2 * data(6), rtol=1e-6)
            kept = weakref.ref(job)
            del job, y
            await wait_until(lambda: gc.collect() >= 0 and kept() is None,
                             what="the finished job let go")

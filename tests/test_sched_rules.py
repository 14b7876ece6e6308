"""Scheduler rules no other test pinned down: a mutation review broke each on purpose (the
first unseen failure raised on leaving, back-pressure after failures, the loop never blocked
by a lone job waiting on another scheduler's job, nested spans in the union, trace units,
the settings' exact bounds, a job's state settling a finished job, an error exit while an
aclose() drains) and every other test still passed. Each test here fails on its mutant."""

from __future__ import annotations

import json
import threading
import time

import anyio
import pytest
from sched_helpers import BACKENDS, Gate, LateBad, data, double_program, wait_until

from streamlane.runtime.errors import InvalidArgument, InvalidInput
from streamlane.sched import Scheduler
from streamlane.sched.timeline import Span, Timeline

pytestmark = pytest.mark.anyio


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


async def test_leaving_raises_the_first_unseen_failure_not_a_later_one(host):
    method = double_program().method("forward", device=host)
    with pytest.raises(InvalidInput) as info:
        async with Scheduler(host, lanes=1) as sched:
            jobs = [await sched.submit(method, [LateBad()]) for _ in range(3)]
            await wait_until(lambda: all(j.done() for j in jobs))
    assert info.value is jobs[0].exception()
    assert f"{jobs[0].label} failed and nobody awaited it" in "".join(info.value.__notes__)


async def test_a_failed_job_gives_its_room_back_once(host):
    method = double_program().method("forward", device=host)
    held = host.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1, queue_size=1) as sched:
            for _ in range(3):
                with pytest.raises(InvalidInput):
                    await (await sched.submit(method, [LateBad()]))
            with host.create_latch() as latch:
                latch.hold(held)
                first = await sched.submit(method, [data(0)], stream=held)
                with anyio.move_on_after(0.2) as scope:
                    await sched.submit(method, [data(1)], stream=held)
                assert scope.cancelled_caught, "a full lane (queue_size=1) must make submit wait"
                latch.release()
                await first


async def test_a_lone_job_on_another_schedulers_unpublished_job_never_blocks_the_loop(host):
    """As test_a_dependency_on_another_schedulers_job_never_blocks_the_loop, but timing the
    loop's next turn too, where a held-back job is started."""
    first = double_program("first").method("forward", device=host)
    second = double_program("second").method("forward", device=host)
    stream = host.create_stream()
    gate = Gate(data(10))
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1) as one, Scheduler(host, lanes=1) as two:
            a = await one.submit(first, [gate])
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            timer = threading.Timer(1.0, gate.open)
            timer.start()
            t = time.perf_counter()
            b = await two.submit(second, [a.outputs[0]], after=[a], stream=stream)
            await anyio.sleep(0.01)  # the loop's next turn starts a held-back job
            took = time.perf_counter() - t
            gate.open()
            timer.cancel()
            await b
            await a
    assert took < 0.5, f"the event loop was held for {took:.2f} s"


def test_union_and_overlap_of_nested_spans():
    t = Timeline([Span(0, "a", 0, "lane 0", 0.0, 10.0), Span(1, "b", 1, "lane 1", 2.0, 3.0)])
    assert t.union_s() == 10.0
    assert t.overlap() == pytest.approx(1.1)


def test_the_chrome_trace_gives_start_and_duration_in_microseconds(tmp_path):
    t = Timeline([Span(0, "a", 0, "lane 0", 0.5, 0.75)], "host:0")
    trace = json.loads(t.to_chrome_trace(tmp_path / "t.json").read_text())
    (event,) = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert (event["ts"], event["dur"]) == (500_000.0, 250_000.0)


def test_settings_bounds_are_exact(host):
    with pytest.raises(InvalidArgument, match="lanes must be at most 1024"):
        Scheduler(host, lanes=1025)
    assert len(Scheduler(host, lanes=1024).lanes) == 1024
    with pytest.raises(InvalidArgument, match="queue_size must be an int >= 1"):
        Scheduler(host, queue_size=0)
    Scheduler(host, timeline_size=0)  # README: timeline_size >= 0


async def test_state_agrees_with_the_device_while_the_loop_is_busy(device):
    method = double_program().method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(method, [data(0)])
            time.sleep(0.3)  # a busy loop: the waiter's settle is posted, not run
            seen = job.state  # looked at first, before done()
            await job
    assert seen == "done"


async def test_an_error_exit_while_an_aclose_drains_cancels_the_jobs_not_yet_enqueued(host):
    method = double_program().method("forward", device=host)
    other = double_program("other").method("forward", device=host)
    gate = Gate(data(0))
    with anyio.fail_after(30):
        sched = Scheduler(host, lanes=1)
        await sched.__aenter__()
        g = await sched.submit(method, [gate])
        await anyio.to_thread.run_sync(gate.entered.wait, 5)
        b = await sched.submit(other, [data(1)])  # queued behind g, not enqueued
        async with anyio.create_task_group() as tg:
            tg.start_soon(sched.aclose)  # a normal close, draining
            await anyio.sleep(0.05)
            tg.start_soon(sched.__aexit__, RuntimeError, RuntimeError("x"), None)
            await anyio.sleep(0.05)
            gate.open()
    assert g.state == "done"
    assert b.state == "cancelled"

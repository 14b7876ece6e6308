"""asyncio's own cancellation (``task.cancel()``: ``asyncio.timeout``, ``wait_for``, a failing
``TaskGroup`` sibling) while a scheduler closes. anyio's shield stops anyio's and trio's
cancellation, not this one: the close returned with its lane threads running and a job
pending, and the next scheduler found the method still busy. The close now finishes first and
raises the cancellation after, so ``asyncio.timeout`` still reports its ``TimeoutError``."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest
from sched_helpers import Gate, data, double_program, wait_threads

from streamlane.sched import Scheduler

LOOPS = ["asyncio", "uvloop"]


def _run(loop: str, main) -> None:
    if loop == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        uvloop.run(main())
    else:
        asyncio.run(main())


def _lanes_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("streamlane-")
            and not t.name.startswith("streamlane-host")]


@pytest.mark.parametrize("loop", LOOPS)
def test_asyncio_timeout_during_the_close_still_drains_and_joins(host, loop):
    method = double_program().method("forward", device=host)
    x = data(1)
    baseline = threading.active_count()
    seen: dict[str, object] = {}

    async def main():
        gate = Gate(x)
        try:
            async with asyncio.timeout(None) as deadline:
                async with Scheduler(host, lanes=1) as sched:
                    job = await sched.submit(method, [gate])  # its lane thread blocks in it
                    deadline.reschedule(asyncio.get_running_loop().time() + 0.05)
                    threading.Timer(0.3, gate.open).start()  # after the deadline, mid-close
        except TimeoutError:
            seen["timeout"] = True
        seen["state"], seen["pending"] = job.state, sched.pending
        seen["alive"] = _lanes_alive()
        seen["result"] = (await job)[0].to_host()
        async with Scheduler(host, lanes=1) as again:  # the method is free again
            seen["again"] = (await again.run(method, [x]))[0].to_host()

    _run(loop, main)
    assert seen["timeout"] is True  # the cancellation is not lost, only delayed
    assert seen["state"] == "done" and seen["pending"] == 0 and seen["alive"] == []
    np.testing.assert_array_equal(seen["result"], x + x)
    np.testing.assert_array_equal(seen["again"], x + x)
    assert wait_threads(baseline) <= baseline


@pytest.mark.parametrize("loop", LOOPS)
def test_cancels_landing_all_through_the_close_wait_for_its_end(host, loop):
    """One cancel cut the drain short (harmless: the close went on to stop the lanes); the next
    one, landing while it waited for the lane threads to exit, skipped joining them."""
    method = double_program().method("forward", device=host)
    x = data(4)
    seen: dict[str, object] = {}

    async def closer():
        gate = Gate(x)
        sched = Scheduler(host, lanes=1)
        try:
            async with sched:
                seen["job"] = await sched.submit(method, [gate])
                threading.Timer(0.3, gate.open).start()
        except asyncio.CancelledError:
            seen["at cancel"] = sched.pending, _lanes_alive(), seen["job"].state
            raise

    async def main():
        task = asyncio.create_task(closer())
        for _ in range(8):
            await asyncio.sleep(0.04)
            task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(loop, main)
    assert seen["at cancel"] == (0, [], "done")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_failing_task_group_sibling_does_not_cut_the_close_short(host, loop):
    method = double_program().method("forward", device=host)
    x = data(2)
    seen: dict[str, object] = {}

    async def worker():
        gate = Gate(x)
        async with asyncio.timeout(0.05):  # a deadline first, then the sibling's failure
            async with Scheduler(host, lanes=1) as sched:
                seen["sched"] = sched
                seen["job"] = await sched.submit(method, [gate])
                threading.Timer(0.3, gate.open).start()
        seen["left"] = sched.pending, _lanes_alive()  # not reached: cancelled on leaving

    async def failing():
        await asyncio.sleep(0.1)
        raise ValueError("sibling")

    async def main():
        with pytest.raises(ExceptionGroup) as info:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(worker())
                tg.create_task(failing())
        assert info.group_contains(ValueError)
        seen["after"] = seen["sched"].pending, _lanes_alive(), seen["job"].state

    _run(loop, main)
    assert "left" not in seen
    assert seen["after"] == (0, [], "done")


@pytest.mark.parametrize("loop", LOOPS)
def test_a_second_closer_cancelled_natively_waits_for_the_first(host, loop):
    method = double_program().method("forward", device=host)
    x = data(3)
    seen: dict[str, object] = {}

    async def main():
        gate = Gate(x)
        sched = Scheduler(host, lanes=1)
        await sched.__aenter__()
        await sched.submit(method, [gate])
        first = asyncio.create_task(sched.aclose())
        await asyncio.sleep(0.02)
        second = asyncio.create_task(sched.aclose())
        await asyncio.sleep(0.02)
        second.cancel()
        threading.Timer(0.2, gate.open).start()
        with pytest.raises(asyncio.CancelledError):
            await second
        seen["second"] = sched.pending, _lanes_alive()
        await first

    _run(loop, main)
    assert seen["second"] == (0, [])


@pytest.mark.parametrize("loop", LOOPS)
def test_a_cancelled_close_with_an_unobserved_failure_raises_the_cancellation_with_it(host, loop):
    """The failure nobody saw replaced the cancellation: the task went on, cancelled for good
    in asyncio's count (cancelling() == 1), and a Ctrl-C ended as that error, status 1."""
    from sched_helpers import LateBad

    from streamlane.runtime.errors import InvalidInput

    method = double_program().method("forward", device=host)
    x = data(5)
    seen: dict[str, object] = {}

    async def closer():
        gate = Gate(x)
        sched = Scheduler(host, lanes=1)
        await sched.__aenter__()
        await sched.submit(method, [LateBad()])  # fails on its lane; nobody awaits it
        await sched.submit(method, [gate])
        asyncio.get_running_loop().call_later(0.1, asyncio.current_task().cancel)
        threading.Timer(0.3, gate.open).start()
        try:
            await sched.aclose()
        except asyncio.CancelledError as exc:
            seen["cause"] = type(exc.__cause__)
            seen["left"] = sched.pending, _lanes_alive()
            raise
        seen["went on"] = True

    async def main():
        with pytest.raises(asyncio.CancelledError):
            await asyncio.create_task(closer())

    _run(loop, main)
    assert "went on" not in seen
    assert seen["cause"] is InvalidInput and seen["left"] == (0, [])

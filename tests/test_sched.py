"""The scheduler's contract (DESIGN.md, "The scheduler"): lanes, after=, caller streams, a loop
that never blocks, back-pressure, draining and joining on exit. Every test runs on asyncio,
uvloop and trio."""

from __future__ import annotations

import gc
import threading
import time

import anyio
import numpy as np
import pytest
from sched_helpers import (
    BACKENDS,
    Gate,
    Interrupt,
    LateBad,
    RaiseAt,
    data,
    double_program,
    spin_program,
    wait_threads,
    wait_until,
)

from streamlane.runtime import CallerStream, Program, Result, get_device
from streamlane.runtime.errors import InvalidArgument, InvalidInput, InvalidState, StreamClosed
from streamlane.runtime.examples import load
from streamlane.runtime.reference import run_reference
from streamlane.sched import Job, JobOutput, Scheduler, SchedulerClosed

pytestmark = pytest.mark.anyio


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


async def test_run_gives_outputs_that_match_the_float64_reference(device):
    enc, dec = load("encoder"), load("decoder")
    encoder, decoder = enc.method("forward", device=device), dec.method("forward", device=device)
    xs = [np.random.default_rng(i).standard_normal((8, 256)).astype(np.float32)
          for i in range(4)]
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            outs = []
            for x in xs:
                e = await sched.submit(encoder, [x], lane=0)
                outs.append(await sched.run(decoder, [e.outputs[0]], lane=1, after=[e]))
    for x, out in zip(xs, outs, strict=True):
        (y,) = run_reference(enc, "forward", [x])
        (want,) = run_reference(dec, "forward", [y])
        assert isinstance(out[0], Result)
        np.testing.assert_allclose(out[0].to_host(), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("b_lane", [1, 0], ids=["other-lane", "same-lane"])
@pytest.mark.parametrize("how", ["after", "job-output-only", "after-only"])
async def test_a_dependent_waits_on_the_device_while_a_latch_holds_its_producer(device, how,
                                                                              b_lane):
    """after=[a] orders b on the device; so does passing a's output alone (no after=), and
    after=[a] alone (b reads none of a's outputs). Also on a's own lane, where a ran on a
    caller stream and b runs on the lane's stream."""
    first, second = (double_program(n).method("forward", device=device) for n in ("a", "b"))
    x = data(1)
    held = device.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                a = await sched.submit(first, [x], lane=0, stream=held)
                b = await sched.submit(second, [x if how == "after-only" else a.outputs[0]],
                                       lane=b_lane, after=[] if how == "job-output-only" else [a])
                await wait_until(lambda: b.state == "running")  # enqueued: its lane did not block
                await anyio.sleep(0.05)
                assert not a.done() and not b.done()
                assert not b.event.query()  # on the device: the dependent has not run
                latch.release()
                (out,) = await b
                assert a.event.query()  # a finished on the device before b
                assert a.done()  # and done() says so, whenever a's own lane reports it
        np.testing.assert_array_equal(out.to_host(), (2 if how == "after-only" else 4) * x)
        assert b.span[0] >= a.span[1]  # timing events: b started after a ended


async def test_after_orders_a_caller_stream_job_behind_its_lanes_own_stream(device):
    """a on lane 0's own stream, b on the same lane under a caller stream with after=[a]: b's
    stream must wait for a. Comparing a's stream with the lane's (not with b's) skipped the
    wait, and only one random case of the fuzzer noticed (found by breaking the rule)."""
    slow = spin_program(100_000, "slow").method("forward", device=device)
    second = double_program("b").method("forward", device=device)
    x = data(2)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            a = await sched.submit(slow, [x], lane=0)
            b = await sched.submit(second, [x], lane=0, stream=device.create_stream(),
                                   after=[a])
            (out,) = await b
            assert a.event.query()  # a finished on the device before b
            await a
    np.testing.assert_array_equal(out.to_host(), 2 * x)
    assert b.span[0] >= a.span[1]


async def test_done_agrees_with_the_device_when_a_waiter_reports_late(device, monkeypatch):
    """done(), state and exception() settle a job the device has finished, instead of waiting
    for its lane's waiter thread (here made to report half a second late) to say so."""
    slow = spin_program(50_000, "slow").method("forward", device=device)
    fast = double_program("fast").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            lane0 = sched.lanes[0]
            wait = lane0._wait

            def late(job):
                wait(job)
                time.sleep(0.5)

            monkeypatch.setattr(lane0, "_wait", late)
            a = await sched.submit(slow, [data(0)], lane=0)
            b = await sched.submit(fast, [data(1)], lane=1, after=[a])
            t = time.perf_counter()
            await b
            assert a.done() and a.state == "done" and a.exception() is None
            (y,) = await a
            assert time.perf_counter() - t < 0.4  # neither await waited for the late report
            np.testing.assert_array_equal(y.to_host(), data(0))
            stats = sched.statistics()
        assert stats[0].completed == 1 and stats[0].in_flight == 0
    assert sched.pending == 0


async def test_a_submit_that_waited_for_room_sees_where_the_method_went_meanwhile(device):
    """a's first submit of a new method (no lane asked for) picks lane 0 and waits for room;
    meanwhile b binds the method to lane 1, where a Gate holds it in set_inputs. Once a gets
    room it must not drive the method from lane 0 as if it were still new (two lanes at once:
    InvalidState, or unordered work): it follows the method to lane 1, behind b's job. With
    lane=0 asked for, the same race is a move, ordered after b's job (rule 4)."""
    method = double_program("m").method("forward", device=device)
    fillers = [double_program(f"filler{i}").method("forward", device=device) for i in range(2)]
    held = [device.create_stream(), device.create_stream()]
    gate = Gate(data(2))
    box = {}
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2, queue_size=1) as sched:
            with device.create_latch() as latch0, device.create_latch() as latch1:
                latch0.hold(held[0])
                latch1.hold(held[1])
                for i in range(2):  # both lanes full; a tie, so a new method picks lane 0
                    await sched.submit(fillers[i], [data(0)], lane=i, stream=held[i])

                async def first():
                    box["a"] = await sched.submit(method, [data(1)])

                async def second():
                    box["b"] = await sched.submit(method, [gate], lane=1)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    await anyio.sleep(0.05)
                    tg.start_soon(second)
                    await anyio.sleep(0.05)
                    latch1.release()  # b gets room on lane 1 and binds the method there
                    await anyio.to_thread.run_sync(gate.entered.wait, 5)
                    latch0.release()  # now a gets room on lane 0
                    await anyio.sleep(0.1)
                    gate.open()
            (ya,), (yb,) = await box["a"], await box["b"]
            assert box["a"].lane.index == 1
    np.testing.assert_array_equal(yb.to_host(), 2 * data(2))
    np.testing.assert_array_equal(ya.to_host(), 2 * data(1))


async def test_a_submit_that_follows_its_method_keeps_its_after_and_its_copied_inputs(device):
    """The same race, with ``after=`` an iterator and a numpy input the caller reuses while the
    submit waits for room: following the method to its new lane, the submit started again
    with the caller's arguments, so the iterator was spent (the job ran before the job it was
    to wait for, held on the device) and the array was copied again, after the caller had
    changed it (found by a review). It keeps what it checked and copied before the wait."""
    method = double_program("m").method("forward", device=device)
    fillers = [double_program(f"filler{i}").method("forward", device=device) for i in range(2)]
    before = double_program("before").method("forward", device=device)
    held = [device.create_stream() for _ in range(3)]
    gate = Gate(data(2))
    shared = data(1).copy()
    box = {}
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=3, queue_size=1) as sched:
            with device.create_latch() as latch0, device.create_latch() as latch1, \
                    device.create_latch() as latch2:
                for latch, stream in zip((latch0, latch1, latch2), held, strict=True):
                    latch.hold(stream)
                for i in range(2):  # lanes 0 and 1 full
                    await sched.submit(fillers[i], [data(0)], lane=i, stream=held[i])
                dep = await sched.submit(before, [data(3)], lane=2, stream=held[2])

                async def first():  # a tie: the new method picks lane 0 and waits for room
                    box["a"] = await sched.submit(method, [shared], after=iter([dep]))

                async def second():
                    box["b"] = await sched.submit(method, [gate], lane=1)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    await anyio.sleep(0.05)
                    shared[:] = data(9)  # the caller reuses its array: the submit copied it
                    tg.start_soon(second)
                    await anyio.sleep(0.05)
                    latch1.release()  # b gets room on lane 1 and binds the method there
                    await anyio.to_thread.run_sync(gate.entered.wait, 5)
                    latch0.release()  # a gets room on lane 0, then follows the method
                    await anyio.sleep(0.1)
                    gate.open()
                (yb,) = await box["b"]
                await anyio.sleep(0.2)
                assert not box["a"].done(), "it ran before its after= job, held on the device"
                latch2.release()
            (ya,) = await box["a"]
            assert box["a"].lane.index == 1 and dep.done()
    np.testing.assert_array_equal(yb.to_host(), 2 * data(2))
    np.testing.assert_array_equal(ya.to_host(), 2 * data(1))


async def test_an_explicit_lane_after_waiting_for_room_is_a_move_ordered_after_the_rest(device):
    method = double_program("m").method("forward", device=device)
    filler = double_program("filler").method("forward", device=device)
    held = device.create_stream()
    gate = Gate(data(2))
    box = {}
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2, queue_size=1) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                await sched.submit(filler, [data(0)], lane=0, stream=held)  # lane 0 is full

                async def first():
                    box["a"] = await sched.submit(method, [data(1)], lane=0)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(first)
                    await anyio.sleep(0.05)  # a waits for room on lane 0
                    b = await sched.submit(method, [gate], lane=1)
                    await anyio.to_thread.run_sync(gate.entered.wait, 5)
                    latch.release()
                    await anyio.sleep(0.1)
                    gate.open()
            (ya,), (yb,) = await box["a"], await b
            assert box["a"].lane.index == 0
    np.testing.assert_array_equal(yb.to_host(), 2 * data(2))
    np.testing.assert_array_equal(ya.to_host(), 2 * data(1))


async def test_done_agrees_with_the_device_while_the_loop_is_busy(device):
    """The loop is busy (0.2 s without yielding) while a and then b (after=[a], another lane)
    finish on the device. Lane 0's waiter has claimed a and posted its settle, which the busy
    loop has not run; lane 1's waiter is stuck behind a held job, so nothing has claimed b.
    Looking at b settles it; looking at a must then not say a is still running."""
    slow = spin_program(20_000, "slow").method("forward", device=device)
    fast = double_program("fast").method("forward", device=device)
    other = double_program("other").method("forward", device=device)
    held = device.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                c = await sched.submit(other, [data(0)], lane=1, stream=held)
                a = await sched.submit(slow, [data(1)], lane=0)
                b = await sched.submit(fast, [data(2)], lane=1, after=[a])
                time.sleep(0.2)  # a busy loop: no task, no posted call runs meanwhile
                seen = (b.done(), a.done(), a.state)
                latch.release()
                await c
            (ya,), (yb,) = await a, await b
            stats = sched.statistics()
    assert seen == (True, True, "done"), seen
    assert [s.completed for s in stats] == [1, 2] and all(s.in_flight == 0 for s in stats)
    np.testing.assert_array_equal(ya.to_host(), data(1))
    np.testing.assert_array_equal(yb.to_host(), 2 * data(2))


async def test_the_loop_is_never_blocked_while_jobs_are_held(device):
    method = double_program().method("forward", device=device)
    other = double_program("other").method("forward", device=device)
    held = device.create_stream()
    gate = Gate(data(3))
    lags: list[float] = []
    stop = anyio.Event()

    async def ticker() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            await anyio.sleep(0.002)
            lags.append(time.perf_counter() - t - 0.002)

    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched, anyio.create_task_group() as tg:
            with device.create_latch() as latch:
                latch.hold(held)
                tg.start_soon(ticker)
                on_device = await sched.submit(method, [data(4)], lane=0, stream=held)  # a stream
                on_host = await sched.submit(other, [gate], lane=1)  # a lane thread, in set_inputs
                with anyio.move_on_after(0.3):
                    await on_device  # awaiting held work must not block the loop either
                assert gate.entered.wait(5)
                assert not on_device.done() and not on_host.done()
                latch.release()
                gate.open()
                await on_device
                await on_host
                stop.set()
    assert len(lags) > 50
    assert max(lags) < 0.1, f"loop lag up to {max(lags) * 1e3:.1f} ms"


async def test_a_lane_launches_without_releasing_the_gil_only_while_its_queue_is_short(
        device, monkeypatch):
    """Lanes keep the GIL through launches (Device.hold_gil), but never while enough of their
    work is queued on the device that a launch could block on a full stream queue: a launch
    stuck with the GIL held would stall the loop (and, behind a latch, never end)."""
    from streamlane.sched.lane import HOLD_GIL_BELOW

    settings: list[tuple[str, bool, int | None]] = []  # thread, on, the lane's queued calls
    scheds: list[Scheduler] = []
    real = type(device).hold_gil

    def hold_gil(self, on):
        name = threading.current_thread().name
        queued = scheds[0].lanes[0]._queued_calls if name.startswith("streamlane-lane") else None
        settings.append((name, on, queued))
        real(self, on)

    monkeypatch.setattr(type(device), "hold_gil", hold_gil)
    method = double_program().method("forward", device=device)
    x = Result.from_host(data(0), device)
    x.to_host()
    held = device.create_stream()
    # Past the bound, but short of a full CUDA stream queue (about a thousand entries), where
    # the lane would block in the driver before all of them are in flight:
    count = 6 * HOLD_GIL_BELOW // 5 // (len(method.definition.steps) + 4)
    with anyio.fail_after(60):
        async with Scheduler(device, lanes=1, queue_size=count) as sched:
            scheds.append(sched)  # the lane's first setting comes with the first job
            with device.create_latch() as latch:
                latch.hold(held)
                # A host input keeps every job on the lane thread (the loop enqueues only jobs
                # whose inputs are on the device: Lane.run_inline).
                jobs = [await sched.submit(method, [data(0)], stream=held)
                        for _ in range(count)]
                await wait_until(lambda: sched.statistics()[0].in_flight == count)
                latch.release()
            for job in jobs:
                await job
            await sched.run(method, [x])
    per_job = jobs[0]._calls
    first_over = per_job * -(-HOLD_GIL_BELOW // per_job)  # queued calls once past the bound
    lane = [(on, queued) for name, on, queued in settings if name.startswith("streamlane-lane")]
    assert [on for on, _ in lane] == [True, False, True], lane
    assert lane[0][1] == 0, "the first job did not keep the GIL"
    assert lane[1][1] == first_over, "let go of the GIL at the wrong queue length"
    assert lane[2][1] < HOLD_GIL_BELOW, "the queue drained: launches keep the GIL again"
    assert ("streamlane-wait-0", True, None) in settings


async def test_a_full_lane_makes_submit_wait(device):
    method = double_program().method("forward", device=device)
    held = device.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, queue_size=2) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                jobs = [await sched.submit(method, [data(i)], stream=held) for i in range(2)]
                with anyio.move_on_after(0.2) as scope:
                    await sched.submit(method, [data(2)], stream=held)
                assert scope.cancelled_caught, "the third submit should wait for room"
                (stats,) = sched.statistics()
                assert stats.queued + stats.in_flight == 2
                async with anyio.create_task_group() as tg:
                    third: list[Job] = []

                    async def submit_third() -> None:
                        third.append(await sched.submit(method, [data(2)], stream=held))

                    tg.start_soon(submit_third)
                    await anyio.sleep(0.05)
                    assert not third
                    latch.release()
                results = [await job for job in (*jobs, *third)]
    for i, (out,) in enumerate(results):
        np.testing.assert_array_equal(out.to_host(), 2 * data(i))


async def test_new_methods_spread_over_the_lanes_by_the_methods_alive(host):
    """With the lanes idle, a new method goes to the lane with the fewest methods bound. A
    dropped method was still counted (a service binding a method per request made one lane
    look full forever: every later method went to the other)."""
    program = double_program()
    async with Scheduler(host, lanes=2) as sched:
        for _ in range(50):  # a method per request, on lane 0, dropped after
            await sched.run(program.method("forward", device=host), [data(0)], lane=0)
        gc.collect()
        kept = [program.method("forward", device=host) for _ in range(4)]
        picked = []
        for m in kept:
            await sched.run(m, [data(1)])
            picked.append(sched._methods[m].lane.index)
        assert picked == [0, 1, 0, 1]
        moved = program.method("forward", device=host)
        await sched.run(moved, [data(2)], lane=0)
        await sched.run(moved, [data(3)], lane=1)  # a move counts on its new lane only
        assert [len(lane.methods) for lane in sched.lanes] == [2, 3]


async def test_a_method_stays_on_its_lane_until_moved_and_the_move_is_ordered(device):
    m1 = double_program("m1").method("forward", device=device)
    m2 = double_program("m2").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            a = await sched.submit(m1, [data(0)])
            b = await sched.submit(m1, [data(1)])
            c = await sched.submit(m2, [data(2)])  # a new method goes to the least loaded lane
            assert a.lane is b.lane and c.lane is not a.lane
            # Hold the method's job inside set_inputs on its lane thread, then move the method:
            # the moved job must wait for it on the host, so the method is never driven by two
            # threads at once (the runtime would refuse with InvalidState).
            gate = Gate(data(3))
            held = await sched.submit(m1, [gate])
            moved = await sched.submit(m1, [data(4)], lane=c.lane.index)
            assert moved.lane is c.lane
            follow = await sched.submit(m1, [data(5)])  # stays on the new lane
            assert follow.lane is c.lane
            assert gate.entered.wait(5)
            await anyio.sleep(0.05)
            assert moved.state == "queued"
            gate.open()
            outs = [await j for j in (a, b, c, held, moved, follow)]
    for i, (out,) in enumerate(outs):
        np.testing.assert_array_equal(out.to_host(), 2 * data(i))


async def test_numpy_inputs_are_copied_at_submit(device):
    method = double_program().method("forward", device=device)
    x = data(6)
    want = 2 * x
    async with Scheduler(device, lanes=1) as sched:
        job = await sched.submit(method, [x])
        x[:] = 0  # the caller may reuse its array as soon as submit returns
        (out,) = await job
    np.testing.assert_array_equal(out.to_host(), want)


async def test_a_bad_input_is_the_submits_error_and_takes_nothing(device):
    """What can be checked at submit() is checked there, as set_inputs() checks it: the count,
    numpy arrays, Results, job outputs, numbers and objects no input can be. The submit raises
    InvalidInput naming the input, before it waits for room on a full lane, and no job is
    made."""
    method = double_program().method("forward", device=device)
    other = spin_program(0, "wide").method("forward", device=device)
    zero_d = Program.build("scalar")
    f = zero_d.method("forward", a=("float32", []))
    f.output(f.step("add", "a", "a", out="y"))
    scalar = zero_d.finish().method("forward", device=device)
    good = data(1)
    wrong_result = Result.from_host(np.zeros((3, 3), np.float32), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, queue_size=1) as sched:
            first = await sched.submit(other, [good])
            cases = [
                ([], None, "expected 1 inputs, got 0"),
                ([good, good], None, "expected 1 inputs, got 2"),
                ([good.astype(np.float64)], 0, "got dtype float64"),
                ([np.zeros((3, 3), np.float32)], 0, r"got shape \[3, 3\]"),
                ([wrong_result], 0, r"got shape \[3, 3\]"),
                ([None], 0, "got NoneType"),
                (["x"], 0, "got str"),
                ([2.0], 0, "got a Python number 2.0"),
            ]
            for inputs, index, message in cases:
                for call in (sched.submit, sched.run):
                    with pytest.raises(InvalidInput, match=message) as info:
                        await call(method, inputs)
                    assert info.value.index == index and info.value.method == method.name
            with pytest.raises(InvalidInput, match=r"input 0 of method 'scalar\.forward': "
                               r"expected float32\[\], got shape \[4, 8\]"):
                await sched.submit(scalar, [good])  # an array for a scalar
            assert sched.pending == 1  # nothing counted for the refusals
            (y,) = await first
            (k,) = await sched.run(scalar, [3])  # a number is checked and passed
            assert sched.pending == 0
    np.testing.assert_array_equal(y.to_host(), good)
    assert k.to_host() == np.float32(6.0)


async def test_a_job_output_of_another_shape_is_the_submits_error(device):
    b = Program.build("rows")
    m = b.method("forward", x=("float32", [3, 3]))
    m.output(m.step("copy", "x", out="y"))
    rows = b.finish().method("forward", device=device)
    method = double_program().method("forward", device=device)
    async with Scheduler(device, lanes=2) as sched:
        producer = await sched.submit(rows, [np.ones((3, 3), np.float32)], lane=0)
        with pytest.raises(InvalidInput, match=r"input 0 of method 'double\.forward': "
                           r"expected float32\[4, 8\], got <JobOutput 0 of .*float32\[3, 3\]"):
            await sched.submit(method, [producer.outputs[0]], lane=1)
        class Mine(JobOutput):
            __slots__ = ()

        unset = JobOutput.__new__(JobOutput)
        for made in (JobOutput(producer, 1), JobOutput(producer, -1), JobOutput("job", 0),
                     JobOutput(producer, np.int64(0)), Mine(producer, 0), unset):
            with pytest.raises(InvalidInput, match="naming no output of a job") as info:
                await sched.submit(rows, [made])
            assert info.value.index == 0
        with pytest.raises(InvalidArgument, match=r"inputs must be a list .*got ndarray"):
            await sched.submit(rows, np.ones((3, 3), np.float32))
        (y,) = await producer
    np.testing.assert_array_equal(y.to_host(), np.ones((3, 3), np.float32))


async def test_a_caller_stream_job_runs_on_that_stream(device):
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    async with Scheduler(device, lanes=1) as sched:
        (out,) = await sched.run(method, [data(7)], stream=stream)
        (plain,) = await sched.run(method, [data(8)])  # back on the lane: rule 4 orders it
        tracks = sched.timeline().tracks()
    np.testing.assert_array_equal(out.to_host(), 2 * data(7))
    np.testing.assert_array_equal(plain.to_host(), 2 * data(8))
    assert tracks[0] == "lane 0" and tracks[1].startswith("lane 0 stream ")


async def test_leaving_normally_drains_pending_jobs(device):
    method = spin_program(20_000).method("forward", device=device)
    async with Scheduler(device, lanes=2) as sched:
        jobs = [await sched.submit(method, [data(i)]) for i in range(5)]
        assert not all(j.done() for j in jobs)
    assert all(j.state == "done" for j in jobs)
    for i, job in enumerate(jobs):
        np.testing.assert_array_equal(job.results[0].to_host(), data(i))


async def test_a_job_given_up_on_fails_the_exit_unless_handed_to_a_task_that_forgets_it(host):
    """README's "Serving requests": an await cancelled before its job failed leaves the error
    unseen, so leaving the scheduler raises it; a task that awaits the job and suppresses its
    error (the pattern README gives) takes it out of the way."""
    import contextlib

    from streamlane.runtime.errors import StreamlaneError

    method = double_program().method("forward", device=host)
    bad = LateBad()  # the wrong shape: the job fails when its lane runs it

    async def forget(job):
        with contextlib.suppress(StreamlaneError):
            await job

    for handed in (False, True):
        with anyio.fail_after(30):
            with pytest.raises(InvalidInput) if not handed else contextlib.nullcontext():
                async with Scheduler(host, lanes=1) as sched, anyio.create_task_group() as tg:
                    job = await sched.submit(method, [bad])
                    with anyio.move_on_after(0):  # the client gave up
                        await job
                    if handed:
                        tg.start_soon(forget, job)
            assert job.state == "failed"


async def test_leaving_on_an_error_cancels_jobs_not_yet_enqueued(device):
    method = double_program().method("forward", device=device)
    gate = Gate(data(0))
    jobs: list[Job] = []
    opener = threading.Timer(0.2, gate.open)
    with anyio.fail_after(30), pytest.raises(RuntimeError, match="boom"):
        async with Scheduler(device, lanes=1) as sched:
            jobs.append(await sched.submit(method, [gate]))
            jobs.extend([await sched.submit(method, [data(i)]) for i in range(1, 4)])
            assert gate.entered.wait(5)
            opener.start()  # the gate opens while the scheduler is leaving
            raise RuntimeError("boom")
    opener.join()
    assert jobs[0].state == "done", jobs[0]._error  # already in the runtime: it runs to completion
    assert [j.state for j in jobs[1:]] == ["cancelled"] * 3
    for job in jobs[1:]:
        with pytest.raises(SchedulerClosed, match="cancelled before it ran"):
            await job


async def test_leaving_on_an_error_cancels_a_job_waiting_for_another_lane_too(device):
    """b (lane 1, after=[a]) already waits on its lane thread for a, queued on lane 0 behind a
    held job, when the block raises: a is cancelled, and so is b (it never ran either), not
    failed with DependencyFailed."""
    method = double_program().method("forward", device=device)
    other = double_program("other").method("forward", device=device)
    gate = Gate(data(0))
    opener = threading.Timer(0.2, gate.open)
    with anyio.fail_after(30), pytest.raises(RuntimeError, match="boom"):
        async with Scheduler(device, lanes=2) as sched:
            held = await sched.submit(method, [gate], lane=0)
            a = await sched.submit(method, [data(1)], lane=0)
            b = await sched.submit(other, [data(2)], lane=1, after=[a])
            assert gate.entered.wait(5)
            await anyio.sleep(0.05)  # b's lane thread is waiting for a to be enqueued
            opener.start()
            raise RuntimeError("boom")
    opener.join()
    assert [held.state, a.state, b.state] == ["done", "cancelled", "cancelled"]
    for job in (a, b):
        with pytest.raises(SchedulerClosed, match="cancelled before it ran"):
            await job


async def test_threads_are_joined_on_exit_and_closing_twice_is_a_no_op(device):
    method = double_program().method("forward", device=device)
    await anyio.to_thread.run_sync(lambda: None)  # anyio's worker thread belongs in the baseline
    gc.collect()  # streams other tests dropped stop their host workers now, not mid-test
    baseline = threading.active_count()
    sched = Scheduler(device, lanes=3)
    async with sched:
        assert threading.active_count() >= baseline + 6  # a lane and a waiter per lane
        await sched.run(method, [data(0)])
    await sched.aclose()
    await sched.aclose()
    assert all(not lane.thread.is_alive() and not lane.waiter.is_alive() for lane in sched.lanes)
    assert wait_threads(baseline) <= baseline  # streams of earlier tests may also stop
    assert "closed" in repr(sched)


async def test_a_second_aclose_while_the_first_drains_returns_when_it_is_done(device):
    method = double_program().method("forward", device=device)
    held = device.create_stream()
    returned = []
    with anyio.fail_after(30):
        sched = Scheduler(device, lanes=1)
        await sched.__aenter__()
        with device.create_latch() as latch:
            latch.hold(held)
            job = await sched.submit(method, [data(0)], stream=held)

            async def close(name):
                await sched.aclose()
                returned.append((name, job.done(), sched.lanes[0].thread.is_alive()))

            async with anyio.create_task_group() as tg:
                tg.start_soon(close, "first")
                await anyio.sleep(0.05)
                tg.start_soon(close, "second")
                await anyio.sleep(0.05)
                assert returned == [], "an aclose returned while the job was still held"
                latch.release()
    assert sorted(returned) == [("first", True, False), ("second", True, False)]


async def test_submit_outside_the_context_raises(device):
    method = double_program().method("forward", device=device)
    sched = Scheduler(device, lanes=1)
    with pytest.raises(InvalidState, match="async with Scheduler"):
        await sched.submit(method, [data(0)])
    async with sched:
        with pytest.raises(InvalidState, match="already entered"):
            await sched.__aenter__()
    with pytest.raises(SchedulerClosed, match="closed"):
        await sched.submit(method, [data(0)])
    never = Scheduler(device, lanes=1)
    await never.aclose()  # closed before it was ever entered: it said "already entered"
    with pytest.raises(InvalidState, match="was closed; create a new Scheduler"):
        await never.__aenter__()


async def test_bad_arguments_raise_invalid_argument(device):
    method = double_program().method("forward", device=device)
    async with Scheduler(device, lanes=2) as sched:
        with pytest.raises(InvalidArgument, match=r"lane must be an int in 0\.\.1"):
            await sched.submit(method, [data(0)], lane=2)
        with pytest.raises(InvalidArgument, match="lane must be"):
            await sched.submit(method, [data(0)], lane=True)
        with pytest.raises(InvalidArgument, match="after"):
            await sched.submit(method, [data(0)], after=["job"])
        for bad in (42, "s", object()):  # the message said None meant the legacy stream
            with pytest.raises(InvalidArgument, match=r"stream= takes a Stream.*None to run "
                                                      r"the job on its lane's own stream"):
                await sched.submit(method, [data(0)], stream=bad)
        with pytest.raises(InvalidArgument, match="after= takes an iterable"):
            await sched.submit(method, [data(0)], after=None)
        with pytest.raises(InvalidArgument, match="per-thread stream"):
            await sched.submit(method, [data(0)], stream=device.per_thread_stream())

        class PerThread:  # CuPy's Stream.ptds: ran on whichever thread enqueued the job
            def __cuda_stream__(self):
                return (0, 2)

        with pytest.raises(InvalidArgument, match="names the per-thread default stream"):
            await sched.submit(method, [data(0)], stream=PerThread())

        class NotReady:  # the property's own AttributeError, not "has no __cuda_stream__"
            @property
            def __cuda_stream__(self):
                raise AttributeError("not initialised yet")

        with pytest.raises(InvalidArgument, match=r"NotReady.__cuda_stream__ raised "
                                                  r"AttributeError\('not initialised yet'\)"):
            await sched.submit(method, [data(0)], stream=NotReady())
        # One that cannot be read was accepted, took lane room and failed only when awaited.
        for stream in (type("S", (), {"__cuda_stream__": lambda s: None})(),
                       type("S", (), {"__cuda_stream__": lambda s: "abc"})(),
                       type("S", (), {"__cuda_stream__": 5})(),
                       type("S", (), {"__cuda_stream__": lambda s: (0, -1)})(),
                       type("S", (), {"__cuda_stream__": lambda s: (0, 2**70)})()):
            with pytest.raises(InvalidArgument, match="__cuda_stream__"):
                await sched.submit(method, [data(0)], stream=stream)
        assert sched.pending == 0
        # a lane picked with np.argmin was refused as "not an int in 0..1"
        for lane in (np.int64(1), np.uint8(0)):
            np.testing.assert_array_equal(
                (await sched.run(method, [data(1)], lane=lane))[0].to_host(), 2 * data(1))
        class BadIndex:  # its __index__ raises: not an int, as before (ValueError escaped)
            def __index__(self):
                raise ValueError("no")

        for bad in (np.int64(2), np.float64(1.0), np.bool_(True), 1.0, BadIndex()):
            with pytest.raises(InvalidArgument, match=r"lane must be an int in 0\.\.1"):
                await sched.submit(method, [data(0)], lane=bad)
        stream = device.create_stream()
        await sched.run(method, [data(0)], stream=stream)
        stream.close()  # a stream that passed before is checked again
        with pytest.raises(InvalidArgument, match="is closed") as info:
            await sched.submit(method, [data(0)], stream=stream)
        assert isinstance(info.value, StreamClosed)  # as the runtime says it
        with pytest.raises(InvalidArgument, match="inputs must be a list"):
            await sched.submit(method, data(0))
        with pytest.raises(InvalidArgument, match=r"inputs must be a list .*got str"):
            await sched.submit(method, "x")
        first = await sched.submit(method, [data(0)])  # job.outputs as they are (a Sequence,
        chained = await sched.run(method, first.outputs)  # not a list) were refused
        np.testing.assert_array_equal(chained[0].to_host(), 4 * data(0))
        with pytest.raises(InvalidArgument, match="takes a Method"):
            await sched.submit(print, [data(0)])
    with pytest.raises(InvalidArgument, match="lanes must be an int >= 1"):
        Scheduler(device, lanes=0)
    for name in ("lanes", "queue_size", "timeline_size"):
        with pytest.raises(InvalidArgument, match=f"{name} must be an int"):
            Scheduler(device, **{name: np.bool_(True)})
        with pytest.raises(InvalidArgument, match=f"{name} must be an int"):
            Scheduler(device, **{name: 2.0})
    numbered = Scheduler(device, lanes=np.int64(3), queue_size=np.int32(8),
                         timeline_size=np.uint16(5))
    assert (len(numbered.lanes), numbered.queue_size) == (3, 8)
    assert all(type(v) is int for v in (numbered.queue_size,))
    await numbered.aclose()
    start = time.perf_counter()  # 10**6 lanes ran for minutes in the constructor
    with pytest.raises(InvalidArgument, match=r"lanes must be at most 1024 .*caller streams"):
        Scheduler(device, lanes=10**6)
    assert time.perf_counter() - start < 1


async def test_reprs_show_state(device):
    method = double_program().method("forward", device=device)
    held = device.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                job = await sched.submit(method, [data(0)], lane=1, stream=held)
                await wait_until(lambda: job.state == "running")
                assert repr(sched.lanes[1]) == f"<Lane 1 {device.name}, 0 queued, 1 in flight>"
                assert repr(job) == f"<Job #{job.id} double.forward lane=1 caller-stream running>"
                assert repr(sched) == f"<Scheduler {device.name}, 2 lanes, open, 1 pending>"
                latch.release()
                await job
                assert repr(job) == f"<Job #{job.id} double.forward lane=1 caller-stream done>"
                plain = await sched.submit(method, [data(0)])
                await plain
                assert repr(plain) == f"<Job #{plain.id} double.forward lane=1 done>"
                assert repr(sched.lanes[0]) == f"<Lane 0 {device.name}, 0 queued>"



async def test_finished_jobs_are_freed_without_the_cycle_collector(host):
    """A job and its outputs form no reference cycle: once awaited and dropped, its output
    buffers return to the method's pool at once, so steady-state runs do not allocate per call
    — also when a job's output feeds the next job on another lane."""
    m = double_program().method("forward", device=host)
    x = data(0)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=2, timing=False) as sched:
            for _ in range(20):
                job = await sched.submit(m, [x])
                await sched.run(m, [job.outputs[0]], lane=1)
            del job
            gc.collect()
            gc.disable()
            try:
                allocations = host.stats.allocations
                for _ in range(50):
                    job = await sched.submit(m, [x], lane=0)
                    (out,) = await sched.run(m, [job.outputs[0]], lane=1)
                # The loop may settle job N only after the lane ran job N+1 (or N+2), and later
                # still on a loaded machine (2 busy cores: up to 19 here), so some buffers join
                # the pool once; allocating per job would be 100.
                assert host.stats.allocations - allocations <= 30
                assert gc.collect() == 0, "something is freed only by the cycle collector"
            finally:
                gc.enable()
    np.testing.assert_array_equal(out.to_host(), 4 * x)


async def test_jobs_settled_by_the_waiter_are_not_kept_by_it(host):
    """The waiter thread settles a batch of jobs and then waits for the next: it must not keep
    the last of them (and its output buffers) alive while it waits."""
    import weakref

    m = double_program().method("forward", device=host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1) as sched:
            with host.create_stream() as held, host.create_latch() as latch:
                latch.hold(held)
                jobs = [await sched.submit(m, [data(i)], stream=held) for i in range(5)]
                latch.release()
                for job in jobs:
                    await job
            refs = [weakref.ref(job) for job in jobs]
            del jobs, job
            await anyio.sleep(0.05)
            gc.collect()
            assert [i for i, ref in enumerate(refs) if ref() is not None] == []


async def test_submit_await_and_close_from_another_thread_raise_invalid_state(device):
    """A scheduler's jobs and queues belong to the loop that entered it: another loop or
    thread gets InvalidState at once, nothing is submitted, and nothing hangs or leaks."""
    m = spin_program(300_000, "held").method("forward", device=device)  # y = x, after 0.3 s
    x = data(0)

    def from_other_loop(fn):
        async def call():
            return await fn()

        with pytest.raises(InvalidState, match="another thread than the event loop"):
            anyio.run(call)

    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(m, [x])
            await anyio.to_thread.run_sync(from_other_loop, lambda: sched.submit(m, [x]))
            await anyio.to_thread.run_sync(from_other_loop, job.wait)  # not finished yet
            await anyio.to_thread.run_sync(from_other_loop, sched.aclose)
            (out,) = await job
            assert sched.statistics()[0].completed == 1
    np.testing.assert_array_equal(out.to_host(), x)
    assert not [t for t in threading.enumerate() if t.name.startswith("streamlane-lane")]


@pytest.mark.parametrize("second", ["asyncio", "trio"])
@pytest.mark.parametrize("first", ["asyncio", "trio"])
def test_a_scheduler_left_open_by_an_ended_loop_refuses_the_next_loop(first, second):
    """Loop one ends with the scheduler open and a job in flight (a test fixture, a second
    asyncio.run on the same thread); loop two, on the same thread, gets InvalidState from
    submit, await and close at once (they hung: nothing settles jobs in a loop that ended), and
    can still await a job that had finished."""
    dev = get_device("host")
    m, spin = double_program().method("forward", device=dev), \
        spin_program(300_000).method("forward", device=dev)
    held: dict = {}

    async def loop_one():
        sched = held["sched"] = await Scheduler(dev, lanes=1).__aenter__()
        held["done"] = await sched.submit(m, [data(0)])
        await held["done"]
        held["running"] = await sched.submit(spin, [data(1)])

    async def loop_two():
        sched = held["sched"]
        for attempt in (lambda: sched.run(m, [data(2)]), held["running"].wait, sched.aclose):
            with anyio.fail_after(5), pytest.raises(InvalidState, match="another event loop"):
                await attempt()
        (out,) = await held["done"]
        return out.to_host()

    anyio.run(loop_one, backend=first)
    try:
        np.testing.assert_array_equal(anyio.run(loop_two, backend=second), 2 * data(0))
    finally:  # the lanes of a scheduler no loop can close: stopped by hand
        for lane in held["sched"].lanes:
            lane.stop()
        for lane in held["sched"].lanes:
            lane.join()


UNCLOSED = """
import sys, anyio
from streamlane.runtime import get_device
from streamlane.sched import Scheduler

async def main():
    kept = await Scheduler(get_device("host"), lanes=2).__aenter__()
    twin = await Scheduler(get_device("host"), lanes=2).__aenter__()  # the same repr
    if sys.argv[1] == "close":
        await kept.aclose()
        await twin.aclose()
    async with Scheduler(get_device("host"), lanes=1):
        pass
    return kept

kept = anyio.run(main)
print("RESULT", kept)
"""


@pytest.mark.parametrize("close", ["close", "leave open"])
def test_a_scheduler_never_closed_gives_a_resource_warning_at_exit(close):
    """Its lane threads are daemons: the process exits without waiting for them, and nothing
    said so. Now a ResourceWarning names each one (two with the same repr: two warnings), as
    for an unclosed file; a closed one says nothing."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c", UNCLOSED, close],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "RESULT <Scheduler" in out.stdout, out
    warned = [line for line in out.stderr.splitlines() if "ResourceWarning" in line]
    if close == "close":
        assert warned == [], out.stderr
    else:
        assert len(warned) == 2 and all("2 lanes" in w and "was never closed" in w
                                        for w in warned), out.stderr


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "lane enqueues"])
async def test_a_caller_stream_closed_right_after_submit_still_runs_the_job(device, inline):
    """submit() promises the job will run: leaving `with device.create_stream() as s:` right
    after submitting on it (the job held back, or queued for its lane) closes the stream
    once the job is enqueued, not before."""
    m = double_program().method("forward", device=device)
    x = data(3)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, inline=inline) as sched:
            first = Result.from_host(x, device)
            with device.create_stream() as s:
                job = await sched.submit(m, [first], stream=s)
            assert s.closed
            with pytest.raises(StreamClosed):
                await sched.submit(m, [first], stream=s)
            (out,) = await job
            np.testing.assert_array_equal(out.to_host(), 2 * x)


async def test_a_caller_stream_closed_while_its_submit_waits_for_room_frees_the_room(device):
    """The stream is checked again once there is room: the submit raises ClosedStreamGiven and
    gives the room back (it leaked, and the next submit on that lane waited forever)."""
    from streamlane.sched import ClosedStreamGiven

    first = double_program("a").method("forward", device=device)
    second = double_program("b").method("forward", device=device)
    held, doomed = device.create_stream(), device.create_stream()
    box = {}
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, queue_size=1) as sched:
            with device.create_latch() as latch:
                latch.hold(held)
                job = await sched.submit(first, [data(0)], stream=held)  # the lane is full

                async def submit_waiting_for_room():
                    try:
                        await sched.submit(second, [data(1)], stream=doomed)
                    except Exception as exc:  # reported below
                        box["error"] = exc

                async with anyio.create_task_group() as tg:
                    tg.start_soon(submit_waiting_for_room)
                    await anyio.sleep(0.05)
                    doomed.close()
                    latch.release()
            await job
            assert isinstance(box.get("error"), ClosedStreamGiven), box
            (out,) = await sched.run(first, [data(2)])  # the room came back
    np.testing.assert_array_equal(out.to_host(), 2 * data(2))


@pytest.mark.anyio
async def test_another_thread_using_the_method_mid_job_is_refused_never_mixed_in(device,
                                                                                monkeypatch):
    """Rule 4 for a method a scheduler runs while another thread uses it too (a second
    scheduler, a direct ``m(x)``): the lane holds the method from the job's inputs to its
    outputs, so the other call is refused with ``InvalidState`` and the job computes its own
    inputs. The lane once set the inputs and executed in two calls; a call landing between
    them ran the job on the other thread's inputs, silently."""
    from streamlane.runtime.method import Method

    method = double_program().method("forward", device=device)
    x, y = data(1), data(2) * 1000
    loop_thread = threading.get_ident()
    refused = []

    def interfere():  # another thread's whole call, while the lane is mid-job
        def call():
            try:
                method([y])
            except InvalidState:
                refused.append(True)
            else:
                refused.append(False)

        other = threading.Thread(target=call)
        other.start()
        other.join()

    def hooked(name):
        real = getattr(Method, name)

        def wrapper(self, *args, **kwargs):
            result = real(self, *args, **kwargs)
            if threading.get_ident() != loop_thread and threading.current_thread().name.startswith(
                    "streamlane-lane"):
                interfere()
            return result

        return wrapper

    # after the inputs are in (the old two-call window), and inside the execute
    monkeypatch.setattr(Method, "set_inputs", hooked("set_inputs"))
    monkeypatch.setattr(Method, "_execute", hooked("_execute"))
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, inline=False) as sched:
            (out,) = await sched.run(method, [x])
            got = out.to_host()
    np.testing.assert_allclose(got, 2 * x, rtol=1e-6)
    assert refused and all(refused), refused


@pytest.mark.anyio
async def test_done_is_true_when_the_waiter_claims_the_job_as_the_loop_looks(host):
    """``done()`` looks at a job the device has finished just as its waiter claims it: the
    loop's own settle then finds nothing to settle, and the job is finished from the claim.
    A job never looks unfinished after one ordered after it (``after=``) is done."""
    import sys

    loop_queried, waiter_claimed = threading.Event(), threading.Event()

    class PausingLock:  # lane 0's lock: the waiter's claim lands between the loop's query
        def __init__(self, lock):  # and its own claim
            self.lock = lock

        def __enter__(self):
            caller = sys._getframe(1).f_code.co_name
            waiter = threading.current_thread().name.startswith("streamlane-wait")
            if caller == "_settle" and waiter and not waiter_claimed.is_set():
                loop_queried.wait(5)
            elif caller == "_settle" and not waiter and not loop_queried.is_set():
                loop_queried.set()
                waiter_claimed.wait(5)
            return self.lock.__enter__()

        def __exit__(self, *exc):
            self.lock.__exit__(*exc)
            if sys._getframe(1).f_code.co_name == "_settle" and \
                    threading.current_thread().name.startswith("streamlane-wait"):
                waiter_claimed.set()

    a_m = spin_program(2000, "a").method("forward", device=host)
    b_m = double_program("b").method("forward", device=host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=2, poll_us=0) as sched:
            sched.lanes[0]._lock = PausingLock(sched.lanes[0]._lock)
            a = await sched.submit(a_m, [data(0)], lane=0)
            b = await sched.submit(b_m, [data(1)], lane=1, after=[a])
            await b
            assert loop_queried.is_set() or a.done()
            assert a.done() and a.state == "done"
            await a


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["submit", "run"])
async def test_an_interrupt_as_a_lone_job_is_handed_over_leaves_no_job_counted(host, where):
    """An interrupt on the loop as a lone caller-stream job is counted for its lane and held
    back (``submit``), or as the loop starts to enqueue it (``run``): the job is settled
    without a lane running it, and taken out of the lane's queued count."""
    from streamlane.sched.lane import Lane

    if where == "submit":  # the line after the job is counted for its lane
        cut = RaiseAt(Scheduler._enqueue, "lane.park(job)", offset=1)
    else:  # as the loop's enqueue starts
        cut = RaiseAt(Lane._execute, "if not job._take():")
    method = double_program().method("forward", device=host)
    stream = host.create_stream()
    x = Result.from_host(data(0), host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1) as sched:
            with cut, pytest.raises(Interrupt):
                if where == "submit":
                    await sched.submit(method, [x], stream=stream)
                else:
                    await sched.run(method, [x], stream=stream)
            (y,) = await sched.run(method, [x], stream=stream)  # the scheduler goes on
            np.testing.assert_array_equal(y.to_host(), 2 * data(0))
    assert cut.hits == 1
    (stats,) = sched.statistics()
    assert (stats.queued, stats.in_flight, stats.completed, sched.pending) == (0, 0, 2, 0)


@pytest.mark.anyio
async def test_failed_jobs_whose_error_was_seen_are_not_kept(host):
    """The scheduler keeps a failed job until its error has been seen (leaving raises the first
    nobody saw), not for its whole life: a long-lived scheduler with bad inputs now and then
    does not hold every failed job and its traceback."""
    method = double_program().method("forward", device=host)
    bad = LateBad()  # the wrong shape: refused at enqueue
    with anyio.fail_after(60):
        async with Scheduler(host, lanes=1) as sched:
            for _ in range(500):
                job = await sched.submit(method, [bad])
                with pytest.raises(InvalidInput):
                    await job
            kept = len(sched._unobserved)
    assert kept < 200, kept


@pytest.mark.anyio
async def test_a_method_whose_outputs_are_views_is_refused(device):
    """clone_outputs=False outputs are views each execute overwrites; the scheduler picks when
    executes run, so it cannot keep a job's outputs for its await or its consumers."""
    from streamlane.runtime.errors import NotSupported

    views = double_program("views").method("forward", device=device, clone_outputs=False)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            with pytest.raises(NotSupported, match="clone_outputs=True"):
                await sched.submit(views, [data(0)])
            with pytest.raises(NotSupported, match="clone_outputs=False"):
                await sched.run(views, [data(0)])
            assert sched.pending == 0 and sched.statistics()[0].queued == 0
            (view,) = views([data(1)])  # called directly: a view as another job's input
            with pytest.raises(NotSupported, match="a view"):
                await sched.submit(double_program("reader").method("forward", device=device),
                                   [view])
            (y,) = await sched.run(double_program("copies").method("forward", device=device),
                                   [data(0)])
    np.testing.assert_allclose(y.to_host(), 2 * data(0), rtol=1e-6)


@pytest.mark.anyio
async def test_a_finished_job_can_be_awaited_from_a_loop_on_another_thread(device):
    method = double_program("elsewhere").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(method, [data(3)])
            pending = await sched.submit(spin_program(200_000, "long").method(
                "forward", device=device), [data(4)])
            await job

            def elsewhere(target):
                async def main():
                    return await target

                return anyio.run(main)

            (y,) = await anyio.to_thread.run_sync(elsewhere, job)
            with pytest.raises(InvalidState, match="another thread"):
                await anyio.to_thread.run_sync(elsewhere, pending)  # not finished: refused
            await pending
    np.testing.assert_allclose(y.to_host(), 2 * data(3), rtol=1e-6)
    (again,) = await anyio.to_thread.run_sync(elsewhere, job)  # and after the close
    np.testing.assert_allclose(again.to_host(), 2 * data(3), rtol=1e-6)


@pytest.mark.anyio
async def test_a_method_in_use_by_another_scheduler_is_refused_at_submit(device):
    """Two schedulers drive one method; while one has a job of it not finished (a Gate input
    keeps its lane thread inside the call), the other's submit is refused with
    ``MethodBusy`` saying what to do. It used to be accepted, and the job failed at its
    await, or not, by timing: half the jobs of an interleaved burst of two schedulers failed
    at random. One after the other they share it (rule 4 orders the hand-over)."""
    from streamlane.runtime.errors import MethodBusy

    method = double_program("shared").method("forward", device=device)
    gate = Gate(data(5))
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as one, Scheduler(device, lanes=1) as two:
            held = await one.submit(method, [gate])
            await anyio.to_thread.run_sync(gate.entered.wait, 5)
            with pytest.raises(MethodBusy, match=r"not yet enqueued.*one method per scheduler"):
                await two.submit(method, [data(6)])
            gate.open()
            (y,) = await held
            (z,) = await two.run(method, [data(7)])  # free again: it runs
            ys = []
            for i in range(20):  # taking turns, each awaited: never refused
                sched = (one, two)[i % 2]
                ys.append((await sched.run(method, [data(i)]))[0].to_host())
    np.testing.assert_allclose(y.to_host(), 2 * data(5), rtol=1e-6)
    np.testing.assert_allclose(z.to_host(), 2 * data(7), rtol=1e-6)
    for i, value in enumerate(ys):
        np.testing.assert_allclose(value, 2 * data(i), rtol=1e-6)


@pytest.mark.anyio
async def test_a_dependency_failure_names_the_jobs_without_a_state_they_left(device):
    method = double_program("first").method("forward", device=device)
    other = double_program("second").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2) as sched:
            bad = await sched.submit(method, [LateBad()], lane=0)
            dependent = await sched.submit(other, [bad.outputs[0]], lane=1)
            with pytest.raises(Exception) as info:
                await dependent
            with pytest.raises(InvalidInput):
                await bad
    assert type(info.value).__name__ == "DependencyFailed"
    assert str(info.value).startswith(
        f"<Job #{dependent.id} second.forward lane=1> was not run: it depends on "
        f"<Job #{bad.id} first.forward lane=0>, which did not complete (InvalidInput"), \
        str(info.value)


@pytest.mark.anyio
async def test_each_await_of_a_failed_job_gets_only_its_own_traceback(device):
    method = double_program("tb").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(method, [LateBad()])
            depths = []
            for _ in range(50):
                try:
                    await job
                except InvalidInput as exc:
                    tb, depth = exc.__traceback__, 0
                    while tb is not None:
                        tb, depth = tb.tb_next, depth + 1
                    depths.append(depth)
    assert len(set(depths)) == 1, depths  # it grew with every await



@pytest.mark.parametrize("inputs", ["host", "device"])
@pytest.mark.parametrize("lanes", [1, 2])
async def test_a_caller_stream_job_done_behind_a_held_one_of_its_lane_is_awaited(device, lanes,
                                                                                 inputs):
    """Deliberate overlap, observed from async code: a job on caller stream s1 is held by a
    latch; jobs on s2 and s3 of the same lane finish on the device. Their awaits waited for
    the held job (the lane's waiter reports in order), though done() said they were done.
    With inputs already on the device the held job, lone when submitted, is held back for its
    await and handed to the lane thread by the next submit (a rule that had the loop enqueue
    the burst was tried: bench/NOTES.md, twenty-second session): jobs done behind it must
    still be reported, whichever thread enqueued them."""
    a, b, c = (double_program(n).method("forward", device=device) for n in ("a", "b", "c"))
    s1, s2, s3 = (device.create_stream() for _ in range(3))
    xs = [data(i) if inputs == "host" else Result.from_host(data(i), device) for i in range(3)]
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=lanes) as sched:
            with device.create_latch() as latch:
                latch.hold(s1)
                held = await sched.submit(a, [xs[0]], stream=s1, lane=0)
                jb = await sched.submit(b, [xs[1]], stream=s2, lane=0)
                jc = await sched.submit(c, [xs[2]], stream=s3, lane=lanes - 1)
                for job, x in ((jb, data(1)), (jc, data(2))):
                    with anyio.fail_after(5):
                        (y,) = await job
                    with CallerStream(job.stream):
                        np.testing.assert_allclose(y.to_host(), 2 * x, rtol=1e-6)
                assert held.state == "running"
                latch.release()
            (y,) = await held
    np.testing.assert_allclose(y.to_host(), 2 * data(0), rtol=1e-6)


async def test_a_job_done_behind_a_held_one_is_awaited_while_its_lane_stays_busy(device):
    """The lane thread looked behind the head only after LOOK_AFTER_S (1 ms) without a new
    job: with another task submitting to the lane without pause, a job done on another stream
    than a held one's was reported only once the lane's queue_size jobs were all out and it
    went idle (2.2 s on the host device with 4096; its await waited for ever with a queue
    the feeder never filled), though done() was true. A lane now looks at most every
    LOOK_EVERY_S whatever its traffic: 40-80 ms here, the time to reach the job."""
    held_m, quick, filler = (double_program(n).method("forward", device=device)
                             for n in ("held", "quick", "filler"))
    s1, s2 = device.create_stream(), device.create_stream()
    with anyio.fail_after(60):
        async with Scheduler(device, lanes=1, queue_size=4096) as sched:
            stop = anyio.Event()

            async def feeder() -> None:  # another client keeps the lane thread busy
                while not stop.is_set():
                    await sched.submit(filler, [data(2)], stream=s2)
                    await anyio.sleep(0)

            with device.create_latch() as latch:
                latch.hold(s1)
                held = await sched.submit(held_m, [data(0)], stream=s1)
                async with anyio.create_task_group() as tg:
                    tg.start_soon(feeder)
                    await anyio.sleep(0.01)
                    job = await sched.submit(quick, [data(1)], stream=s2)
                    try:
                        with anyio.fail_after(1):
                            (y,) = await job
                    finally:
                        stop.set()
                    with CallerStream(s2):
                        np.testing.assert_allclose(y.to_host(), 2 * data(1), rtol=1e-6)
                assert held.state == "running"
                latch.release()
            (y,) = await held
    np.testing.assert_allclose(y.to_host(), 2 * data(0), rtol=1e-6)


async def test_pending_counts_what_the_device_has_not_finished_without_a_loop_turn(device):
    """``pending`` counted a job the device had finished (statistics() said completed, done()
    said True) until the loop turned, so code polling it without yielding never saw 0. It now
    settles what is finished, as done() does; a job held back for its await is started."""
    method = double_program().method("forward", device=device)
    stream = device.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            for kw in ({}, {"stream": stream}):
                job = await sched.submit(method, [data(0)], **kw)
                deadline = time.monotonic() + 10
                while sched.pending and time.monotonic() < deadline:
                    time.sleep(0.001)  # no await: the loop does not turn
                assert sched.pending == 0, (kw, sched.statistics())
                assert job._finished and sched.statistics()[0].in_flight == 0
                (y,) = await job
                np.testing.assert_array_equal(y.to_host(), 2 * data(0))


async def test_the_lane_thread_stops_looking_once_one_stream_is_left_in_flight(host,
                                                                               monkeypatch):
    """After the lane thread had reported a job done behind a held one on another stream,
    it went on waking every 16 ms for as long as the held job ran: the job it had settled
    still counted as a second stream in flight until the waiter got past the held one."""
    from streamlane.sched.lane import Lane

    looks = []
    look = Lane._look_behind_head
    monkeypatch.setattr(Lane, "_look_behind_head", lambda self: (looks.append(1), look(self)))
    a, b = (double_program(n).method("forward", device=host) for n in ("a", "b"))
    s1, s2 = host.create_stream(), host.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1) as sched:
            with host.create_latch() as latch:
                latch.hold(s1)
                held = await sched.submit(a, [data(0)], stream=s1)
                with anyio.fail_after(5):
                    await sched.run(b, [data(1)], stream=s2)  # reported by the lane thread
                await anyio.sleep(0.05)
                before = len(looks)
                await anyio.sleep(0.3)  # only the held job is left in flight
                assert len(looks) - before <= 1, f"{len(looks) - before} looks in 0.3 s"
                latch.release()
            await held


@pytest.mark.parametrize("size", [2**62, 2**63 - 1, 2**63, 10**30])
async def test_a_timeline_size_past_what_a_deque_bounds_keeps_every_span(host, size):
    """A huge ``timeline_size`` raised ``OverflowError`` from the spans' deque (a review):
    it means keep them all."""
    method = double_program().method("forward", device=host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1, timeline_size=size) as sched:
            for i in range(3):
                await sched.run(method, [data(i)])
            assert len(sched.timeline()) == 3


async def test_run_names_itself_when_called_before_the_scheduler_started(host):
    method = double_program().method("forward", device=host)
    sched = Scheduler(host, lanes=1)
    with pytest.raises(InvalidState, match=r"^run\(\) before the scheduler started"):
        await sched.run(method, [data(0)])
    with pytest.raises(InvalidState, match=r"^submit\(\) before the scheduler started"):
        await sched.submit(method, [data(0)])


@pytest.mark.anyio
async def test_a_job_and_its_outputs_refuse_numpy_and_pickle_saying_what_to_do(host):
    """np.asarray(job.outputs[0]) made a 0-d object array, silently (a Result's refuses);
    pickling a job raised a TypeError about an Event."""
    import copy
    import pickle

    method = double_program().method("forward", device=host)
    async with Scheduler(host, lanes=1) as sched:
        job = await sched.submit(method, [data(0)])
        with pytest.raises(InvalidArgument, match="await the job and read its Result"):
            np.asarray(job.outputs[0])
        for thing in (job, job.outputs, job.outputs[0]):
            for how in (pickle.dumps, copy.deepcopy):
                with pytest.raises(TypeError, match="belongs to a scheduler of this process"):
                    how(thing)
            assert copy.copy(thing) is thing  # as a Result's
        np.testing.assert_array_equal((await job)[0].to_host(), data(0) * 2)


async def test_a_failed_jobs_output_says_why_it_has_no_result_and_what_helps(host):
    """``job.outputs[0].result`` of a failed job advised passing the output to a later submit,
    which would only fail with ``DependencyFailed``; a scheduler of one lane said "1 lanes"."""

    class Unreadable:  # read by the lane thread, when the job runs
        def __array__(self, dtype=None, copy=None):
            raise ValueError("not today")

    method = double_program().method("forward", device=host)
    async with Scheduler(host, lanes=1) as sched:
        assert repr(sched).startswith(f"<Scheduler {host.name}, 1 lane, ")
        waiting = await sched.submit(method, [data(0)])
        failed = await sched.submit(method, [Unreadable()])
        with pytest.raises(InvalidInput):
            await failed
        with pytest.raises(InvalidState, match="await the job to see why") as info:
            failed.outputs[0].result  # noqa: B018
        assert "later submit" not in str(info.value)
        await waiting


@pytest.mark.anyio
async def test_an_interleaved_burst_of_two_schedulers_on_one_method_is_refused_not_failed(
        host):
    """Two schedulers submitting one method in turns, without awaiting: each gave it to a
    lane of its own, and whichever lane called it second failed with ``MethodBusy`` (half
    the jobs, at random, seen at their await). Now the second scheduler's submit is refused
    while the first has jobs of it unfinished; every job accepted gives the right number.
    And a dependency on a job of another scheduler says so: ids count per scheduler, and
    "#1 depends on #1" read as a job waiting for itself."""
    from streamlane.runtime.errors import MethodBusy
    from streamlane.sched import DependencyFailed

    method = double_program().method("forward", device=host)
    accepted, refused = [], 0
    async with Scheduler(host, lanes=1) as first, Scheduler(host, lanes=1) as second:
        for i in range(40):
            try:
                accepted.append((i, await (first, second)[i % 2].submit(method, [data(i)])))
            except MethodBusy:
                refused += 1
        for i, job in accepted:
            np.testing.assert_allclose((await job)[0].to_host(), 2 * data(i), rtol=1e-6)
    assert accepted and refused  # the first's burst stood; the second's submits were refused
    class Unreadable:  # read by the lane thread: the job fails before the device
        def __array__(self, dtype=None, copy=None):
            raise ValueError("not today")

    other = double_program("other").method("forward", device=host)
    async with Scheduler(host, lanes=1) as earlier:
        bad = await earlier.submit(other, [Unreadable()])
        with pytest.raises(InvalidInput):
            await bad
    fresh = double_program("fresh").method("forward", device=host)
    async with Scheduler(host, lanes=1) as later:
        with pytest.raises(DependencyFailed, match="of another scheduler, which did not"):
            await later.run(fresh, [data(4)], after=[bad])


def test_a_scheduler_closing_refuses_another_thread_and_two_threads_entering_one(host):
    """``aclose()`` from another thread while the owning loop drained waited on that loop's
    event: for ever on asyncio (a RuntimeError on trio); two threads entering one scheduler
    at once both passed the state check and started its lanes twice (one hung)."""
    import asyncio

    method = spin_program(400_000).method("forward", device=host)
    sched = Scheduler(host, lanes=1)
    seen = {}

    def close_from_another_thread():
        time.sleep(0.15)  # the owning loop is draining now
        try:
            asyncio.run(asyncio.wait_for(sched.aclose(), 10))
        except BaseException as exc:
            seen["error"] = exc

    async def own():
        async with sched:
            await sched.submit(method, [data(0)])
            threading.Thread(target=close_from_another_thread).start()

    started = time.monotonic()
    asyncio.run(own())
    while "error" not in seen and time.monotonic() - started < 15:
        time.sleep(0.01)
    assert isinstance(seen.get("error"), InvalidState), seen
    assert "another thread" in str(seen["error"])

    twice = Scheduler(host, lanes=1)
    barrier = threading.Barrier(2)
    outcomes = []

    def enter():
        async def go():
            barrier.wait(10)
            try:
                await twice.__aenter__()
            except InvalidState as exc:
                outcomes.append(("refused", str(exc)))
                return
            outcomes.append(("entered", ""))
            await anyio.sleep(0.2)  # the other thread's attempt lands while this one is open
            await twice.aclose()
        asyncio.run(go())

    threads = [threading.Thread(target=enter) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "an entering thread hung"
    assert sorted(kind for kind, _ in outcomes) == ["entered", "refused"], outcomes
    assert "already entered" in next(text for kind, text in outcomes if kind == "refused")


@pytest.mark.anyio
async def test_a_submit_that_waited_for_room_checks_the_methods_claim_again(host):
    """A submit that took a method's claim and then waited for room on its full lane did not
    look again: another scheduler took the method meanwhile, and the job, accepted, failed
    with ``MethodBusy`` at its await. It is refused as it resumes now."""
    from streamlane.runtime.errors import MethodBusy

    shared = double_program("shared").method("forward", device=host)
    filler = double_program("filler").method("forward", device=host)
    gate_a, gate_b = Gate(data(0)), Gate(data(1))
    outcome = {}
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1, queue_size=1) as a, \
                Scheduler(host, lanes=1) as b:
            held = await a.submit(filler, [gate_a])  # a's only room, its lane thread held
            await anyio.to_thread.run_sync(gate_a.entered.wait, 5)

            async def waiting():
                try:
                    outcome["job"] = await a.submit(shared, [data(2)])
                except MethodBusy as exc:
                    outcome["error"] = exc

            async with anyio.create_task_group() as tg:
                tg.start_soon(waiting)
                await anyio.sleep(0.05)  # it waits for room on a's lane
                taken = await b.submit(shared, [gate_b])  # b takes the method meanwhile
                await anyio.to_thread.run_sync(gate_b.entered.wait, 5)
                gate_a.open()  # room: the waiting submit goes on, b's lane still inside
                await held
            gate_b.open()
            (y,) = await taken
    assert "error" in outcome, outcome
    np.testing.assert_allclose(y.to_host(), 2 * data(1), rtol=1e-6)

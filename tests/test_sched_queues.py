"""Timing events and the GPU's hardware queues: a scheduler with timing events warns once
(``TimingStallWarning``) when more streams have jobs pending than the device has hardware
queues, since the timing event after each job then holds up the streams sharing its queue
(bench/queue_probe.py). The host device has no such queues and never warns; tests pretend it
has two. Async tests run on asyncio, uvloop and trio."""

from __future__ import annotations

import warnings

import anyio
import numpy as np
import pytest
from sched_helpers import BACKENDS, data, double_program, spin_program

from streamlane.runtime import get_device
from streamlane.runtime.errors import InvalidArgument
from streamlane.sched import Scheduler, TimingStallWarning

SPIN_US = 30_000  # long enough that every job of a burst is still pending at its last submit


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


def _stalls(caught: list[warnings.WarningMessage]) -> list[warnings.WarningMessage]:
    return [w for w in caught if issubclass(w.category, TimingStallWarning)]


async def _burst(device, n: int, *, lanes: int = 1, streams: bool = True, timing: bool = True,
                 check_before_last: bool = False) -> list[warnings.WarningMessage]:
    """Submit ``n`` spins at once (one caller stream each, or one lane each), then await them;
    the warnings caught."""
    methods = [spin_program(SPIN_US, f"s{i}").method("forward", device=device) for i in range(n)]
    owned = [device.create_stream() for _ in range(n)] if streams else [None] * n
    with anyio.fail_after(30), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with Scheduler(device, lanes=lanes, timing=timing) as sched:
            jobs = []
            for i, (method, stream) in enumerate(zip(methods, owned, strict=True)):
                if check_before_last and i == n - 1:
                    assert not _stalls(caught), "warned before the streams outnumbered the queues"
                jobs.append(await sched.submit(method, [data(i)], stream=stream,
                                               lane=None if streams else i))
            for job in jobs:
                await job
    for stream in owned:
        if stream is not None:
            stream.close()
    return caught


@pytest.mark.anyio
async def test_more_busy_streams_than_hardware_queues_warn_once_at_the_submit(device,
                                                                               monkeypatch):
    monkeypatch.setattr(device, "hardware_queues", 2)
    caught = await _burst(device, 5, check_before_last=False)
    stalls = _stalls(caught)
    assert len(stalls) == 1, [str(w.message) for w in caught]
    message = str(stalls[0].message)
    assert "3 streams" in message and "2 hardware queues" in message
    assert "timing=False" in message and "CUDA_DEVICE_MAX_CONNECTIONS=32" in message
    assert stalls[0].filename == __file__  # it points at the user's submit


@pytest.mark.anyio
async def test_the_warning_points_at_the_users_run_too(device, monkeypatch):
    monkeypatch.setattr(device, "hardware_queues", 1)
    methods = [spin_program(SPIN_US, f"r{i}").method("forward", device=device) for i in range(2)]
    streams = [device.create_stream() for _ in range(2)]
    with anyio.fail_after(30), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with Scheduler(device, lanes=1) as sched:
            first = await sched.submit(methods[0], [data(0)], stream=streams[0])
            await sched.run(methods[1], [data(1)], stream=streams[1])  # the second busy stream
            await first
    stalls = _stalls(caught)
    assert len(stalls) == 1 and stalls[0].filename == __file__
    for stream in streams:
        stream.close()


@pytest.mark.anyio
async def test_as_many_busy_streams_as_queues_do_not_warn(device, monkeypatch):
    monkeypatch.setattr(device, "hardware_queues", 3)
    assert not _stalls(await _burst(device, 3))
    # The fourth stream is the first one too many (checked before it is submitted).
    assert len(_stalls(await _burst(device, 4, check_before_last=True))) == 1


@pytest.mark.anyio
async def test_lane_streams_count_too(device, monkeypatch):
    monkeypatch.setattr(device, "hardware_queues", 2)
    assert len(_stalls(await _burst(device, 3, lanes=3, streams=False))) == 1


@pytest.mark.anyio
async def test_without_timing_events_nothing_stalls_and_nothing_warns(device, monkeypatch):
    monkeypatch.setattr(device, "hardware_queues", 2)
    assert not _stalls(await _burst(device, 5, timing=False))


class _Wrapper:
    """What torch.cuda.current_stream() gives: a new object per call, for one stream."""

    def __init__(self, stream):
        self._stream = stream

    def __cuda_stream__(self):
        return (0, self._stream.handle)


@pytest.mark.anyio
@pytest.mark.parametrize("wrap", ["foreign", "wrap_stream"])
async def test_one_stream_through_many_wrapper_objects_counts_once(device, monkeypatch, wrap):
    monkeypatch.setattr(device, "hardware_queues", 1)
    method = spin_program(SPIN_US, "wrapped").method("forward", device=device)
    stream = device.create_stream()
    with anyio.fail_after(30), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with Scheduler(device, lanes=1) as sched:
            jobs = []
            for i in range(3):
                each = _Wrapper(stream) if wrap == "foreign" else device.wrap_stream(
                    _Wrapper(stream))
                jobs.append(await sched.submit(method, [data(i)], stream=each))
            for job in jobs:
                await job
            assert len(sched.timeline().tracks()) == 1
    assert not _stalls(caught), [str(w.message) for w in caught]
    stream.close()


@pytest.mark.anyio
async def test_an_unhashable_bad_stream_fails_its_job_and_leaks_no_room(device, monkeypatch):
    """A stream= object whose __cuda_stream__ breaks after submit() read it fails its job on
    the lane with InvalidArgument; counting it as a busy stream must not raise (it is
    unhashable) nor keep its room on the lane. (One broken from the start is refused by
    submit().)"""
    monkeypatch.setattr(device, "hardware_queues", 8)
    real = device.create_stream()

    class Broken:
        __hash__ = None  # type: ignore[assignment]

        def __init__(self):
            self.reads = 0

        def __cuda_stream__(self):
            self.reads += 1
            return (0, real.handle) if self.reads == 1 else (0, None)

    method = double_program("broken").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, queue_size=2) as sched:
            for i in range(4):  # more than the lane's room
                job = await sched.submit(method, [data(i)], stream=Broken())
                with pytest.raises(InvalidArgument, match="__cuda_stream__"):
                    await job

            class Raising:  # its __cuda_stream__ is a property that fails
                @property
                def __cuda_stream__(self):
                    raise ZeroDivisionError

            with pytest.raises(InvalidArgument, match="ZeroDivisionError"):
                await sched.submit(method, [data(0)], stream=Raising())
            (y,) = await sched.run(method, [data(9)])
            assert sched.lanes[0].outstanding == 0
    np.testing.assert_allclose(y.to_host(), 2 * data(9), rtol=1e-6)
    real.close()


@pytest.mark.anyio
async def test_a_stream_stops_counting_once_its_jobs_finish(device, monkeypatch):
    monkeypatch.setattr(device, "hardware_queues", 2)
    method = double_program().method("forward", device=device)
    streams = [device.create_stream() for _ in range(6)]
    with anyio.fail_after(30), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with Scheduler(device, lanes=1) as sched:
            for i, stream in enumerate(streams):  # one stream busy at a time
                (y,) = await sched.run(method, [data(i)], stream=stream)
                assert (y.to_host() == data(i) * 2).all()
    assert not _stalls(caught)
    for stream in streams:
        stream.close()


@pytest.mark.anyio
async def test_the_host_device_has_no_hardware_queues_and_never_warns():
    host = get_device("host")
    assert host.hardware_queues is None
    assert not _stalls(await _burst(host, 5))


@pytest.mark.cuda
def test_cuda_reports_the_hardware_queues_of_its_environment(cuda_device, monkeypatch):
    import os

    from streamlane.runtime.cuda import _max_connections

    assert cuda_device.hardware_queues == _max_connections(
        os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"))
    assert [_max_connections(v) for v in (None, "8", "32", "64", "1", "0", "-3", "x")] == \
        [8, 8, 32, 32, 1, 8, 8, 8]


@pytest.mark.anyio
async def test_the_warning_as_an_error_leaves_the_submitted_job_running(device, monkeypatch):
    """Under a filter that turns the warning into an error, the submit raises it once its job
    is queued: the job runs, its stream closes, and leaving the scheduler does not hang (the
    job was left pending forever, its stream pinned)."""
    monkeypatch.setattr(device, "hardware_queues", 1)
    methods = [spin_program(SPIN_US, f"e{i}").method("forward", device=device) for i in range(2)]
    streams = [device.create_stream() for _ in range(2)]
    with anyio.fail_after(30), warnings.catch_warnings():
        warnings.simplefilter("error", TimingStallWarning)
        async with Scheduler(device, lanes=1) as sched:
            first = await sched.submit(methods[0], [data(0)], stream=streams[0])
            with pytest.raises(TimingStallWarning):
                await sched.submit(methods[1], [data(1)], stream=streams[1])
            streams[1].close()
            await first
    assert sched.statistics()[0].completed == 2 and streams[1].closed
    assert not streams[1]._pins, "the second job never gave its stream back"
    streams[0].close()


@pytest.mark.anyio
async def test_a_hook_showing_the_warning_sees_the_jobs_awaited_before(device, monkeypatch):
    """A warnings hook runs inside the submit, where observers only read (a raw signal handler
    may land there too): a job awaited before, its span not read yet, was missing from the
    timeline and the busy time the hook read. The scheduler brings them up to date first."""
    from streamlane.runtime import Result

    monkeypatch.setattr(device, "hardware_queues", 2)
    quick = double_program("quick").method("forward", device=device)
    spins = [spin_program(SPIN_US, f"s{i}").method("forward", device=device) for i in range(3)]
    x = Result.from_host(data(0), device)
    seen = {}
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1e6) as sched:
            first = await sched.submit(quick, [x], stream=device.create_stream())
            await first  # settled by the loop's poll, its span not read yet (so here)

            def hook(message, category, filename, lineno, file=None, line=None):
                seen["jobs"] = [span.job for span in sched.timeline()]
                seen["busy"] = sched.statistics()[0].busy_time_s

            monkeypatch.setattr(warnings, "showwarning", hook)
            jobs = [await sched.submit(m, [x], stream=device.create_stream()) for m in spins]
            for job in jobs:
                await job
    assert seen["jobs"] == [first.id] and seen["busy"] > 0, seen


@pytest.mark.anyio
async def test_a_hook_showing_the_warning_sees_every_finished_job_done(host, monkeypatch):
    """Job a finished on the device; c, ordered after it on another lane, was seen done (user
    code polling without yielding). The hook, which only reads, saw a not done: a job looked
    unfinished after one ordered after it had finished. Every finished job is settled first."""
    import time

    monkeypatch.setattr(host, "hardware_queues", 2)
    ma, mc, mb = (double_program(n).method("forward", device=host) for n in "acb")
    busy = spin_program(300_000, "busy").method("forward", device=host)
    seen = {}
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=2) as sched:
            a = await sched.submit(ma, [data(0)], lane=0)
            c = await sched.submit(mc, [a.outputs[0]], lane=1, after=[a])
            d = await sched.submit(busy, [data(1)], lane=1)  # keeps lane 1's stream busy

            def hook(message, category, filename, lineno, file=None, line=None):
                seen.update(a=a.done(), c=c.done())

            deadline = time.monotonic() + 10
            while not c.done() and time.monotonic() < deadline:  # no yield to the loop
                time.sleep(0.001)
            assert c.done() and a.event.query()  # the case under test
            time.sleep(0.05)
            monkeypatch.setattr(warnings, "showwarning", hook)
            b = await sched.submit(mb, [data(2)], stream=host.create_stream())  # it warns
            await b
            await d
    assert seen == {"a": True, "c": True}, seen

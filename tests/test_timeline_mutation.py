"""Measuring, as a user reads it: the timeline's wall time, the trace's rows and labels, the
plot's rows and axis, the per-lane statistics, and the demo's table and checks (README "The
scheduler" / "Measuring", "Quickstart"). Host device only; each test takes well under 3 s."""

from __future__ import annotations

import json
import re
import time

import anyio
import numpy as np
import pytest
from sched_helpers import data, spin_program

from streamlane.runtime import get_device
from streamlane.sched import Scheduler, Span, Timeline


def _four_tracks() -> Timeline:
    return Timeline([Span(0, "enc.forward", 0, "lane 0", 0.0, 1.0),
                     Span(1, "dec.forward", 1, "lane 1", 0.5, 1.5),
                     Span(2, "enc.forward", 0, "lane 0 stream 0x10", 0.2, 0.4),
                     Span(3, "dec.forward", 0, "lane 0 stream 0x9", 3.0, 4.0)], "host:0")


# -- Timeline ---------------------------------------------------------------------------------
def test_wall_time_runs_to_the_latest_end_not_the_last_started_spans_end():
    t = Timeline([Span(0, "long", 0, "lane 0", 0.0, 5.0), Span(1, "short", 1, "lane 1", 1.0, 2.0)])
    assert t.wall_s() == 5.0
    assert t.union_s() == 5.0 and t.overlap() == pytest.approx(6.0 / 5.0)


def test_the_trace_puts_each_job_on_the_row_of_its_track_in_the_order_of_tracks(tmp_path):
    """One trace row (tid) per lane and caller stream, named by the track, sorted as
    ``tracks()``; every job event on its own track's row."""
    t = _four_tracks()
    doc = json.loads(t.to_chrome_trace(tmp_path / "t.json").read_text())
    events = doc["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    order = {e["tid"]: e["args"]["sort_index"] for e in events
             if e["name"] == "thread_sort_index"}
    assert sorted(names.values()) == sorted(t.tracks()) and len(names) == 4
    assert {names[tid]: order[tid] for tid in names} == \
        {track: i for i, track in enumerate(t.tracks())}  # rows shown in tracks() order
    by_job = {s.job: s for s in t.spans}
    jobs = [e for e in events if e["ph"] == "X"]
    assert sorted(e["args"]["job"] for e in jobs) == [0, 1, 2, 3]
    for e in jobs:
        span = by_job[e["args"]["job"]]
        assert names[e["tid"]] == span.track, e
        assert (e["name"], e["args"]["lane"]) == (span.name, span.lane), e


def test_the_trace_names_its_device_and_gives_the_measured_overlap(tmp_path):
    t = _four_tracks()
    doc = json.loads(t.to_chrome_trace(tmp_path / "t.json").read_text())
    (process,) = [e for e in doc["traceEvents"] if e["name"] == "process_name"]
    assert process["args"]["name"] == "streamlane host:0"
    # busy 3.2 s over a union of 2.5 s
    assert doc["otherData"] == {"device": "host:0", "jobs": 4, "overlap": 1.28}


def _bars(timeline: Timeline) -> set[tuple[float, float, float]]:
    """(x0, x1, row centre) of every bar the plot draws."""
    fig = timeline._figure(None)
    bars = set()
    for collection in fig.axes[0].collections:
        for path in collection.get_paths():
            box = path.get_extents()
            bars.add(tuple(round(float(v), 6) for v in (box.x0, box.x1, (box.y0 + box.y1) / 2)))
    return bars


def test_the_plot_draws_each_job_on_its_tracks_row_in_ms_since_the_first_start():
    t = Timeline([Span(0, "a", 0, "lane 0", 1.000, 1.002), Span(1, "b", 1, "lane 1", 1.001, 1.004),
                  Span(2, "a", 0, "lane 0 stream 0x9", 1.003, 1.0035)])
    fig = t._figure(None)
    assert [x.get_text() for x in fig.axes[0].get_yticklabels()] == t.tracks()
    assert t.tracks() == ["lane 0", "lane 0 stream 0x9", "lane 1"]
    assert _bars(t) == {(0.0, 2.0, 0.0), (3.0, 3.5, 1.0), (1.0, 4.0, 2.0)}


def test_caller_stream_jobs_one_after_another_share_a_plot_row():
    """Past PLOT_ROWS tracks the caller streams' jobs are packed into as few rows as never
    overlap: 60 streams whose jobs run back to back (each starts as the one before ends)
    never overlap, so they take one row."""
    spans = [Span(0, "own", 0, "lane 0", 0.0, 0.5)]
    spans += [Span(i + 1, "req", 0, f"lane 0 stream {i + 1:#x}", float(i), float(i + 1))
              for i in range(60)]
    tracks, rows = Timeline(spans)._rows()
    assert tracks == ["lane 0", "60 caller streams, row 1"], tracks
    assert [len(r) for r in rows] == [1, 60]


# -- statistics ---------------------------------------------------------------------------------
@pytest.mark.anyio
async def test_busy_time_is_each_lanes_sum_of_its_jobs_durations():
    """``busy_time_s``: the sum of the lane's jobs' device durations, the spans of the
    lane's jobs (which carry that lane)."""
    host = get_device("host")
    method = spin_program(3_000, "busy").method("forward", device=host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=2) as sched:
            jobs = [await sched.submit(method, [data(i)], lane=i % 2) for i in range(6)]
            for job in jobs:
                await job
            stats = sched.statistics()
            timeline = sched.timeline()
    for job in jobs:
        (span,) = [s for s in timeline.spans if s.job == job.id]
        assert (span.lane, span.track) == (job.lane.index, f"lane {job.lane.index}")
        assert (span.start_s, span.end_s) == job.span
    for lane in (0, 1):
        durations = [s.duration_s for s in timeline.spans if s.lane == lane]
        assert len(durations) == 3
        assert stats[lane].busy_time_s == pytest.approx(sum(durations), rel=1e-9, abs=1e-12)
        assert 3 * 0.0025 < stats[lane].busy_time_s < 3 * 0.05, stats[lane]


@pytest.mark.anyio
async def test_statistics_tell_queued_from_in_flight():
    """Jobs held on the device by a latch are in flight, not queued; a job whose input the
    lane thread is still reading is queued."""
    from sched_helpers import Gate

    host = get_device("host")
    method = spin_program(10, "held").method("forward", device=host)
    stream = host.create_stream()
    with anyio.fail_after(30), host.create_latch() as latch:
        async with Scheduler(host, lanes=1) as sched:
            latch.hold(stream)
            gate = Gate(data(9))
            try:
                jobs = [await sched.submit(method, [data(i)], stream=stream) for i in range(3)]
                deadline = time.monotonic() + 5
                while sched.statistics()[0].queued and time.monotonic() < deadline:
                    await anyio.sleep(0.002)
                (stats,) = sched.statistics()
                assert (stats.queued, stats.in_flight, stats.completed) == (0, 3, 0), stats
                late = await sched.submit(method, [gate], stream=stream)
                await anyio.to_thread.run_sync(gate.entered.wait, 5)
                (stats,) = sched.statistics()
                assert (stats.queued, stats.in_flight, stats.completed) == (1, 3, 0), stats
            finally:  # a failed check must not leave the scheduler's exit waiting on them
                gate.open()
                latch.release()
            for job in [*jobs, late]:
                await job
            (stats,) = sched.statistics()
            assert (stats.queued, stats.in_flight, stats.completed) == (0, 0, 4), stats


@pytest.mark.anyio
async def test_statistics_read_from_code_the_scheduler_calls_keep_the_busy_time(host):
    """User code the scheduler calls on the loop thread (an ``after=`` generator) reads the
    statistics as settled before: the busy time of the jobs already measured too."""
    method = spin_program(2_000, "seen").method("forward", device=host)
    seen = []
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1) as sched:
            first = await sched.submit(method, [data(0)])
            await first
            (before,) = sched.statistics()
            assert before.completed == 1 and before.busy_time_s > 0.0015, before

            def after():
                seen.append(sched.statistics())
                yield first

            await sched.run(method, [data(1)], after=after())
    assert seen == [(before,)]


@pytest.mark.anyio
async def test_a_job_failed_by_a_break_and_then_by_its_own_input_is_counted_once(host):
    """The device broke while lane 0's thread read a job's input (a Gate): the break counted
    that job completed (failed). When the thread got out, the input turned out bad (wrong
    shape), failing the job again on the thread: it must not be counted again."""
    from sched_helpers import Gate, double_program, wait_until

    from streamlane.sched import SchedulerBroken

    a, b = (double_program(n).method("forward", device=host) for n in ("a", "b"))
    gate = Gate(np.zeros((3, 3), np.float32))  # the wrong shape: refused once read
    held = host.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=2) as sched:
            try:
                job = await sched.submit(a, [gate], lane=0)
                await wait_until(gate.entered.is_set)  # lane 0's thread is reading it
                with host.create_latch() as latch:  # a job on lane 1 faults the device
                    latch.hold(held)
                    host.inject_failure(held, "injected kernel fault")
                    faulty = await sched.submit(b, [data(3)], lane=1, stream=held)
                    await wait_until(lambda: faulty.state == "running")
                    latch.release()
                for failed in (faulty, job):
                    with pytest.raises(SchedulerBroken):
                        await failed
            finally:
                gate.open()
            counts = []
            for _ in range(30):  # the thread gets out and fails the job once more
                await anyio.sleep(0.01)
                lane0 = sched.statistics()[0]
                counts.append((lane0.queued, lane0.in_flight, lane0.completed))
    assert set(counts) == {(0, 0, 1)}, counts


# -- the demo -------------------------------------------------------------------------------------
def test_the_demo_runs_each_configuration_as_described_with_each_decoder_after_its_encoder(
        tmp_path):
    """One lane: everything on lane 0's stream. Two lanes: encoders on lane 0, decoders on
    lane 1. Caller streams: one stream per program, on one lane. Every decoder starts on the
    device after its encoder ended (``after=``)."""
    from streamlane.sched.demo import run_demo

    results = anyio.run(run_demo, get_device("host"), 3, tmp_path)
    one, two, streams = results
    assert one.timeline.tracks() == ["lane 0"]
    assert two.timeline.tracks() == ["lane 0", "lane 1"]
    assert len(streams.timeline.tracks()) == 2
    assert all(t.startswith("lane 0 stream 0x") for t in streams.timeline.tracks())
    for r in results:
        spans = sorted(r.timeline.spans, key=lambda s: s.job)
        enc = [s for s in spans if s.name == "encoder.forward"]
        dec = [s for s in spans if s.name == "decoder.forward"]
        assert len(enc) == len(dec) == 3, r.config
        assert len({s.track for s in enc}) == len({s.track for s in dec}) == 1, r.config
        if r.config != "one lane":
            assert enc[0].track != dec[0].track, r.config
        if r.config == "two lanes":
            assert (enc[0].lane, dec[0].lane) == (0, 1)
        for e, d in zip(enc, dec, strict=True):
            assert d.start_s >= e.end_s, (r.config, e, d)
        assert r.correct == r.checked == 6, r


@pytest.mark.parametrize("wrong", ["1% high", "1e-4 high"])
def test_the_demo_counts_a_decoder_output_a_little_off_wrong(tmp_path, monkeypatch, wrong):
    """``correct``: outputs within rtol 1e-3 of the float64 reference. A decoder whose last
    kernel (softmax, used by the decoder only) comes out 1% high, or 1e-4 high (its outputs
    are 1.3e-4 to 0.42, median 4.8e-4: 20% of the median), is wrong in every configuration;
    the encoders stay right."""
    from streamlane.kernels import get_kernel
    from streamlane.sched.demo import run_demo

    spec, host = get_kernel("softmax"), get_device("host")
    real = spec.host

    def high(ins, outs, params):
        real(ins, outs, params)
        if wrong == "1% high":
            outs[0][...] *= np.float32(1.01)
        else:
            outs[0][...] += np.float32(1e-4)

    object.__setattr__(spec, "host", high)
    monkeypatch.setattr(host, "_functions", {})  # kernels loaded earlier: loaded again
    try:
        results = anyio.run(run_demo, host, 1, tmp_path)
    finally:
        object.__setattr__(spec, "host", real)
    for r in results:
        assert (r.correct, r.checked) == (1, 2), r
        assert 5e-5 < r.max_error < 1e-2, r


def _fake_results(monkeypatch, walls):
    """``run_demo`` replaced: results with the given wall times, overlaps of a timeline with
    a gap (busy 3 s, union 2.5 s, wall 4 s: 1.20x), all correct."""
    from streamlane.sched import demo as demo_module

    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0), Span(1, "b", 1, "lane 1", 0.5, 1.5),
                         Span(2, "a", 0, "lane 0", 3.0, 4.0)], "host:0")

    async def run_demo(device, requests, out, progress=None, programs=None, rounds=1):
        return [demo_module.DemoResult(config, wall, timeline.overlap(), 2 * requests,
                                       2 * requests, 1e-6, timeline, walls_s=[wall])
                for config, wall in zip(demo_module.CONFIGS, walls, strict=True)]

    monkeypatch.setattr(demo_module, "run_demo", run_demo)


def test_the_table_gives_wall_time_in_ms_overlap_and_speedup_over_one_lane(
        tmp_path, monkeypatch, capsys):
    from streamlane.sched import cli

    _fake_results(monkeypatch, [0.1, 0.05, 0.04])
    assert cli.main(["demo", "--device", "host", "--requests", "1", "--out",
                     str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = {}
    for line in out.splitlines():
        cells = [c.strip() for c in re.split(r"[│|]", line) if c.strip()]
        if cells and cells[0] in ("one lane", "two lanes", "caller streams"):
            rows[cells[0]] = cells[1:]
    assert rows == {"one lane": ["100.0 ms", "1.20x", "1.00x", "2/2", "1.0e-06"],
                    "two lanes": ["50.0 ms", "1.20x", "2.00x", "2/2", "1.0e-06"],
                    "caller streams": ["40.0 ms", "1.20x", "2.50x", "2/2", "1.0e-06"]}, out


def test_the_demo_reports_the_faster_middle_round_its_files_and_the_worst_error(
        tmp_path, monkeypatch):
    """Two rounds: each configuration's wall time, overlap and written files are those of the
    faster round (here always the first), its max error the worst of either round."""
    from streamlane.sched import demo as demo_module

    calls: dict[str, int] = {}

    async def run(config, device, p, xs, refs, progress):
        n = calls[config] = calls.get(config, 0) + 1
        job = 100 * n
        span = Span(job, "m.forward", 0, "lane 0", 0.0, 0.001 * n)
        return demo_module._Round(wall_s=0.1 * n, timeline=Timeline([span], "host:0"),
                                  right=[True] * (2 * len(xs)),
                                  max_error=1e-6 if n == 1 else 5e-6)

    monkeypatch.setattr(demo_module, "_run", run)
    results = anyio.run(demo_module.run_demo, get_device("host"), 1, tmp_path, None, None, 2)
    for r in results:
        assert r.walls_s == pytest.approx([0.1, 0.2]) and r.wall_s == pytest.approx(0.1), r
        assert [s.job for s in r.timeline.spans] == [100], r
        assert r.max_error == 5e-6 and r.correct == r.checked == 2, r
        _, trace = demo_module.output_files(tmp_path, r.config)
        doc = json.loads(trace.read_text())
        assert [e["args"]["job"] for e in doc["traceEvents"] if e["ph"] == "X"] == [100]

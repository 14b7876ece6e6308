"""Measuring what the scheduler did: statistics, timelines and overlap, and the exports. Async
tests run on asyncio, uvloop and trio."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest
from sched_helpers import BACKENDS, Interrupt, RaiseAt, data, double_program, spin_program

from streamlane.runtime import Result
from streamlane.runtime.errors import InvalidArgument
from streamlane.sched import LaneStatistics, Scheduler, Span, Timeline

SPIN_US = 50_000


@pytest.fixture(params=BACKENDS)
def anyio_backend(request):
    return request.param


@pytest.fixture
def lane_reads_held(monkeypatch):
    """The lane threads' own span reads (after they tell the loop) wait until the event this
    gives is set, leaving every span to the loop thread's reads until then."""
    from streamlane.sched.lane import Lane

    held = threading.Event()
    loop_thread = threading.get_ident()
    real = Lane.read_spans

    def read_spans(self):
        if threading.get_ident() != loop_thread:
            held.wait(10)
        real(self)

    monkeypatch.setattr(Lane, "read_spans", read_spans)
    yield held
    held.set()


async def _one_job_per_lane(sched: Scheduler, method) -> None:
    """Run one job on each lane, in turn: with ``lane_reads_held``, a held lane thread settles
    nothing more, so each span is left to the loop's reads."""
    for i in range(len(sched.lanes)):
        await sched.run(method, [data(i)], lane=i)


async def _two_spins(device, lanes: int, streams: bool = False) -> tuple[Scheduler, float]:
    a, b = (spin_program(SPIN_US, n).method("forward", device=device) for n in ("a", "b"))
    s = [device.create_stream(), device.create_stream()] if streams else [None, None]
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=lanes) as sched:
            for job in [await sched.submit(m, [data(0)], stream=st)
                        for m, st in zip((a, b), s, strict=True)]:
                await job
    return sched, sched.timeline().overlap()


@pytest.mark.anyio
async def test_two_lanes_overlap_and_one_lane_serializes(device):
    two, overlap_two = await _two_spins(device, lanes=2)
    one, overlap_one = await _two_spins(device, lanes=1)
    assert overlap_two > 1.6, two.timeline()
    assert overlap_one < 1.15, one.timeline()
    stats = two.statistics()
    assert [s.lane for s in stats] == [0, 1]
    assert [(s.queued, s.in_flight, s.completed) for s in stats] == [(0, 0, 1), (0, 0, 1)]
    assert all(0.045 < s.busy_time_s < 0.5 for s in stats), stats
    (single,) = one.statistics()
    assert single.completed == 2 and single.busy_time_s > 0.09
    assert two.timeline().wall_s() < one.timeline().wall_s()


@pytest.mark.anyio
async def test_a_caller_stream_per_program_overlaps_on_one_lane(device):
    sched, overlap = await _two_spins(device, lanes=1, streams=True)
    assert overlap > 1.6, sched.timeline()
    assert len(sched.timeline().tracks()) == 2


@pytest.mark.anyio
async def test_timing_events_are_reused_and_every_span_stays_right(device, monkeypatch):
    """A job's span starts at a timing event the lane reuses once the span is read, and ends
    at the job's own event (public, so new for each job): one timing event per job is created,
    not two, and the spans of one lane's jobs still follow each other in order."""
    created = []
    real_create = type(device).create_event

    def create_event(self, timing=False):
        created.append(timing)
        return real_create(self, timing=timing)

    monkeypatch.setattr(type(device), "create_event", create_event)
    method = spin_program(200, "t").method("forward", device=device)
    count = 60
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            jobs = []
            for i in range(count):
                jobs.append(await sched.submit(method, [data(i)]))
                if i % 3 == 2:  # batches of three in flight, then drained
                    for job in jobs[-3:]:
                        await job
            spans = [job.span for job in jobs]
    assert all(span is not None and 0 <= span[0] < span[1] for span in spans), spans
    assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans)), "spans out of order"
    assert created.count(True) <= count + 10, f"{created.count(True)} for {count} jobs"
    assert len(sched.timeline().spans) == count


@pytest.mark.anyio
@pytest.mark.parametrize("look", ["span", "timeline", "statistics"])
async def test_a_jobs_span_is_there_as_soon_as_its_await_returns(device, lane_reads_held, look):
    """The thread that settles a timed job tells the loop first and reads the job's span after
    (Lane.read_spans); until it has, ``job.span``, ``timeline()`` and ``statistics()`` read it
    themselves. Here the lane's threads are held before their read until the checks are done."""
    held = lane_reads_held
    method = spin_program(2_000, "seen").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=4, poll_us=0) as sched:
            try:
                for i in range(4):  # one per lane: a held thread settles nothing more
                    job = await sched.submit(method, [data(i)], lane=i)
                    await job
                    if look == "span":
                        assert job.span is not None and 0 <= job.span[0] < job.span[1]
                    elif look == "timeline":
                        assert len(sched.timeline()) == i + 1
                    else:
                        busy = sum(s.busy_time_s for s in sched.statistics())
                        assert busy >= (i + 1) * 0.0015, busy
            finally:
                held.set()  # before the exit joins the threads


@pytest.mark.anyio
async def test_spans_the_loop_settles_are_read_without_anyone_asking(device, monkeypatch):
    """Lone jobs the loop settles itself (its poll) leave their spans to be read later: while
    it polls the next job, or at its next turn once many wait. They never pile up."""
    from streamlane.sched.lane import UNREAD_MAX, Lane

    settled_on = set()
    real = Lane._settle
    monkeypatch.setattr(Lane, "_settle", lambda self, batch, error: (
        settled_on.add(threading.get_ident()), real(self, batch, error))[1])
    method = spin_program(300, "lone").method("forward", device=device)
    stream = device.create_stream()
    x = Result.from_host(data(1), device)
    most = 0
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1e6) as sched:
            lane = sched.lanes[0]
            for _ in range(3 * UNREAD_MAX):
                await sched.run(method, [x], stream=stream)
                most = max(most, len(lane._unread))
            assert len(sched.timeline()) == 3 * UNREAD_MAX
            assert lane.statistics().completed == 3 * UNREAD_MAX
    assert settled_on == {threading.get_ident()}  # the loop's poll settled every one
    assert 0 < most <= UNREAD_MAX, most


def test_a_scheduler_not_entered_yet_can_be_looked_at(host):
    sched = Scheduler(host, lanes=2)
    assert [s.completed for s in sched.statistics()] == [0, 0]
    assert len(sched.timeline()) == 0 and sched.pending == 0
    sched.clear_timeline()


def test_statistics_are_frozen_dataclasses():
    stats = LaneStatistics(0, 1, 2, 3, 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        stats.queued = 4  # type: ignore[misc]


def test_a_timeline_is_an_immutable_snapshot():
    """Its docstring says so; its spans and device could be reassigned."""
    t = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)], "host:0")
    for name, value in (("spans", ()), ("device", "other"), ("extra", 1)):
        with pytest.raises(AttributeError):
            setattr(t, name, value)
    assert len(t.spans) == 1 and t.device == "host:0"
    with pytest.raises(dataclasses.FrozenInstanceError):
        t.spans[0].end_s = 2.0  # type: ignore[misc]


def test_a_timeline_pickles_copies_and_takes_weak_references():
    """Made read-only with __slots__, it lost pickling under protocols 0 and 1, and weak
    references."""
    import copy
    import pickle
    import weakref

    t = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0), Span(1, "b", 1, "lane 1", 0.5, 2.0)],
                 "host:0")
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(t, protocol))
        assert back.spans == t.spans and back.device == t.device, protocol
    assert copy.deepcopy(t).spans == t.spans and copy.copy(t).overlap() == t.overlap()
    assert weakref.ref(t)() is t


def test_overlap_is_the_sum_of_durations_over_their_union():
    spans = [Span(0, "a", 0, "lane 0", 0.0, 1.0), Span(1, "b", 1, "lane 1", 0.5, 1.5),
             Span(2, "a", 0, "lane 0", 3.0, 4.0)]
    t = Timeline(spans, "host:0")
    assert t.busy_s() == 3.0 and t.union_s() == 2.5 and t.wall_s() == 4.0
    assert t.overlap() == pytest.approx(1.2)
    assert Timeline([]).overlap() == 0.0
    empty = Timeline([])  # floats, as annotated (busy_s() gave the int 0)
    assert [type(f()) for f in (empty.busy_s, empty.union_s, empty.wall_s)] == [float] * 3
    assert t.tracks() == ["lane 0", "lane 1"]
    assert repr(t) == "<Timeline 3 jobs, 2 tracks, overlap 1.20x>"


def test_a_span_that_ends_before_it_starts_is_refused():
    """It gave a negative union, overlap 0.0 and a trace event of negative duration, which the
    trace format has no meaning for."""
    with pytest.raises(InvalidArgument, match="ends before it starts"):
        Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0), Span(1, "b", 0, "lane 0", 2.0, 1.0)])
    assert Timeline([Span(0, "a", 0, "lane 0", 1.0, 1.0)]).busy_s() == 0.0  # an instant is one


def test_caller_stream_rows_go_by_handle_and_plot_text_is_plain(tmp_path):
    """Rows were sorted by the handle as text (0x10 before 0x9); a title or job name holding
    "$" was read as matplotlib mathtext (r"$\\foo$": a ParseFatalException)."""
    t = Timeline([Span(i, name, 0, track, i, i + 1.0) for i, (name, track) in enumerate(
        [("a", "lane 0 stream 0x10"), ("costs $5", "lane 0 stream 0x9"), ("a", "lane 0"),
         (r"$\foo$", "lane 0 stream 0x9")])])
    assert t.tracks() == ["lane 0", "lane 0 stream 0x9", "lane 0 stream 0x10"]
    for title in (r"$\foo$", "cost $5 vs $6", "", None):
        assert t.plot(tmp_path / "t.png", title=title).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("names", [3, 12, 40])
def test_the_legend_fits_the_plot_and_every_name_has_its_own_look(names):
    """Two rows of 12 method names: the figure's height followed the rows only, and the legend
    beside them ran off the bottom (m8, m9 not drawn); past ten names colours repeated."""
    t = Timeline([Span(i, f"m{i % names}", 0, f"lane {i % 2}", i * 1e-3, i * 1e-3 + 2e-3)
                  for i in range(2 * names)])
    fig = t._figure(None)
    fig.canvas.draw()
    (ax,) = fig.axes
    legend = ax.get_legend()
    box, page = legend.get_window_extent(), fig.bbox
    assert box.y0 >= page.y0 - 1 and box.y1 <= page.y1 + 1, (box, page)
    assert len(legend.get_texts()) == names
    looks = {(tuple(p.get_facecolor()), p.get_hatch()) for p in legend.get_patches()}
    assert len(looks) == names


def test_a_plot_of_thousands_of_names_lists_forty_and_says_how_many_more(tmp_path):
    """3,500 method names: the height followed the legend (0.21 in a name), a figure ~740 in
    tall that Agg refuses to draw (ValueError past 2**16 pixels), after a minute of one bar
    collection per name. The legend names 39 of them and says how many more; the plot keeps
    a sane height."""
    n = 3500
    t = Timeline([Span(i, f"m{i:04d}", 0, "lane 0", i * 1e-6, i * 1e-6 + 1e-6)
                  for i in range(n)])
    png = t.plot(tmp_path / "many.png")
    assert png.read_bytes()[:4] == b"\x89PNG"
    fig = t._figure(None)
    texts = [x.get_text() for x in fig.axes[0].get_legend().get_texts()]
    assert texts[:2] == ["m0000", "m0001"] and len(texts) == 40
    assert texts[-1] == f"... {n - 39} more"
    assert fig.get_figheight() < 20


@pytest.mark.anyio
async def test_the_trace_is_valid_json_with_one_track_per_lane_and_the_plot_is_a_png(
        device, tmp_path):
    sched, _ = await _two_spins(device, lanes=2)
    timeline = sched.timeline()
    trace = json.loads(timeline.to_chrome_trace(tmp_path / "t" / "trace.json").read_text())
    jobs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    names = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert len(jobs) == 2 and names == {"lane 0", "lane 1"}
    assert {e["name"] for e in jobs} == {"a.forward", "b.forward"}
    assert all(e["dur"] > 0.04e6 for e in jobs)  # microseconds
    png = timeline.plot(tmp_path / "timeline.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.anyio
async def test_a_span_starts_after_the_jobs_device_waits(device):
    """A method run on a caller stream and then on its lane's stream: the second job waits on
    the device for the first (rule 4). Its span starts when its own work can start, so two
    jobs that ran one after the other do not look like overlap."""
    method = spin_program(20_000, "handoff").method("forward", device=device)
    stream = device.create_stream()
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            await sched.run(method, [data(0)])  # warm
            sched.clear_timeline()
            first = await sched.submit(method, [data(1)], stream=stream)
            second = await sched.submit(method, [data(2)])  # the lane's own stream
            await second
            await first
            timeline = sched.timeline()
    assert second.span[0] >= first.span[1] - 1e-4, (first.span, second.span)
    assert timeline.overlap() < 1.1


@pytest.mark.anyio
async def test_clear_timeline_forgets_a_finished_job_the_loop_still_kept(device):
    """A lone caller-stream job is enqueued by the loop, which keeps it for its await. Done on
    the device but never awaited, it was not forgotten by clear_timeline() (timeline() settles
    it, clear_timeline() did not): it showed up in the next phase's timeline and overlap."""
    early = spin_program(1000, "early").method("forward", device=device)
    spins = [spin_program(50_000, f"spin{i}").method("forward", device=device) for i in "ab"]
    x = Result.from_host(data(0), device)
    streams = [device.create_stream() for _ in range(3)]
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(early, [x], stream=streams[0])  # the loop's, kept
            await anyio.sleep(0.2)  # it has long finished on the device
            assert sched._loop_job is job  # the case under test (not settled yet)
            sched.clear_timeline()
            phase = [await sched.submit(m, [x], stream=s)
                     for m, s in zip(spins, streams[1:], strict=True)]
            for j in phase:
                await j
            await job
            names = [span.name for span in sched.timeline()]
    assert names == ["spina.forward", "spinb.forward"] or \
        names == ["spinb.forward", "spina.forward"], names


@pytest.mark.parametrize("bad", [None, 5, ["trace.json"]])
def test_exports_take_a_file_path(bad):
    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    with pytest.raises(InvalidArgument, match="to_chrome_trace takes a file path"):
        timeline.to_chrome_trace(bad)
    with pytest.raises(InvalidArgument, match="plot takes a file path"):
        timeline.plot(bad)


def test_exports_take_bytes_paths_as_open_does(tmp_path):
    """A path given as bytes, or by an ``os.PathLike`` whose ``__fspath__`` returns bytes (both
    valid for ``open()``), raised a bare ``TypeError`` from ``pathlib``; one whose
    ``__fspath__`` returns neither is refused with ``InvalidArgument``."""

    class BytesPath:
        def __init__(self, raw: bytes):
            self.raw = raw

        def __fspath__(self) -> bytes:
            return self.raw

    class Odd:
        def __fspath__(self) -> int:
            return 5

    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    trace = os.fsencode(tmp_path / "t.json")
    assert timeline.to_chrome_trace(trace) == tmp_path / "t.json"
    assert json.loads((tmp_path / "t.json").read_text())["otherData"]["jobs"] == 1
    assert timeline.plot(BytesPath(os.fsencode(tmp_path / "t"))) == tmp_path / "t.png"
    assert (tmp_path / "t.png").read_bytes().startswith(b"\x89PNG")
    with pytest.raises(InvalidArgument, match="name a file"):
        timeline.plot(BytesPath(os.fsencode(f"{tmp_path}/traces/")))
    for export in (timeline.to_chrome_trace, timeline.plot):
        with pytest.raises(InvalidArgument, match="takes a file path"):
            export(Odd())


_WRITE_UNDER_A_SIZE_LIMIT = """
import resource, sys
from streamlane.sched import Span, Timeline
spans = [Span(i, "job", i, "lane 0", i * 1e-3, i * 1e-3 + 5e-4) for i in range(5000)]
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))  # Python ignores SIGXFSZ
for export, name in ((Timeline(spans).to_chrome_trace, "t.json"), (Timeline(spans).plot, "t.png")):
    try:
        export(sys.argv[1] + "/" + name)
    except OSError as exc:
        print(name, "OSError", exc.errno)
"""


def test_an_export_that_fails_leaves_the_earlier_file_whole(tmp_path):
    """A trace or plot cut short (here by a file size limit: a full disk is the same) was left
    truncated, a broken JSON file in place of the earlier good one. Each export now writes a
    new file and renames it into place: the old file stays as it was, no temporary is left."""
    import subprocess
    import sys

    small = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    small.to_chrome_trace(tmp_path / "t.json")
    small.plot(tmp_path / "t.png")
    before = {n: (tmp_path / n).read_bytes() for n in ("t.json", "t.png")}
    proc = subprocess.run([sys.executable, "-c", _WRITE_UNDER_A_SIZE_LIMIT, str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["t.json OSError 27", "t.png OSError 27"], proc.stdout
    assert {n: (tmp_path / n).read_bytes() for n in ("t.json", "t.png")} == before
    assert json.loads(before["t.json"])["otherData"]["jobs"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json", "t.png"]


def test_an_export_that_cannot_create_its_file_names_the_path_given(tmp_path, monkeypatch):
    """Where the new file could not be made (no space for it; a folder such as /proc that
    takes no new files) the error named the hidden temporary file, a name the caller never
    gave; it names the caller's path now, with the errno ``open()`` would give."""
    import errno

    from streamlane.runtime import program

    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    real_open = os.open

    def full(path, *args, **kwargs):
        if ".streamlane-save-" in os.fspath(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), os.fspath(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(program.os, "open", full)
    for export, name in ((timeline.to_chrome_trace, "t.json"), (timeline.plot, "t.png")):
        with pytest.raises(OSError) as info:
            export(tmp_path / name)
        assert info.value.errno == errno.ENOSPC and info.value.filename == str(tmp_path / name)
    assert not list(tmp_path.iterdir())


def test_an_export_writes_through_a_symlink_and_keeps_the_mode(tmp_path):
    """As ``open()`` does: a symlinked path gets its target rewritten (the link stays), and a
    replaced file keeps its mode."""
    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    (tmp_path / "real").mkdir()
    target = tmp_path / "real" / "t.json"
    target.write_text("{}")
    target.chmod(0o640)
    (tmp_path / "t.json").symlink_to(target)
    timeline.to_chrome_trace(tmp_path / "t.json")
    assert (tmp_path / "t.json").is_symlink()
    long = tmp_path / ("\u00e9" * 125 + ".json")  # 255 bytes of UTF-8: the longest name
    assert timeline.to_chrome_trace(long) == long and long.is_file()
    assert json.loads(target.read_text())["otherData"]["jobs"] == 1
    assert target.stat().st_mode & 0o777 == 0o640


def test_an_export_writes_into_what_is_not_a_plain_file_as_open_does(tmp_path):
    """Writing a new file and renaming it over the path replaced whatever the path named: a
    device (as root, to_chrome_trace("/dev/null") would have replaced the system's), a pipe,
    one name of a hard-linked file; a symlink loop became a file. Those are written as
    ``open()`` writes them, and a loop raises as it does (found by a review)."""
    import stat
    import subprocess

    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    reader = subprocess.Popen(["cat", str(fifo)], stdout=subprocess.PIPE)
    timeline.to_chrome_trace(fifo)
    assert json.loads(reader.communicate(timeout=30)[0])["otherData"]["jobs"] == 1
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    one, other = tmp_path / "one.json", tmp_path / "other.json"
    one.write_text("old")
    os.link(one, other)
    timeline.to_chrome_trace(one)
    assert other.read_text() == one.read_text() != "old"
    try:
        os.mknod(tmp_path / "null", 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    except PermissionError:
        pass  # not root: no device to test with
    else:
        timeline.to_chrome_trace(tmp_path / "null")
        assert stat.S_ISCHR(os.lstat(tmp_path / "null").st_mode)
    (tmp_path / "a.json").symlink_to(tmp_path / "b.json")
    (tmp_path / "b.json").symlink_to(tmp_path / "a.json")
    with pytest.raises(OSError):
        timeline.to_chrome_trace(tmp_path / "a.json")
    assert (tmp_path / "a.json").is_symlink()
    assert not list(tmp_path.glob(".streamlane-*"))


def test_exports_refuse_a_folder_name_and_a_span_json_cannot_hold(tmp_path):
    """``to_chrome_trace("traces/")`` wrote a file named ``traces``; a NaN time was written as
    a bare ``NaN``, which is not JSON (Perfetto refuses the file)."""
    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    for bad in (f"{tmp_path}/traces/", f"{tmp_path}/traces/.", "a\0b.json"):
        with pytest.raises(InvalidArgument, match="name a file"):
            timeline.to_chrome_trace(bad)
        with pytest.raises(InvalidArgument, match="name a file"):
            timeline.plot(bad)
    assert not (tmp_path / "traces").exists()
    for start, end in ((0.0, float("nan")), (0.0, float("inf")), (1e308, 1e308)):
        bad = Timeline([Span(0, "a", 0, "lane 0", start, end)])  # the last: 1e314 microseconds
        with pytest.raises(InvalidArgument, match="finite"):
            bad.to_chrome_trace(tmp_path / "t.json")
        with pytest.raises(InvalidArgument, match="finite"):
            bad.plot(tmp_path / "t.png")
    assert not (tmp_path / "t.json").exists() and not (tmp_path / "t.png").exists()


def test_a_plot_of_thousands_of_caller_streams_packs_them_into_rows(tmp_path):
    """A caller stream per request gave a row per stream: 2,000 requests made a 100,000-pixel
    tall PNG in 29 s. Past PLOT_ROWS tracks the caller streams' spans share as few rows as
    never overlap (here 8 at a time: 8 rows), beside each lane's own row."""
    import matplotlib.image

    from streamlane.sched.timeline import PLOT_ROWS

    spans = [Span(0, "own", 0, "lane 0", 0.0, 0.5)]
    for i in range(2000):  # 8 side by side at any time, each on a stream of its own
        start = (i // 8) * 1.0
        spans.append(Span(i + 1, "req", i % 2, f"lane {i % 2} stream {i:#x}", start,
                          start + 0.9))
    timeline = Timeline(spans)
    tracks, rows = timeline._rows()
    assert len(tracks) == len(rows) == 1 + 8 < PLOT_ROWS
    assert sorted(s.job for row in rows for s in row) == list(range(2001))
    for row in rows:  # no two spans of a row overlap
        assert all(a.end_s <= b.start_s for a, b in itertools.pairwise(row))
    start = time.perf_counter()
    path = timeline.plot(tmp_path / "many.png")
    assert time.perf_counter() - start < 20
    assert matplotlib.image.imread(path).shape[0] < 2000
    # All 2,000 side by side (a lane's queue holds 1,024 by default): still PLOT_ROWS rows,
    # the packed rows folded onto them
    crowd = Timeline([Span(i, "req", 0, f"lane 0 stream {i:#x}", 0.0, 1.0) for i in range(2000)])
    tracks, rows = crowd._rows()
    assert len(tracks) == len(rows) == PLOT_ROWS and sum(map(len, rows)) == 2000
    lanes_only = Timeline([Span(i, "a", i, f"lane {i}", 0.0, 1.0) for i in range(60)])
    assert lanes_only._rows()[0] == [f"lane {i}" for i in range(60)]  # no empty packed row
    assert matplotlib.image.imread(crowd.plot(tmp_path / "crowd.png")).shape[0] < 4000


def test_caller_streams_beside_48_lanes_or_more_keep_rows_of_their_own():
    """With PLOT_ROWS lanes or more, no row was left for the caller streams: five side by side
    were folded onto one row, drawn over each other (a review). They keep up to STREAM_ROWS
    rows, and fold only when more than that run side by side."""
    from streamlane.sched.timeline import STREAM_ROWS

    lanes = [Span(i, "own", i, f"lane {i}", 0.0, 1.0) for i in range(50)]
    five = [Span(50 + i, "req", 0, f"lane 0 stream {i + 1:#x}", 0.0, 1.0) for i in range(5)]
    tracks, rows = Timeline(lanes + five)._rows()
    assert len(rows) == 55 and [len(r) for r in rows[50:]] == [1] * 5
    assert tracks[-1] == "5 caller streams, row 5"
    crowd = [Span(60 + i, "req", 0, f"lane 0 stream {i + 1:#x}", 0.0, 1.0) for i in range(20)]
    tracks, rows = Timeline(lanes + crowd)._rows()
    assert len(rows) == 50 + STREAM_ROWS and sum(map(len, rows[50:])) == 20
    assert tracks[-1].endswith(f"row {STREAM_ROWS} of {STREAM_ROWS} (folded: jobs overlap)")


def test_a_name_matplotlib_cannot_draw_is_plotted_escaped(tmp_path):
    """A lone surrogate in a hand-made span's name (no program's name has one) made plot()
    raise matplotlib's TypeError; the trace kept it. Both write it now."""
    t = Timeline([Span(0, "bad\ud800name", 0, "lane 0", 0.0, 1e-3)])
    assert t.plot(tmp_path / "t.png", title="t\udc80").read_bytes()[:4] == b"\x89PNG"
    for title in (123, Path("run-7")):  # drawn as str() gives it, as matplotlib does
        assert t.plot(tmp_path / "t.png", title=title).read_bytes()[:4] == b"\x89PNG"
    assert json.loads(t.to_chrome_trace(tmp_path / "t.json").read_text())


def test_an_export_under_a_file_raises_what_open_raises(tmp_path):
    """A folder of the path that is a file raised FileExistsError ("File exists"), which
    reads as "the trace exists"; ``open()`` says it is not a directory, and so do both
    exports now (a dangling link as the folder: no such file). Nothing is written."""
    import errno

    (tmp_path / "notes").write_text("x")
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    for export, name in ((timeline.to_chrome_trace, "t.json"), (timeline.plot, "t.png")):
        for folder in ("notes", "notes/sub", "gone", "gone/sub", "loop"):
            with pytest.raises(OSError) as opened:
                open(tmp_path / folder / name, "wb")  # noqa: SIM115 (raises)
            with pytest.raises(OSError) as exported:
                export(tmp_path / folder / name)
            assert (type(exported.value), exported.value.errno) == \
                (type(opened.value), opened.value.errno), folder
            assert opened.value.errno in (errno.ENOTDIR, errno.ENOENT, errno.ELOOP)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gone", "loop", "notes"]
    assert (tmp_path / "notes").read_text() == "x"


def test_plot_writes_a_png_at_the_path_it_returns(tmp_path):
    """The path returned is the file written: a missing suffix gets .png, another suffix and
    a directory are refused (a directory for the trace too)."""
    timeline = Timeline([Span(0, "a", 0, "lane 0", 0.0, 1.0)])
    png = timeline.plot(tmp_path / "timeline")
    assert png == tmp_path / "timeline.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert timeline.plot(tmp_path / "UPPER.PNG").read_bytes()[:4] == b"\x89PNG"
    for bad in ("t.svg", "t.json"):
        with pytest.raises(InvalidArgument, match=r"ending in \.png"):
            timeline.plot(tmp_path / bad)
        assert not (tmp_path / bad).exists()
    (tmp_path / "d").mkdir()
    with pytest.raises(InvalidArgument, match="is a directory"):
        timeline.plot(tmp_path / "d")
    with pytest.raises(InvalidArgument, match="is a directory"):
        timeline.to_chrome_trace(tmp_path / "d")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["UPPER.PNG", "d", "timeline.png"]


@pytest.mark.anyio
async def test_a_failing_span_read_on_a_lane_thread_ends_no_thread(device, monkeypatch):
    """Reading spans on a lane's threads after the loop is told: a failure there (a bug) is
    reported on the loop and the thread goes on; ended, it would hang every later job."""
    from streamlane.sched.lane import Lane

    real = Lane._read
    calls = []

    def failing_once(self, note, ref, busy):
        calls.append(threading.current_thread().name)
        if len(calls) == 1:
            raise RuntimeError("a bug in reading spans")
        return real(self, note, ref, busy)

    monkeypatch.setattr(Lane, "_read", failing_once)
    method = spin_program(500, "r").method("forward", device=device)
    with anyio.fail_after(20):
        async with Scheduler(device, lanes=1, poll_us=0) as sched:
            if sched.waker.backend == "asyncio":  # reported on the loop, as a callback's error
                import asyncio

                reported = []
                asyncio.get_running_loop().set_exception_handler(
                    lambda loop, context: reported.append(context["exception"]))
            for i in range(5):
                (y,) = await sched.run(method, [data(i)])
                np.testing.assert_array_equal(y.to_host(), data(i))
    assert calls[0].startswith("streamlane-")
    if sched.waker.backend == "asyncio":
        assert [str(e) for e in reported] == ["a bug in reading spans"]


@pytest.mark.anyio
async def test_spans_cut_short_by_an_interrupt_are_read_later_once(device, lane_reads_held):
    """An exception other than ``Exception`` (a Ctrl-C) raised into ``timeline()`` while it
    reads pending spans: those not read yet are put back, so the next ``timeline()`` has every
    job once, and the busy time counts each once."""
    from streamlane.sched.lane import Lane

    held = lane_reads_held  # the lane's threads leave every span to the loop here
    method = spin_program(300, "cut").method("forward", device=device)
    # the second job's span, the first already recorded
    cut = RaiseAt(Lane._read, "t1 = ref.elapsed_ms(note.end)", nth=2)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=4, poll_us=0) as sched:
            try:
                await _one_job_per_lane(sched, method)
                with cut, pytest.raises(Interrupt):
                    sched.timeline()
                spans = sched.timeline().spans
                busy = sum(s.busy_time_s for s in sched.statistics())
            finally:
                held.set()
    assert cut.hits == 2
    assert sorted(span.job for span in spans) == sorted({span.job for span in spans})
    assert len(spans) == 4, spans
    assert busy == pytest.approx(sum(span.duration_s for span in spans))


@pytest.mark.anyio
async def test_spans_the_loop_reads_late_do_not_push_out_later_jobs(device):
    """``timeline_size`` keeps the most recent jobs by submit order, though a job the loop
    settled has its span read after those of later jobs."""
    a = spin_program(200, "early").method("forward", device=device)
    b = spin_program(200, "late").method("forward", device=device)
    stream = device.create_stream()
    x = Result.from_host(data(0), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2, timeline_size=4) as sched:
            early = await sched.submit(a, [x], stream=stream, lane=0)
            await anyio.sleep(0.05)  # the loop's next turn enqueues it; done on the device
            later = [await sched.submit(b, [data(i)], lane=1) for i in range(4)]
            for job in later:
                await job
            assert early.done()
            spans = sched.timeline().spans
    assert sorted(span.job for span in spans) == [job.id for job in later]


@pytest.mark.anyio
async def test_spans_survive_an_interrupt_before_their_read_starts(device, monkeypatch,
                                                                    lane_reads_held):
    """An interrupt as the loop starts reading a note (before any of it is recorded): the note
    is put back and read later, never lost."""
    from streamlane.sched.lane import Lane

    held = lane_reads_held
    real_read = Lane._read
    raised = []

    def read(self, note, ref, busy):
        if not raised:
            raised.append(note.id)
            raise Interrupt
        return real_read(self, note, ref, busy)

    monkeypatch.setattr(Lane, "_read", read)
    method = spin_program(300, "entry").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=2, poll_us=0) as sched:
            try:
                await _one_job_per_lane(sched, method)
                with pytest.raises(Interrupt):
                    sched.timeline()
                spans = sched.timeline().spans
            finally:
                held.set()
    assert raised and len(spans) == 2, spans


@pytest.mark.anyio
async def test_a_span_cut_short_while_recorded_is_never_read_twice(device, lane_reads_held):
    """An interrupt as a span is recorded: that note is not read again (its start event would
    go back to the pool twice, and two later jobs would share it: a negative span)."""

    held = lane_reads_held
    method = spin_program(300, "twice").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=3, poll_us=0) as sched:
            try:
                await _one_job_per_lane(sched, method)
                real_record = sched.record_span
                calls = []

                def record_span(span):
                    real_record(span)
                    calls.append(span.job)
                    if len(calls) == 2:  # as the record returns
                        raise Interrupt

                sched.record_span = record_span
                with pytest.raises(Interrupt):
                    sched.timeline()
                sched.record_span = real_record
                spans = sched.timeline().spans
                pools = [list(lane._events) for lane in sched.lanes]
            finally:
                held.set()
    ids = [span.job for span in spans]
    assert sorted(ids) == sorted(set(ids)) and len(ids) == 3, ids
    for pool in pools:
        assert len({id(event) for event in pool}) == len(pool)


@pytest.mark.anyio
async def test_a_job_the_loop_finishes_while_its_waiter_settles_it_keeps_its_span(device):
    """The waiter claims a job and is switched out (the GIL moves on) before it notes the
    span; ``await job`` finds the job claimed and done on the device and finishes it. The span
    was noted under the claim, so ``job.span`` and the timeline have it."""
    import sys

    go = threading.Event()

    class PausingLock:  # the lane's lock, pausing its waiter once as _settle's claim ends
        def __init__(self, lock):
            self.lock, self.paused = lock, False

        def __enter__(self):
            return self.lock.__enter__()

        def __exit__(self, *exc):
            self.lock.__exit__(*exc)
            if (not self.paused and threading.current_thread().name.startswith(
                    "streamlane-wait") and sys._getframe(1).f_code.co_name == "_settle"):
                self.paused = True
                go.wait(10)

    method = spin_program(20_000, "claimed").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1000) as sched:
            lane = sched.lanes[0]
            lane._lock = PausingLock(lane._lock)
            try:
                job = await sched.submit(method, [data(0)])
                # Done on the device, claimed by the paused waiter. Waited for, not assumed
                # after a fixed sleep: on the H200 a short spin once finished after more
                # than 50 ms (a lane stream can share a hardware queue with a stream another
                # test left busy). A lane thread held up past the spin finds the job done
                # and settles it itself (once on the H200 with a 300-us spin): then the
                # case under test did not happen.
                while not lane._lock.paused:
                    if job._finished:  # (read, not done(): that would settle it here)
                        pytest.skip("the lane thread settled the job: no waiter claim")
                    await anyio.sleep(0.001)
                await job
                assert job.span is not None
                assert [span.job for span in sched.timeline().spans] == [job.id]
            finally:
                go.set()


@pytest.mark.anyio
async def test_a_lost_read_of_the_loops_spans_is_made_up_for(device, monkeypatch):
    """The read the loop queues once UNREAD_MAX spans wait can be lost (an interrupt as it is
    queued); notes then still stop piling up, at 4x that."""
    from streamlane.sched._wakeup import LoopWaker
    from streamlane.sched.lane import UNREAD_MAX

    real = LoopWaker.call_soon
    lost = []

    def call_soon(self, callback):
        if not lost and getattr(callback, "__name__", "") == "_read_spans_soon":
            lost.append(1)
            raise Interrupt
        return real(self, callback)

    monkeypatch.setattr(LoopWaker, "call_soon", call_soon)
    method = spin_program(100, "lost").method("forward", device=device)
    stream = device.create_stream()
    x = Result.from_host(data(0), device)
    most = 0
    with anyio.fail_after(60):
        async with Scheduler(device, lanes=1) as sched:
            lane = sched.lanes[0]
            for _ in range(6 * UNREAD_MAX):
                job = await sched.submit(method, [x], stream=stream)
                await anyio.sleep(0)  # the loop's next turn enqueues it
                while not job._is_published or not job.event.query():
                    await anyio.sleep(0.0005)
                try:
                    await job  # complete at once: the loop settles it
                except Interrupt:
                    await job
                await anyio.sleep(0)
                most = max(most, len(lane._unread))
            assert len(sched.timeline()) == 6 * UNREAD_MAX
    assert lost and most <= 4 * UNREAD_MAX, most


@pytest.mark.anyio
async def test_looking_at_the_scheduler_from_inside_a_span_read_does_not_hang(device,
                                                                           monkeypatch):
    """A signal handler runs on the loop thread, perhaps while that thread reads spans (holding
    the lane's span lock): one that looks at ``statistics()``, ``timeline()`` or ``job.span``
    must not wait for that lock forever."""
    from streamlane.sched.lane import Lane

    real = Lane._read
    seen = []

    def read(self, note, ref, busy):
        if not seen:  # as a handler would, between two of the loop's own reads
            seen.append((sched.statistics(), len(sched.timeline()), job.span))
        return real(self, note, ref, busy)

    monkeypatch.setattr(Lane, "_read", read)
    method = spin_program(300, "handler").method("forward", device=device)
    stream = device.create_stream()
    x = Result.from_host(data(0), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1) as sched:
            job = await sched.submit(method, [x], stream=stream)
            await job
            sched.timeline()  # reads job's span on the loop thread
    assert seen


@pytest.mark.anyio
async def test_an_await_that_finishes_a_claimed_job_waits_for_its_span_note(device):
    """The waiter claims a job and, before it has noted the span, is held (a thread switch);
    ``await job`` finds the job claimed and done on the device and finishes it itself. It
    first waits out the claim, so the span is there when the await returns."""
    import inspect

    from streamlane.sched import lane as lane_module

    lines, first = inspect.getsourcelines(lane_module.Lane._settle)
    target = next(first + i for i, text in enumerate(lines)
                  if text.strip().startswith("noted = ["))
    paused = threading.Event()

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target and not paused.is_set():
            paused.set()
            time.sleep(0.1)  # long enough for the loop's await to finish the job, unguarded
        return local

    def tracer(frame, event, arg):
        if frame.f_code is lane_module.Lane._settle.__code__ and \
                threading.current_thread().name.startswith("streamlane-wait"):
            return local
        return None

    method = spin_program(300, "claim").method("forward", device=device)
    threading.settrace(tracer)
    try:
        with anyio.fail_after(30):
            async with Scheduler(device, lanes=1, poll_us=0) as sched:
                job = await sched.submit(method, [data(0)])
                while not paused.is_set():
                    await anyio.sleep(0.001)
                await job
                assert job.span is not None
                assert [span.job for span in sched.timeline().spans] == [job.id]
    finally:
        threading.settrace(None)


@pytest.mark.anyio
async def test_an_interrupt_in_the_loops_settle_leaves_the_counts_right(device, monkeypatch):
    """An interrupt as the loop settles a job it polled (between claiming and counting, where
    a signal can land) never leaves a job claimed but not counted: the lane's in-flight and
    completed counts stay right."""
    from streamlane.sched.lane import Lane

    # the line after the job is claimed, counted and kept
    cut = RaiseAt(Lane._settle, "claimed.append(job)", offset=1)
    method = spin_program(300, "counted").method("forward", device=device)
    stream = device.create_stream()
    x = Result.from_host(data(0), device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=1e6) as sched:
            job = await sched.submit(method, [x], stream=stream)
            with cut, pytest.raises(Interrupt):
                await job  # the loop's poll settles it
            await job
            (stats,) = sched.statistics()
    assert cut.hits == 1
    assert (stats.in_flight, stats.completed) == (0, 1), stats


@pytest.mark.anyio
async def test_busy_time_counts_a_job_as_soon_as_its_await_returns(device):
    """The busy time is added under the span lock with the spans: ``statistics()`` right after
    an await, which waits for a lane thread's read in progress, counts the job. (It was added
    after that lock was let go, under the lane's lock: a thread switch there hid it.)"""
    import sys

    class PausingLock:  # a lane thread switched out as read_spans takes the lane's lock
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            if threading.current_thread().name.startswith("streamlane-") and \
                    sys._getframe(1).f_code.co_name == "read_spans":
                time.sleep(0.2)
            return self.lock.__enter__()

        def __exit__(self, *exc):
            return self.lock.__exit__(*exc)

    method = spin_program(300, "busy").method("forward", device=device)
    with anyio.fail_after(30):
        async with Scheduler(device, lanes=1, poll_us=0) as sched:
            sched.lanes[0]._lock = PausingLock(sched.lanes[0]._lock)
            for i in range(3):
                job = await sched.submit(method, [data(i)])
                await job
                busy = sched.statistics()[0].busy_time_s
                assert busy >= (i + 1) * 0.00025, busy


@pytest.mark.anyio
async def test_an_untimed_scheduler_has_no_timeline_to_read(host):
    """With timing=False, timeline() gave an empty Timeline whose overlap() of 0.0 read as "no
    overlap" rather than "not measured"."""
    from streamlane.runtime.errors import InvalidState

    method = double_program().method("forward", device=host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1, timing=False) as sched:
            await sched.run(method, [data(0)])
            with pytest.raises(InvalidState, match="timing=False"):
                sched.timeline()
            sched.clear_timeline()  # nothing to clear: fine
            assert sched.statistics()[0].completed == 1



@pytest.mark.anyio
@pytest.mark.parametrize("look", ["statistics", "timeline", "span"])
async def test_polling_the_measurements_without_yielding_sees_a_held_back_job_finish(host, look):
    """A lone caller-stream job with device inputs is held back for its await; ``done()`` and
    ``pending`` started it when looked at, but ``statistics()``, ``timeline()`` and
    ``job.span`` did not, so a loop polling them without yielding spun for ever."""
    method = double_program().method("forward", device=host)
    x = Result.from_host(data(0), host)
    with anyio.fail_after(30):
        async with Scheduler(host, lanes=1) as sched:
            job = await sched.submit(method, [x], stream=host.create_stream())
            seen = {
                "statistics": lambda: sched.statistics()[0].completed == 1,
                "timeline": lambda: len(sched.timeline()) == 1,
                "span": lambda: job.span is not None,
            }[look]
            deadline = time.monotonic() + 10
            while not seen():  # no await: the loop never turns
                assert time.monotonic() < deadline, (look, sched.statistics(), job)
                time.sleep(0.001)
            np.testing.assert_allclose((await job)[0].to_host(), 2 * data(0))


def test_a_hand_made_timeline_takes_numpy_numbers_and_refuses_what_is_not_a_span(tmp_path):
    """A Span of numpy scalars (``np.int64`` lane, ``np.float32`` times) made
    ``to_chrome_trace`` raise json's TypeError; ``Timeline([1])`` an AttributeError and
    ``Timeline(None)`` a TypeError."""
    span = Span(np.int64(3), "a.b", np.int64(0), "lane 0", np.float32(0.001), np.float64(0.002))
    timeline = Timeline([span], "host:0")
    doc = json.loads(timeline.to_chrome_trace(tmp_path / "t.json").read_text())
    (event,) = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert event["args"] == {"job": 3, "lane": 0} and event["dur"] == pytest.approx(1000, 1e-4)
    assert type(timeline.spans[0].job) is int and type(timeline.spans[0].start_s) is float
    for bad, match in (([1], r"spans\[0\] must be a Span"), (None, "iterable of Spans"),
                       ([Span(0, "a", -1, "lane 0", 0.0, 1.0)], "int job and lane >= 0"),
                       ([Span(0, "a", 0, "lane 0", "0", 1.0)], "real start and end"),
                       ([Span(0, "a", 0, "lane 0", True, 1.0)], "real start and end"),
                       ([Span(0, 5, 0, "lane 0", 0.0, 1.0)], "str name and track")):
        with pytest.raises(InvalidArgument, match=match):
            Timeline(bad)
    with pytest.raises(InvalidArgument, match="device must be a str"):
        Timeline([], 0)


def test_the_plot_draws_track_names_as_plain_text_and_counts_each_stream_once(tmp_path):
    """A track named ``r"$\\foo$"`` made ``plot()`` raise (matplotlib read it as mathtext; the
    title and legend were plain already); past ``PLOT_ROWS`` tracks the packed rows said
    "60 caller streams" for 30 streams used from two lanes; an unnamed device's title read
    "streamlane : 1 jobs"."""
    odd = Timeline([Span(0, "a.b", 0, r"$\foo$", 0.0, 1e-3)])
    odd.plot(tmp_path / "odd.png")
    fig = odd._figure(None)
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == [r"$\foo$"]
    assert fig.axes[0].get_title() == "streamlane: 1 job, overlap 1.00x"
    spans = [Span(2 * i + k, "m", k, f"lane {k} stream {0x100 + i:#x}", i * 1e-3, i * 1e-3 + 5e-4)
             for i in range(30) for k in (0, 1)]
    tracks, _ = Timeline(spans)._rows()
    assert len(Timeline(spans).tracks()) == 60 and tracks[0].startswith("30 caller streams,")
    # hand-made tracks of other names count one each (they all counted as one)
    made = [Span(i, "m", 0, f"gpu{i}", i * 1e-3, i * 1e-3 + 5e-4) for i in range(60)]
    assert Timeline(made)._rows()[0][0].startswith("60 caller streams,")


@pytest.mark.anyio
async def test_a_measurement_looks_at_a_bounded_number_of_pending_jobs(host, monkeypatch):
    """Settling every pending job in each ``statistics()`` / ``timeline()`` call made one call
    cost 14.7 ms with 5,000 jobs pending, and submitting them with a ``statistics()`` after
    each quadratic (17 s against 0.5); off the loop thread the walk did nothing, for 2.4 ms.
    A call now looks at ``OBSERVE_AT_MOST`` of them at most, none off the loop."""
    from streamlane.sched import scheduler as scheduler_module
    from streamlane.sched.lane import Lane

    looked = []
    real = Lane.observe
    monkeypatch.setattr(Lane, "observe", lambda self, job: (looked.append(job), real(self, job)))
    method = double_program().method("forward", device=host)
    held = host.create_stream()
    count = 3 * scheduler_module.OBSERVE_AT_MOST
    with anyio.fail_after(60), host.create_latch() as latch:
        async with Scheduler(host, lanes=1, queue_size=count + 8) as sched:
            latch.hold(held)
            jobs = [await sched.submit(method, [data(i)], stream=held) for i in range(count)]
            for measure in (sched.statistics, sched.timeline):
                looked.clear()
                measure()
                assert 0 < len(looked) <= scheduler_module.OBSERVE_AT_MOST, measure
            looked.clear()
            await anyio.to_thread.run_sync(sched.statistics)
            assert looked == []
            latch.release()
            for i, job in enumerate(jobs):
                np.testing.assert_allclose((await job)[0].to_host(), 2 * data(i))
            assert sched.statistics()[0].completed == count

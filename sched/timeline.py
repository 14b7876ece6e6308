"""Timelines: when each job ran on the device, measured with timing events.

Each job's span runs from a timing event its execute records on its stream after the execute's
device waits (rule 4's handoff, inputs from other streams), just before its first step, to one
recorded just after the execute, both read against one reference event recorded when the
scheduler started.
So spans of different lanes and streams share one clock (the device's), and the overlap factor
is measured, not inferred: ``overlap() = sum of job durations / length of their union``.
"""

from __future__ import annotations

import heapq
import json
import math
import numbers
import os
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamlane.runtime.dtypes import int_in
from streamlane.runtime.errors import InvalidArgument
from streamlane.runtime.program import FilePath, make_folders, new_hidden_file, path_text

__all__ = ["Span", "Timeline"]


# Past this many tracks, plot() packs the caller streams' spans into rows (Timeline._rows).
PLOT_ROWS = 48
STREAM_ROWS = 8  # rows the caller streams keep past PLOT_ROWS, however many lanes there are
# The legend names this many methods at most, then says how many more: the plot's height
# follows the legend, and thousands of names made a PNG taller than Agg can draw.
LEGEND_NAMES = 40


@dataclass(frozen=True)
class Span:
    """One job on the device: seconds since the scheduler's reference event."""

    job: int
    name: str
    lane: int
    track: str  # "lane 0" (its per-thread stream) or "lane 0 stream 0x10" (a caller stream)
    start_s: float
    end_s: float

    @property
    def duration_s(self) -> float:
        """``end_s - start_s``."""
        return self.end_s - self.start_s


_HATCHES = ("", "//", "..", "xx", "\\\\", "oo")


def _by_start(span: Span) -> tuple[float, int]:
    return span.start_s, span.job


class Timeline:
    """An immutable snapshot of spans (``Scheduler.timeline()``)."""

    __slots__ = ("__weakref__", "_device", "_spans")

    def __init__(self, spans: Iterable[Span], device: str = ""):
        if not isinstance(device, str):
            raise InvalidArgument(f"Timeline: device must be a str (its name), got "
                                  f"{type(device).__name__}")
        try:
            given = list(spans)
        except TypeError:
            raise InvalidArgument(f"Timeline takes an iterable of Spans, got "
                                  f"{type(spans).__name__}") from None
        checked = [_checked(s, i) for i, s in enumerate(given)]
        self._spans: tuple[Span, ...] = tuple(sorted(checked, key=_by_start))
        self._device = device

    @classmethod
    def _recorded(cls, spans: Iterable[Span], device: str) -> Timeline:
        """The timeline of spans a scheduler recorded (``Scheduler.timeline``): not checked
        again, as an observer (a raw signal handler too) should find it cheap to read."""
        timeline = cls.__new__(cls)
        timeline._spans = tuple(sorted(spans, key=_by_start))
        timeline._device = device
        return timeline

    def __reduce__(self) -> tuple[type[Timeline], tuple[tuple[Span, ...], str]]:
        return Timeline, (self._spans, self._device)  # every pickle protocol, and copy

    @property
    def spans(self) -> tuple[Span, ...]:
        """The spans, by start."""
        return self._spans

    @property
    def device(self) -> str:
        """The name of the device they ran on."""
        return self._device

    def __len__(self) -> int:
        return len(self.spans)

    def __iter__(self) -> Iterator[Span]:
        return iter(self.spans)

    def tracks(self) -> list[str]:
        """The rows: one per lane, plus one per caller stream used on a lane (by lane, then
        by stream handle: 0x9 before 0x10)."""
        first = {}
        for s in self.spans:
            if s.track not in first:
                caller = s.track != f"lane {s.lane}"
                try:  # "lane 0 stream 0x10": the handle; a hand-made name sorts as written
                    number = int(s.track.rpartition(" stream 0x")[2], 16) if caller else -1
                except ValueError:
                    number = -1
                first[s.track] = (s.lane, caller, number, s.track)
        return [t for t, _ in sorted(first.items(), key=lambda kv: kv[1])]

    def busy_s(self) -> float:
        """The sum of job durations."""
        return sum((s.duration_s for s in self.spans), 0.0)

    def union_s(self) -> float:
        """The time at least one job was running (the union of the spans)."""
        total, end = 0.0, float("-inf")
        for s in self.spans:  # sorted by start
            if s.end_s <= end:
                continue
            total += s.end_s - max(s.start_s, end)
            end = s.end_s
        return total

    def wall_s(self) -> float:
        """From the first start to the last end (gaps included)."""
        if not self.spans:
            return 0.0
        return max(s.end_s for s in self.spans) - self.spans[0].start_s

    def overlap(self) -> float:
        """Sum of job durations / length of their union: 1.0 when jobs ran one at a time, N when
        N ran side by side throughout; 0.0 for an empty timeline."""
        union = self.union_s()
        return self.busy_s() / union if union > 0 else 0.0

    # -- export -----------------------------------------------------------------------------
    def to_chrome_trace(self, path: FilePath) -> Path:
        """Write a Chrome / Perfetto trace (JSON; open it in ui.perfetto.dev or
        chrome://tracing), one track per lane and caller stream. Returns the path."""
        path = _path(path, "to_chrome_trace")
        tid = {t: i for i, t in enumerate(self.tracks())}
        events: list[dict] = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
                               "args": {"name": f"streamlane {self.device}".strip()}}]
        for track, i in tid.items():
            events.append({"name": "thread_name", "ph": "M", "pid": 1, "tid": i,
                           "args": {"name": track}})
            events.append({"name": "thread_sort_index", "ph": "M", "pid": 1, "tid": i,
                           "args": {"sort_index": i}})
        self._check_finite("to_chrome_trace")
        for s in self.spans:
            events.append({"name": s.name, "cat": "job", "ph": "X", "pid": 1, "tid": tid[s.track],
                           "ts": round(s.start_s * 1e6, 3), "dur": round(s.duration_s * 1e6, 3),
                           "args": {"job": s.job, "lane": s.lane}})
        doc = {"traceEvents": events, "displayTimeUnit": "ms",
               "otherData": {"device": self.device, "jobs": len(self.spans),
                             "overlap": round(self.overlap(), 4)}}
        text = json.dumps(doc).encode("utf-8")
        _write_file(path, lambda f: f.write(text))
        return path

    def plot(self, path: FilePath, title: str | None = None) -> Path:
        """Write a PNG timeline (matplotlib, Agg; no global backend change), one row per lane
        and caller stream (past ``PLOT_ROWS`` tracks, the caller streams' spans packed into
        rows: ``_rows``). A path without a suffix gets ``.png``; another suffix than
        ``.png`` is refused. Returns the path written."""
        path = _path(path, "plot")
        if not path.suffix:
            path = _path(path.with_name(path.name + ".png"), "plot")
        elif path.suffix.lower() != ".png":
            raise InvalidArgument(f"Timeline.plot writes a PNG; give a path ending in .png, got "
                                  f"{str(path)!r} (to_chrome_trace() writes the JSON trace)")
        self._check_finite("plot")
        fig = self._figure(title)
        _write_file(path, lambda f: fig.savefig(f, format="png"))
        return path

    def _figure(self, title: str | None) -> Any:
        """The plot's matplotlib Figure (on an Agg canvas)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        tracks, rows = self._rows()
        names = sorted({s.name for s in self.spans})
        # Tall enough for its rows and for the legend beside them (~0.2 in per name at the
        # small font): a short plot of many names cut the legend off at the bottom.
        listed = names if len(names) <= LEGEND_NAMES else names[:LEGEND_NAMES - 1]
        entries = len(listed) + (len(listed) < len(names))  # "... N more" is one too
        height = max(1.2 + 0.5 * max(1, len(tracks)), 0.9 + 0.21 * entries)
        fig = Figure(figsize=(10, height), dpi=100)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot()
        t0 = self.spans[0].start_s if self.spans else 0.0
        # Ten colours, then the same ten hatched: names past the tenth stay told apart.
        style = {n: (f"C{i % 10}", _HATCHES[i // 10 % len(_HATCHES)])
                 for i, n in enumerate(names)}
        for row, spans in enumerate(rows):
            # One collection per look in a row (60 at most), not per name: each costs an
            # autoscale, and 6,000 names took a minute to draw.
            bars: dict[tuple[str, str], list[tuple[float, float]]] = {}
            for s in spans:
                bars.setdefault(style[s.name], []).append(
                    ((s.start_s - t0) * 1e3, max(s.duration_s * 1e3, 1e-3)))
            for (colour, hatch), xranges in bars.items():
                ax.broken_barh(xranges, (row - 0.4, 0.8), facecolors=colour, hatch=hatch,
                               edgecolor="black", linewidth=0.3)
        ax.set_yticks(range(len(tracks)), [_shown(t) for t in tracks])
        for label in ax.get_yticklabels():  # plain text too (a hand-made track r"$\foo$")
            label.set_parse_math(False)
        ax.set_ylim(-0.6, max(0.6, len(tracks) - 0.4))
        ax.invert_yaxis()
        ax.set_xlabel("ms since the first job started")
        # Plain text, as given: matplotlib reads "$...$" as mathtext ("$5 and $6" in italics,
        # r"$\foo$" an error). title="" draws none.
        jobs = len(self.spans)
        ax.set_title(_shown(title if title is not None else
                            f"{f'streamlane {self.device}'.strip()}: {jobs} "
                            f"job{'' if jobs == 1 else 's'}, overlap {self.overlap():.2f}x"),
                     parse_math=False)
        if names:
            from matplotlib.patches import Patch

            handles = [Patch(facecolor=style[n][0], hatch=style[n][1], edgecolor="black",
                             linewidth=0.3, label=_shown(n)) for n in listed]
            if len(listed) < len(names):
                handles.append(Patch(facecolor="none", edgecolor="none",
                                     label=f"... {len(names) - len(listed)} more"))
            legend = ax.legend(handles=handles,
                               loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small")
            for text in legend.get_texts():
                text.set_parse_math(False)
        fig.tight_layout()
        return fig

    def _check_finite(self, what: str) -> None:
        """A span's times in microseconds must be finite numbers: JSON has no NaN or infinity
        (Perfetto refuses the file), and no plot can place one. No span of ours is."""
        for s in self.spans:
            if not (math.isfinite(s.start_s * 1e6) and math.isfinite(s.duration_s * 1e6)):
                raise InvalidArgument(f"Timeline.{what}: {s} has a time that is not a finite "
                                      f"number of microseconds")

    def _rows(self) -> tuple[list[str], list[list[Span]]]:
        """The plot's rows: a row per track, or, past ``PLOT_ROWS`` tracks (a caller stream
        per request), a row per lane's own stream and the caller streams' spans packed into
        as few rows as never overlap in time (a PNG of thousands of rows helps nobody)."""
        by_track: dict[str, list[Span]] = {}
        for s in self.spans:
            by_track.setdefault(s.track, []).append(s)
        tracks = self.tracks()
        if len(tracks) <= PLOT_ROWS:
            return tracks, [by_track[t] for t in tracks]
        own = [t for t in tracks if t == f"lane {by_track[t][0].lane}"]
        rows = [by_track[t] for t in own]
        ends: list[tuple[float, int]] = []  # (end of the row's last span, row), a heap
        packed: list[list[Span]] = []
        for s in self.spans:  # by start
            if s.track in own:
                continue
            if ends and ends[0][0] <= s.start_s:
                _, row = heapq.heappop(ends)
            else:
                row = len(packed)
                packed.append([])
            packed[row].append(s)
            heapq.heappush(ends, (s.end_s, row))
        # Caller streams, each counted once (a stream used from two lanes is two tracks; a
        # track of another name, in a timeline made by hand, is one of its own)
        streams = len({t.partition(" stream ")[2] or t for t in tracks if t not in own})
        if not packed:  # lanes alone: a row each, however many
            return own, rows
        # The rows left beside the lanes', and at least STREAM_ROWS: with 48 lanes or more,
        # a few caller streams side by side were folded onto one row, drawn over each other.
        fold = max(PLOT_ROWS - len(own), STREAM_ROWS)
        if len(packed) <= fold:
            return own + [f"{streams} caller streams, row {i + 1}"
                          for i in range(len(packed))], rows + packed
        # Still too many (more jobs side by side than rows): fold them, drawn over each other.
        folded: list[list[Span]] = [[] for _ in range(fold)]
        for i, row in enumerate(packed):
            folded[i % fold].extend(row)
        return own + [f"{streams} caller streams, row {i + 1} of {fold} (folded: jobs overlap)"
                      for i in range(fold)], rows + folded

    def __repr__(self) -> str:
        return (f"<Timeline {len(self.spans)} jobs, {len(self.tracks())} tracks, overlap "
                f"{self.overlap():.2f}x>")


def _shown(text: object) -> str:
    """``text`` (as ``str()`` gives it: a title may be any object, as matplotlib takes it)
    as matplotlib can draw it: a lone surrogate (a name no program of ours has, but a
    Timeline made by hand may) as its escape, where matplotlib raised TypeError."""
    return str(text).encode("utf-8", "backslashreplace").decode("utf-8")


def _checked(span: object, i: int) -> Span:
    """A span given to ``Timeline``, as the scheduler records one: numpy's ints and floats as
    Python's (json writes no numpy scalar), anything else an ``InvalidArgument``."""
    if not isinstance(span, Span):
        raise InvalidArgument(f"Timeline: spans[{i}] must be a Span, got {type(span).__name__}")
    job, lane = int_in(span.job, 0), int_in(span.lane, 0)
    start, end = _time(span.start_s), _time(span.end_s)
    if job is None or lane is None or not isinstance(span.name, str) or \
            not isinstance(span.track, str):
        raise InvalidArgument(f"Timeline: spans[{i}] ({span}) needs an int job and lane >= 0 "
                              f"and a str name and track")
    if start is None or end is None:
        raise InvalidArgument(f"Timeline: spans[{i}] ({span}) needs real start and end times")
    if end < start:  # a negative duration has no union, no trace event, no bar
        raise InvalidArgument(f"Timeline: {span} ends before it starts")
    if (type(span.job), type(span.lane), type(span.start_s), type(span.end_s)) == \
            (int, int, float, float):
        return span  # as recorded
    return Span(job, span.name, lane, span.track, start, end)


def _time(value: object) -> float | None:
    """A span's time as a float (a NaN or an infinity too: the exports refuse those)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _path(path: object, what: str) -> Path:
    text = path_text(path, f"Timeline.{what}")
    if text.endswith(("/", os.sep)) or "\0" in text or os.path.basename(text) in (".", ".."):
        raise InvalidArgument(f"Timeline.{what} takes a file path, got {text!r} (a folder's "
                              f"name, or a NUL character); name a file")
    path = Path(text)
    if path.is_dir():
        raise InvalidArgument(f"Timeline.{what} takes a file path, and {str(path)!r} is a "
                              f"directory; name a file in it")
    return path


def _write_file(path: Path, write: Any) -> None:
    """Write the file ``open(path, "wb")`` would write: through symlinks (a loop raises as it
    would), the folders made first. A regular file of one name is written whole or not at
    all: ``write(f)`` fills a new hidden file beside it, which then replaces it (an earlier
    trace stays as it was if the write fails: a full disk, a file size limit, a Ctrl-C), with
    the mode ``open()`` leaves (that of the file it replaces, else 0o666 less the umask).
    Anything else is written in place, as ``open()`` would: a device or a pipe (replacing
    ``/dev/null`` would be a disaster), a file with other names (hard links), one we may not
    write (``open()``'s error), or one in a folder we may not add to."""
    make_folders(path.parent, path)
    try:
        path = Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:  # a new file, or a link to one: made where it points
        path = Path(os.path.realpath(path))
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and (not stat.S_ISREG(st.st_mode) or st.st_nlink > 1
                           or not os.access(path, os.W_OK)):
        _write_in_place(path, write)
        return
    written: list[Path] = []  # the temporary file: removed unless renamed into place
    try:
        try:
            f = new_hidden_file(path.parent, written, like=path)
        except PermissionError:  # a folder we may not add to (the file itself may be writable)
            _write_in_place(path, write)
            return
        with f:
            write(f)
        os.replace(written[0], path)
    finally:
        for temp in written:
            temp.unlink(missing_ok=True)


def _write_in_place(path: Path, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)

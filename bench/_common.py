"""Shared benchmark plumbing: timing helpers, the results table and the JSON record
(date, commit, device and every figure) under bench/results/."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
# Settings that change what a GPU run measures, recorded with every figure:
ENV = ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_LAUNCH_BLOCKING", "STREAMLANE_DEVICE",
       "STREAMLANE_HOLD_GIL")


def commit() -> str:
    """The commit measured: $STREAMLANE_COMMIT when set (a lent GPU machine gets a copy of the
    working tree whose .git may be stale: pass the hash in the command), else git's view."""
    if os.environ.get("STREAMLANE_COMMIT"):
        return os.environ["STREAMLANE_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, cwd=Path(__file__).parent, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, cwd=Path(__file__).parent,
                               timeout=10).stdout.strip()
        return out.stdout.strip() + ("+dirty" if dirty else "") or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def device_info(device: Any) -> dict[str, Any]:
    info = {"name": device.name, "kind": device.kind, "host": platform.node(),
            "python": platform.python_version()}
    for attr in ("device_name", "arch", "total_memory"):
        if hasattr(device, attr):
            info[attr] = getattr(device, attr)
    return info


def median_us(fn: Callable[[], Any], repeats: int, inner: int,
              sync: Callable[[], Any] | None = None) -> float:
    """Median over ``repeats`` of the per-call host time of ``inner`` calls, in µs."""
    samples = []
    for _ in range(repeats):
        if sync:
            sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter() - t0) / inner * 1e6)
    if sync:
        sync()
    return statistics.median(samples)


def kernel_us(device: Any, stream: Any, variants: list[str], in_shape: tuple[int, ...],
              out_shape: tuple[int, ...], x: Any, y: Any, rounds: int = 2,
              launches: int = 20) -> dict[str, float]:
    """Device time per launch of each kernel in ``variants`` (library names) on the same
    buffers, interleaved: ``rounds`` rounds of ``launches`` launches between two timing events,
    after 3 warm-up launches; the best round of each."""
    us: dict[str, list[float]] = {v: [] for v in variants}
    for variant in variants * rounds:
        launch = device.prepare(variant, [in_shape], [out_shape])
        for _ in range(3):
            launch.run(stream, [x], [y])
        e0 = stream.record(device.create_event(timing=True))
        for _ in range(launches):
            launch.run(stream, [x], [y])
        e1 = stream.record(device.create_event(timing=True))
        e1.synchronize()
        us[variant].append(e0.elapsed_ms(e1) / launches * 1e3)
    return {v: min(t) for v, t in us.items()}


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q / 100 * len(s)))]


class Report:
    """Collects sections of rows, prints a table per section, writes one JSON file."""

    def __init__(self, name: str, device: Any, quick: bool):
        self.name = name
        self.data: dict[str, Any] = {
            "benchmark": name, "date": datetime.datetime.now(datetime.UTC).isoformat(),
            "commit": commit(), "device": device_info(device), "quick": quick,
            "env": {k: os.environ.get(k) for k in ENV}, "absent": {}, "sections": {}}

    def absent(self, peer: str, why: str) -> None:
        """Record (and say) that a peer or a configuration was not measured, and why: its rows
        and columns are missing from the tables, not made up."""
        if peer not in self.data["absent"]:
            self.data["absent"][peer] = why
            print(f"not measured: {peer} ({why})")

    def section(self, title: str, rows: list[dict[str, Any]], note: str = "") -> None:
        self.data["sections"][title] = {"rows": rows, "note": note}
        from rich.console import Console
        from rich.table import Table

        table = Table(title=title, caption=note or None)
        keys = list(dict.fromkeys(k for r in rows for k in r))
        for k in keys:
            table.add_column(k, no_wrap=True)
        for r in rows:
            table.add_row(*[_fmt(r.get(k)) for k in keys])
        # As wide as its columns (a 24-column overlap table cut every header to "ra…" at a
        # fixed 140); at least 140, so that the caption wraps as before.
        width = sum(max([len(k)] + [len(_fmt(r.get(k))) for r in rows]) + 3 for k in keys)
        Console(width=max(140, width + 1)).print(table)

    def error(self, title: str, exc: BaseException) -> None:
        self.data["sections"][title] = {"error": repr(exc)}
        print(f"[{title}] FAILED: {exc!r}")

    def write(self, out: str | None) -> Path:
        path = Path(out) if out else RESULTS / f"{self.name}-{self.data['device']['kind']}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        # A figure not measured is None: NaN or infinity would make the file invalid JSON.
        path.write_text(json.dumps(_finite(self.data), indent=1, default=str,
                                   allow_nan=False) + "\n")
        print(f"wrote {path}")
        return path


def _finite(value: Any) -> Any:
    """``value`` with every non-finite float replaced by None (JSON has neither)."""
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "" if v is None else str(v)

"""``streamlane demo``: the shipped encoder and decoder, run concurrently three ways.

Each request is an encoder job and a decoder job that consumes its output, ordered with
``after=``. The same requests run

- on **one lane** (everything on one thread's stream: serial, the baseline);
- on **two lanes** (encoders on lane 0, decoders on lane 1: the decoder's stream waits for its
  encoder on the device);
- with **a caller stream per program** on one lane (``stream=``).

Every result is checked against the float64 reference; each run's timeline is measured with
timing events and written as a PNG and a Chrome/Perfetto trace. With ``rounds`` > 1 the three
run that many times, their order rotating each round, and each configuration reports its
median round: on a GPU one run takes ~30 ms, and four single runs of the same code on one
H200 read 0.89x to 1.63x for caller streams (bench/results/demo-cuda-96c68c6.txt).
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import numpy as np

from streamlane.runtime import Device, Method, Program
from streamlane.runtime.errors import InvalidArgument
from streamlane.runtime.examples import build_decoder, build_encoder, load
from streamlane.runtime.reference import run_reference

from .scheduler import Scheduler
from .timeline import Timeline

__all__ = ["CONFIGS", "MAX_ROUNDS", "SIZES", "DemoResult", "demo_programs", "output_files",
           "run_demo"]

CONFIGS = ("one lane", "two lanes", "caller streams")
# (batch, width) of the encoder and decoder. "small" is the shipped example files: quick on the
# host device, but on a GPU its kernels take a few microseconds and the run only measures the
# host. "large" is the same programs built wider (build_encoder/build_decoder), so the device
# work dominates, with few rows, so one job's kernels leave SMs for another's: at batch 256 a
# matmul fills the GPU and two concurrent jobs only share it (H200, warmed up: 1.14x faster
# than one lane; batch 16 x width 4096: 1.80x / 1.93x with caller streams, in
# bench/results/demo-sizes-cuda.txt).
SIZES = {"small": (8, 256), "large": (16, 4096)}
MAX_ROUNDS = 100
RTOL, ATOL = 1e-3, 1e-5


@dataclass
class DemoResult:
    """One configuration: its median round's wall time, overlap and timeline (the one written;
    of an even count of rounds, the faster of the two middle ones); ``correct`` of ``checked``
    outputs right in every round, the worst error of any round, and each round's wall time in
    the order they ran (``walls_s``)."""
    config: str
    wall_s: float
    overlap: float
    correct: int
    checked: int
    max_error: float
    timeline: Timeline
    files: list[Path] = field(default_factory=list)  # written
    file_errors: list[str] = field(default_factory=list)  # one line per file not written
    walls_s: list[float] = field(default_factory=list)


@dataclass
class _Round:
    wall_s: float
    timeline: Timeline
    right: list[bool]  # per output, requests' encoder then decoder
    max_error: float


@dataclass
class _Programs:
    encoder: Program
    decoder: Program
    enc: Method
    dec: Method


def output_files(out: Path, config: str) -> tuple[Path, Path]:
    """The (PNG timeline, Chrome trace) a configuration writes under ``out``."""
    slug = config.replace(" ", "-")
    return out / f"timeline-{slug}.png", out / f"trace-{slug}.json"


def demo_programs(size: str) -> tuple[Program, Program]:
    """The (encoder, decoder) pair of a size in ``SIZES``."""
    if size not in SIZES:
        raise ValueError(f"size must be one of {', '.join(SIZES)}, got {size!r}")
    if size == "small":
        return load("encoder"), load("decoder")
    batch, width = SIZES[size]
    return build_encoder(batch, width), build_decoder(batch, width)


async def run_demo(device: Device, requests: int, out: Path,
                   progress: Callable[[str, int], None] | None = None,
                   programs: tuple[Program, Program] | None = None,
                   rounds: int = 1) -> list[DemoResult]:
    """``await run_demo(dev, n, out, rounds=k)`` is equivalent to ``streamlane demo --requests
    n --out out --rounds k`` without the table: run the three configurations ``rounds`` times
    (their order rotating each round) and return each one's median round (``DemoResult``).
    ``progress(config, done)`` is called as requests complete (``done`` counts over the
    rounds). ``programs``: the (encoder, decoder) pair to run (default: the shipped examples).
    A configuration's files are written as its last round ends.

    **Cancellation**: each configuration's scheduler leaves on the cancellation, waiting for
    the work already on the device; the files of configurations whose last round had not
    ended are not written.
    """
    if type(rounds) is not int or not 1 <= rounds <= MAX_ROUNDS:
        raise InvalidArgument(f"rounds must be an int in 1..{MAX_ROUNDS}, got {rounds!r}")
    encoder, decoder = programs or demo_programs("small")
    p = _Programs(encoder, decoder, encoder.method("forward", device=device),
                  decoder.method("forward", device=device))
    (shape,) = [t.shape for t in encoder.methods["forward"].inputs]
    rng = np.random.default_rng(2026)
    xs = [rng.standard_normal(shape).astype(np.float32) for _ in range(requests)]
    refs = []
    for x in xs:  # float64, on the host: ~0.1 s a request at the large size, so a Ctrl-C
        await anyio.lowlevel.checkpoint()  # (a cancellation) gets in between two
        (y,) = run_reference(encoder, "forward", [x])
        refs.append((y, run_reference(decoder, "forward", [y])[0]))
    # Warm up outside the measured runs: kernel compilation, first allocations, and an idle
    # GPU's clocks, which ramp up over the first milliseconds of work (on an H200 one pair left
    # the one-lane row, measured first, anywhere from 52 to 67 ms): one pass over every request.
    async with Scheduler(device, lanes=1) as sched:
        for x in xs:
            await sched.submit(p.dec, [(await sched.submit(p.enc, [x])).outputs[0]])
    runs: dict[str, list[_Round]] = {config: [] for config in CONFIGS}
    results: dict[str, DemoResult] = {}
    for r in range(rounds):
        for config in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:
            runs[config].append(await _run(
                config, device, p, xs, refs,
                (lambda n, c=config, base=r * requests: progress(c, base + n))
                if progress else None))
            if r == rounds - 1:  # its last round: its files now, as a Ctrl-C may come next
                results[config] = _result(config, runs[config], device, out)
    return [results[config] for config in CONFIGS]


def _result(config: str, rounds: list[_Round], device: Device, out: Path) -> DemoResult:
    """A configuration's median round (of an even count, the faster of the two middle ones),
    with its files."""
    median = sorted(rounds, key=lambda r: r.wall_s)[(len(rounds) - 1) // 2]
    timeline = median.timeline
    correct = sum(all(column) for column in zip(*(r.right for r in rounds), strict=True))
    result = DemoResult(config, median.wall_s, timeline.overlap(), correct,
                        len(median.right), max(r.max_error for r in rounds), timeline,
                        walls_s=[r.wall_s for r in rounds])
    png, trace = output_files(out, config)
    title = f"{config} on {device.name}: overlap {result.overlap:.2f}x"
    for write, path in ((lambda: timeline.plot(png, title=title), png),
                        (lambda: timeline.to_chrome_trace(trace), trace)):
        try:  # a file that cannot be written (a full disk, a path taken meanwhile) is reported,
            result.files.append(write())  # not fatal: the run's figures are still good
        except (OSError, InvalidArgument) as exc:  # InvalidArgument: the path is a folder now
            text = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            result.file_errors.append(f"cannot write {path}: {text}")
    return result


async def _run(config: str, device: Device, p: _Programs, xs: list[np.ndarray],
               refs: list[tuple[np.ndarray, np.ndarray]],
               progress: Callable[[int], None] | None) -> _Round:
    streams = [device.create_stream(), device.create_stream()] if config == "caller streams" \
        else [None, None]
    lanes = 2 if config == "two lanes" else 1
    enc_lane, dec_lane = (0, 1) if lanes == 2 else (0, 0)
    # A full collection of the process's heap takes 30-60 ms on a small VM (cuda-python's
    # modules alone hold tens of thousands of objects): done here, it does not land inside one
    # configuration's measured wall time and skew the comparison.
    gc.collect()
    async with Scheduler(device, lanes=lanes) as sched:
        try:
            start = time.perf_counter()
            pairs = []
            for x in xs:
                e = await sched.submit(p.enc, [x], lane=enc_lane, stream=streams[0])
                d = await sched.submit(p.dec, [e.outputs[0]], lane=dec_lane, after=[e],
                                       stream=streams[1])
                pairs.append((e, d))
            outputs = []
            for i, (e, d) in enumerate(pairs):
                outputs.append(((await e)[0], (await d)[0]))
                if progress:
                    progress(i + 1)
            wall = time.perf_counter() - start
            timeline = sched.timeline()
        except (KeyboardInterrupt, anyio.get_cancelled_exc_class()):  # Ctrl-C (asyncio, and
            if sched.pending:  # trio under the command line: a cancellation; trio: KI)
                print(f"streamlane demo: interrupted; the scheduler cancels what is not on the "
                      f"device yet and waits for what is ({sched.pending} jobs pending): "
                      f"Ctrl-C again to stop at once", file=sys.stderr, flush=True)
            raise
    right, worst = [], 0.0
    for (y, z), (y_ref, z_ref) in zip(outputs, refs, strict=True):
        for got, want in ((y.to_host(), y_ref), (z.to_host(), z_ref)):
            error = float(np.max(np.abs(got - want)))
            worst = max(worst, math.inf if math.isnan(error) else error)  # max(0, nan) is 0
            right.append(bool(np.allclose(got, want, rtol=RTOL, atol=ATOL)))
    return _Round(wall, timeline, right, worst)

"""The ``streamlane`` command line (also ``python -m streamlane.sched``).

``streamlane demo [--device auto|host|cuda] [--requests N] [--rounds K] [--out DIR]
[--backend ...] [--size auto|small|large]`` runs the shipped encoder and decoder concurrently (see
``streamlane.sched.demo``) and prints a table.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["main"]

BACKENDS = ("asyncio", "uvloop", "trio")
MAX_REQUESTS = 1024  # per configuration; the demo prepares every input and reference first
MAX_ROUNDS = 100  # streamlane.sched.demo.MAX_ROUNDS (imported late: see main)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamlane",
        description="Await GPU programs from async Python with the ordering you meant and the "
                    "overlap you asked for.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo", help="run the shipped encoder and decoder concurrently and measure the overlap",
        description="Run the shipped encoder and decoder concurrently: on one lane, on two "
                    "lanes (decoder after= its encoder) and with a caller stream per program; "
                    "check every result against the float64 reference; write the timelines.")
    demo.add_argument("--device", default="auto",
                      help="auto (cuda if a GPU is usable, else host), host, cuda or cuda:N "
                           "(default: auto, or $STREAMLANE_DEVICE)")
    demo.add_argument("--requests", type=int, default=32,
                      help=f"encoder+decoder requests per configuration, 1..{MAX_REQUESTS} "
                           f"(default: 32)")
    demo.add_argument("--rounds", type=int, default=3,
                      help=f"runs of each configuration, their order rotating each round; the "
                           f"table gives each one's median round (of an even count, the faster "
                           f"of the two middle ones), 1..{MAX_ROUNDS} (default: 3)")
    demo.add_argument("--out", type=_folder, default=Path("streamlane-out"),
                      help="folder for the PNG timelines and Chrome traces "
                           "(default: ./streamlane-out)")
    demo.add_argument("--backend", choices=BACKENDS, default="asyncio",
                      help="event loop to run on (default: asyncio)")
    demo.add_argument("--size", choices=("auto", "small", "large"), default="auto",
                      help="small: the shipped example programs (batch 8, width 256); large: "
                           "the same programs at batch 16, width 4096, so GPU work dominates "
                           "(default: auto, large on a GPU, small on the host device)")
    demo.set_defaults(subparser=demo)  # whose usage an unknown option is reported with
    return parser


class _Stdout:
    """Standard output as the demo's console writes it, noting a write that failed: only such
    a failure is reported as standard output's (any other error keeps its traceback)."""

    def __init__(self, file: Any):
        self._file = file
        self.failed: OSError | None = None

    def write(self, text: str) -> int:
        try:
            return self._file.write(text)
        except OSError as exc:
            self.failed = exc
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except OSError as exc:
            self.failed = exc
            raise

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding: as the file's
        return getattr(self._file, name)


def main(argv: Sequence[str] | None = None) -> int:
    # Everything, imports included (this module and the package import only the standard
    # library before this point), runs under the Ctrl-C handler.
    # Standard output closed at start (`>&-`): Python gives None; write to nowhere (a file
    # kept open for the process).
    nowhere = None if sys.stdout is not None else open(os.devnull, "w")  # noqa: SIM115
    stdout = _Stdout(sys.stdout if nowhere is None else nowhere)
    try:
        # An option the demo does not know is the demo's error, with its usage: argparse
        # would report it with the top-level usage, which lists no option.
        parser = _parser()
        args, unknown = parser.parse_known_args(argv)
        if unknown:
            given = list(sys.argv[1:] if argv is None else argv)
            # before the command's name: given to `streamlane` itself
            ours = args.command in given and unknown[0] in given and \
                given.index(unknown[0]) < given.index(args.command)
            (parser if ours else args.subparser).error(
                f"unrecognized arguments: {' '.join(unknown)}")
        if not 1 <= args.requests <= MAX_REQUESTS:
            return _fail(f"--requests must be in 1..{MAX_REQUESTS} (the demo prepares every "
                         f"request's input before it starts), got {args.requests}", 2)
        if not 1 <= args.rounds <= MAX_ROUNDS:
            return _fail(f"--rounds must be in 1..{MAX_ROUNDS}, got {args.rounds}", 2)
        return _demo(args, stdout)
    except KeyboardInterrupt:  # the schedulers have already waited for the device's work
        return _fail("interrupted", 130)
    except OSError:
        failed = stdout.failed
        if failed is None:  # not standard output: unexpected, keep its traceback
            raise
        # Standard output could not be written (a full disk, a closed pipe). Later writes,
        # Python's own flush at exit included, go nowhere instead of failing again.
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):  # not a file descriptor (embedded use)
            pass
        if isinstance(failed, BrokenPipeError):  # its reader left (`| head`): nothing to say
            return 1
        return _fail(f"cannot write to standard output: {failed.strerror or failed}", 1)


def _fail(message: str, code: int) -> int:
    """Print ``message`` on stderr as it is (no rich markup: it may quote user input)."""
    from rich.console import Console

    Console(stderr=True, highlight=False).print(f"streamlane demo: {message}", style="red",
                                                markup=False, soft_wrap=True)
    return code


def _missing_backend(backend: str) -> str | None:
    """Why ``--backend`` cannot run here, or None."""
    if backend == "asyncio":
        return None
    try:
        importlib.import_module(backend)
    except ImportError:
        how = "pip install trio (from a checkout: pip install '.[trio]')" \
            if backend == "trio" else \
            "pip install uvloop (it does not support Windows)"
        return f"--backend {backend} needs the {backend} package: {how}, or use --backend asyncio"
    return None


def _folder(text: str) -> Path:
    """``--out``: an empty name is refused (``Path("")`` is the current folder, where the
    demo's files would land unasked)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("empty; name a folder (it is created if missing)")
    return Path(text)


def _unusable_out(out: Path) -> str | None:
    """Why the demo cannot write its files under ``out``, or None. Checked before any work:
    an unusable --out is a usage error, not a traceback at the end."""
    from streamlane.runtime.program import make_folders

    from .demo import CONFIGS, output_files

    try:
        if out.exists() and not out.is_dir():
            return f"--out {out} is a file; name a folder (it is created if missing)"
        make_folders(out, out)
        with tempfile.TemporaryFile(dir=out):  # an existing folder may not be writable
            pass
    except OSError as exc:
        return f"cannot write the timelines to --out {out}: {exc.strerror or exc}"
    taken = [f for config in CONFIGS for f in output_files(out, config) if f.is_dir()]
    if taken:
        return f"--out {out}: {taken[0].name} is a folder there, and the demo writes a file " \
               f"of that name; choose another --out"
    return None


def _one_blas_thread(host: bool) -> contextlib.AbstractContextManager[Any]:
    """On the host device, numpy's BLAS limited to one thread while the demo runs (restored
    after): each stream is a worker thread, and OpenBLAS's pool, called from several of them
    at once on a loaded 2-core machine, stalled the caller-streams run for ~1.1 s in 3 of 10
    runs (none of 10 with one thread)."""
    if not host:
        return contextlib.nullcontext()
    from threadpoolctl import threadpool_limits

    return threadpool_limits(1, user_api="blas")


def _demo(args: argparse.Namespace, stdout: _Stdout) -> int:
    import anyio
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from streamlane.runtime import get_device
    from streamlane.runtime.errors import DeviceError, StreamlaneError

    from .demo import CONFIGS, SIZES, demo_programs, run_demo

    missing = _missing_backend(args.backend)
    if missing:
        return _fail(missing, 2)
    try:
        device = get_device(None if args.device == "auto" else args.device)
    except StreamlaneError as exc:
        hint = " On the command line, --device host runs on the emulated host device." \
            if isinstance(exc, DeviceError) else ""
        message = str(exc)
        if hint and not message.endswith("."):
            message += "."
        return _fail(f"{message}{hint}", 2)
    unusable = _unusable_out(args.out)
    if unusable:
        return _fail(unusable, 2)
    console = Console(file=stdout)
    size = args.size if args.size != "auto" else ("large" if device.kind == "cuda" else "small")
    batch, width = SIZES[size]
    console.print(f"streamlane demo on [bold]{device.name}[/bold]: {args.requests} requests "
                  f"(encoder -> decoder, {size}: batch {batch}, width {width}) per "
                  f"configuration, {args.backend} event loop")
    programs = demo_programs(size)
    with _one_blas_thread(device.kind == "host"), Progress(
            TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(),
            console=console, transient=True) as bar:
        tasks = {c: bar.add_task(c, total=args.requests * args.rounds) for c in CONFIGS}

        def progress(config: str, done: int) -> None:
            bar.update(tasks[config], completed=done)

        backend = "asyncio" if args.backend == "uvloop" else args.backend
        options = {"use_uvloop": True} if args.backend == "uvloop" else {}
        run = _ctrl_c_cancels if backend == "trio" else _plain
        try:
            results = anyio.run(run, run_demo, device, args.requests, args.out, progress,
                                programs, args.rounds, backend=backend,
                                backend_options=options)
        except StreamlaneError as exc:
            bar.stop()
            return _fail(f"failed: {type(exc).__name__}: {exc}", 1)
    base = results[0].wall_s
    table = Table(title=f"encoder -> decoder x {args.requests} on {device.name}")
    for column in ("run", "wall", "overlap", "speedup", "correct", "max error"):
        table.add_column(column, justify="left" if column == "run" else "right", no_wrap=True)
    for r in results:
        ok = r.correct == r.checked
        table.add_row(r.config, f"{r.wall_s * 1e3:.1f} ms", f"{r.overlap:.2f}x",
                      f"{base / r.wall_s:.2f}x",
                      f"[{'green' if ok else 'red'}]{r.correct}/{r.checked}[/]",
                      f"{r.max_error:.1e}")
    console.print(table)
    rounds = ""
    if args.rounds > 1:
        middle = "" if args.rounds % 2 else " (of the two middle ones, the faster)"
        rounds = (f"each run's median round of {args.rounds}{middle}, their order rotating each "
                  f"round: its wall time, overlap and files; ")
    console.print(f"{rounds}overlap: sum of job durations / time any job ran (timing events); "
                  f"speedup: one-lane wall time / wall time; correct: outputs within rtol 1e-3 "
                  f"of the float64 reference" + (" in every round; max error: the worst of any "
                                                 "round" if args.rounds > 1 else ""))
    failed = []
    for r in results:
        if r.files:
            console.print(f"{r.config}: " + ", ".join(
                f"{'timeline' if f.suffix == '.png' else 'trace'} {f}" for f in r.files),
                markup=False, highlight=False, soft_wrap=True)  # paths printed whole
        failed += r.file_errors
    if device.kind == "host":
        console.print("[dim]host device: kernels are numpy on CPU threads that share the cores "
                      "and the GIL, so jobs run longer side by side: overlap above 1x here need "
                      "not mean faster (see speedup). Run on a GPU for device figures.[/dim]")
    for message in failed:
        _fail(message, 1)
    return 0 if all(r.correct == r.checked for r in results) and not failed else 1


async def _plain(fn: Any, *args: Any) -> Any:
    """asyncio (uvloop too): its runner already turns the first Ctrl-C into a cancellation of
    the main task and raises ``KeyboardInterrupt`` once the run has ended."""
    return await fn(*args)


async def _ctrl_c_cancels(fn: Any, *args: Any) -> Any:
    """trio: the first Ctrl-C cancels the run, as asyncio's runner does, and is raised as
    ``KeyboardInterrupt`` once the schedulers have drained. trio's own delivery raises it
    wherever the main thread is: in a weakref callback, where it was swallowed (the demo ran
    on and exited 0), or inside an import (an interpreter abort at exit). Once the first has
    come, trio's delivery is back, so a second Ctrl-C stops at once."""
    import signal

    import anyio

    interrupted = False
    try:
        async with anyio.create_task_group() as tg:
            async def watch(*, task_status: Any) -> None:
                nonlocal interrupted
                with anyio.open_signal_receiver(signal.SIGINT) as signals:
                    task_status.started()  # installed: from here on a Ctrl-C comes this way
                    async for _ in signals:
                        interrupted = True
                        tg.cancel_scope.cancel()
                        return

            await tg.start(watch)
            result = await fn(*args)
            tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:  # trio's task group wraps the second Ctrl-C's
        if group.split(KeyboardInterrupt)[1] is None:
            raise KeyboardInterrupt from None
        raise
    if interrupted:
        raise KeyboardInterrupt
    return result


if __name__ == "__main__":
    sys.exit(main())

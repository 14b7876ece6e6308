"""The ``streamlane`` command line: ``streamlane demo`` runs, checks every result, and refuses
bad arguments with one line on stderr (no traceback), before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest


def demo(*args, timeout=120, **kw):
    return subprocess.run([sys.executable, "-m", "streamlane.sched", "demo", *args],
                          capture_output=True, text=True, timeout=timeout, **kw)


@pytest.mark.parametrize("where", ["under a file", "an existing unwritable folder",
                                   "a name too long"])
def test_the_demo_refuses_an_unusable_out_before_running(tmp_path, where):
    if where == "under a file":
        blocker = tmp_path / "a-file"
        blocker.write_text("not a directory")
        out = blocker / "out"
    elif where == "a name too long":  # ENAMETOOLONG from the first look at it: a traceback
        out = tmp_path / ("a" * 300)
    else:  # /proc exists and takes no new files, even from root
        if not os.path.isdir("/proc"):
            pytest.skip("no /proc on this system")
        out = Path("/proc")
    proc = subprocess.run(
        [sys.executable, "-m", "streamlane.sched", "demo", "--device", "host", "--requests", "1",
         "--out", str(out)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "cannot write the timelines to --out" in proc.stderr and "Traceback" not in \
        proc.stdout + proc.stderr


def test_the_demo_command_runs_and_checks_every_result(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "streamlane.sched", "demo", "--device", "host", "--requests", "3",
         "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "6/6" in proc.stdout and "two lanes" in proc.stdout
    for slug in ("one-lane", "two-lanes", "caller-streams"):
        assert (tmp_path / f"timeline-{slug}.png").stat().st_size > 0
        json.loads((tmp_path / f"trace-{slug}.json").read_text())


def test_an_empty_out_is_a_usage_error_not_the_current_folder(tmp_path):
    proc = demo("--device", "host", "--requests", "1", "--out", "", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "--out: empty" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_outputs_that_are_nan_show_as_an_infinite_error(tmp_path):
    """max(0.0, nan) is 0.0: a demo whose outputs were all NaN printed "max error 0.0e+00"
    beside its 0/2 correct."""
    script = (
        "import sys, numpy as np\n"
        "from streamlane.kernels import get_kernel\n"
        "spec = get_kernel('gelu'); orig = spec.host\n"
        "def nan(ins, outs, p):\n"
        "    orig(ins, outs, p); outs[0][...] = np.nan\n"
        "object.__setattr__(spec, 'host', nan)\n"
        "from streamlane.sched.cli import main\n"
        f"sys.exit(main(['demo', '--device', 'host', '--requests', '1', '--out', "
        f"{str(tmp_path)!r}]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    rows = [line for line in proc.stdout.splitlines() if "0/2" in line]
    assert len(rows) == 3 and all("inf" in row for row in rows), proc.stdout


@pytest.mark.parametrize("count", ["0", "1025", "1000000000"])
def test_the_demo_refuses_a_bad_request_count(count):
    proc = subprocess.run([sys.executable, "-m", "streamlane.sched", "demo", "--requests", count],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--requests must be in 1..1024" in proc.stderr, proc.stderr


def test_demo_sizes_build_the_same_programs_wider():
    from streamlane.sched.demo import SIZES, demo_programs

    for size, (batch, width) in SIZES.items():
        encoder, decoder = demo_programs(size)
        assert encoder.methods["forward"].inputs[0].shape == (batch, width)
        assert decoder.methods["forward"].outputs[0].shape == (batch, width)
        assert [s.target for s in encoder.methods["forward"].steps] == \
            [s.target for s in demo_programs("small")[0].methods["forward"].steps]
    with pytest.raises(ValueError, match="small, large"):
        demo_programs("huge")


def test_the_demo_runs_the_large_size_on_request(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "streamlane.sched", "demo", "--device", "host", "--size", "large",
         "--requests", "1", "--out", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "batch 16, width 4096" in " ".join(proc.stdout.split()) and "2/2" in proc.stdout


def test_an_out_that_is_a_file_or_holds_a_folder_of_an_output_name_is_refused(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("")
    proc = demo("--device", "host", "--requests", "1", "--out", str(afile))
    assert proc.returncode == 2 and "is a file; name a folder" in proc.stderr, proc.stderr
    (tmp_path / "coll" / "trace-two-lanes.json").mkdir(parents=True)
    proc = demo("--device", "host", "--requests", "1", "--out", str(tmp_path / "coll"))
    assert proc.returncode == 2 and "trace-two-lanes.json is a folder there" in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    assert not list((tmp_path / "coll").glob("*.png")), "it ran before refusing"


def test_user_text_is_printed_as_it_is_not_as_markup(tmp_path):
    """rich markup in a path or a device name is text: the paths printed are the paths
    written, and a stray closing tag does not crash the error message."""
    out = tmp_path / "out[gpu]"
    proc = demo("--device", "host", "--requests", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert str(out / "timeline-one-lane.png") in proc.stdout
    assert (out / "timeline-one-lane.png").exists()
    proc = demo("--device", "a[/red]b")
    assert proc.returncode == 2 and "unknown device 'a[/red]b'" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


def test_an_output_file_that_cannot_be_written_is_one_line_after_the_table(tmp_path):
    """A file the --out check cannot foresee (a dangling link in its place; a full disk is the
    same): the runs and the table are still shown, the file is a one-line error, status 1."""
    (tmp_path / "trace-two-lanes.json").symlink_to(tmp_path / "missing" / "x.json")
    proc = demo("--device", "host", "--requests", "2", "--out", str(tmp_path))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "4/4" in proc.stdout and "caller streams" in proc.stdout  # the table
    assert "Traceback" not in proc.stdout + proc.stderr
    assert proc.stderr.strip().splitlines() == [
        f"streamlane demo: cannot write {tmp_path / 'trace-two-lanes.json'}: No such file or "
        f"directory"], proc.stderr
    assert f"two lanes: timeline {tmp_path / 'timeline-two-lanes.png'}" in \
        " ".join(proc.stdout.split())
    assert (tmp_path / "trace-one-lane.json").exists()


def test_a_file_path_taken_by_a_folder_during_the_run_is_reported_not_raised(tmp_path):
    """run_demo writes each configuration's files as it ends; a path taken meanwhile (here a
    folder, which the CLI's --out check would have refused had it been there before) is a
    line in that configuration's ``file_errors``, and the other configurations still run."""
    import anyio

    from streamlane.runtime import get_device
    from streamlane.sched.demo import run_demo

    (tmp_path / "trace-two-lanes.json").mkdir()
    results = anyio.run(run_demo, get_device("host"), 2, tmp_path)
    assert [r.config for r in results] == ["one lane", "two lanes", "caller streams"]
    assert [len(r.files) for r in results] == [2, 1, 2]
    assert results[1].file_errors and "trace-two-lanes.json" in results[1].file_errors[0]
    assert not results[0].file_errors and not results[2].file_errors
    assert all(r.correct == r.checked == 4 for r in results)


def test_forcing_cuda_without_a_gpu_names_the_command_line_way_out():
    from streamlane.runtime import cuda

    if cuda.usable():
        pytest.skip("a GPU is usable here")
    proc = demo("--device", "cuda")
    assert proc.returncode == 2 and "--device host" in proc.stderr, proc.stderr
    assert proc.stdout == ""


def test_a_backend_that_is_not_installed_is_a_usage_error(monkeypatch, capsys):
    import importlib

    from streamlane.sched import cli

    real = importlib.import_module

    def without_trio(name, *args):
        if name == "trio":
            raise ImportError("No module named 'trio'")
        return real(name, *args)

    monkeypatch.setattr(cli.importlib, "import_module", without_trio)
    assert cli.main(["demo", "--device", "host", "--backend", "trio"]) == 2
    assert "pip install trio (from a checkout: pip install '.[trio]')" in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_ctrl_c_ends_the_demo_with_one_line_and_status_130(tmp_path, backend):
    """On trio the Ctrl-C is a cancellation too (see the test below for why)."""
    pytest.importorskip(backend)
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlane.sched", "demo", "--device", "host", "--requests",
         "1024", "--out", str(tmp_path), "--backend", backend], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().startswith("streamlane demo on")  # running now
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, out + err
    assert "interrupted" in err and "Traceback" not in out + err, err


def test_on_trio_the_demos_first_ctrl_c_cancels_and_a_second_interrupts():
    """trio delivers Ctrl-C by raising KeyboardInterrupt wherever the main thread is: in a
    weakref callback it was swallowed (the demo ran on and exited 0), inside an import it
    ended in an interpreter abort, about 1 run in 20 of a reviewer's. The demo's runner makes
    the first one a cancellation, as asyncio's runner does, and raises it once the run has
    ended; the second is trio's own again."""
    anyio = pytest.importorskip("anyio")
    pytest.importorskip("trio")
    from streamlane.sched.cli import _ctrl_c_cancels

    seen = []

    async def work(signals: int) -> None:
        try:
            for _ in range(signals):
                signal.raise_signal(signal.SIGINT)
                try:
                    await anyio.sleep(5)
                except anyio.get_cancelled_exc_class():
                    seen.append("cancelled")
                    with anyio.CancelScope(shield=True):  # draining, as schedulers do
                        await anyio.sleep(0.01)
                    if signals == 1:
                        raise
        except KeyboardInterrupt:
            seen.append("interrupt")
            raise

    for signals, want in ((1, ["cancelled"]), (2, ["cancelled", "interrupt"])):
        seen.clear()
        t = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            anyio.run(_ctrl_c_cancels, work, signals, backend="trio")
        assert seen == want and time.monotonic() - t < 4, seen


def test_the_command_imports_nothing_heavy_before_its_ctrl_c_handler():
    """The console script imports ``streamlane.sched.cli`` (and so the package) before ``main``
    runs: numpy, anyio and the runtime load inside ``main``, where Ctrl-C gives one line, not
    Python's traceback (they took ~0.2 s of that window before)."""
    code = ("import sys, streamlane.sched.cli; "
            "print([m for m in ('numpy', 'anyio', 'streamlane.runtime') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]", out


def test_the_packages_say_they_are_typed():
    """PEP 561: without py.typed a type checker ignores streamlane's annotations (mypy: "missing
    library stubs or py.typed marker"); the literal __all__ of streamlane.sched is what makes
    its lazily loaded names exported for mypy --strict."""
    from importlib.resources import files

    for package in ("streamlane.runtime", "streamlane.sched", "streamlane.kernels"):
        assert files(package).joinpath("py.typed").is_file(), package


def test_the_package_names_load_on_first_use():
    code = ("import streamlane.sched as s; from streamlane.sched import *; "
            "names = [n for n in s.__all__ if getattr(s, n).__name__ != n]; "
            "missing = set(s.__all__) - set(dir(s)); "
            "print(len(s.__all__), names, sorted(missing), s.Scheduler is s.scheduler.Scheduler, "
            "sorted(s.__all__) == sorted(s._HOMES))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "13 [] [] True True", out
    err = subprocess.run([sys.executable, "-c", "import streamlane.sched as s; s.Schedular"],
                         capture_output=True, text=True).stderr
    assert "AttributeError: module 'streamlane.sched' has no attribute 'Schedular'" in err, err


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
def test_a_standard_output_that_cannot_be_written_is_one_line_on_stderr(tmp_path):
    """``streamlane demo > /dev/full`` ended in a 20-line traceback from inside rich."""
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "streamlane.sched", "demo", "--device",
                               "host", "--requests", "1", "--out", str(tmp_path)],
                              stdout=full, stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().splitlines() == [
        "streamlane demo: cannot write to standard output: No space left on device"], proc.stderr


def test_a_reader_that_leaves_early_ends_the_demo_quietly(tmp_path):
    """``streamlane demo | head -1``: the pipe closes under the demo; no traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "streamlane.sched", "demo", "--device", "host",
                             "--requests", "1", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    _, err = proc.communicate(timeout=120)
    # 0 if the demo had written everything before the reader left (README: status 1 otherwise)
    assert proc.returncode in (0, 1) and b"Traceback" not in err and b"Exception" not in err, err
    assert err == b"", err  # quietly


@pytest.mark.skipif(sys.platform != "linux", reason="an open-file limit set for the child")
def test_another_error_without_a_file_name_is_not_blamed_on_standard_output(tmp_path):
    """With 5 open files allowed, asyncio cannot make its own pipe (EMFILE, an OSError with no
    file name): that was reported as "cannot write to standard output", and standard output
    (a writable file) was then sent to /dev/null."""
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_NOFILE, (5, 5))

    with open(tmp_path / "out.txt", "w") as out:
        proc = subprocess.run([sys.executable, "-m", "streamlane.sched", "demo", "--device",
                               "host", "--requests", "1", "--out", str(tmp_path / "files")],
                              stdout=out, stderr=subprocess.PIPE, text=True, timeout=120,
                              preexec_fn=limit)
    assert proc.returncode != 0 and "standard output" not in proc.stderr, proc.stderr
    assert "streamlane demo on host" in (tmp_path / "out.txt").read_text()


def test_a_standard_output_closed_from_the_start_runs_quietly(tmp_path):
    """``streamlane demo >&-``: Python starts with sys.stdout None; the console's wrapper
    raised AttributeError with a traceback."""
    proc = subprocess.run([sys.executable, "-m", "streamlane.sched", "demo", "--device", "host",
                           "--requests", "1", "--out", str(tmp_path)], stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, timeout=120,
                          preexec_fn=lambda: os.close(1))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr


def test_the_host_demo_runs_numpys_blas_on_one_thread_and_restores_it(tmp_path, monkeypatch):
    """Each host stream is a worker thread; OpenBLAS's pool, called from several at once on a
    loaded 2-core machine, stalled the caller-streams run for ~1.1 s in 3 runs of 10."""
    threadpoolctl = pytest.importorskip("threadpoolctl")
    from streamlane.sched import cli
    from streamlane.sched import demo as demo_module

    def blas_threads():
        return [pool["num_threads"] for pool in threadpoolctl.threadpool_info()
                if pool["user_api"] == "blas"]

    before, during = blas_threads(), []
    real = demo_module.run_demo

    async def run_demo(*args, **kw):
        during.extend(blas_threads())
        return await real(*args, **kw)

    monkeypatch.setattr(demo_module, "run_demo", run_demo)
    assert cli.main(["demo", "--device", "host", "--requests", "1", "--out",
                     str(tmp_path)]) == 0
    assert during and set(during) == {1}
    assert blas_threads() == before


def test_rounds_report_each_configurations_median_round_and_check_every_round(tmp_path):
    """``rounds``: every configuration runs that many times, in an order that rotates each
    round; its wall time, overlap and files are its median round's, its ``correct`` counts the
    outputs right in every round, and progress counts over the rounds."""
    import statistics

    import anyio

    from streamlane.runtime import get_device
    from streamlane.runtime.errors import InvalidArgument
    from streamlane.sched import cli
    from streamlane.sched import demo as demo_module

    order: list[str] = []
    real_run = demo_module._run

    async def run(config, *args):
        order.append(config)
        return await real_run(config, *args)

    seen: dict[str, int] = {}

    def progress(config, done):
        seen[config] = max(seen.get(config, 0), done)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(demo_module, "_run", run)
        results = anyio.run(lambda: demo_module.run_demo(get_device("host"), 2, tmp_path,
                                                         progress, None, 3))
    one, two, streams = demo_module.CONFIGS
    assert order == [one, two, streams, two, streams, one, streams, one, two]
    assert seen == {one: 6, two: 6, streams: 6}
    for r in results:
        assert len(r.walls_s) == 3 and r.wall_s == statistics.median(r.walls_s)
        assert r.correct == r.checked == 4 and len(r.files) == 2
        assert r.overlap == r.timeline.overlap()
    for bad in (0, 101, 1.5, True):
        with pytest.raises(InvalidArgument, match=r"rounds must be an int in 1\.\.100"):
            anyio.run(demo_module.run_demo, get_device("host"), 1, tmp_path, None, None, bad)
    assert cli.MAX_ROUNDS == demo_module.MAX_ROUNDS
    proc = demo("--device", "host", "--requests", "1", "--rounds", "0", "--out", str(tmp_path))
    assert proc.returncode == 2 and "--rounds must be in 1..100, got 0" in proc.stderr


def test_a_round_with_a_wrong_output_makes_that_output_wrong(tmp_path, monkeypatch):
    """``correct`` counts an output right only if it was right in every round: one output of
    one round marked wrong after its check (the second round's first run, the first request's
    decoder output) shows in that configuration's count."""
    import anyio

    from streamlane.runtime import get_device
    from streamlane.sched import demo as demo_module

    real_run = demo_module._run
    calls = []

    async def run(config, *args):
        result = await real_run(config, *args)
        calls.append(config)
        if len(calls) == 4:  # the second round's first run
            result.right[1] = False
        return result

    monkeypatch.setattr(demo_module, "_run", run)
    results = anyio.run(demo_module.run_demo, get_device("host"), 2, tmp_path, None, None, 2)
    assert [r.correct for r in results] == [4, 3, 4]  # round 2 starts with "two lanes"


def test_a_configuration_writes_its_files_as_its_last_round_ends(tmp_path, monkeypatch):
    """An interruption in the last round leaves the files of the configurations whose last
    round had ended (with one round: those run before it, as before rounds) and no others;
    the one-round footer reads as before rounds."""
    import anyio

    from streamlane.runtime import get_device
    from streamlane.sched import demo as demo_module

    real_run = demo_module._run
    calls = []

    async def run(config, *args):
        calls.append(config)
        if len(calls) == 5:  # round 2 runs two lanes, caller streams, one lane
            raise RuntimeError("interrupted")
        return await real_run(config, *args)

    monkeypatch.setattr(demo_module, "_run", run)
    with pytest.raises(RuntimeError, match="interrupted"):
        anyio.run(demo_module.run_demo, get_device("host"), 1, tmp_path, None, None, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "timeline-two-lanes.png", "trace-two-lanes.json"]
    calls.clear()
    with pytest.raises(RuntimeError, match="interrupted"):
        calls.extend(["x", "y"])  # the third call, caller streams, is the fifth
        anyio.run(demo_module.run_demo, get_device("host"), 1, tmp_path / "one", None, None, 1)
    assert sorted(p.name for p in (tmp_path / "one").iterdir()) == [
        "timeline-one-lane.png", "timeline-two-lanes.png", "trace-one-lane.json",
        "trace-two-lanes.json"]
    monkeypatch.undo()
    proc = demo("--device", "host", "--requests", "1", "--rounds", "1", "--out",
                str(tmp_path / "footer"))
    footer = " ".join(proc.stdout.split())
    assert proc.returncode == 0, footer
    assert footer.split("┘", 1)[1].lstrip().startswith("overlap: sum of job durations"), footer
    assert "median" not in footer and "every round" not in footer


def test_an_unknown_demo_option_is_reported_with_the_demos_usage(tmp_path):
    """argparse reports an option no subcommand knows with the top-level usage, which lists
    no option at all: the demo's usage is the one that helps."""
    proc = demo("--device", "host", "--bogus", "1", cwd=tmp_path, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert "usage: streamlane demo" in proc.stderr and "--requests" in proc.stderr
    assert "unrecognized arguments: --bogus 1" in proc.stderr
    assert list(tmp_path.iterdir()) == []
    # before the command's name it was given to `streamlane` itself: its usage
    proc = subprocess.run([sys.executable, "-m", "streamlane.sched", "--verbose", "demo"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 2 and "usage: streamlane [-h]" in proc.stderr, proc.stderr
    assert "streamlane: error: unrecognized arguments: --verbose" in proc.stderr


def test_an_out_through_a_dangling_link_says_what_open_would(tmp_path):
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    proc = demo("--device", "host", "--requests", "1", "--out", str(tmp_path / "gone"),
                cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and "No such file or directory" in proc.stderr, proc.stderr
    assert "File exists" not in proc.stderr

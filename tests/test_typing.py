"""The annotations, as a user's type checker reads them: ``typed_user.py`` (every public name,
with ``assert_type`` where a checker must infer a precise type) runs on the host device and
passes ``mypy --strict`` against this tree's sources."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPT = HERE / "typed_user.py"


def test_the_typed_user_script_runs():
    env = {**os.environ, "STREAMLANE_DEVICE": "host"}
    proc = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


# Mistakes a checker must catch: with an Any from the library, each would pass unseen.
MISTAKES = """\
from streamlane.runtime import Program, get_device
from streamlane.sched import Job, Schedular  # misspelt
def look(job: Job) -> None:
    job.outputs[0].reslt  # misspelt
    if job.state == "don":  # not a state
        pass
    get_device("host").inject_dealy  # misspelt
def bind(program: Program) -> None:
    program.method("forward", clone_outputs="no")  # not a bool (InvalidArgument at run time)
"""
EXPECTED = [
    ('mistakes.py:2', 'Module "streamlane.sched" has no attribute "Schedular"'),
    ('mistakes.py:4', '"JobOutput" has no attribute "reslt"'),
    ('mistakes.py:5', 'Non-overlapping equality check'),
    ('mistakes.py:7', '"HostDevice" has no attribute "inject_dealy"'),
    ('mistakes.py:9', 'Argument "clone_outputs" to "method" of "Program" has incompatible type'),
]


def test_mypy_strict_passes_the_typed_user_script_and_catches_mistakes(tmp_path):
    pytest.importorskip("mypy", reason="mypy comes with the test extras: pip install -e '.[test]'")
    # The three packages as the installed distribution lays them out (streamlane.runtime, ...),
    # from this tree (an editable install is an import hook mypy does not follow); their own
    # errors are not the user's (silent: as for an installed package).
    package = tmp_path / "src" / "streamlane"
    package.mkdir(parents=True)
    for name in ("runtime", "sched", "kernels"):
        (package / name).symlink_to(ROOT / name, target_is_directory=True)
    (tmp_path / "mistakes.py").write_text(MISTAKES)
    env = {**os.environ, "MYPYPATH": str(tmp_path / "src")}
    proc = subprocess.run([sys.executable, "-m", "mypy", "--strict", "--follow-imports=silent",
                           "--no-incremental", "--cache-dir", os.devnull, "--no-pretty",
                           "--no-error-summary", str(SCRIPT), "mistakes.py"],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    errors = [line for line in proc.stdout.splitlines() if ": error:" in line]
    assert [e for e in errors if not e.startswith("mistakes.py:")] == [], proc.stdout
    assert len(errors) == len(EXPECTED), proc.stdout + proc.stderr
    for (where, what), line in zip(EXPECTED, errors, strict=True):
        assert line.startswith(where + ":") and what in line, (where, what, proc.stdout)

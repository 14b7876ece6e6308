"""A user's script over the public surface, for a type checker: ``test_typing.py`` runs it
(on the host device) and checks it with ``mypy --strict``. Each ``assert_type`` is what a
user's checker must infer there; a wrong annotation or an ``Any`` leaking from the library
fails the check. Not a pytest module (no ``test_`` prefix): it runs as a script."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, assert_type

import anyio
import numpy as np

from streamlane.runtime import (
    CallerStream,
    HostDevice,
    Method,
    MethodBuilder,
    Program,
    ProgramBuilder,
    Result,
    Stream,
    get_device,
)
from streamlane.runtime.errors import (
    DeviceError,
    InvalidArgument,
    InvalidProgram,
    InvalidState,
    NotSupported,
    StreamlaneError,
)
from streamlane.runtime.examples import load as load_example
from streamlane.runtime.examples import path as example_path
from streamlane.sched import (
    DependencyFailed,
    Job,
    JobOutput,
    JobOutputs,
    LaneStatistics,
    Scheduler,
    Span,
    Timeline,
)


class Folder(os.PathLike[str]):
    """A path type of the user's own."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __fspath__(self) -> str:
        return self.path


def double(stream: Stream, ins: list[Any], outs: list[Any]) -> int:
    """A callable step (on the host device, numpy in stream order); what it returns is
    ignored, so any type will do."""
    np.multiply(ins[0], 2.0, out=outs[0])
    return len(outs)


def build() -> Program:
    b = Program.build("typed", constants={"w": np.eye(4, dtype=np.float32)})
    assert_type(b, ProgramBuilder)
    m = b.method("forward", x=("float32", [4, 4]), name=(np.float32, (4, 4)))
    assert_type(m, MethodBuilder)
    h = m.step("matmul", "x", "w")
    y = m.step("add", h, "name")
    (z,) = m.call(double, [y], [("z", np.dtype("float32"), np.array([4, 4]))])
    m.output(y, z)
    return b.finish()


def sync_part(tmp: str) -> Method:
    dev = get_device("host")
    assert_type(dev, HostDevice)
    program = build()
    assert_type(program.name, str)
    assert sorted(program.methods) == ["forward"] and "w" in program.constants
    encoder = Program.load(os.fsencode(example_path("encoder")))
    assert_type(encoder, Program)
    encoder.save(Folder(os.path.join(tmp, "encoder.json")))
    assert Program.load(Path(tmp, "encoder.json")) == load_example("encoder")
    m = program.method("forward", device=dev, clone_outputs=True)
    x = np.ones((4, 4), np.float32)
    outs = m([x, x])
    assert_type(outs, list[Result])
    host = outs[0].to_host()
    assert_type(host, np.ndarray)
    assert np.allclose(host, 2.0) and np.allclose(outs[1].to_host(), 4.0)
    stream = dev.create_stream()
    with CallerStream(stream):
        again = m([Result.from_host(x, dev), x])
    assert_type(again[0].shape, tuple[int, ...])
    dev.inject_delay(stream, 0.0)
    stream.synchronize()
    try:
        Program.load(os.path.join(tmp, "missing.json"))
    except InvalidProgram as exc:
        assert_type(exc, InvalidProgram)
        assert isinstance(exc, StreamlaneError)
    for error in (InvalidArgument, InvalidState, NotSupported, DeviceError):
        assert issubclass(error, StreamlaneError)
    return m


async def async_part(m: Method, tmp: str) -> None:
    dev = m.device
    x = np.ones((4, 4), np.float32)
    async with Scheduler(dev, lanes=np.int64(2), queue_size=np.int32(16),
                         spin_us=Fraction(1, 2), poll_us=np.float32(10)) as sched:
        assert_type(sched, Scheduler)
        first = await sched.submit(m, [x, x], lane=np.argmin([3, 1]))
        assert_type(first, Job)
        assert_type(first.outputs, JobOutputs)
        assert_type(first.outputs[0], JobOutput)
        assert_type(first.outputs[0:1], tuple[JobOutput, ...])
        second = await sched.submit(m, [first.outputs[0], x], lane=0,
                                    after=(j for j in [first]))
        third = await sched.run(m, [x, x], after={first, second}, stream=dev.create_stream())
        assert_type(third, list[Result])
        fourth = await sched.run(m, list(first.outputs), after=second)
        outs = await second
        assert_type(outs, list[Result])
        assert_type(second.state, Literal["queued", "running", "done", "failed", "cancelled"])
        if second.state == "done":  # a Literal: "don" would be an error
            assert np.allclose(outs[0].to_host(), 3.0)  # 2 @ I + 1
        assert np.allclose(fourth[1].to_host(), 12.0)  # 2 * (2 @ I + 4)
        stats = sched.statistics()
        assert_type(stats, tuple[LaneStatistics, ...])
        assert sum(s.completed for s in stats) >= 3
        assert_type(sched.queue_size, int)
        assert_type(sched.timing, bool)
    timeline = sched.timeline()
    assert_type(timeline, Timeline)
    assert_type(timeline.spans, tuple[Span, ...])
    assert_type(timeline.overlap(), float)
    written = timeline.to_chrome_trace(os.fsencode(os.path.join(tmp, "trace.json")))
    assert_type(written, Path)
    timeline.plot(Folder(os.path.join(tmp, "timeline.png")))
    try:
        raise DependencyFailed(second, first, RuntimeError("a user's"))
    except DependencyFailed as exc:
        assert_type(exc.job, Job | None)  # None once pickled


def use_sequence(values: Sequence[Result]) -> None:
    assert_type(values[0], Result)


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        m = sync_part(tmp)
        anyio.run(async_part, m, tmp)
    print("ok")


if __name__ == "__main__":
    main()

"""The errors of the async layer.

Each has one meaning (trio's distinction): ``SchedulerClosed`` — *your code* closed the scheduler
(or left its ``async with`` on an error, cancelling the jobs still queued); ``SchedulerBroken`` —
*the device* failed, so every pending job failed and no new work is accepted;
``DependencyFailed`` — a job could not run because a job it depends on never reached the device.
``TimingStallWarning`` is a warning, not an error: timing events are costing overlap.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from streamlane.runtime.errors import (
    DeviceError,
    InvalidArgument,
    InvalidState,
    StreamClosed,
    StreamlaneError,
)

if TYPE_CHECKING:
    from .job import Job

__all__ = ["ClosedStreamGiven", "DependencyFailed", "SchedulerBroken", "SchedulerClosed",
           "TimingStallWarning"]


class ClosedStreamGiven(StreamClosed, InvalidArgument):
    """``stream=`` names a closed stream: a ``StreamClosed``, as the runtime raises for work
    given to a closed stream, and an ``InvalidArgument`` of the call that was given it."""


class SchedulerClosed(InvalidState):
    """The scheduler was closed by its owner: submitting after exit, or awaiting a job that was
    still queued when the ``async with`` block left on an error (that job never ran)."""


class SchedulerBroken(DeviceError):
    """The device failed under the scheduler. Every job pending at that moment fails with this
    error, and every later ``submit`` raises it at once. Its ``__cause__`` is the original
    ``DeviceError``; ``code`` repeats the driver's error name where there is one."""


class DependencyFailed(StreamlaneError):
    """A job was not run because ``dependency`` (an ``after=`` job, or the job whose output it
    takes as input) failed before reaching the device, or failed on it and let go of the
    outputs this job reads. ``__cause__`` is that job's error."""

    def __init__(self, job: Job, dependency: Job, error: BaseException):
        # None in a copy made by pickle or deepcopy (__reduce__)
        self.job: Job | None = job
        self.dependency: Job | None = dependency
        # A chain names the job where it started, not every link (each message held the one
        # before it: quadratic in the chain's length).
        self._root: BaseException | None
        if isinstance(error, DependencyFailed):
            self._root, self._root_label = error._root, error._root_label
            why = (f"was not run either: the chain of dependencies goes back to "
                   f"{error._root_label}, which did not complete")
        else:
            self._root, self._root_label = error, dependency.label
            why = "did not complete"
        # Job ids and lanes are counted per scheduler: one of another says so ("#1 depends
        # on #1" read as a job waiting for itself)
        theirs = "" if dependency.lane._core is job.lane._core else " of another scheduler"
        super().__init__(f"{job.label} was not run: it depends on {dependency.label}{theirs}, "
                         f"which {why} ({type(self._root).__name__}: {self._root})")

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled or deep-copied, it keeps its message and loses its jobs (``job`` and
        ``dependency`` are None): they belong to this process's scheduler, and copying them
        would copy it, event loop and all."""
        rebuild, args, state = super().__reduce__()
        return rebuild, args, {**state, "job": None, "dependency": None, "_root": None}

    def __copy__(self) -> DependencyFailed:
        """``copy.copy`` keeps the jobs (the same objects)."""
        rebuild, args, state = super().__reduce__()
        twin = rebuild(*args)
        twin.__dict__.update(state)
        return twin


class TimingStallWarning(UserWarning):
    """Issued once per scheduler when it has timed jobs in flight on more streams than the
    device has hardware queues (``device.hardware_queues``; on CUDA ``CUDA_DEVICE_MAX_CONNECTIONS``,
    8 by default). Streams then share queues, and the timing event recorded after each job waits
    at its queue's head for the job's kernels, holding up the streams behind it: overlap stops
    near the number of queues (an H200: 7.5x for 128 two-ms spins on 128 streams, 42.6x without
    timing events, bench/results/queue-probe-cuda.txt). ``Scheduler(timing=False)`` removes the
    stall (``timeline()`` then raises ``InvalidState``); ``CUDA_DEVICE_MAX_CONNECTIONS=32``, set
    before CUDA initializes in the process, moves the limit to 32 queues."""

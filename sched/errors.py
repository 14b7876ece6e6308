"""The errors of the async layer.

Each has one meaning (trio's distinction): ``SchedulerClosed`` — *your code* closed the scheduler
(or left its ``async with`` on an error, cancelling the jobs still queued); ``SchedulerBroken`` —
*the device* failed, so every pending job failed and no new work is accepted;
``DependencyFailed`` — a job could not run because a job it depends on never reached the device.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamlane.runtime.errors import DeviceError, InvalidState, StreamlaneError

if TYPE_CHECKING:
    from .job import Job

__all__ = ["DependencyFailed", "SchedulerBroken", "SchedulerClosed"]


class SchedulerClosed(InvalidState):
    """The scheduler was closed by its owner: submitting after exit, or awaiting a job that was
    still queued when the ``async with`` block left on an error (that job never ran)."""


class SchedulerBroken(DeviceError):
    """The device failed under the scheduler. Every job pending at that moment fails with this
    error, and every later ``submit`` raises it at once. Its ``__cause__`` is the original
    ``DeviceError``; ``code`` repeats the driver's error name where there is one."""


class DependencyFailed(StreamlaneError):
    """A job was not run because ``dependency`` (an ``after=`` job, or the job whose output it
    takes as input) failed before reaching the device. ``__cause__`` is that job's error."""

    def __init__(self, job: Job, dependency: Job, error: BaseException):
        self.job = job
        self.dependency = dependency
        super().__init__(f"{job!r} was not run: it depends on {dependency!r}, which failed with "
                         f"{type(error).__name__}: {error}")

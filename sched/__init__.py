"""streamlane.sched: await device programs from async Python (anyio: asyncio, uvloop, trio).

A ``Scheduler`` runs methods on lanes (dedicated host threads, one stream each); ``submit``
returns a ``Job`` to await; ``after=`` orders jobs across lanes on the device; ``timeline()``
measures the overlap you asked for.
"""

from .errors import (
    ClosedStreamGiven,
    DependencyFailed,
    SchedulerBroken,
    SchedulerClosed,
    TimingStallWarning,
)
from .job import Job, JobOutput
from .lane import Lane, LaneStatistics
from .scheduler import Scheduler
from .timeline import Span, Timeline

__all__ = [
    "ClosedStreamGiven",
    "DependencyFailed",
    "Job",
    "JobOutput",
    "Lane",
    "LaneStatistics",
    "Scheduler",
    "SchedulerBroken",
    "SchedulerClosed",
    "Span",
    "Timeline",
    "TimingStallWarning",
]

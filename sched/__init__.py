"""streamlane.sched: await device programs from async Python (anyio: asyncio, uvloop, trio).

A ``Scheduler`` runs methods on lanes (dedicated host threads, one stream each); ``submit``
returns a ``Job`` to await; ``after=`` orders jobs across lanes on the device; ``timeline()``
measures the overlap you asked for.

The names below are imported on first use (PEP 562): the ``streamlane`` command imports this
package before its ``main`` runs, and numpy, anyio and the runtime take ~0.2 s to import, a
window in which Ctrl-C would print Python's traceback instead of the command's one line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the names for type checkers; at run time __getattr__ loads them
    from .errors import (
        ClosedStreamGiven,
        DependencyFailed,
        SchedulerBroken,
        SchedulerClosed,
        TimingStallWarning,
    )
    from .job import Job, JobOutput, JobOutputs
    from .lane import Lane, LaneStatistics
    from .scheduler import Scheduler
    from .timeline import Span, Timeline

# A literal list, which type checkers read (the names are exported: mypy --strict)
__all__ = [
    "ClosedStreamGiven",
    "DependencyFailed",
    "Job",
    "JobOutput",
    "JobOutputs",
    "Lane",
    "LaneStatistics",
    "Scheduler",
    "SchedulerBroken",
    "SchedulerClosed",
    "Span",
    "Timeline",
    "TimingStallWarning",
]

_HOMES = {
    "ClosedStreamGiven": "errors",
    "DependencyFailed": "errors",
    "Job": "job",
    "JobOutput": "job",
    "JobOutputs": "job",
    "Lane": "lane",
    "LaneStatistics": "lane",
    "Scheduler": "scheduler",
    "SchedulerBroken": "errors",
    "SchedulerClosed": "errors",
    "Span": "timeline",
    "Timeline": "timeline",
    "TimingStallWarning": "errors",
}


if not TYPE_CHECKING:  # seen by a type checker, it would make any misspelt import an Any

    def __getattr__(name: str) -> Any:
        home = _HOMES.get(name)
        if home is None:
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{home}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOMES})

"""What each driver call a job makes costs from Python (cuda.bindings), one thread, no contention.

The scheduler's per-job host cost on the GPU is mostly these calls (each also releases and
retakes the GIL); this prices them so a change can be judged by the calls it removes. Rows:
median per call over repeats of 2,000 calls, µs.

Usage: python bench/driver_calls.py [--out F]   (needs a CUDA GPU)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(__file__))
from _common import Report, median_us
from _raw_cuda import RawCuda

from streamlane.runtime import get_device


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dev = get_device("cuda")
    raw = RawCuda(dev.index)
    cu = raw.cu
    stream, other = raw.stream(), raw.stream()
    plain, timed = raw.event(), raw.event(timing=True)
    xp, yp = raw.alloc(1024), raw.alloc(1024)
    raw.record(plain, stream)
    raw.record(timed, stream)
    raw.sync(timed)
    rows: list[dict[str, Any]] = []

    def row(name: str, fn: Any, sync: Any = None) -> None:
        rows.append({"call": name, "us": median_us(fn, repeats=15, inner=2000, sync=sync)})

    def drain() -> None:
        raw.check(cu.cuStreamSynchronize(stream))

    row("cuLaunchKernel (1 block, 3 params, tuple form)", lambda: raw.twice(stream, xp, yp, 1),
        drain)
    row("cuEventRecord, timing disabled", lambda: raw.record(plain, stream), drain)
    row("cuEventRecord, timing event", lambda: raw.record(timed, stream), drain)
    row("cuEventQuery (complete)", lambda: cu.cuEventQuery(plain))
    row("cuStreamWaitEvent (complete event)", lambda: cu.cuStreamWaitEvent(other, plain, 0), drain)
    row("cuEventElapsedTime", lambda: cu.cuEventElapsedTime(timed, timed))
    flags = cu.CUevent_flags.CU_EVENT_DEFAULT

    def create_destroy() -> None:
        _, ev = cu.cuEventCreate(flags)
        cu.cuEventDestroy(ev)

    row("cuEventCreate + cuEventDestroy (timing)", create_destroy)

    def sync_done() -> None:
        cu.cuEventSynchronize(plain)

    row("cuEventSynchronize (complete)", sync_done)
    t = time.perf_counter()
    for _ in range(20000):
        pass
    empty = (time.perf_counter() - t) / 20000 * 1e6
    rows.append({"call": "empty Python loop iteration", "us": empty})
    rep = Report("driver-calls", dev, quick=False)
    rep.section("cuda.bindings driver calls, per call (one thread)", rows,
                "median of 15 x 2,000 calls; launches and records drained between repeats")
    rep.write(args.out)


if __name__ == "__main__":
    main()

"""Same-machine A/B of the one-step execute on CUDA: ``execute()`` with a Result input (the
row of bench_runtime's (execute) section), ``m([Result])``, ``m([numpy])`` and
``device.create_event()``, medians of 15 rounds of 2,000 calls. One version per process (a
package cannot be imported twice); run them alternating, the old tree first on PYTHONPATH:

    mkdir -p old/streamlane && git archive a346ca5^ runtime kernels sched | tar -x -C old/streamlane
    touch old/streamlane/__init__.py
    for i in 1 2 3; do LABEL=new python3 bench/ab_exec_cuda.py cuda
                       LABEL=old PYTHONPATH=old python3 bench/ab_exec_cuda.py cuda; done
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from streamlane.runtime import Program, Result, get_device


def main() -> None:
    dev = get_device(sys.argv[1] if len(sys.argv) > 1 else "cuda")
    b = Program.build("chain1")
    m = b.method("forward", x=("float32", [1024]))
    m.output(m.step("scale", "x", out="y", factor=1.0))
    method = b.finish().method("forward", device=dev)
    x = Result.from_host(np.ones(1024, np.float32), dev)
    x.to_host()
    method.set_inputs([x])
    method.execute()
    stream = dev.per_thread_stream()

    def per_call(fn: Callable[[], Any], inner: int = 2000, reps: int = 15) -> float:
        samples = []
        for _ in range(reps):
            stream.synchronize()
            t = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t) / inner * 1e6)
        stream.synchronize()
        return statistics.median(samples)

    xn = np.ones(1024, np.float32)
    label = os.environ.get("LABEL", "?")
    print(f"{label:4} execute(Result in) {per_call(method.execute):6.2f} us  "
          f"m([Result]) {per_call(lambda: method([x])):6.2f} us  "
          f"m([numpy]) {per_call(lambda: method([xn])):6.2f} us  "
          f"create_event {per_call(dev.create_event):5.2f} us", flush=True)


if __name__ == "__main__":
    main()

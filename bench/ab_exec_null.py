"""A/B of two runtime versions on the null device (no driver work): CPU time per method call,
``m([Result])`` and ``m([numpy])``, one tiny kernel step. Each version runs in its own
process (a package cannot be imported twice), alternating, and each process reports the best
of seven rounds of 20,000 calls: the noise of a shared VM only ever adds time.

    mkdir -p /tmp/old/streamlane
    git archive eb37cd4 runtime kernels sched | tar -x -C /tmp/old/streamlane
    python bench/ab_exec_null.py --old /tmp/old --pairs 6
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

ONE = r"""
import sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from bench_overhead import NullDevice
from bench_sched import tiny_program
from streamlane.runtime import Result
dev = NullDevice()
m = tiny_program(256).method("forward", device=dev)
x = Result.from_host(np.ones(256, np.float32), dev)
x.to_host()
xh = np.ones(256, np.float32)

def per_call(f, n=20000):
    for _ in range(2000):
        f()
    t = time.process_time()
    for _ in range(n):
        f()
    return (time.process_time() - t) / n * 1e6

best = {"m([Result])": [], "m([numpy])": []}
for _ in range(7):
    best["m([Result])"].append(per_call(lambda: m([x])))
    best["m([numpy])"].append(per_call(lambda: m([xh])))
print(" ".join(f"{k} {min(v):.3f}" for k, v in best.items()))
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, help="a folder holding streamlane/{runtime,...}")
    parser.add_argument("--pairs", type=int, default=6)
    args = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    for i in range(args.pairs):
        for label in ("old", "new"):
            env = dict(os.environ)
            if label == "old":
                env["PYTHONPATH"] = os.pathsep.join(filter(None, [args.old,
                                                                  env.get("PYTHONPATH")]))
            out = subprocess.run([sys.executable, "-c", ONE, here], env=env, text=True,
                                 capture_output=True, check=True).stdout.strip()
            print(f"{label} {i + 1}: {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Probe: does a latch held on CUDA's legacy default stream stall other streams?

CUDA's legacy default stream synchronizes with every blocking stream, the per-thread default
streams included; streams the library creates are non-blocking. The host device does not
imitate this (README, Known gaps). This probe holds a latch on the legacy stream, runs one
execute each on the legacy stream (``CallerStream(None)``), on the thread's per-thread stream
(no guard) and on a created stream, and prints which finished within 0.2 s, then after the
latch's release.

Usage: ``python bench/legacy_probe.py`` (needs a GPU); ``results/legacy-probe-cuda.txt``.
"""

import argparse
import time

import numpy as np

from streamlane.runtime import CallerStream, Program, get_device

argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help
dev = get_device("cuda")
b = Program.build("p")
mb = b.method("forward", x=("float32", [4]))
mb.output(mb.step("relu", "x", out="y"))
p = b.finish()
m1, m2, m3 = (p.method("forward", device=dev) for _ in range(3))
x = np.ones(4, np.float32)
for m in (m1, m2, m3):
    m([x])
dev.synchronize()
latch = dev.create_latch()
latch.hold(dev.legacy_stream())
with CallerStream(None):
    a = m1([x])[0]
b_ = m2([x])[0]  # the thread's per-thread stream
with dev.create_stream() as s, CallerStream(s):
    c = m3([x])[0]
    time.sleep(0.2)
    print("legacy ready:", a.ready(), "| per-thread ready:", b_.ready(), "| created stream ready:",
          c.ready())
    latch.release()
    dev.synchronize()
print("after release:", a.ready(), b_.ready(), c.ready())

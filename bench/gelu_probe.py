"""A/B of gelu's device time: the stable-sigmoid form (this tree) against the tanh form it
replaced (80ad721), same run, same buffers (CUDA events, best of two rounds of 20 launches).

    python bench/gelu_probe.py        # on the GPU machine

gelu is memory-bound on an H200 either way; the question is whether expf and a division cost
more than tanhf where the data comes from L2 (small arrays) or HBM (large ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import types

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import kernel_us

from streamlane.kernels import get_kernel, library
from streamlane.kernels.elementwise import GELU_C, GELU_K, _source
from streamlane.runtime import get_device

TANH_BODY = ("const float v = x[i]; "
             f"const float u = {GELU_C!r}f * (v + {GELU_K!r}f * v * v * v); "
             "out[i] = 0.5f * v * (1.0f + tanhf(u));")
SIZES = (1 << 16, 1 << 20, 1 << 24, 1 << 28)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()  # --help
    spec = get_kernel("gelu")
    table = dict(library.KERNELS)
    table["gelu_tanh"] = dataclasses.replace(
        spec, name="gelu_tanh", entry="sl_gelu_tanh",
        source=_source("sl_gelu_tanh", ("x",), TANH_BODY, ()))
    library.KERNELS = types.MappingProxyType(table)
    dev = get_device("cuda")
    s = dev.per_thread_stream()
    for n in SIZES:
        x = dev.to_device(np.random.default_rng(0).standard_normal(n).astype(np.float32), s)
        y = dev.empty((n,), np.float32)
        us = kernel_us(dev, s, ["gelu_tanh", "gelu"], (n,), (n,), x, y)
        old, new = us["gelu_tanh"], us["gelu"]
        print(f"gelu n={n:<11d} tanh {old:9.1f} us  sigmoid {new:9.1f} us  ({new / old:.2f}x)  "
              f"{2 * 4 * n / new / 1e3:6.0f} GB/s", flush=True)


if __name__ == "__main__":
    main()

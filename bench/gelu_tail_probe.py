"""Probe: gelu's worst relative error on its negative tail, over every float32 in [-10.6, -1]
(27.9M values; gelu underflows to subnormals near -10.5), on a device against the float64
reference. README states the bound this finds.

    python bench/gelu_tail_probe.py --device cuda    # or host (the numpy twin)

Prints the worst relative error where the reference is a normal float32, and its x.
"""

from __future__ import annotations

import argparse

import numpy as np

from streamlane.kernels import get_kernel
from streamlane.runtime import get_device

CHUNK = 1 << 22


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    dev = get_device(args.device)
    s = dev.per_thread_stream()
    spec = get_kernel("gelu")
    # negative float32s: the bit pattern grows with the magnitude
    first, last = np.float32(-1.0).view(np.uint32), np.float32(-10.6).view(np.uint32)
    x = np.arange(first, last + 1, dtype=np.uint32).view(np.float32)
    worst, at = 0.0, 0.0
    for i in range(0, len(x), CHUNK):
        xs = np.ascontiguousarray(x[i:i + CHUNK])
        d_x = dev.to_device(xs, s)
        d_y = dev.empty(xs.shape, np.float32)
        dev.launch("gelu", s, [d_x], [d_y])
        got = dev.to_host(d_y, s).astype(np.float64)
        with np.errstate(all="ignore"):
            want = spec.reference([xs], {})[0]
        normal = np.abs(want) >= np.finfo(np.float32).tiny
        rel = np.where(normal, np.abs(got - want) / np.where(normal, np.abs(want), 1.0), 0.0)
        j = int(rel.argmax())
        if rel[j] > worst:
            worst, at = float(rel[j]), float(xs[j])
    print(f"gelu on {dev.kind}: {len(x)} float32 values in [-10.6, -1]; worst relative error "
          f"{worst:.3g} at x = {at:.7g} (where the reference is a normal float32)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

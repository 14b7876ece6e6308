"""A/B of the row kernels' device time: another commit's CUDA sources against this tree's,
same run, same buffers (CUDA events, best of two rounds of 20 launches).

    python bench/rows_probe.py --extract 770939f > /tmp/rows-old.json   # where git is
    python bench/rows_probe.py --old /tmp/rows-old.json                 # on the GPU machine

Written for the switch of softmax / layernorm / reduce_sum from float32 to double sums
(results/rows-probe-cuda.txt); the old layernorm took its eps as a float.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import subprocess
import types

import numpy as np

from streamlane.kernels import get_kernel, library
from streamlane.kernels.spec import LaunchConfig, c_double, c_float
from streamlane.runtime import get_device

SOURCES = {"reduce_sum": "REDUCE_SUM_CUDA", "softmax": "SOFTMAX_CUDA",
           "layernorm": "LAYERNORM_CUDA"}
SHAPES = ((8192, 4096), (64, 1_000_000), (1_000_000, 64), (4, 16_000_000), (262_144, 256),
          (65_536, 1024), (4_000_000, 8))


def extract(commit: str) -> dict[str, str]:
    """The three kernels' full CUDA sources at ``commit`` (block reductions included)."""
    common = subprocess.check_output(["git", "show", f"{commit}:kernels/_common.py"], text=True)
    rows = subprocess.check_output(["git", "show", f"{commit}:kernels/rows.py"], text=True)
    block = re.search(r'BLOCK_REDUCE_CUDA = r"""(.*?)"""', common, re.S).group(1)
    return {n: block + re.search(rf'{var} = BLOCK_REDUCE_CUDA \+ r"""(.*?)"""', rows,
                                 re.S).group(1) for n, var in SOURCES.items()}


def _block_per_row(c: LaunchConfig, float_eps: bool) -> LaunchConfig:
    """The launch the sources before the warp-per-row rule expect: a block of up to 256
    threads per row, the row index from blockIdx.x alone."""
    (rows, _), (cols, _) = c.scalars[:2]
    threads = min(256, max(32, 1 << (cols - 1).bit_length()))
    scalars = tuple((v, c_float if float_eps and t is c_double else t) for v, t in c.scalars)
    return LaunchConfig((min(rows, 65535), 1, 1), (threads, 1, 1), c.shared_mem, scalars)


def register_old(old: dict[str, str]) -> None:
    """Register the old sources as ``<name>_old``, launched one block per row as they expect
    (an eps they declare ``float`` gets a float)."""
    table = dict(library.KERNELS)
    for name, source in old.items():
        spec = get_kernel(name)
        float_eps = re.search(r"\bfloat eps\b", source) is not None

        def configure(i, o, p, _c=spec.configure, _f=float_eps):
            return _block_per_row(_c(i, o, p), _f)

        table[f"{name}_old"] = dataclasses.replace(spec, name=f"{name}_old", source=source,
                                                   configure=configure)
    library.KERNELS = types.MappingProxyType(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extract", metavar="COMMIT", help="print COMMIT's sources as JSON")
    parser.add_argument("--old", metavar="FILE", help="the JSON --extract printed")
    args = parser.parse_args()
    if args.extract:
        print(json.dumps(extract(args.extract)))
        return
    if not args.old:
        parser.error("--old FILE or --extract COMMIT")
    with open(args.old) as f:
        register_old(json.load(f))
    dev = get_device("cuda")
    s = dev.per_thread_stream()
    for shape in SHAPES:
        x = dev.to_device(np.random.default_rng(0).standard_normal(shape).astype(np.float32), s)
        for name in SOURCES:
            spec = get_kernel(name)
            out_shape = spec.infer([shape], spec.resolve_params(None))[0]
            y = dev.empty(out_shape, np.float32)
            us: dict[str, list[float]] = {"old": [], "new": []}
            for variant in (f"{name}_old", name, f"{name}_old", name):
                launch = dev.prepare(variant, [shape], [out_shape])
                for _ in range(3):
                    launch.run(s, [x], [y])
                e0 = s.record(dev.create_event(timing=True))
                for _ in range(20):
                    launch.run(s, [x], [y])
                e1 = s.record(dev.create_event(timing=True))
                e1.synchronize()
                us["old" if variant.endswith("_old") else "new"].append(
                    e0.elapsed_ms(e1) / 20 * 1e3)
            old, new = min(us["old"]), min(us["new"])
            print(f"{name:10s} {shape!s:18s} old {old:9.1f} us  new {new:9.1f} us  "
                  f"({new / old:.2f}x)", flush=True)


if __name__ == "__main__":
    main()

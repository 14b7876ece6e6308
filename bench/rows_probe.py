"""A/B of the row kernels' device time: another commit's CUDA sources against this tree's,
same run, same buffers (CUDA events, best of two rounds of 20 launches).

    python bench/rows_probe.py --extract 770939f > /tmp/rows-old.json   # where git is
    python bench/rows_probe.py --old /tmp/rows-old.json                 # on the GPU machine

Written for the switch of softmax / layernorm / reduce_sum from float32 to double sums
(results/rows-probe-cuda.txt; the old layernorm took its eps as a float), then used for their
float4 loads: each row also runs this tree's kernel with the other block size of a long row
(256 / 1024 threads, "alt"), and the table gives each kernel's registers and spills and the
bandwidth of its least traffic (reduce_sum reads x once, softmax and layernorm read x and
write out once).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import types

import numpy as np
from cuda.bindings import driver

sys.path.insert(0, os.path.dirname(__file__))
from _common import kernel_us

from streamlane.kernels import get_kernel, library
from streamlane.kernels.spec import KernelSpec, LaunchConfig, c_double, c_float
from streamlane.runtime import get_device
from streamlane.runtime.cuda import check

SOURCES = {"reduce_sum": "REDUCE_SUM_CUDA", "softmax": "SOFTMAX_CUDA",
           "layernorm": "LAYERNORM_CUDA"}
SHAPES = ((8192, 4096), (64, 1_000_000), (1_000_000, 64), (4, 16_000_000), (262_144, 256),
          (65_536, 1024), (4_000_000, 8), (1, 16_000_001), (1024, 65_537), (16_384, 16_384))


def extract(commit: str) -> dict[str, str]:
    """The three kernels' full CUDA sources at ``commit`` (block reductions and, from the
    float4 loads on, the row traversal included)."""
    common = subprocess.check_output(["git", "show", f"{commit}:kernels/_common.py"], text=True)
    rows = subprocess.check_output(["git", "show", f"{commit}:kernels/rows.py"], text=True)
    parts = {name: re.search(rf'{name} = r"""(.*?)"""', common, re.S)
             for name in ("BLOCK_REDUCE_CUDA", "ROW_EACH_CUDA")}
    sources = {}
    for n, var in SOURCES.items():
        m = re.search(rf'{var} = ((?:[A-Z_]+ \+ )+)r"""(.*?)"""', rows, re.S)
        names = [p.strip() for p in m.group(1).split("+") if p.strip()]
        sources[n] = "".join(parts[p].group(1) for p in names) + m.group(2)
    return sources


def _old_launch(c: LaunchConfig, float_eps: bool, warp_rows: bool,
                long_entry: bool = False) -> LaunchConfig:
    """The launch the old sources expect: before the warp-per-row rule a block of up to 256
    threads per row, the row index from blockIdx.x alone; with it (``SL_FIRST_ROW`` in the
    source) a warp per row up to 256 columns, else a block of 256 threads; with a ``_long``
    entry, this tree's rule (unchanged since that entry came)."""
    if long_entry:
        return c
    (rows, _), (cols, _) = c.scalars[:2]
    scalars = tuple((v, c_float if float_eps and t is c_double else t) for v, t in c.scalars)
    if warp_rows and cols <= 256:
        return LaunchConfig((min(-(-rows // 8), 65535), 1, 1), (32, 8, 1), c.shared_mem,
                            scalars)
    threads = 256 if warp_rows else min(256, max(32, 1 << (cols - 1).bit_length()))
    return LaunchConfig((min(rows, 65535), 1, 1), (threads, 1, 1), c.shared_mem, scalars)


def _other_block(c: LaunchConfig) -> LaunchConfig:
    """This tree's launch with the other block size of a long row (256 <-> 1024 threads)."""
    threads = 256 if c.block[0] == 1024 else 1024
    return dataclasses.replace(c, block=(threads, 1, 1))


def old_spec(name: str, source: str) -> KernelSpec:
    """This tree's spec of row kernel ``name`` with ``source`` (from ``extract``), launched as
    that source expects (an eps it declares ``float`` gets a float)."""
    spec = get_kernel(name)
    float_eps = re.search(r"\bfloat eps\b", source) is not None
    warp_rows = "SL_FIRST_ROW" in source
    long_entry = f"{spec.entry}_long(" in source

    def configure(i, o, p, _c=spec.configure):
        return _old_launch(_c(i, o, p), float_eps, warp_rows, long_entry)

    return dataclasses.replace(spec, source=source, configure=configure)


def register_old(old: dict[str, str]) -> None:
    """Register the old sources as ``<name>_old``, and this tree's kernels as ``<name>_alt``
    with the other block size of a long row."""
    table = dict(library.KERNELS)
    for name, source in old.items():
        spec = get_kernel(name)

        def alternative(i, o, p, _c=spec.configure):
            return _other_block(_c(i, o, p))

        table[f"{name}_old"] = dataclasses.replace(old_spec(name, source), name=f"{name}_old")
        table[f"{name}_alt"] = dataclasses.replace(spec, name=f"{name}_alt",
                                                   configure=alternative)
    library.KERNELS = types.MappingProxyType(table)


def _resources(function: object) -> str:
    attr = driver.CUfunction_attribute
    regs = check(driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, function))
    local = check(driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, function))
    return f"{regs} regs, {local} B local"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--extract", metavar="COMMIT", help="print COMMIT's sources as JSON")
    parser.add_argument("--old", metavar="FILE", help="the JSON --extract printed")
    parser.add_argument("--shapes", metavar="RxC,...",
                        help="rows x cols to time instead of the built-in list, e.g. 64x1000000")
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
    for name in SOURCES:
        spec = get_kernel(name)
        for variant, shape in ((f"{name}_old", (2, 1024)), (name, (2, 1024)),
                               (name, (2, 1 << 20))):
            out_shape = spec.infer([shape], spec.resolve_params(None))[0]
            launch = dev.prepare(variant, [shape], [out_shape])
            entry = launch.config.entry or spec.entry
            print(f"# {variant} ({entry}): {_resources(launch.function)}")
    shapes = SHAPES if not args.shapes else tuple(
        tuple(int(n) for n in item.split("x")) for item in args.shapes.split(","))
    for shape in shapes:
        x = dev.to_device(np.random.default_rng(0).standard_normal(shape).astype(np.float32), s)
        for name in SOURCES:
            spec = get_kernel(name)
            out_shape = spec.infer([shape], spec.resolve_params(None))[0]
            y = dev.empty(out_shape, np.float32)
            variants = [f"{name}_old", name]
            if shape[-1] > 256:
                variants.append(f"{name}_alt")
            us = kernel_us(dev, s, variants, shape, out_shape, x, y)
            old, new = us[f"{name}_old"], us[name]
            traffic = x.nbytes * (1 if name == "reduce_sum" else 2)
            line = (f"{name:10s} {shape!s:18s} old {old:9.1f} us  new {new:9.1f} us  "
                    f"({new / old:.2f}x)  {traffic / new / 1e3:7.0f} GB/s")
            if f"{name}_alt" in us:
                threads = dev.prepare(name, [shape], [out_shape]).config.block[0]
                alt = us[f"{name}_alt"]
                other = 256 if threads == 1024 else 1024
                line += f"  [{threads} threads; {other} threads: {alt / new:.2f}x]"
            print(line, flush=True)

if __name__ == "__main__":
    main()

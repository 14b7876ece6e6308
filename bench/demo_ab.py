"""A/B of the demo's three configurations (large programs, on the GPU) with this tree's kernels
against older sources of the row kernels (``rows_probe.py --extract``) and gelu's tanh form,
same process, alternating, the order swapped each round.

    python bench/rows_probe.py --extract 681b265 > /tmp/rows-old.json   # where git is
    python bench/demo_ab.py --old /tmp/rows-old.json --rounds 4         # on the GPU machine

Prints each round's wall times and the median per variant and configuration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import types
from pathlib import Path
from typing import Any

import anyio
import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from gelu_probe import TANH_BODY
from rows_probe import old_spec

import streamlane.sched.demo as demo
from streamlane.kernels import get_kernel, library
from streamlane.kernels.elementwise import _source
from streamlane.runtime import get_device


def old_kernels(old: dict[str, str]) -> types.MappingProxyType[str, Any]:
    """The library with ``old``'s row kernels (launched as they expect) and tanh gelu, under
    their own names, so that programs pick them up."""
    table = dict(library.KERNELS)
    for name, source in old.items():
        table[name] = old_spec(name, source)
    table["gelu"] = dataclasses.replace(get_kernel("gelu"),
                                        source=_source("sl_gelu", ("x",), TANH_BODY, ()))
    return types.MappingProxyType(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", required=True, metavar="FILE",
                        help="the JSON rows_probe.py --extract printed")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--requests", type=int, default=32)
    args = parser.parse_args()
    with open(args.old) as f:
        variants = {"old": old_kernels(json.load(f)), "new": library.KERNELS}
    dev = get_device("cuda")
    programs = demo.demo_programs("large")
    references: dict[tuple[str, bytes], Any] = {}
    run_reference = demo.run_reference

    def cached_reference(program: Any, method: str, inputs: list[np.ndarray]) -> Any:
        key = (program.name, inputs[0].tobytes())  # the same requests every run (one seed)
        if key not in references:
            references[key] = run_reference(program, method, inputs)
        return references[key]

    demo.run_reference = cached_reference
    walls: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as out:
        for r in range(args.rounds):
            for label in (("old", "new") if r % 2 == 0 else ("new", "old")):
                library.KERNELS = variants[label]
                # Loaded kernels are cached by name: each variant loads its own.
                dev._functions.clear()
                getattr(dev, "_module_of", {}).clear()
                dev._launch_cache.clear()
                results = anyio.run(demo.run_demo, dev, args.requests, Path(out), None,
                                    programs)
                assert all(res.correct == res.checked for res in results), label
                cells = []
                for res in results:
                    walls.setdefault((label, res.config), []).append(res.wall_s * 1e3)
                    cells.append(f"{res.config} {res.wall_s * 1e3:5.1f} ms")
                print(f"round {r} {label}: " + ", ".join(cells), flush=True)
    for label in ("old", "new"):
        one = statistics.median(walls[(label, "one lane")])
        cells = [f"{config} {statistics.median(walls[(label, config)]):5.1f} ms "
                 f"({one / statistics.median(walls[(label, config)]):.2f}x)"
                 for config in demo.CONFIGS]
        print(f"median {label}: " + ", ".join(cells))


if __name__ == "__main__":
    main()

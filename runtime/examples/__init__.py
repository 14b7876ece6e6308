"""Example programs shipped with streamlane: an ``encoder`` and a ``decoder`` that consumes the
encoder's output. Both are stacks of matmul → gelu → layernorm blocks (the decoder ends in a
row softmax). ``load(name)`` reads the shipped files; ``build_*`` makes other sizes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import InvalidArgument
from ..program import Program, path_text

__all__ = ["EXAMPLES", "build_decoder", "build_encoder", "load", "path"]

EXAMPLES = ("encoder", "decoder")
_HERE = Path(__file__).parent


def path(name: str) -> Path:
    """The manifest path of a shipped example."""
    if not isinstance(name, str) or name not in EXAMPLES:
        raise InvalidArgument(f"no example {name!r}; examples: {', '.join(EXAMPLES)}")
    return _HERE / f"{name}.json"


def load(name: str) -> Program:
    """A shipped example program (``"encoder"`` or ``"decoder"``), loaded from its files."""
    return Program.load(path(name))


def _weights(rng: np.random.Generator, width: int, count: int) -> dict[str, np.ndarray]:
    scale = 1.0 / np.sqrt(width)
    return {f"w{i}": (rng.standard_normal((width, width)) * scale).astype(np.float32)
            for i in range(count)}


def build_encoder(batch: int = 8, width: int = 256, blocks: int = 2, seed: int = 1) -> Program:
    """``forward(x[batch, width]) -> y[batch, width]``: ``blocks`` x (matmul, gelu, layernorm)."""
    b = Program.build("encoder", constants=_weights(np.random.default_rng(seed), width, blocks))
    m = b.method("forward", x=("float32", [batch, width]))
    h = "x"
    for i in range(blocks):
        h = m.step("layernorm", m.step("gelu", m.step("matmul", h, f"w{i}")),
                   out="y" if i == blocks - 1 else None)
    m.output("y")
    return b.finish()


def build_decoder(batch: int = 8, width: int = 256, blocks: int = 2, seed: int = 2) -> Program:
    """``forward(h[batch, width]) -> p[batch, width]``: blocks of (matmul, gelu, layernorm), then
    a residual add of the input and a row softmax."""
    b = Program.build("decoder", constants=_weights(np.random.default_rng(seed), width, blocks))
    m = b.method("forward", h=("float32", [batch, width]))
    x = "h"
    for i in range(blocks):
        x = m.step("layernorm", m.step("gelu", m.step("matmul", x, f"w{i}")))
    m.output(m.step("softmax", m.step("add", x, "h"), out="p"))
    return b.finish()


def write_examples(folder: str | bytes | os.PathLike[str] | os.PathLike[bytes] = _HERE) -> None:
    """Write the example programs into ``folder`` (default: the shipped files; ``python -m
    streamlane.runtime.examples DIR``); a path as ``str``, ``bytes`` or ``os.PathLike``."""
    folder = Path(path_text(folder, "write_examples"))
    build_encoder().save(folder / "encoder.json")
    build_decoder().save(folder / "decoder.json")


"""Elementwise kernels: fill, copy, add, mul, axpy, scale, relu, gelu.

Every CUDA kernel is a grid-stride loop over ``n`` elements (64-bit index), so one launch rule
covers any size: ``(in..., out, long long n, float param...)``. Host twins compute in float32
like the device and write through ``out=`` / slice assignment (outputs are views of device
memory and must never be rebound); references compute in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from ._common import by_blocks, check_ins, checked_configure, f64, same_shapes, stride_launch
from .spec import KernelSpec, LaunchConfig, Param, Shape, c_float

# A float param becomes a CUDA float: anything that rounds beyond FLT_MAX would silently turn
# into inf. Below FLT_MAX + half its ulp a value rounds to FLT_MAX (3.4028235e38, as numpy
# prints FLT_MAX, is a little above it); at that tie it rounds to even, which is inf.
FLOAT32_MAX = float(np.finfo(np.float32).max)
FLOAT32_LIMIT = float(np.nextafter(FLOAT32_MAX + 2.0 ** 103, 0.0))
GELU_C = math.sqrt(2.0 / math.pi)
GELU_K = 0.044715

HostFn = Callable[[Sequence[np.ndarray], Sequence[np.ndarray], Mapping[str, Any]], None]
RefFn = Callable[[Sequence[np.ndarray], Mapping[str, Any]], list[np.ndarray]]


def _float_param(default: float, doc: str) -> Param:
    return Param(float, default, minimum=-FLOAT32_LIMIT, maximum=FLOAT32_LIMIT, doc=doc)


def _as_float32(value: float) -> float:
    """A float param as the kernel gets it (a CUDA float), for the float64 references: 1e-50
    is 0 there, and a reference with 1e-50 would be far from the device's exact answer."""
    return float(np.float32(value))


def _source(entry: str, ins: Sequence[str], body: str, scalars: Sequence[str] = ()) -> str:
    args = ", ".join([*(f"const float* {a}" for a in ins), "float* out", "long long n",
                      *(f"float {s}" for s in scalars)])
    return (
        f'extern "C" __global__ void {entry}({args}) {{\n'
        "    const long long stride = (long long)gridDim.x * blockDim.x;\n"
        "    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;"
        " i += stride) {\n"
        f"        {body}\n"
        "    }\n"
        "}\n"
    )


def _elementwise(name: str, ins: Sequence[str], body: str, host: HostFn, reference: RefFn,
                 params: Mapping[str, Param] | None = None, doc: str = "") -> KernelSpec:
    """A kernel whose inputs all have one shape, which its single output keeps."""
    params = dict(params or {})
    entry = f"sl_{name}"

    def infer(in_shapes: Sequence[Shape], p: Mapping[str, Any]) -> list[Shape | None]:
        return [same_shapes(check_ins(name, in_shapes, len(ins)))]

    def launch(in_s: list[Shape], out_s: list[Shape], p: Mapping[str, Any]) -> LaunchConfig:
        return stride_launch(math.prod(out_s[0]), *((p[k], c_float) for k in params))

    return KernelSpec(
        name=name, n_in=len(ins), n_out=1, source=_source(entry, ins, body, tuple(params)),
        entry=entry, infer=infer, configure=checked_configure(name, infer, launch),
        host=host, reference=reference, params=params, in_place=True, doc=doc)


# -- fill: no inputs, so any output shape ------------------------------------------------------
def _fill_infer(in_shapes: Sequence[Shape], p: Mapping[str, Any]) -> list[Shape | None]:
    check_ins("fill", in_shapes, 0)
    return [None]


def _fill_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
               p: Mapping[str, Any]) -> None:
    outs[0].fill(np.float32(p["value"]))


def _fill_reference(ins: Sequence[np.ndarray], p: Mapping[str, Any]) -> list[np.ndarray]:
    # fill has no input to take the shape from: the reference is the value as a 0-d array,
    # which broadcasts against an output of any shape.
    return [np.asarray(_as_float32(p["value"]), dtype=np.float64)]


FILL = KernelSpec(
    name="fill", n_in=0, n_out=1, source=_source("sl_fill", (), "out[i] = value;", ("value",)),
    entry="sl_fill", infer=_fill_infer,
    configure=checked_configure(
        "fill", _fill_infer,
        lambda i, o, p: stride_launch(math.prod(o[0]), (p["value"], c_float))),
    host=_fill_host, reference=_fill_reference,
    params={"value": _float_param(0.0, "the value written to every element")},
    doc="out[...] = value. The output may have any shape; the reference is a 0-d array.")


# -- the rest: same shape in and out -----------------------------------------------------------
# 0.5 x (1 + tanh(u)) equals x * sigmoid(2u), computed as the stable sigmoid: with
# e = exp(-2|u|) <= 1, x / (1 + e) for u >= 0 and x e / (1 + e) below. 1 + tanh(u) cancels for
# negative u (the tail lost all relative accuracy below x ~ -5.4); this form keeps it down to
# where the value underflows, and never overflows.
def _gelu32(x: np.ndarray) -> np.ndarray:
    # float32 throughout, the same expression as the CUDA source
    x = x.astype(np.float32, copy=False)
    u = np.float32(GELU_C) * (x + np.float32(GELU_K) * x * x * x)
    e = np.exp(np.float32(-2.0) * np.abs(u))
    return np.where(u >= 0, x, x * e) / (np.float32(1.0) + e)


def _gelu64(x: np.ndarray) -> np.ndarray:
    u = GELU_C * (x + GELU_K * x**3)
    e = np.exp(-2.0 * np.abs(u))
    with np.errstate(invalid="ignore"):  # -inf * 0: gelu(-inf) is NaN, as 0.5 x (1 + tanh u)
        return np.where(u >= 0, x, x * e) / (1.0 + e)


def _assign(fn: Callable[[Sequence[np.ndarray], Mapping[str, Any]], np.ndarray]) -> HostFn:
    """A host twin that writes ``fn(ins, params)`` into outs[0]."""

    def host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
             p: Mapping[str, Any]) -> None:
        by_blocks(lambda *block: fn(block, p), ins, outs[0])  # bounded scratch

    return host


COPY = _elementwise(
    "copy", ("x",), "out[i] = x[i];",
    host=lambda ins, outs, p: np.copyto(outs[0], ins[0]),
    reference=lambda ins, p: [f64(ins[0]).copy()],
    doc="out = x.")

ADD = _elementwise(
    "add", ("a", "b"), "out[i] = a[i] + b[i];",
    host=lambda ins, outs, p: np.add(ins[0], ins[1], out=outs[0]),
    reference=lambda ins, p: [f64(ins[0]) + f64(ins[1])],
    doc="out = a + b (same shapes, no broadcasting).")

MUL = _elementwise(
    "mul", ("a", "b"), "out[i] = a[i] * b[i];",
    host=lambda ins, outs, p: np.multiply(ins[0], ins[1], out=outs[0]),
    reference=lambda ins, p: [f64(ins[0]) * f64(ins[1])],
    doc="out = a * b (same shapes, no broadcasting).")

AXPY = _elementwise(
    "axpy", ("x", "y"), "out[i] = fmaf(alpha, x[i], y[i]);",
    # One rounding, as fmaf: the float32 product is exact in float64, and the float64 sum
    # then rounds to float32 (a double rounding, 1 ulp off fmaf in rare ties at most).
    host=_assign(lambda ins, p: np.float32(p["alpha"]) * f64(ins[0]) + ins[1]),
    reference=lambda ins, p: [_as_float32(p["alpha"]) * f64(ins[0]) + f64(ins[1])],
    params={"alpha": _float_param(1.0, "the factor of x")},
    doc="out = alpha * x + y (same shapes).")

SCALE = _elementwise(
    "scale", ("x",), "out[i] = factor * x[i];",
    host=lambda ins, outs, p: np.multiply(ins[0], np.float32(p["factor"]), out=outs[0]),
    reference=lambda ins, p: [_as_float32(p["factor"]) * f64(ins[0])],
    params={"factor": _float_param(1.0, "the factor")},
    doc="out = factor * x.")

# `v <= 0 ? 0 : v` rather than fmaxf: NaN propagates, as in numpy (np.maximum) and torch, and
# -0.0 gives +0.0, as np.maximum(-0.0, 0.0) does.
RELU = _elementwise(
    "relu", ("x",), "const float v = x[i]; out[i] = v <= 0.0f ? 0.0f : v;",
    host=lambda ins, outs, p: np.maximum(ins[0], np.float32(0.0), out=outs[0]),
    reference=lambda ins, p: [np.maximum(f64(ins[0]), 0.0)],
    doc="out = max(x, 0); NaN stays NaN.")

GELU = _elementwise(
    "gelu", ("x",),
    "const float v = x[i]; "
    f"const float u = {GELU_C!r}f * (v + {GELU_K!r}f * v * v * v); "
    "const float e = expf(-2.0f * fabsf(u)); "
    "out[i] = (u >= 0.0f ? v : v * e) / (1.0f + e);",
    host=_assign(lambda ins, p: _gelu32(ins[0])),
    reference=lambda ins, p: [_gelu64(f64(ins[0]))],
    doc="GELU, tanh approximation: 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), "
        "computed as x sigmoid(2u) so the negative tail keeps its relative accuracy.")

SPECS = (FILL, COPY, ADD, MUL, AXPY, SCALE, RELU, GELU)

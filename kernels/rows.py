"""Row kernels over the last axis: softmax, layernorm, reduce_sum.

A tensor of any rank >= 1 is seen as ``rows x cols`` (cols = last axis). One block handles one
row (grid-stride over rows past 65535) and combines its threads' partial results with the
block reductions of ``_common.BLOCK_REDUCE_CUDA``. Signature: ``(x, out, long long rows,
long long cols[, float eps])``. Each row kernel reads a row only after the previous block
reduction finished, so in-place use (out == x) is safe too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._common import BLOCK_REDUCE_CUDA, check_ins, checked_configure, f64, min_rank, row_launch
from .spec import KernelSpec, LaunchConfig, Param, Shape, c_float

SOFTMAX_CUDA = BLOCK_REDUCE_CUDA + r"""
// Numerically stable: exp(x - max) never overflows. Pass 2 stores the exponentials in out,
// pass 3 divides them by the row sum.
extern "C" __global__ void sl_softmax(const float* x, float* out, long long rows, long long cols) {
    __shared__ float scratch[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float* yr = out + r * cols;
        float mx = __int_as_float(0xff800000);
        for (long long j = threadIdx.x; j < cols; j += blockDim.x) mx = fmaxf(mx, xr[j]);
        mx = sl_block_max(mx, scratch);
        float s = 0.0f;
        for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
            const float e = expf(xr[j] - mx);
            yr[j] = e;
            s += e;
        }
        s = sl_block_sum(s, scratch);
        for (long long j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = yr[j] / s;
    }
}
"""

# Two passes (mean, then the mean of squared deviations) rather than E[x^2] - E[x]^2, which
# cancels catastrophically when |mean| >> std.
LAYERNORM_CUDA = BLOCK_REDUCE_CUDA + r"""
extern "C" __global__ void sl_layernorm(const float* x, float* out, long long rows, long long cols,
                                        float eps) {
    __shared__ float scratch[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float* yr = out + r * cols;
        // Relative to the row's first element k: x - k is exact for values near k, so a
        // constant row gives exactly 0 and a large offset (a row near 1e4) costs no precision;
        // the mean itself (near k) is never rounded to float32.
        const float k = xr[0];
        float s = 0.0f;
        for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j] - k;
        const float m = sl_block_sum(s, scratch) / (float)cols;  // mean - k
        float q = 0.0f;
        for (long long j = threadIdx.x; j < cols; j += blockDim.x) {
            const float d = (xr[j] - k) - m;
            q = fmaf(d, d, q);
        }
        const float var = sl_block_sum(q, scratch) / (float)cols;
        const float inv = 1.0f / sqrtf(var + eps);
        for (long long j = threadIdx.x; j < cols; j += blockDim.x) yr[j] = ((xr[j] - k) - m) * inv;
    }
}
"""

REDUCE_SUM_CUDA = BLOCK_REDUCE_CUDA + r"""
extern "C" __global__ void sl_reduce_sum(const float* x, float* out, long long rows,
                                         long long cols) {
    __shared__ float scratch[32];
    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {
        const float* xr = x + r * cols;
        float s = 0.0f;
        for (long long j = threadIdx.x; j < cols; j += blockDim.x) s += xr[j];
        s = sl_block_sum(s, scratch);
        if (threadIdx.x == 0) out[r] = s;
    }
}
"""


def _one_rank1(name: str, in_shapes: Sequence[Shape]) -> Shape:
    (x,) = check_ins(name, in_shapes, 1)
    min_rank(x, 1, "in[0]")
    return x


def _softmax_infer(in_shapes: Sequence[Shape], p: Mapping[str, Any]) -> list[Shape | None]:
    return [_one_rank1("softmax", in_shapes)]


def _layernorm_infer(in_shapes: Sequence[Shape], p: Mapping[str, Any]) -> list[Shape | None]:
    return [_one_rank1("layernorm", in_shapes)]


def _reduce_sum_infer(in_shapes: Sequence[Shape], p: Mapping[str, Any]) -> list[Shape | None]:
    x = _one_rank1("reduce_sum", in_shapes)
    return [x[:-1] or (1,)]


def _rows_launch(ins: list[Shape], outs: list[Shape], p: Mapping[str, Any]) -> LaunchConfig:
    return row_launch(ins[0])


def _layernorm_launch(ins: list[Shape], outs: list[Shape], p: Mapping[str, Any]) -> LaunchConfig:
    cfg = row_launch(ins[0])
    return LaunchConfig(cfg.grid, cfg.block, cfg.shared_mem,
                        (*cfg.scalars, (p["eps"], c_float)))


def _softmax32(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _softmax64(x: np.ndarray) -> np.ndarray:
    return _softmax32(f64(x))


def _layernorm(x: np.ndarray, eps: float) -> np.ndarray:
    y = x - x[..., :1]  # relative to the row's first element, as the CUDA kernel
    d = y - y.mean(axis=-1, keepdims=True)
    var = (d * d).mean(axis=-1, keepdims=True)
    return d / np.sqrt(var + x.dtype.type(eps))


def _reduce_sum(x: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    return x.sum(axis=-1).reshape(out_shape)


def _softmax_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                  p: Mapping[str, Any]) -> None:
    outs[0][...] = _softmax32(ins[0])


def _layernorm_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                    p: Mapping[str, Any]) -> None:
    outs[0][...] = _layernorm(ins[0], p["eps"])


def _reduce_sum_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                     p: Mapping[str, Any]) -> None:
    outs[0][...] = _reduce_sum(ins[0], outs[0].shape)


SOFTMAX = KernelSpec(
    name="softmax", n_in=1, n_out=1, source=SOFTMAX_CUDA, entry="sl_softmax",
    infer=_softmax_infer, configure=checked_configure("softmax", _softmax_infer, _rows_launch),
    host=_softmax_host,
    reference=lambda ins, p: [_softmax64(ins[0])],
    doc="Softmax over the last axis (rank >= 1), max-subtracted.")

LAYERNORM = KernelSpec(
    name="layernorm", n_in=1, n_out=1, source=LAYERNORM_CUDA, entry="sl_layernorm",
    infer=_layernorm_infer,
    configure=checked_configure("layernorm", _layernorm_infer, _layernorm_launch),
    host=_layernorm_host,
    reference=lambda ins, p: [_layernorm(f64(ins[0]), p["eps"])],
    params={"eps": Param(float, 1e-5, minimum=0.0, maximum=1e30,
                         doc="added to the variance before the square root")},
    doc="(x - mean) / sqrt(var + eps) over the last axis; biased variance, no gamma/beta.")

REDUCE_SUM = KernelSpec(
    name="reduce_sum", n_in=1, n_out=1, source=REDUCE_SUM_CUDA, entry="sl_reduce_sum",
    infer=_reduce_sum_infer,
    configure=checked_configure("reduce_sum", _reduce_sum_infer, _rows_launch),
    host=_reduce_sum_host,
    reference=lambda ins, p: [_reduce_sum(f64(ins[0]), ins[0].shape[:-1] or (1,))],
    doc="Sum over the last axis: out shape in_shape[:-1], or (1,) for a 1-D input.")

SPECS = (SOFTMAX, LAYERNORM, REDUCE_SUM)

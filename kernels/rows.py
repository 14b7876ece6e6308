"""Row kernels over the last axis: softmax, layernorm, reduce_sum.

A tensor of any rank >= 1 is seen as ``rows x cols`` (cols = last axis). One block handles one
row, or for short rows one warp does (``_common.row_launch``), with a grid-stride loop over
rows; its threads read the row (``_common.ROW_EACH_CUDA``: float4 loads for rows of
``LONG_ROW_COLS`` or more) and their partial results are combined by the reductions of
``_common.BLOCK_REDUCE_CUDA``, summing in double.
Signature: ``(x, out, long long rows, long long cols[, double eps])``. A thread writes element
j of a row only in a pass where it read x[j] itself, after reading it, so softmax and layernorm
may write over their input (out == x, exactly); reduce_sum's output may not overlap its input
(``KernelSpec.in_place``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._common import (
    BLOCK_REDUCE_CUDA,
    ROW_EACH_CUDA,
    by_blocks,
    check_ins,
    checked_configure,
    f64,
    min_rank,
    row_launch,
)
from .spec import KernelSpec, LaunchConfig, Param, Shape, c_double

# Each row kernel has two entries over one body: sl_<name> reads one element per thread at a
# time, sl_<name>_long with float4 loads (``_common.row_launch`` picks by row length).
SOFTMAX_CUDA = BLOCK_REDUCE_CUDA + ROW_EACH_CUDA + r"""
// Numerically stable: exp(x - max) never overflows. Pass 2 stores the exponentials in out
// and sums them in double, pass 3 scales them by the sum's reciprocal (a double product
// rounded once to float32; a double division per element took 1.23x the kernel's time).
template <bool VEC>
__device__ __forceinline__ void sl_softmax_rows(const float* x, float* out, long long rows,
                                                long long cols) {
    __shared__ double scratch[32];
    for (long long r = SL_FIRST_ROW; r < rows; r += SL_ROW_STRIDE) {
        const float* xr = x + r * cols;
        float* yr = out + r * cols;
        float mx = __int_as_float(0xff800000);
        sl_row_each<VEC>(xr, cols, [&](long long, float v) { mx = fmaxf(mx, v); });
        mx = sl_block_max(mx, (float*)scratch);
        double s = 0.0;
        sl_row_map<VEC>(xr, yr, cols, [&](float v) {
            const float e = expf(v - mx);
            s += e;
            return e;
        });
        const double inv = 1.0 / sl_block_sum(s, scratch);
        // Vectorized, pass 3 walks yr, whose elements may fall to other threads than in pass
        // 2 (yr and xr may differ in alignment): a warp's reduction has no barrier, so one.
        if (VEC && blockDim.x == 32) __syncwarp();
        sl_row_map<VEC>(yr, yr, cols, [&](float v) { return (float)(v * inv); });
    }
}
extern "C" __global__ void sl_softmax(const float* x, float* out, long long rows, long long cols) {
    sl_softmax_rows<false>(x, out, rows, cols);
}
extern "C" __global__ void __launch_bounds__(1024) sl_softmax_long(const float* x, float* out,
                                                                   long long rows, long long cols) {
    sl_softmax_rows<true>(x, out, rows, cols);
}
"""

# Two passes (mean, then the mean of squared deviations) rather than E[x^2] - E[x]^2, which
# cancels catastrophically when |mean| >> std; both in double, from float32 values: x - mean
# is then exact to double precision, so a constant row (even far from zero) gives exactly 0, a
# long row's mean is accurate, and squares of deviations up to float32's range cannot overflow.
LAYERNORM_CUDA = BLOCK_REDUCE_CUDA + ROW_EACH_CUDA + r"""
template <bool VEC>
__device__ __forceinline__ void sl_layernorm_rows(const float* x, float* out, long long rows,
                                                  long long cols, double eps) {
    __shared__ double scratch[32];
    for (long long r = SL_FIRST_ROW; r < rows; r += SL_ROW_STRIDE) {
        const float* xr = x + r * cols;
        float* yr = out + r * cols;
        double s = 0.0;
        sl_row_each<VEC>(xr, cols, [&](long long, float v) { s += v; });
        const double m = sl_block_sum(s, scratch) / (double)cols;
        double q = 0.0;
        sl_row_each<VEC>(xr, cols, [&](long long, float v) {
            const double d = v - m;
            q = fma(d, d, q);
        });
        const double var = sl_block_sum(q, scratch) / (double)cols;
        const double inv = 1.0 / sqrt(var + eps);
        sl_row_map<VEC>(xr, yr, cols, [&](float v) { return (float)((v - m) * inv); });
    }
}
extern "C" __global__ void sl_layernorm(const float* x, float* out, long long rows, long long cols,
                                        double eps) {
    sl_layernorm_rows<false>(x, out, rows, cols, eps);
}
extern "C" __global__ void __launch_bounds__(1024) sl_layernorm_long(
        const float* x, float* out, long long rows, long long cols, double eps) {
    sl_layernorm_rows<true>(x, out, rows, cols, eps);
}
"""

REDUCE_SUM_CUDA = BLOCK_REDUCE_CUDA + ROW_EACH_CUDA + r"""
template <bool VEC>
__device__ __forceinline__ void sl_reduce_sum_rows(const float* x, float* out, long long rows,
                                                   long long cols) {
    __shared__ double scratch[32];
    for (long long r = SL_FIRST_ROW; r < rows; r += SL_ROW_STRIDE) {
        double s = 0.0;
        sl_row_each<VEC>(x + r * cols, cols, [&](long long, float v) { s += v; });
        s = sl_block_sum(s, scratch);
        if (threadIdx.x == 0) out[r] = (float)s;
    }
}
extern "C" __global__ void sl_reduce_sum(const float* x, float* out, long long rows,
                                         long long cols) {
    sl_reduce_sum_rows<false>(x, out, rows, cols);
}
extern "C" __global__ void __launch_bounds__(1024) sl_reduce_sum_long(
        const float* x, float* out, long long rows, long long cols) {
    sl_reduce_sum_rows<true>(x, out, rows, cols);
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


def _softmax_launch(ins: list[Shape], outs: list[Shape], p: Mapping[str, Any]) -> LaunchConfig:
    return row_launch(ins[0], "softmax")


def _reduce_sum_launch(ins: list[Shape], outs: list[Shape],
                       p: Mapping[str, Any]) -> LaunchConfig:
    return row_launch(ins[0], "reduce_sum")


def _layernorm_launch(ins: list[Shape], outs: list[Shape], p: Mapping[str, Any]) -> LaunchConfig:
    cfg = row_launch(ins[0], "layernorm")
    return dataclasses.replace(cfg, scalars=(*cfg.scalars, (p["eps"], c_double)))


def _softmax(x: np.ndarray) -> np.ndarray:
    """Softmax, the sum in float64 (as the CUDA kernel); from float32 exponentials for a
    float32 ``x``, so the twin rounds where the kernel does."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True, dtype=np.float64)


def _layernorm(x: np.ndarray, eps: float) -> np.ndarray:
    """In float64, as the CUDA kernel (which reads float32 values into double)."""
    x = f64(x)
    d = x - x.mean(axis=-1, keepdims=True)
    var = (d * d).mean(axis=-1, keepdims=True)
    return d / np.sqrt(var + eps)


def _reduce_sum(x: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    return x.sum(axis=-1, dtype=np.float64).reshape(out_shape)


def _softmax_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                  p: Mapping[str, Any]) -> None:
    by_blocks(_softmax, ins, outs[0], row=ins[0].shape[-1])  # bounded scratch


def _layernorm_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                    p: Mapping[str, Any]) -> None:
    by_blocks(lambda x: _layernorm(x, p["eps"]), ins, outs[0], row=ins[0].shape[-1])


def _reduce_sum_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                     p: Mapping[str, Any]) -> None:
    # the float64 sums of short rows are a temporary as large as the tensor: by blocks
    by_blocks(lambda x: x.sum(axis=-1, dtype=np.float64), ins, outs[0], row=ins[0].shape[-1],
              reduce=True)


SOFTMAX = KernelSpec(
    name="softmax", n_in=1, n_out=1, source=SOFTMAX_CUDA, entry="sl_softmax",
    infer=_softmax_infer, configure=checked_configure("softmax", _softmax_infer, _softmax_launch),
    host=_softmax_host, in_place=True,
    reference=lambda ins, p: [_softmax(f64(ins[0]))],
    doc="Softmax over the last axis (rank >= 1), max-subtracted.")

LAYERNORM = KernelSpec(
    name="layernorm", n_in=1, n_out=1, source=LAYERNORM_CUDA, entry="sl_layernorm",
    infer=_layernorm_infer,
    configure=checked_configure("layernorm", _layernorm_infer, _layernorm_launch),
    host=_layernorm_host, in_place=True,
    reference=lambda ins, p: [_layernorm(ins[0], p["eps"])],
    params={"eps": Param(float, 1e-5, minimum=0.0, maximum=1e30,
                         doc="added to the variance before the square root")},
    doc="(x - mean) / sqrt(var + eps) over the last axis; biased variance, no gamma/beta.")

REDUCE_SUM = KernelSpec(
    name="reduce_sum", n_in=1, n_out=1, source=REDUCE_SUM_CUDA, entry="sl_reduce_sum",
    infer=_reduce_sum_infer,
    configure=checked_configure("reduce_sum", _reduce_sum_infer, _reduce_sum_launch),
    host=_reduce_sum_host,
    reference=lambda ins, p: [_reduce_sum(f64(ins[0]), ins[0].shape[:-1] or (1,))],
    doc="Sum over the last axis: out shape in_shape[:-1], or (1,) for a 1-D input.")

SPECS = (SOFTMAX, LAYERNORM, REDUCE_SUM)

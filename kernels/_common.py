"""Shape checks and launch arithmetic shared by the kernel modules.

Every check raises ``KernelSpecError`` naming the offending part ("in[1]", "out[0]"), so the
runtime can turn it into ``InvalidProgram`` / ``InvalidArgument`` with the JSON path.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .spec import KernelSpecError, LaunchConfig, Shape, c_longlong

# Kernels index with 64-bit integers; this bound keeps every product of an index and a stride
# (at most numel) far from 2**63, so no CUDA index expression can overflow.
MAX_NUMEL = 1 << 48

# Elementwise launches: 256 threads per block and a grid-stride loop. The grid cap keeps the
# grid inside every dimension limit (y/z are 65535) while still oversubscribing any GPU
# (an H200 runs at most 132 SMs x 8 such blocks at once).
BLOCK = 256
MAX_GRID = 65535

InferFn = Callable[[Sequence[Shape], Mapping[str, Any]], list[Shape | None]]
LaunchFn = Callable[[list[Shape], list[Shape], Mapping[str, Any]], LaunchConfig]
ConfigureFn = Callable[[Sequence[Shape], Sequence[Shape], Mapping[str, Any]], LaunchConfig]


def shape_of(shape: Any, where: str) -> Shape:
    """``shape`` as a tuple of ints, each >= 1, with at most ``MAX_NUMEL`` elements."""
    if isinstance(shape, (str, bytes)) or not isinstance(shape, (Sequence, np.ndarray)):
        raise KernelSpecError(where, "a shape (a sequence of ints)", shape)
    dims = tuple(shape)
    for d in dims:
        if isinstance(d, (bool, np.bool_)) or not isinstance(d, (int, np.integer)) or d < 1:
            raise KernelSpecError(where, "a shape whose dimensions are ints >= 1", dims)
    dims = tuple(int(d) for d in dims)
    if math.prod(dims) > MAX_NUMEL:
        raise KernelSpecError(where, f"at most {MAX_NUMEL} elements", dims)
    return dims


def check_ins(name: str, in_shapes: Sequence[Any], n: int) -> list[Shape]:
    """The input shapes, after checking there are ``n`` of them."""
    if len(in_shapes) != n:
        raise KernelSpecError("in", f"{n} input(s) for {name}", len(in_shapes))
    return [shape_of(s, f"in[{i}]") for i, s in enumerate(in_shapes)]


def check_outs(name: str, out_shapes: Sequence[Any], n: int) -> list[Shape]:
    if len(out_shapes) != n:
        raise KernelSpecError("out", f"{n} output(s) for {name}", len(out_shapes))
    return [shape_of(s, f"out[{i}]") for i, s in enumerate(out_shapes)]


def same_shapes(shapes: Sequence[Shape]) -> Shape:
    """The common shape of ``shapes`` (inputs of an elementwise kernel)."""
    for i, s in enumerate(shapes[1:], start=1):
        if s != shapes[0]:
            raise KernelSpecError(f"in[{i}]", f"shape {list(shapes[0])} (the shape of in[0])",
                                  list(s))
    return shapes[0]


def min_rank(shape: Shape, rank: int, where: str) -> None:
    if len(shape) < rank:
        raise KernelSpecError(where, f"rank >= {rank}", list(shape))


def checked_configure(name: str, infer: InferFn, launch: LaunchFn) -> ConfigureFn:
    """A ``configure`` that re-checks the outputs against ``infer`` before ``launch``.

    ``configure`` is the last step before arguments are marshalled, so a caller that skipped
    ``infer`` must still never launch a kernel on buffers of the wrong size.
    """

    def configure(in_shapes: Sequence[Shape], out_shapes: Sequence[Shape],
                  params: Mapping[str, Any]) -> LaunchConfig:
        expected = infer(in_shapes, params)
        outs = check_outs(name, out_shapes, len(expected))
        for i, (want, got) in enumerate(zip(expected, outs, strict=True)):
            if want is not None and want != got:
                raise KernelSpecError(f"out[{i}]", f"shape {list(want)}", list(got))
        ins = [shape_of(s, f"in[{i}]") for i, s in enumerate(in_shapes)]
        return launch(ins, outs, params)

    return configure


def stride_launch(n: int, *scalars: tuple[Any, type]) -> LaunchConfig:
    """A 1-D grid-stride launch over ``n`` elements; ``n`` is the first scalar (long long)."""
    blocks = min(max(1, -(-n // BLOCK)), MAX_GRID)
    return LaunchConfig(grid=(blocks, 1, 1), block=(BLOCK, 1, 1),
                        scalars=((n, c_longlong), *scalars))


def rows_cols(shape: Shape) -> tuple[int, int]:
    """A tensor seen as rows over its last axis."""
    return math.prod(shape[:-1]), shape[-1]


# Rows up to this long get one warp each (WARP_ROWS_PER_BLOCK rows per block): a block per
# short row spends most of its time in the block reduction's barriers.
WARP_ROW_COLS = 256
WARP_ROWS_PER_BLOCK = 8


def row_launch(shape: Shape) -> LaunchConfig:
    """The launch of a row kernel, scalars (rows, cols): a warp per row for rows of up to
    ``WARP_ROW_COLS`` (block 32 x ``WARP_ROWS_PER_BLOCK``), else a block of 256 threads per
    row (whole warps, as the block reductions need); grid-stride over rows past the grid."""
    rows, cols = rows_cols(shape)
    if cols <= WARP_ROW_COLS:
        blocks = -(-rows // WARP_ROWS_PER_BLOCK)
        block = (32, WARP_ROWS_PER_BLOCK, 1)
    else:
        blocks, block = rows, (256, 1, 1)
    return LaunchConfig(grid=(min(blocks, MAX_GRID), 1, 1), block=block,
                        scalars=((rows, c_longlong), (cols, c_longlong)))


def f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


# Block reductions for the row kernels, pasted into each source so every source stays
# self-contained. Every thread of the block gets the result. The leading __syncthreads makes
# back-to-back reductions safe: no warp overwrites scratch while another still reads it.
# Sums are in double: each thread adds cols / blockDim terms one after another, and in float32
# that running sum's error grows with the row (a row of 1e6 x 0.1 summed to 3.7e-5 relative,
# where numpy's pairwise float32 sum is within 1e-7). Against the float32 version, H200
# (bench/results/rows-probe-cuda.txt, second run): 0-5% slower on rows of 1e6 and more, 1-15%
# at 8192 x 4096, 7-30% at 65536 x 1024 (layernorm the most: three passes in double), and
# 0.59-0.87x on short rows, which now get a warp each.
BLOCK_REDUCE_CUDA = r"""
// Rows: a block per row (blockDim.y == 1), or a warp per row (blockDim.x == 32, a row per
// threadIdx.y). A warp's reductions stay within the warp: no barrier, so the warps of a block
// may loop over different numbers of rows.
#define SL_FIRST_ROW ((long long)blockIdx.x * blockDim.y + threadIdx.y)
#define SL_ROW_STRIDE ((long long)gridDim.x * blockDim.y)
__device__ __forceinline__ double sl_warp_sum(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float sl_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
// blockDim.x must be a multiple of 32 (at most 1024); scratch holds 32 doubles.
__device__ double sl_block_sum(double v, double* scratch) {
    if (blockDim.x == 32) return sl_warp_sum(v);  // a warp per row
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = sl_warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return sl_warp_sum(lane < warps ? scratch[lane] : 0.0);
}
// scratch holds 32 floats (a double scratch serves, through a cast).
__device__ float sl_block_max(float v, float* scratch) {
    if (blockDim.x == 32) return sl_warp_max(v);  // a warp per row
    const float neg_inf = __int_as_float(0xff800000);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = sl_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    return sl_warp_max(lane < warps ? scratch[lane] : neg_inf);
}
"""

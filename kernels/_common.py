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
# short row spends most of its time in the block reduction's barriers. Rows of LONG_ROW_COLS
# columns or more go to the kernel's "_long" entry, which reads them with float4 loads, four in
# flight per thread (``ROW_EACH_CUDA``), in blocks of 256 threads, or 1024 past
# WIDE_BLOCK_COLS. The long entry needs twice the registers (46-64 against 28-32), which halves
# how many warps an SM holds: shorter rows, with few elements per thread, ran up to 2.6x
# slower with it on the H200 (bench/results/rows-probe-cuda.txt), so they keep the plain entry.
WARP_ROW_COLS = 256
WARP_ROWS_PER_BLOCK = 8
LONG_ROW_COLS = 2048
WIDE_BLOCK_COLS = 16384


def row_launch(shape: Shape, name: str) -> LaunchConfig:
    """The launch of row kernel ``name``, scalars (rows, cols): a warp per row for rows of up
    to ``WARP_ROW_COLS`` (block 32 x ``WARP_ROWS_PER_BLOCK``), else a block per row, of 256
    threads, or 1024 past ``WIDE_BLOCK_COLS`` (whole warps, as the block reductions need), by
    the entry ``sl_<name>_long`` from ``LONG_ROW_COLS`` on; grid-stride over rows past the
    grid."""
    rows, cols = rows_cols(shape)
    entry = None
    if cols <= WARP_ROW_COLS:
        blocks = -(-rows // WARP_ROWS_PER_BLOCK)
        block = (32, WARP_ROWS_PER_BLOCK, 1)
    else:
        blocks, block = rows, (1024 if cols > WIDE_BLOCK_COLS else 256, 1, 1)
        if cols >= LONG_ROW_COLS:
            entry = f"sl_{name}_long"
    return LaunchConfig(grid=(min(blocks, MAX_GRID), 1, 1), block=block,
                        scalars=((rows, c_longlong), (cols, c_longlong)), entry=entry)


def f64(a: Any) -> np.ndarray:
    return np.asarray(a, dtype=np.float64)


# How many elements a host twin computes at once. Twins that make float64 or float32
# temporaries of their input (gelu, axpy, softmax, layernorm: 3-6x its bytes at once) work on
# blocks of this many, so that a large tensor needs a few tens of MB of scratch, not a few
# times its size: a MemoryError inside a twin is a fault of the whole host device, where the
# CUDA kernels need no scratch at all. Each element (each row, for the row kernels) is
# computed exactly as in one pass.
HOST_CHUNK = 1 << 20


def by_blocks(fn: Callable[..., np.ndarray], ins: Sequence[np.ndarray], out: np.ndarray,
              row: int = 1, reduce: bool = False) -> None:
    """``out[...] = fn(*ins)``, computed over blocks of whole rows of ``row`` elements (1: any
    elementwise ``fn``) of about ``HOST_CHUNK`` elements. ``out`` has the size of ``ins``
    (it may be one of them: each block is read before it is written), or with ``reduce`` one
    element per row (``fn`` drops the last axis)."""
    n = ins[0].size
    rows = n // row if row > 0 else 0
    if n <= HOST_CHUNK or rows * row != n or out.size != (rows if reduce else n) or \
            not out.flags.c_contiguous or \
            not all(a.flags.c_contiguous and a.size == n for a in ins):
        out[...] = fn(*ins)
        return
    flat_out = out.reshape(rows) if reduce else out.reshape(rows, row)
    flat_ins = [a.reshape(rows, row) for a in ins]
    step = max(1, HOST_CHUNK // row)
    for r in range(0, rows, step):
        flat_out[r:r + step] = fn(*(a[r:r + step] for a in flat_ins))


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


# The row traversal of the row kernels. sl_row_each<false>: one element per thread at a
# time, as every row kernel read rows before. sl_row_each<true> (the "_long" entries): float4
# loads, four in flight per thread, where one 4-byte load at a time left long rows far short
# of the memory bandwidth (reduce_sum of (64, 1e6) at 164 GB/s on the H200,
# bench/results/rows-probe-cuda.txt); sl_row_map writes with float4 stores as well. Either way
# each thread visits the same elements in the same order in every pass over a row (from the
# same pointer), so a kernel that writes element j in a pass wrote only what that thread read.
ROW_EACH_CUDA = r"""
template <typename F>
__device__ __forceinline__ void sl_each4(F& f, long long j, const float4 q) {
    f(j, q.x);
    f(j + 1, q.y);
    f(j + 2, q.z);
    f(j + 3, q.w);
}
// f(j, xr[j]) for every j < cols, over the threads along x. Vectorized: the (at most 3)
// elements before xr's first 16-byte boundary, then float4 loads, then the (at most 3) left.
template <bool VEC, typename F>
__device__ __forceinline__ void sl_row_each(const float* xr, long long cols, F f) {
    const long long t = threadIdx.x, n = blockDim.x;
    if (!VEC) {
        for (long long j = t; j < cols; j += n) f(j, xr[j]);
        return;
    }
    long long head = (long long)(((16u - ((unsigned)(unsigned long long)xr & 15u)) & 15u) >> 2);
    if (head > cols) head = cols;
    if (t < head) f(t, xr[t]);
    const float4* v = reinterpret_cast<const float4*>(xr + head);
    const long long nv = (cols - head) >> 2;
    long long k = t;
    for (; k + 3 * n < nv; k += 4 * n) {
        const float4 a = v[k], b = v[k + n], c = v[k + 2 * n], d = v[k + 3 * n];
        sl_each4(f, head + 4 * k, a);
        sl_each4(f, head + 4 * (k + n), b);
        sl_each4(f, head + 4 * (k + 2 * n), c);
        sl_each4(f, head + 4 * (k + 3 * n), d);
    }
    for (; k < nv; k += n) sl_each4(f, head + 4 * k, v[k]);
    const long long j = head + 4 * nv + t;
    if (j < cols) f(j, xr[j]);
}
template <typename G>
__device__ __forceinline__ float4 sl_map4(const float4 q, G& g) {
    float4 r;  // in order: g may accumulate
    r.x = g(q.x);
    r.y = g(q.y);
    r.z = g(q.z);
    r.w = g(q.w);
    return r;
}
// yr[j] = g(xr[j]) for every j < cols, each element read and written by one thread (xr may be
// yr). Vectorized, with float4 stores too where yr is as far from a 16-byte boundary as xr
// (always for buffers of the same shape from the pool); else as sl_row_each, storing floats.
template <bool VEC, typename G>
__device__ __forceinline__ void sl_row_map(const float* xr, float* yr, long long cols, G g) {
    if (!VEC || ((((unsigned long long)xr ^ (unsigned long long)yr) & 15u) != 0)) {
        sl_row_each<VEC>(xr, cols, [&](long long j, float v) { yr[j] = g(v); });
        return;
    }
    const long long t = threadIdx.x, n = blockDim.x;
    long long head = (long long)(((16u - ((unsigned)(unsigned long long)xr & 15u)) & 15u) >> 2);
    if (head > cols) head = cols;
    if (t < head) yr[t] = g(xr[t]);
    const float4* v = reinterpret_cast<const float4*>(xr + head);
    float4* w = reinterpret_cast<float4*>(yr + head);
    const long long nv = (cols - head) >> 2;
    long long k = t;
    for (; k + 3 * n < nv; k += 4 * n) {
        const float4 a = v[k], b = v[k + n], c = v[k + 2 * n], d = v[k + 3 * n];
        w[k] = sl_map4(a, g);
        w[k + n] = sl_map4(b, g);
        w[k + 2 * n] = sl_map4(c, g);
        w[k + 3 * n] = sl_map4(d, g);
    }
    for (; k < nv; k += n) w[k] = sl_map4(v[k], g);
    const long long j = head + 4 * nv + t;
    if (j < cols) yr[j] = g(xr[j]);
}
"""

"""matmul: c[m,n] = a[m,k] @ b[k,n], tiled through shared memory."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._common import MAX_GRID, check_ins, checked_configure, f64
from .spec import KernelSpec, KernelSpecError, LaunchConfig, Shape, c_longlong

TILE = 16

# One 16x16 block computes one 16x16 tile of c, walking k in 16-wide slabs staged in shared
# memory. Out-of-range elements load as 0, so any m, k, n (1, primes) is exact without a
# separate edge path. Tiles are visited with grid-stride loops, so m or n beyond 65535 tiles
# still fit the grid limits; the loop bounds depend only on block indices, so every thread
# of a block reaches the same __syncthreads. Indices are 64-bit: row * k overflows int32
# from 2**31 elements on.
MATMUL_CUDA = r"""
constexpr int SL_TILE = 16;

extern "C" __global__ void sl_matmul(const float* a, const float* b, float* c,
                                     long long m, long long k, long long n) {
    __shared__ float ta[SL_TILE][SL_TILE];
    __shared__ float tb[SL_TILE][SL_TILE];
    const int tx = threadIdx.x, ty = threadIdx.y;
    const long long tiles_m = (m + SL_TILE - 1) / SL_TILE;
    const long long tiles_n = (n + SL_TILE - 1) / SL_TILE;
    for (long long tm = blockIdx.y; tm < tiles_m; tm += gridDim.y) {
        for (long long tn = blockIdx.x; tn < tiles_n; tn += gridDim.x) {
            const long long row = tm * SL_TILE + ty;
            const long long col = tn * SL_TILE + tx;
            float acc = 0.0f;
            for (long long k0 = 0; k0 < k; k0 += SL_TILE) {
                const long long ak = k0 + tx, bk = k0 + ty;
                ta[ty][tx] = (row < m && ak < k) ? a[row * k + ak] : 0.0f;
                tb[ty][tx] = (bk < k && col < n) ? b[bk * n + col] : 0.0f;
                __syncthreads();
#pragma unroll
                for (int i = 0; i < SL_TILE; ++i) acc = fmaf(ta[ty][i], tb[i][tx], acc);
                __syncthreads();  // the next slab must not overwrite tiles still being read
            }
            if (row < m && col < n) c[row * n + col] = acc;
        }
    }
}
"""


def _infer(in_shapes: Sequence[Shape], params: Mapping[str, Any]) -> list[Shape | None]:
    a, b = check_ins("matmul", in_shapes, 2)
    if len(a) != 2:
        raise KernelSpecError("in[0]", "a 2-D matrix a[m,k]", list(a))
    if len(b) != 2:
        raise KernelSpecError("in[1]", "a 2-D matrix b[k,n]", list(b))
    if a[1] != b[0]:
        raise KernelSpecError("in[1]", f"b[k,n] with k = {a[1]} (the columns of a)", list(b))
    return [(a[0], b[1])]


def _launch(ins: list[Shape], outs: list[Shape], params: Mapping[str, Any]) -> LaunchConfig:
    (m, k), (_, n) = ins
    grid = (min(-(-n // TILE), MAX_GRID), min(-(-m // TILE), MAX_GRID), 1)
    return LaunchConfig(grid=grid, block=(TILE, TILE, 1),
                        scalars=((m, c_longlong), (k, c_longlong), (n, c_longlong)))


def _host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
          params: Mapping[str, Any]) -> None:
    np.matmul(ins[0], ins[1], out=outs[0])


MATMUL = KernelSpec(
    name="matmul", n_in=2, n_out=1, source=MATMUL_CUDA, entry="sl_matmul", infer=_infer,
    configure=checked_configure("matmul", _infer, _launch), host=_host,
    reference=lambda ins, p: [f64(ins[0]) @ f64(ins[1])],
    doc="c[m,n] = a[m,k] @ b[k,n]; 2-D only, float32 accumulation.")

SPECS = (MATMUL,)

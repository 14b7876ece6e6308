"""Layout kernels: ``strided_copy`` gathers an array in any memory layout (transposed, sliced,
reversed) into the C-contiguous layout, on the device that holds it.

The runtime uses it for device inputs in another layout (``set_inputs`` with a transposed CuPy or
torch array); programs cannot name it, nor can ``Device.prepare`` / ``launch`` (``internal``):
nothing checks the strides in ``meta`` against the memory they reach. It works on bytes: the
source pointer is the array's first element, ``meta`` holds the shape and the strides in bytes
(int64, shape first), and each thread copies whole elements of ``itemsize`` bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._common import stride_launch
from .spec import KernelSpec, KernelSpecError, LaunchConfig, Param, Shape, c_int

MAX_RANK = 8

STRIDED_COPY_CUDA = r"""
extern "C" __global__ void sl_strided_copy(const unsigned char* src, const long long* meta,
                                           unsigned char* dst, long long n, int rank,
                                           int itemsize) {
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += step) {
        long long rem = i, offset = 0;
        for (int k = rank - 1; k >= 0; --k) {  // C order: the last index varies fastest
            const long long d = meta[k];
            offset += (rem % d) * meta[rank + k];
            rem /= d;
        }
        const unsigned char* s = src + offset;
        unsigned char* t = dst + i * itemsize;
        switch (itemsize) {
            case 1: *t = *s; break;
            case 2: *(unsigned short*)t = *(const unsigned short*)s; break;
            case 4: *(unsigned int*)t = *(const unsigned int*)s; break;
            case 8: *(unsigned long long*)t = *(const unsigned long long*)s; break;
            default: for (int b = 0; b < itemsize; ++b) t[b] = s[b];
        }
    }
}
"""

_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _infer(in_shapes: Sequence[Shape], p: Mapping[str, Any]) -> list[Shape | None]:
    if len(in_shapes) != 2:
        raise KernelSpecError("in", "2 inputs (source bytes, meta)", len(in_shapes))
    if tuple(in_shapes[1]) != (2 * p["rank"],):
        raise KernelSpecError("in[1]", f"meta of shape [{2 * p['rank']}]", list(in_shapes[1]))
    return [(p["n"] * p["itemsize"],)]


def _configure(ins: Sequence[Shape], outs: Sequence[Shape], p: Mapping[str, Any]) -> LaunchConfig:
    return stride_launch(p["n"], (p["rank"], c_int), (p["itemsize"], c_int))  # n goes first


def gather_host(src: np.ndarray, meta: np.ndarray, itemsize: int) -> np.ndarray:
    """The elements ``src`` (a byte view starting at the first element) holds in the layout
    ``meta`` describes, C-contiguous. A negative stride reads before ``src``'s first byte, as
    the CUDA kernel does: the caller's buffer must hold the whole layout there."""
    rank = meta.size // 2
    shape, strides = tuple(int(d) for d in meta[:rank]), tuple(int(s) for s in meta[rank:])
    words = np.lib.stride_tricks.as_strided(src.view(np.uint8), (*shape, itemsize),
                                            (*strides, 1), writeable=False)
    return np.ascontiguousarray(words).reshape(-1)


def _host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray], p: Mapping[str, Any]) -> None:
    outs[0][...] = gather_host(ins[0], ins[1], p["itemsize"])


def _reference(ins: Sequence[np.ndarray], p: Mapping[str, Any]) -> list[np.ndarray]:
    return [gather_host(ins[0], ins[1].astype(np.int64), p["itemsize"]).astype(np.float64)]


STRIDED_COPY = KernelSpec(
    name="strided_copy", n_in=2, n_out=1, source=STRIDED_COPY_CUDA, entry="sl_strided_copy",
    infer=_infer, configure=_configure, host=_host, reference=_reference,
    params={"n": Param(int, None, 1, 1 << 48, "elements to copy"),
            "rank": Param(int, None, 1, MAX_RANK, "dimensions of the source"),
            "itemsize": Param(int, None, 1, 16, "bytes per element")},
    dtypes=("uint8",), in_programs=False, internal=True,
    instead="pass the array to a method's set_inputs(), which gathers another layout with it",
    doc="Gather a strided array into C order, bytewise (inputs: source bytes starting at the "
        "first element, int64 meta = shape + byte strides).")

SPECS = (STRIDED_COPY,)

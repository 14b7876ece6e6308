"""Kernel edge cases on every device (host everywhere, CUDA where a GPU is usable): the same
result on both devices, close to the float64 reference, or the same typed streamlane error on
both. The host twins run in numpy, which hides what a CUDA kernel cannot: long float32 running
sums, misaligned or non-native memory, outputs overlapping inputs. Cases that could end a CUDA
context (misaligned loads) run in a subprocess. Tests marked ``cuda`` need sizes a 2-core host
cannot afford, or memory only a large GPU has.
"""

from __future__ import annotations

import math
import subprocess
import sys
import warnings

import numpy as np
import pytest

from streamlane.kernels import get_kernel
from streamlane.runtime import (
    DeviceError,
    InvalidArgument,
    InvalidProgram,
    Program,
)
from streamlane.runtime.dtypes import DTYPES

F32_MAX = float(np.finfo(np.float32).max)


# -- helpers --------------------------------------------------------------------------------------
def _launch(device, name, ins, params=None, out_shapes=None):
    """Run one kernel through Device.launch; outputs start as NaN so unwritten ones show."""
    spec = get_kernel(name)
    s = device.per_thread_stream()
    resolved = spec.resolve_params(params)
    outs = out_shapes or spec.infer([a.shape for a in ins], resolved)
    d_ins = [device.to_device(np.ascontiguousarray(a), s) for a in ins]
    d_outs = [device.to_device(np.full(o, np.nan, np.float32), s) for o in outs]
    device.launch(name, s, d_ins, d_outs, params)
    return [device.to_host(o, s) for o in d_outs]


def _reference(name, ins, params=None):
    spec = get_kernel(name)
    with np.errstate(all="ignore"):
        return spec.reference([np.asarray(a, np.float64) for a in ins],
                              spec.resolve_params(params))


def _manifest(kernel, in_shapes, out_shape, params=None, dtype="float32"):
    step = {"kernel": kernel, "in": [f"x{i}" for i in range(len(in_shapes))], "out": ["y"]}
    if params:
        step["params"] = params
    return {"format": 1, "name": "edge", "methods": {"f": {
        "inputs": [{"name": f"x{i}", "dtype": dtype, "shape": list(s)}
                   for i, s in enumerate(in_shapes)],
        "steps": [step],
        "outputs": [{"name": "y", "dtype": "float32", "shape": list(out_shape)}]}}}


def _run_method(device, kernel, ins, out_shape, params=None):
    """Run one kernel as a program step (the path programs on disk take)."""
    m = Program.from_manifest(_manifest(kernel, [a.shape for a in ins], out_shape, params)) \
        .method("f", device=device)
    return m(list(ins))[0].to_host()


def rel_err(got, want, scale=None):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    denom = np.linalg.norm(want if scale is None else scale)
    return float(np.linalg.norm(got - want) / max(denom, 1e-300))


def _rng(seed=0):
    return np.random.default_rng(seed)


# == long rows: the row kernels' running sums ===================================================
LONG_COLS = [1_000_000, pytest.param(10_000_000, marks=pytest.mark.cuda)]


@pytest.mark.parametrize("cols", LONG_COLS)
def test_reduce_sum_of_a_long_constant_row_keeps_float32_accuracy(device, cols):
    """Each of a block's 256 threads adds cols/256 equal terms one after another: in float32
    the rounding errors of such a running sum do not cancel (an emulation of that order gave
    3.7e-5 at 1e6 columns, 3.7e-4 at 1e7); the kernels sum in double."""
    x = np.full((1, cols), 0.1, np.float32)
    got = _run_method(device, "reduce_sum", [x], (1,))
    want = _reference("reduce_sum", [x])[0]
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)


@pytest.mark.parametrize("cols", LONG_COLS)
def test_softmax_of_a_long_row_keeps_float32_accuracy(device, cols):
    """One element ln(10) above the others: every other exp is ~0.1, so the row sum is the
    long constant sum above."""
    x = np.zeros((1, cols), np.float32)
    x[0, 0] = np.float32(math.log(10.0))
    got = _run_method(device, "softmax", [x], x.shape)
    want = _reference("softmax", [x])[0]
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)


def test_layernorm_of_a_long_row_keeps_its_mean_accurate(device):
    """Row [0, 0.1, 0.1, ...]: the mean's error (the long sum above) is magnified by 1/std
    (3.7e-2 with float32 running sums)."""
    x = np.full((1, 1_000_000), 0.1, np.float32)
    x[0, 0] = 0.0
    got = _run_method(device, "layernorm", [x], x.shape, {"eps": 1e-5})
    want = _reference("layernorm", [x], {"eps": 1e-5})[0]
    assert rel_err(got, want) <= 1e-5, rel_err(got, want)


@pytest.mark.parametrize("name", ["reduce_sum", "softmax", "layernorm"])
def test_long_random_rows_match_the_reference(device, name):
    """Random rows (rounding errors of random sign), the common case."""
    x = _rng(1).standard_normal((2, 1_000_003)).astype(np.float32)
    (got,) = _launch(device, name, [x])
    want = _reference(name, [x])[0]
    scale = _reference(name, [np.abs(x)])[0] if name == "reduce_sum" else None
    assert rel_err(got, want, scale) <= 1e-5


ROW_COLS = [1, 3, 5, 63, 257, 2047, 2049, 4099, 16_385,
            pytest.param(100_003, marks=pytest.mark.cuda)]


def _view_at(device, s, values, shift):
    """``values`` on the device, ``shift`` float32 elements past a buffer's (aligned) start."""
    raw = np.full(values.size + 4, np.nan, np.float32)
    raw[shift:shift + values.size] = values.ravel()
    d = device.to_device(raw, s)
    return d.buffer.view(np.float32, values.shape, d.offset + 4 * shift)


@pytest.mark.parametrize("cols", ROW_COLS)
@pytest.mark.parametrize("name", ["reduce_sum", "softmax", "layernorm"])
def test_row_kernels_on_rows_at_every_alignment(device, name, cols):
    """CUDA reads long rows with float4 loads from the first 16-byte boundary: rows whose start is
    0-3 elements past one (input views at every shift, and odd column counts, which move every
    row's start), outputs at the same shift (float4 stores too) and at another (float stores;
    softmax then rescales elements another thread wrote), and in place. Every element written,
    each close to the reference."""
    rows = 3
    x = _rng(cols).standard_normal((rows, cols)).astype(np.float32)
    spec = get_kernel(name)
    out_shape = spec.infer([x.shape], spec.resolve_params(None))[0]
    want = _reference(name, [x])[0].reshape(out_shape)
    scale = _reference(name, [np.abs(x)])[0].reshape(out_shape) if name == "reduce_sum" else 1
    s = device.per_thread_stream()
    for shift in range(4):
        dx = _view_at(device, s, x, shift)
        for out_shift in sorted({0, shift, 3}):  # float4 stores where it matches the input's
            dy = _view_at(device, s, np.full(out_shape, np.nan, np.float32), out_shift)
            device.launch(name, s, [dx], [dy])
            got = device.to_host(dy, s)
            err = np.abs(got - want) / np.maximum(np.abs(scale), 1e-30)
            assert (err <= 2e-6).all(), (shift, out_shift, float(np.nanmax(err)))
        if spec.in_place:
            device.launch(name, s, [dx], [dx])
            got = device.to_host(dx, s)
            assert (np.abs(got - want) <= 2e-6).all(), (shift, "in place")


# == axpy rounds once (fmaf on CUDA), on both devices ============================================
@pytest.mark.parametrize(("alpha", "x", "y"), [
    (3e38, 2.0, -3e38),                          # alpha*x overflows float32, alpha*x + y does not
    (1 + 2**-12, 1 + 2**-12, -(1 + 2**-11)),     # the product's last bit is the whole answer
], ids=["overflowing-product", "cancellation"])
def test_axpy_is_one_fused_rounding(device, alpha, x, y):
    """CUDA: out = fmaf(alpha, x, y), one rounding; the host twin rounds alpha*x first:
    inf instead of 3e38, 0 instead of 2**-24. The reference agrees with CUDA."""
    xs, ys = np.full(7, x, np.float32), np.full(7, y, np.float32)
    (got,) = _launch(device, "axpy", [xs, ys], {"alpha": alpha})
    fused = (np.float64(np.float32(alpha)) * xs.astype(np.float64) + ys).astype(np.float32)
    want = _reference("axpy", [xs, ys], {"alpha": alpha})[0]
    np.testing.assert_array_equal(got, fused)
    np.testing.assert_allclose(got, want, rtol=1e-6)


# == Device.launch refuses what a kernel would misread ===========================================
def test_launch_refuses_non_native_byte_order(device):
    """'>f4' is named 'float32' too: a CUDA kernel would read its bytes as little-endian values
    (numpy, on the host device, would not), so both devices refuse it."""
    s = device.per_thread_stream()
    a, b = np.arange(1, 6, dtype=">f4"), np.full(5, 0.5, ">f4")
    da, db = device.to_device(a, s), device.to_device(b, s)
    out = device.to_device(np.zeros(5, ">f4"), s)
    with pytest.raises(InvalidArgument, match=r"byte order; copy it as array.astype\('<f4'\)"):
        device.launch("add", s, [da, db], [out])


def test_launch_refuses_an_output_over_an_input_it_still_reads(device):
    """matmul into its own input: CUDA blocks would read rows other blocks already overwrote
    (numpy copies overlapping operands, so only the host device would get it right); the
    front of reduce_sum's input as its output likewise."""
    rng = _rng(2)
    a = rng.standard_normal((64, 64)).astype(np.float32)
    s = device.per_thread_stream()
    da, db = device.to_device(a, s), device.to_device(a.T.copy(), s)
    with pytest.raises(InvalidArgument, match=r"argument 2 of matmul .* is the same memory as "
                                              r"argument 0"):
        device.launch("matmul", s, [da, db], [da])
    front = da.buffer.view(np.float32, (64,), da.offset)
    with pytest.raises(InvalidArgument, match=r"argument 1 of reduce_sum .* overlaps argument 0"):
        device.launch("reduce_sum", s, [da], [front])
    shifted = da.buffer.view(np.float32, (64, 32), da.offset + 4 * 32)
    half = da.buffer.view(np.float32, (64, 32), da.offset)
    with pytest.raises(InvalidArgument, match="exactly that input"):  # in place, but shifted
        device.launch("relu", s, [half], [shifted])
    np.testing.assert_array_equal(device.to_host(da, s), a)  # nothing ran


def test_kernels_safe_in_place_may_write_over_their_input(device):
    """Elementwise kernels, softmax and layernorm write each element after reading it, in the
    same thread: an output that is exactly an input is allowed."""
    x = _rng(4).standard_normal((5, 300)).astype(np.float32)
    s = device.per_thread_stream()
    for name, params in (("relu", None), ("softmax", None), ("layernorm", {"eps": 1e-5})):
        dx = device.to_device(x, s)
        device.launch(name, s, [dx], [dx], params)
        want = _reference(name, [x], params)[0]
        assert rel_err(device.to_host(dx, s), want) <= 1e-6, name
    dx, dy = device.to_device(x, s), device.to_device(x, s)
    device.launch("axpy", s, [dx, dy], [dy], {"alpha": 2.0})
    np.testing.assert_allclose(device.to_host(dy, s), 3 * x, rtol=1e-6)


# == misaligned device pointers (run in a subprocess: a fault poisons the context) ==========
MISALIGNED_SCRIPT = r"""
import sys
import numpy as np
from streamlane.runtime import DeviceError, InvalidArgument, Program, get_device

kind, case = sys.argv[1], sys.argv[2]
dev = get_device(kind)
s = dev.per_thread_stream()
src = np.arange(-4, 4, dtype=np.float32)
raw = np.zeros(40, np.uint8)
raw[2:34] = src.view(np.uint8)            # the floats start 2 bytes into the buffer
buf = dev.to_device(raw, s)
# "launch": a float32 view at byte offset 2; "cai": another library's contiguous array at
# ptr + 2; "cai-strided": every other element of it (gathered by strided_copy)
shape, strides = ((4,), (8,)) if case == "cai-strided" else ((8,), None)
want = np.maximum(src[::2] if case == "cai-strided" else src, 0)


class Foreign:
    def __init__(self):
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": "<f4", "data": (buf.ptr + 2, False), "version": 3,
            "strides": strides, "stream": None}


def run():
    if case == "launch":
        x = buf.buffer.view(np.float32, (8,), offset=buf.offset + 2)
        y = dev.empty((8,), np.float32)
        dev.launch("relu", s, [x], [y])
        return dev.to_host(y, s)
    doc = {"format": 1, "name": "p", "methods": {"f": {
        "inputs": [{"name": "x", "dtype": "float32", "shape": list(shape)}],
        "steps": [{"kernel": "relu", "in": ["x"], "out": ["y"]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": list(shape)}]}}}
    m = Program.from_manifest(doc).method("f", device=dev)
    return m([Foreign()])[0].to_host()


try:
    got = run()
    print("correct" if np.array_equal(got, want) else f"WRONG {got!r}", flush=True)
except InvalidArgument as exc:           # InvalidInput included
    print(f"refused {type(exc).__name__}: {exc}", flush=True)
except DeviceError as exc:
    print(f"FAULT {exc.code}: {exc}", flush=True)
"""


@pytest.mark.parametrize("case", ["launch", "cai", "cai-strided"])
def test_misaligned_float32_memory_is_refused(device, case):
    """A float32 view 2 bytes off alignment (Buffer.view(offset=2), or another library's
    __cuda_array_interface__ pointer or strides): a CUDA float load there is a fault
    (CUDA_ERROR_MISALIGNED_ADDRESS) that ends the context for the whole process, so it is
    refused before anything is enqueued (the host device refuses a CUDA-only array anyway)."""
    out = subprocess.run([sys.executable, "-c", MISALIGNED_SCRIPT, device.kind, case],
                         capture_output=True, text=True, timeout=120)
    lines = out.stdout.strip().splitlines()
    verdict = lines[-1] if lines else f"no verdict (rc {out.returncode})"
    assert verdict.startswith("refused"), f"{verdict}\n{out.stderr[-3000:]}"
    if case == "launch" or device.kind == "cuda":
        assert "aligned" in verdict, verdict


# == IEEE results under warnings-as-errors ========================================================
WARNING_CASES = [
    ("softmax", [np.full((2, 3), -np.inf, np.float32)], {}),              # -inf - -inf
    ("layernorm", [np.full((2, 3), 5.0, np.float32)], {"eps": 0.0}),      # 0 / 0
    ("gelu", [np.array([1e14, -1e14, 1.0], np.float32)], {}),             # K*x*x*x overflows
    ("scale", [np.array([1e30, -2.0], np.float32)], {"factor": 1e30}),    # overflows
]


@pytest.mark.parametrize(("name", "ins", "params"), WARNING_CASES,
                         ids=[c[0] for c in WARNING_CASES])
def test_kernels_give_ieee_results_under_warnings_as_errors(device, name, ins, params):
    """With RuntimeWarning turned into an error (python -W error, pytest -W error, an
    application's simplefilter), a numpy RuntimeWarning inside a host twin would fault the host
    device for good; CUDA returns the IEEE results (NaN, inf), and so must the host."""
    spec = get_kernel(name)
    resolved = spec.resolve_params(params)
    want = [np.empty(o, np.float32) for o in spec.infer([a.shape for a in ins], resolved)]
    with np.errstate(all="ignore"):
        spec.host(ins, want, resolved)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = _launch(device, name, ins, params)
    except DeviceError as exc:
        if device.kind == "host":
            device.reset_error()
        pytest.fail(f"{name} faulted the {device.kind} device: {exc}")
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-6, equal_nan=True)


# == strided_copy gathers reversed layouts on both devices =======================================
def test_strided_copy_of_a_reversed_layout(device):
    """A reversed (negative-stride) layout, as another library may hand one over: the CUDA
    kernel gathers it, and so does the host twin (it used to fault the host device)."""
    s = device.per_thread_stream()
    src = np.arange(4, dtype=np.float32)
    raw = device.to_device(src.view(np.uint8), s)
    first = raw.buffer.view(np.uint8, (4,), raw.offset + 12)  # starts at src[3]
    meta = device.to_device(np.array([4, -4], np.int64), s)
    out = device.empty((16,), np.uint8)
    p = device._prepare(get_kernel("strided_copy"), [(4,), (2,)], [(16,)],  # the runtime's way
                        {"n": 4, "rank": 1, "itemsize": 4}, dtype="uint8")
    p.run(s, [first, meta], [out])
    try:
        got = device.to_host(out, s).view(np.float32)
    except DeviceError as exc:
        if device.kind == "host":
            device.reset_error()
        pytest.fail(f"strided_copy faulted the {device.kind} device: {exc}")
    np.testing.assert_array_equal(got, src[::-1])


def test_strided_copy_cannot_be_named_by_callers(device):
    """Its strides are data the kernel follows unchecked: launched by name it read host memory
    anywhere (a segfault past a mapping on the host device; on CUDA, an illegal address that
    ends the context). The runtime launches it with the strides it derived itself."""
    s = device.per_thread_stream()
    src = device.to_device(np.zeros(4, np.uint8), s)
    meta = device.to_device(np.array([4, 1 << 40], np.int64).view(np.uint8)[:2], s)
    out = device.empty((16,), np.uint8)
    with pytest.raises(InvalidArgument, match="runtime only"):
        device.prepare("strided_copy", [(4,), (2,)], [(16,)],
                       {"n": 4, "rank": 1, "itemsize": 4}, dtype="uint8")
    with pytest.raises(InvalidArgument, match="runtime only"):
        device.launch("strided_copy", s, [src, meta], [out], {"n": 4, "rank": 1, "itemsize": 4})
    device.synchronize()  # nothing was enqueued


def test_prepare_extra_never_replaces_a_checked_param(device):
    """extra (host-side objects, the latch's release event) was merged over the params after
    their check: extra={"us": -5} spun for ~2**64 ns on CUDA and faulted the host device;
    a NaN or 1e300 factor went through."""
    for extra in ({"us": -5}, {"factor": float("nan")}, {3: 1}):
        with pytest.raises(InvalidArgument, match="starting with '_'"):
            device.prepare("spin" if "us" in extra else "scale", [] if "us" in extra else [(4,)],
                           params={"us": 5} if "us" in extra else {"factor": 2.0},
                           extra=extra)
    assert not getattr(device, "lost", False)


def test_launch_tells_minus_zero_from_zero(device):
    """launch() cached its prepared launch by param value, and -0.0 == 0.0: after a fill of
    -0.0, fill(0.0) wrote -0.0, and scale by -0.0 after scale by 0.0 kept the wrong signs."""
    s = device.per_thread_stream()
    out = device.empty((4,), np.float32)
    for value in (-0.0, 0.0, np.float32(-0.0), np.float64(0.0)):
        device.launch("fill", s, [], [out], {"value": value})
        got = device.to_host(out, s)
        assert np.signbit(got).tolist() == [bool(np.signbit(value))] * 4, value


def test_layernorm_of_rows_spread_beyond_1e19(device):
    """In float32, d*d overflows once |x - mean| > 1.8e19: var = inf, 1/sqrt(var) = 0, and the
    row came out all zeros; the reference gives values of order 1."""
    x = np.array([[1e20, -1e20, 3e19, 0.0], [1.0, 2.0, 3.0, 4.0]], np.float32)
    (got,) = _launch(device, "layernorm", [x], {"eps": 1e-5})
    want = _reference("layernorm", [x], {"eps": 1e-5})[0]
    assert rel_err(got, want) <= 1e-5, got


# == layernorm's eps is a double, as in the reference ============================================
def test_layernorm_eps_below_float32_subnormals(device):
    """eps = 1e-50 is 0 as a float32: a constant row would give 0/0 = NaN, where the float64
    reference gives 0."""
    x = np.full((2, 5), 3.0, np.float32)
    (got,) = _launch(device, "layernorm", [x], {"eps": 1e-50})
    want = _reference("layernorm", [x], {"eps": 1e-50})[0]
    np.testing.assert_array_equal(got, want)


# == layernorm's precision: an outlier, a spread beyond float32's squares ========================
@pytest.mark.parametrize("outlier", [1e4, 1e5])
def test_layernorm_with_an_outlier_first_element(device, outlier):
    """Centring on anything but the mean (the row's first element, as before) rounds at the
    outlier's scale: the ordinary elements lost ~1e-4 of their scale."""
    x = _rng(6).standard_normal((1, 4096)).astype(np.float32)
    x[0, 0] = outlier
    (got,) = _launch(device, "layernorm", [x], {"eps": 1e-5})
    want = _reference("layernorm", [x], {"eps": 1e-5})[0]
    rest = np.abs(got[0, 1:] - want[0, 1:]).max() / np.abs(want[0, 1:]).max()
    assert rest <= 1e-5, rest


# == one summation on both devices ===============================================================
def test_reduce_sum_near_float32_overflow(device):
    """[3e38, 3e38, -3e38]: a float32 sum left to right overflows (inf), the CUDA butterfly's
    order does not; in double neither does, on both devices."""
    x = np.array([[3e38, 3e38, -3e38]], np.float32)
    with np.errstate(all="ignore"):
        (got,) = _launch(device, "reduce_sum", [x])
    want = _reference("reduce_sum", [x])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6)


# == relu(-0.0) ==============================================================================
def test_relu_of_negative_zero_has_the_reference_sign(device):
    """np.maximum(-0.0, 0.0) (host twin, reference) gives +0.0; so does the CUDA kernel (which
    kept -0.0 with `v < 0 ? 0 : v`). Visible only through signbit, 1/x or copysign."""
    x = np.array([-0.0, 0.0, -1.0, 1.0], np.float32)
    (got,) = _launch(device, "relu", [x])
    want = _reference("relu", [x])[0]
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


# == edge cases expected to agree on both devices ===============================================
@pytest.mark.parametrize("cols", [1, 2, 31, 32, 33, 63, 255, 256, 257, 1023, 4097])
@pytest.mark.parametrize("name", ["softmax", "layernorm", "reduce_sum"])
def test_row_kernels_at_warp_and_block_boundaries(device, name, cols):
    x = (_rng(cols).standard_normal((3, cols)) * 3).astype(np.float32)
    (got,) = _launch(device, name, [x])
    want = _reference(name, [x])[0]
    scale = _reference(name, [np.abs(x)])[0] if name == "reduce_sum" else None
    assert np.isfinite(got).all()
    assert rel_err(got, want, scale) <= 1e-5


@pytest.mark.parametrize("shape", [(100_000, 1), (70_001, 3), (65_536, 2), (2, 3, 65_537, 1),
                                   (600_001, 2), (70_001, 300)])
@pytest.mark.parametrize("name", ["softmax", "layernorm", "reduce_sum"])
def test_row_kernels_with_more_rows_than_the_grid(device, name, shape):
    """More rows than blocks (65535, and 65535 x 8 for the short rows a warp each handles):
    the grid-stride loop over rows must reach every row."""
    x = _rng(5).standard_normal(shape).astype(np.float32)
    (got,) = _launch(device, name, [x])
    want = _reference(name, [x])[0]
    scale = _reference(name, [np.abs(x)])[0] if name == "reduce_sum" else None
    assert np.isfinite(got).all()
    assert rel_err(got, want, scale) <= 1e-5


def test_one_element_everywhere(device):
    one = np.array([1.5], np.float32)
    assert _launch(device, "softmax", [one])[0].tolist() == [1.0]
    assert _launch(device, "layernorm", [one])[0].tolist() == [0.0]
    assert _launch(device, "reduce_sum", [one])[0].tolist() == [1.5]
    assert _launch(device, "matmul", [one.reshape(1, 1), np.array([[2.0]], np.float32)])[0] \
        .tolist() == [[3.0]]
    assert _launch(device, "gelu", [np.zeros(1, np.float32)])[0].tolist() == [0.0]


SOFTMAX_SPECIAL = {
    "all-minus-inf": [-np.inf] * 4,            # NaN everywhere (0/0), on all three
    "minus-inf-and-finite": [-np.inf, 0.0, -np.inf, -1.0],
    "plus-inf": [np.inf, 0.0, 1.0, 2.0],       # inf - inf: NaN everywhere
    "nan": [np.nan, 0.0, 1.0, 2.0],            # fmaxf drops the NaN, the sum brings it back
    "extremes": [F32_MAX, -F32_MAX, 0.0, F32_MAX],  # x - max overflows to -inf: exp gives 0
    "huge-equal": [1e30, 1e30, 1e30, 1e30],
    "single-inf": [np.inf],
}


@pytest.mark.parametrize("row", list(SOFTMAX_SPECIAL.values()), ids=list(SOFTMAX_SPECIAL))
def test_softmax_of_special_rows(device, row):
    x = np.array([row], np.float32)
    with np.errstate(all="ignore"):
        (got,) = _launch(device, "softmax", [x])
    want = _reference("softmax", [x])[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=0, equal_nan=True)


@pytest.mark.parametrize(("row", "eps"), [
    ([7.0], 1e-5), ([7.0, 7.0, 7.0], 0.0), ([1e4, 1e4 + 1, 1e4 + 2], 0.0),
    ([1.0, 2.0, 3.0], 1e30), ([-np.inf, 0.0, 1.0], 1e-5), ([np.nan, 0.0], 1e-5),
])
def test_layernorm_special_rows_and_eps(device, row, eps):
    x = np.array([row], np.float32)
    with np.errstate(all="ignore"):
        (got,) = _launch(device, "layernorm", [x], {"eps": eps})
    want = _reference("layernorm", [x], {"eps": eps})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30, equal_nan=True)


def test_gelu_special_values_and_negative_tail(device):
    """Same formula in CUDA, host twin and reference (gelu(-inf) is NaN in all three). The tail
    keeps its relative accuracy: computed as 0.5x(1+tanh(u)), 1 + tanh(u) cancelled and the
    relative error reached ~13 near x = -5.4, with 0 below (reference ~1e-8). What is left is
    exp's sensitivity to u's float32 rounding, ~2|u| ulps (1.56e-5 at x = -9.89:
    bench/gelu_tail_probe.py)."""
    special = np.array([0.0, -0.0, 1e-30, -1e-30, np.inf, -np.inf, np.nan, 1e13, -1e13, 8.0,
                        -8.0], np.float32)
    with np.errstate(all="ignore"):
        (got,) = _launch(device, "gelu", [special])
    want = _reference("gelu", [special])[0]
    np.testing.assert_allclose(got, want, rtol=3e-5, atol=1e-36, equal_nan=True)  # -8: tail
    tail = np.linspace(-12, 4, 20001).astype(np.float32)
    (got,) = _launch(device, "gelu", [tail])
    want = _reference("gelu", [tail])[0]
    normal = np.abs(want) >= np.finfo(np.float32).tiny  # below, float32 keeps fewer digits
    assert (tail[normal].min() < -10) and (want[~normal] != 0).any()
    assert (np.abs(got - want) <= 3e-5 * np.abs(want))[normal].all()  # elementwise
    np.testing.assert_allclose(got[tail > -2], want[tail > -2], rtol=2e-6, atol=1e-30)
    np.testing.assert_allclose(got[~normal], want[~normal], rtol=0, atol=2e-43)


@pytest.mark.parametrize(("m", "k", "n"), [
    (1, 1000, 1), (33, 1, 65), (3, 100_003, 2), (17, 16, 15), (16, 17, 16),
    (16 * 65535 + 17, 1, 1),   # tiles_m > 65535: grid.y is capped, the tile loop strides
    (1, 1, 16 * 65535 + 17),   # tiles_n > 65535: same on grid.x
])
def test_matmul_shapes_and_grid_caps(device, m, k, n):
    rng = _rng(m * 7 + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    (got,) = _launch(device, "matmul", [a, b])
    want = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64))
    assert np.isfinite(got).all()
    assert rel_err(got, want, scale) <= 1e-4


def test_matmul_inf_times_zero(device):
    a = np.array([[np.inf, 1.0], [1.0, 1.0]], np.float32)
    b = np.array([[0.0, 1.0], [1.0, 1.0]], np.float32)
    (got,) = _launch(device, "matmul", [a, b])
    with np.errstate(all="ignore"):
        want = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_array_equal(got, want.astype(np.float32))


@pytest.mark.parametrize("name", ["fill", "scale", "axpy"])
def test_float_params_at_the_float32_limits(device, name):
    x = np.array([1.0, -1.0, 0.5], np.float32)
    params = {"fill": {"value": -F32_MAX}, "scale": {"factor": F32_MAX},
              "axpy": {"alpha": F32_MAX}}[name]
    ins = {"fill": [], "scale": [x], "axpy": [x, np.zeros(3, np.float32)]}[name]
    with np.errstate(all="ignore"):
        (got,) = _launch(device, name, ins, params, out_shapes=[(3,)] if name == "fill" else None)
    want = np.broadcast_to(_reference(name, ins, params)[0], (3,))
    np.testing.assert_allclose(got, want, rtol=1e-7)
    for bad in (3.5e38, float("inf"), float("nan")):
        key = next(iter(params))
        with pytest.raises(InvalidArgument):
            device.prepare(name, [a.shape for a in ins], [(3,)], {key: bad})


@pytest.mark.parametrize("name", ["fill", "scale", "axpy"])
def test_float_params_are_taken_as_the_float32_the_kernel_gets(device, name):
    """FLT_MAX as numpy prints it (3.4028235e38, a little above FLT_MAX) was refused though
    the kernel's float rounds it to FLT_MAX; a param the float rounds to zero (1e-50) gave a
    float64 reference of 1e-20 where the device's exact answer is 0."""
    x = np.array([1e30, -3e38, 0.5], np.float32)
    ins = {"fill": [], "scale": [x], "axpy": [x, np.zeros(3, np.float32)]}[name]
    key = {"fill": "value", "scale": "factor", "axpy": "alpha"}[name]
    out = [(3,)] if name == "fill" else None
    for value, f32 in ((3.4028235e38, F32_MAX), (-3.4028235e38, -F32_MAX), (1e-50, 0.0),
                       (-1e-45, -1e-45)):
        with np.errstate(all="ignore"):
            (got,) = _launch(device, name, ins, {key: value}, out_shapes=out)
            want = np.broadcast_to(_reference(name, ins, {key: value})[0], (3,))
            also = np.broadcast_to(_reference(name, ins, {key: f32})[0], (3,))
            exact = want.astype(np.float32)  # inf where 1e30 * FLT_MAX overflows
        np.testing.assert_array_equal(want, also)  # the reference takes the float32 value
        np.testing.assert_allclose(got, exact, rtol=1e-7, atol=0)
    for bad in (F32_MAX + 2.0 ** 103, -(F32_MAX + 2.0 ** 103)):  # the tie rounds to inf
        with pytest.raises(InvalidArgument, match=f"params.{key}"):
            device.prepare(name, [a.shape for a in ins], [(3,)], {key: bad})


# -- dtypes, zero sizes, params: the same typed error on both devices ----------------------------
@pytest.mark.parametrize("dtype", ["float16", "float64", "int32", "uint8", "bfloat16"])
def test_launch_refuses_dtypes_no_source_was_written_for(device, dtype):
    from streamlane.runtime.dtypes import dtype_from_name

    s = device.per_thread_stream()
    dt = dtype_from_name(dtype)
    x = device.to_device(np.ones(4, dt), s)
    y = device.empty((4,), dt)
    with pytest.raises(InvalidArgument, match="float32"):
        device.launch("relu", s, [x], [y])


@pytest.mark.parametrize("dtype", ["complex64", "U3", "V8", "V0", [("a", "f4")],
                                   "datetime64[s]"])
def test_empty_and_to_device_refuse_dtypes_streamlane_does_not_know(device, dtype):
    """Device memory holds numbers; a complex, text, void, record or datetime dtype is refused
    with the list of supported ones, not allocated for a kernel or a copy to misread (V0 made
    a ValueError in to_host). Other integer widths still make scratch buffers."""
    s = device.per_thread_stream()
    with pytest.raises(InvalidArgument, match=r"not one device memory holds.*float32"):
        device.empty((4,), dtype)
    with pytest.raises(InvalidArgument, match="not one device memory holds"):
        device.to_device(np.zeros(4, dtype), s)
    for other in ("int16", "uint32", "uint64", "bfloat16"):
        data = np.arange(4).astype(DTYPES[other] if other == "bfloat16" else other)
        np.testing.assert_array_equal(device.to_host(device.to_device(data, s), s), data)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float64", "int32"])
def test_programs_refuse_dtypes_kernels_do_not_take(device, dtype):
    with pytest.raises(InvalidProgram) as info:
        Program.from_manifest(_manifest("relu", [(4,)], (4,), dtype=dtype)).method(
            "f", device=device)
    assert info.value.path == "methods.f.steps[0].in[0]"


def test_zero_sizes_are_refused_on_both_devices(device):
    with pytest.raises(InvalidArgument):
        device.to_device(np.zeros((0, 3), np.float32), device.per_thread_stream())
    for name, shapes in (("add", [(0,), (0,)]), ("matmul", [(3, 0), (0, 4)]),
                         ("softmax", [(4, 0)]), ("reduce_sum", [(0,)])):
        with pytest.raises(InvalidArgument):
            device.prepare(name, shapes)
    with pytest.raises(InvalidProgram) as info:
        Program.from_manifest(_manifest("relu", [(4, 0)], (4, 0)))
    assert info.value.path == "methods.f.inputs[0].shape[1]"


@pytest.mark.parametrize(("kernel", "params", "where"), [
    ("spin", {"us": -1}, "params.us"), ("spin", {"us": 10_000_001}, "params.us"),
    ("spin", {"us": 1.5}, "params.us"), ("layernorm", {"eps": -1e-9}, "params.eps"),
    ("scale", {"factor": 1e39}, "params.factor"), ("axpy", {"alpha": "2"}, "params.alpha"),
])
def test_bad_params_are_typed_errors_at_bind_time(device, kernel, params, where):
    spec = get_kernel(kernel)
    shapes = [(4,)] * spec.n_in
    with pytest.raises(InvalidArgument):
        device.prepare(kernel, shapes, None, params)
    doc = _manifest(kernel, shapes, (4,), params)
    if spec.n_out == 0:
        doc["methods"]["f"]["steps"][0]["out"] = []
        doc["methods"]["f"]["steps"].append({"kernel": "fill", "in": [], "out": ["y"]})
    with pytest.raises(InvalidProgram) as info:
        Program.from_manifest(doc)
    assert info.value.path == f"methods.f.steps[0].{where}"


def test_latch_is_not_a_program_kernel(device):
    doc = _manifest("fill", [], (4,))
    doc["methods"]["f"]["steps"].insert(0, {"kernel": "latch", "in": [], "out": [],
                                            "params": {"flag_ptr": 1}})
    with pytest.raises(InvalidProgram) as info:
        Program.from_manifest(doc)
    assert info.value.path == "methods.f.steps[0].kernel"


def test_spin_of_zero_microseconds_runs(device):
    doc = _manifest("fill", [], (4,), {"value": 2.0})
    doc["methods"]["f"]["steps"].insert(0, {"kernel": "spin", "in": [], "out": [],
                                            "params": {"us": 0}})
    m = Program.from_manifest(doc).method("f", device=device)
    assert m([])[0].to_host().tolist() == [2.0] * 4


# -- GPU-only: sizes past the grid cap and past 2**31 elements ------------------------------------
@pytest.mark.cuda
def test_elementwise_past_the_grid_cap(cuda_device):
    """n > 65535 blocks x 256 threads: every element is reached by the grid-stride loop."""
    n = 65535 * 256 * 2 + 3
    rng = _rng(9)
    a, b = rng.standard_normal(n, dtype=np.float32), rng.standard_normal(n, dtype=np.float32)
    (got,) = _launch(cuda_device, "add", [a, b])
    np.testing.assert_array_equal(got, a + b)
    (got,) = _launch(cuda_device, "gelu", [a])
    tail = slice(n - 1_000_000, n)  # the float64 reference of all 33M elements is slow
    assert rel_err(got[tail], _reference("gelu", [a[tail]])[0]) <= 1e-6


def _need_memory(dev, gib):
    if dev.total_memory < gib << 30:
        pytest.skip(f"needs {gib} GiB of device memory")


def _tail(dev, array, count):
    """The last ``count`` elements of ``array`` copied back (not the whole 8 GiB)."""
    view = array.buffer.view(np.float32, (count,), array.offset + array.nbytes - 4 * count)
    return dev.to_host(view, dev.per_thread_stream())


def _filled(dev, stream, shape, value):
    """A device array of ``shape`` filled with ``value`` on the device (nothing uploaded)."""
    array = dev.empty(shape, np.float32)
    dev.launch("fill", stream, [], [array], {"value": value})
    return array


@pytest.mark.cuda
def test_row_kernels_past_2_31_elements(cuda_device):
    """2**21 + 1 rows of 1024: the last row starts at element 2**31 (r * cols overflows an
    int). Filled on the device; only the tails travel back."""
    dev = cuda_device
    _need_memory(dev, 40)
    s = dev.per_thread_stream()
    rows, cols = 2**21 + 1, 1024
    x = _filled(dev, s, (rows, cols), 1.0)
    assert (_tail(dev, x, 2 * cols) == 1.0).all()
    sums = dev.empty((rows,), np.float32)
    dev.launch("reduce_sum", s, [x], [sums])
    assert (dev.to_host(sums, s) == cols).all()
    dev.launch("softmax", s, [x], [x])  # in place: documented safe
    assert (_tail(dev, x, 2 * cols) == np.float32(1 / cols)).all()
    dev.launch("layernorm", s, [x], [x], {"eps": 1e-5})
    assert (_tail(dev, x, 2 * cols) == 0.0).all()
    x.buffer.free(s)


@pytest.mark.cuda
def test_matmul_past_2_31_elements(cuda_device):
    """a is 65537 x 32768 (2**31 + 32768 elements): row * k overflows an int at the last row."""
    dev = cuda_device
    _need_memory(dev, 24)
    s = dev.per_thread_stream()
    m, k = 65537, 32768
    a, b = _filled(dev, s, (m, k), 1.0), _filled(dev, s, (k, 1), 1.0)
    c = dev.empty((m, 1), np.float32)
    dev.launch("matmul", s, [a, b], [c])
    assert (dev.to_host(c, s) == k).all()
    a.buffer.free(s)


@pytest.mark.cuda
def test_elementwise_past_2_31_elements(cuda_device):
    dev = cuda_device
    _need_memory(dev, 40)
    s = dev.per_thread_stream()
    x = _filled(dev, s, (2**21 + 1, 1024), -3.0)
    y = dev.empty((2**21 + 1, 1024), np.float32)
    dev.launch("scale", s, [x], [y], {"factor": -2.0})
    dev.launch("axpy", s, [x, y], [y], {"alpha": 2.0})  # in place on y: -6 + 6 = 0
    assert (_tail(dev, y, 4096) == 0.0).all()
    x.buffer.free(s)
    y.buffer.free(s)


@pytest.mark.parametrize(("name", "shape", "params", "most"), [
    ("layernorm", (128, 65536), {"eps": 1e-5}, 1.5), ("softmax", (128, 65536), {}, 1.5),
    ("gelu", (1 << 23,), {}, 1.5), ("axpy", (1 << 23,), {"alpha": 0.5}, 1.5),
    ("layernorm", (3, 1_500_001), {"eps": 1e-5}, 4.0),  # rows longer than a block: one a time
    ("reduce_sum", (1 << 23, 1), {}, 0.5), ("reduce_sum", (1 << 21, 4), {}, 0.5),
])
def test_host_twins_compute_large_tensors_in_blocks_of_bounded_scratch(host, name, shape,
                                                                       params, most):
    """The twins made float64 temporaries of the whole tensor (layernorm 6x its bytes, gelu
    4.25x, axpy 4x, softmax 3x); a MemoryError there is a fault of the whole host device. By
    blocks of whole rows, the scratch stays a few tens of MB (``most``: at most that many
    times the tensor's bytes here), and every element is what one pass over the whole tensor
    gives (in place too)."""
    import tracemalloc

    from streamlane.kernels import _common

    spec = get_kernel(name)
    rng = np.random.default_rng(7)
    ins = [rng.standard_normal(shape).astype(np.float32) * 3 + 1 for _ in range(spec.n_in)]
    assert ins[0].size > _common.HOST_CHUNK
    s = host.per_thread_stream()
    d_ins = [host.to_device(a, s) for a in ins]
    out_shape = spec.infer([shape] * spec.n_in, spec.resolve_params(params))[0]
    d_out = host.empty(out_shape, np.float32)
    in_place = host.to_device(ins[0], s) if spec.in_place else None
    s.synchronize()
    tracemalloc.start()
    try:
        host.launch(name, s, d_ins, [d_out], params)
        s.synchronize()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    if in_place is not None:
        host.launch(name, s, [in_place, *d_ins[1:]], [in_place], params)
    one_pass = np.empty(out_shape, np.float32)
    real = _common.HOST_CHUNK
    try:
        _common.HOST_CHUNK = one_pass.size  # the whole tensor as one block
        spec.host(ins, [one_pass], spec.resolve_params(params))
    finally:
        _common.HOST_CHUNK = real
    np.testing.assert_array_equal(host.to_host(d_out, s), one_pass)
    if in_place is not None:
        np.testing.assert_array_equal(host.to_host(in_place, s), one_pass)
    ratio = peak / ins[0].nbytes
    assert ratio <= most, f"{name}: {ratio:.2f}x the tensor's bytes of scratch"

"""The kernel library: host twins against float64 references, shape/param checks, launch
rules, the CUDA signatures, and the control kernels' host twins. No GPU needed
(test_kernels_cache.py covers NVRTC and the cubin cache)."""

from __future__ import annotations

import ctypes
import math
import re
import secrets
import threading
import time

import numpy as np
import pytest

import streamlane.kernels as K

KernelSpecError = K.KernelSpecError

# -- numerics: host twin vs reference ------------------------------------------------------------
ELEMENTWISE_SHAPES = [(1,), (7,), (13,), (257,), (1009,), (1, 1, 1), (13, 257), (3, 7, 13)]
ROW_SHAPES = [(1,), (7,), (1009,), (4099,), (1, 1), (2, 1), (13, 257), (257, 13), (3, 5, 7)]
# (m, k, n): 1s, primes, exact multiples of the 16-wide tile and one-off-a-multiple sizes
MATMUL_MKN = [(1, 1, 1), (1, 13, 7), (7, 1, 13), (13, 257, 7), (16, 16, 16), (17, 33, 31),
              (31, 1009, 17), (257, 31, 1009)]

UNARY = ("copy", "scale", "relu", "gelu")
BINARY = ("add", "mul", "axpy")
ROWS = ("softmax", "layernorm", "reduce_sum")

# Relative error bounds, ||out - ref|| / ||scale||, with the float32 unit roundoff u = 6e-8:
# - elementwise: one or two roundings per element (gelu: tanh adds a few ulps), so ~1e-7;
#   1e-5 leaves a wide margin yet catches any wrong formula or constant.
# - matmul, reduce_sum: float32 accumulation of k terms is bounded by ~k*u relative to the sum
#   of |terms| (k <= 4099 here), not to the result: a sum can cancel to ~0 and make a correct
#   result look wrong. So those two are measured against |A||B| and sum|x|.
# - softmax, layernorm: exp/sqrt (few ulps) plus a row reduction of up to 4099 terms.
TOL = {**dict.fromkeys(("fill", *UNARY, *BINARY), 1e-5),
       **dict.fromkeys(("matmul", *ROWS), 1e-4)}


def _params(name: str, rng: np.random.Generator) -> dict:
    draw = float(rng.standard_normal() * 3)
    return {"fill": {"value": draw}, "axpy": {"alpha": draw}, "scale": {"factor": draw},
            "layernorm": {"eps": float(rng.choice([1e-5, 1e-3, 0.5]))}}.get(name, {})


def _cases() -> list:
    cases = [pytest.param("fill", [], s, id=f"fill-{s}") for s in ELEMENTWISE_SHAPES]
    for name in UNARY:
        cases += [pytest.param(name, [s], None, id=f"{name}-{s}") for s in ELEMENTWISE_SHAPES]
    for name in BINARY:
        cases += [pytest.param(name, [s, s], None, id=f"{name}-{s}") for s in ELEMENTWISE_SHAPES]
    for name in ROWS:
        cases += [pytest.param(name, [s], None, id=f"{name}-{s}") for s in ROW_SHAPES]
    cases += [pytest.param("matmul", [(m, k), (k, n)], None, id=f"matmul-{m}x{k}x{n}")
              for m, k, n in MATMUL_MKN]
    return cases


GUARD = 8
SENTINEL = np.float32(-12345.0)


def _poisoned_outputs(shapes: list[tuple[int, ...]]) -> tuple[list[np.ndarray], list]:
    """NaN-filled outputs that are views into larger buffers with sentinel guards, the way a
    device hands out its memory: a twin that rebinds instead of writing, or writes past the
    end, is caught."""
    views, bufs = [], []
    for s in shapes:
        n = math.prod(s)
        buf = np.full(n + 2 * GUARD, np.nan, np.float32)
        buf[:GUARD] = buf[-GUARD:] = SENTINEL
        views.append(buf[GUARD:GUARD + n].reshape(s))
        bufs.append(buf)
    return views, bufs


@pytest.mark.parametrize(("name", "in_shapes", "out_shape"), _cases())
def test_host_twin_matches_float64_reference(name, in_shapes, out_shape):
    spec = K.get_kernel(name)
    seed = secrets.randbits(64)
    rng = np.random.default_rng(seed)
    why = f"kernel {name}, inputs {in_shapes}, seed {seed}"
    ins = [rng.standard_normal(s, dtype=np.float32) for s in in_shapes]
    params = spec.resolve_params(_params(name, rng))
    inferred = spec.infer(in_shapes, params)
    out_shapes = [out_shape or s for s in inferred]
    spec.configure(in_shapes, out_shapes, params)  # the shapes we run on are launchable
    outs, bufs = _poisoned_outputs(out_shapes)

    spec.host(ins, outs, params)
    refs = spec.reference([x.astype(np.float64) for x in ins], params)

    assert len(refs) == len(outs) == spec.n_out, why
    for out, ref, buf in zip(outs, refs, bufs, strict=True):
        assert out.dtype == np.float32 and ref.dtype == np.float64, why
        assert not np.isnan(out).any(), f"{why}: {np.isnan(out).sum()} elements never written"
        assert (buf[:GUARD] == SENTINEL).all() and (buf[-GUARD:] == SENTINEL).all(), why
        ref = np.broadcast_to(ref, out.shape)  # fill's reference is 0-d
        scale = ref
        if name == "matmul":
            scale = np.abs(ins[0].astype(np.float64)) @ np.abs(ins[1].astype(np.float64))
        elif name == "reduce_sum":
            scale = spec.reference([np.abs(ins[0].astype(np.float64))], params)[0]
        err = np.linalg.norm(out.astype(np.float64) - ref)
        denom = np.linalg.norm(scale)
        rel = err / denom if denom > 0 else err
        assert rel < TOL[name], f"{why}: relative error {rel:.3g} >= {TOL[name]}"


def test_reference_shapes_and_known_values():
    x = np.array([[1.0, 2.0, 3.0], [-1.0, -1.0, -1.0]])
    assert np.allclose(K.get_kernel("softmax").reference([x], {})[0].sum(axis=-1), 1.0)
    with np.errstate(invalid="ignore"):  # the constant row is 0/0 with eps = 0
        ln = K.get_kernel("layernorm").reference([x], {"eps": 0.0})[0]
    assert np.allclose(ln[0], [-math.sqrt(1.5), 0.0, math.sqrt(1.5)])
    ln = K.get_kernel("layernorm").reference([x], {"eps": 1e-5})[0]
    assert (ln[1] == 0).all()  # a constant row normalizes to 0 once eps > 0
    assert K.get_kernel("reduce_sum").reference([x[0]], {})[0].shape == (1,)
    g = K.get_kernel("gelu").reference([np.array([0.0, 1.0, -1.0])], {})[0]
    assert np.allclose(g, [0.0, 0.8411919906, -0.1588080094], atol=1e-9)
    assert K.get_kernel("relu").reference([np.array([-2.0, 0.5])], {})[0].tolist() == [0.0, 0.5]


# -- registry ----------------------------------------------------------------------------------
ALL = ["add", "axpy", "copy", "fill", "gelu", "latch", "layernorm", "matmul", "mul", "reduce_sum",
       "relu", "scale", "softmax", "spin", "strided_copy"]
RUNTIME_ONLY = {"latch", "strided_copy"}  # kernels programs cannot name
FLOAT_KERNELS = [n for n in ALL if n != "strided_copy"]  # strided_copy works on bytes


def test_registry_lists_every_kernel():
    assert K.kernel_names() == ALL
    assert K.kernel_names(in_programs_only=True) == [n for n in ALL if n not in RUNTIME_ONLY]
    assert set(K.KERNELS) == set(ALL)
    for name, spec in K.KERNELS.items():
        assert spec.name == name and spec.entry == f"sl_{name}" and spec.doc
        assert spec.dtypes == (("uint8",) if name == "strided_copy" else ("float32",))


def test_registry_is_read_only():
    with pytest.raises(TypeError):
        K.KERNELS["evil"] = K.KERNELS["add"]


@pytest.mark.parametrize("bad", ["nope", "", ["add"], None])
def test_unknown_kernel_lists_valid_names(bad):
    with pytest.raises(K.UnknownKernel) as info:
        K.get_kernel(bad)
    assert isinstance(info.value, KeyError)
    assert "matmul" in str(info.value) and "softmax" in str(info.value)
    assert not str(info.value).startswith('"')  # not KeyError's repr-quoted message


# -- infer / configure / params errors ---------------------------------------------------------
def _spec_error(fn, *args) -> KernelSpecError:
    with pytest.raises(KernelSpecError) as info:
        fn(*args)
    return info.value


@pytest.mark.parametrize("name", FLOAT_KERNELS)
def test_wrong_arity_names_in(name):
    spec = K.get_kernel(name)
    params = {"us": 1} if name == "spin" else {"flag_ptr": 1} if name == "latch" else {}
    params = spec.resolve_params(params)
    err = _spec_error(spec.infer, [(3,)] * (spec.n_in + 1), params)
    assert err.where == "in"


@pytest.mark.parametrize(
    ("name", "in_shapes", "where"),
    [
        ("add", [(3, 4), (4, 3)], "in[1]"),
        ("mul", [(3,), (4,)], "in[1]"),
        ("axpy", [(3,), (3, 1)], "in[1]"),
        ("matmul", [(3,), (3, 4)], "in[0]"),
        ("matmul", [(3, 4), (4,)], "in[1]"),
        ("matmul", [(2, 3, 4), (4, 5)], "in[0]"),
        ("matmul", [(3, 4), (5, 6)], "in[1]"),
        ("softmax", [()], "in[0]"),
        ("layernorm", [()], "in[0]"),
        ("reduce_sum", [()], "in[0]"),
        ("copy", [(3, 0)], "in[0]"),
        ("relu", [(-1,)], "in[0]"),
        ("gelu", [(True, 2)], "in[0]"),
        ("scale", [(2.0,)], "in[0]"),
        ("copy", ["abc"], "in[0]"),
        ("copy", [(1 << 30, 1 << 30)], "in[0]"),
        ("add", [(3,), (0,)], "in[1]"),
    ],
)
def test_infer_rejects_bad_shapes(name, in_shapes, where):
    spec = K.get_kernel(name)
    assert _spec_error(spec.infer, in_shapes, spec.resolve_params({})).where == where


@pytest.mark.parametrize(
    ("name", "ins", "outs"),
    [("add", [(3,), (3,)], [(4,)]), ("matmul", [(2, 3), (3, 4)], [(2, 3)]),
     ("reduce_sum", [(5, 7)], [(5, 1)]), ("fill", [], [(0,)]), ("copy", [(3,)], [(3,), (3,)])],
)
def test_configure_rejects_outputs_that_do_not_match(name, ins, outs):
    spec = K.get_kernel(name)
    err = _spec_error(spec.configure, ins, outs, spec.resolve_params({}))
    assert err.where.startswith("out")


def test_inferred_shapes():
    p = {}
    assert K.get_kernel("fill").infer([], p) == [None]
    assert K.get_kernel("matmul").infer([(2, 3), [3, 5]], p) == [(2, 5)]
    assert K.get_kernel("reduce_sum").infer([(7,)], p) == [(1,)]
    assert K.get_kernel("reduce_sum").infer([(2, 3, 7)], p) == [(2, 3)]
    assert K.get_kernel("softmax").infer([(2, 3, 7)], p) == [(2, 3, 7)]
    assert K.get_kernel("axpy").infer([(4, 1), (4, 1)], p) == [(4, 1)]
    assert K.get_kernel("spin").infer([], {"us": 1}) == []


@pytest.mark.parametrize(
    ("name", "given", "where"),
    [
        ("axpy", {"beta": 1.0}, "params.beta"),
        ("add", {"alpha": 1.0}, "params.alpha"),
        ("axpy", {"alpha": float("nan")}, "params.alpha"),
        ("scale", {"factor": float("inf")}, "params.factor"),
        ("fill", {"value": 1e39}, "params.value"),  # overflows a CUDA float
        ("axpy", {"alpha": True}, "params.alpha"),
        ("axpy", {"alpha": "2"}, "params.alpha"),
        ("spin", {}, "params.us"),
        ("spin", {"us": -1}, "params.us"),
        ("spin", {"us": 1.5}, "params.us"),
        ("spin", {"us": False}, "params.us"),
        ("spin", {"us": 10_000_001}, "params.us"),
        ("layernorm", {"eps": -1e-3}, "params.eps"),
        ("latch", {}, "params.flag_ptr"),
        ("latch", {"flag_ptr": -1}, "params.flag_ptr"),
        ("latch", {"flag_ptr": 2**64}, "params.flag_ptr"),  # beyond numpy's ints
        ("axpy", {"alpha": 10**400}, "params.alpha"),  # float() overflows
        ("spin", {"us": 10**400}, "params.us"),
        ("spin", {"us": float("inf")}, "params.us"),
        ("spin", {"us": 1e300}, "params.us"),
        ("latch", {"flag_ptr": 1, "_release": threading.Event()}, "params._release"),
    ],
)
def test_bad_params_are_rejected(name, given, where):
    assert _spec_error(K.get_kernel(name).resolve_params, given).where == where


def test_params_defaults_and_coercion():
    assert K.get_kernel("axpy").resolve_params({}) == {"alpha": 1.0}
    assert K.get_kernel("scale").resolve_params({"factor": 2}) == {"factor": 2.0}
    assert K.get_kernel("fill").resolve_params(None) == {"value": 0.0}
    assert K.get_kernel("layernorm").resolve_params({"eps": 0}) == {"eps": 0.0}
    assert K.get_kernel("spin").resolve_params({"us": 2.0}) == {"us": 2}
    assert K.get_kernel("latch").resolve_params({"flag_ptr": 2**64 - 1}) == {
        "flag_ptr": 2**64 - 1, "timeout_us": 60_000_000}


# -- launch rules and CUDA signatures ----------------------------------------------------------
_CTYPE_OF = {"long long": ctypes.c_longlong, "float": ctypes.c_float,
             "double": ctypes.c_double, "unsigned long long": ctypes.c_ulonglong,
             "int": ctypes.c_int}


def _signature(spec, entry=None) -> list[str]:
    entry = entry or spec.entry
    m = re.search(rf'extern "C" __global__ void (?:__launch_bounds__\(\d+\)\s+)?'
                  rf'{entry}\(([^)]*)\)', spec.source)
    assert m, f"{spec.name}: no extern \"C\" __global__ {entry}"
    return [" ".join(a.split()[:-1]) for a in m.group(1).split(",") if a.strip()]


def _entries(spec) -> list[str]:
    return re.findall(r'extern "C" __global__ void (?:__launch_bounds__\(\d+\)\s+)?(\w+)\(',
                      spec.source)


def _example(name):
    """A launchable (in_shapes, out_shapes, params) for each kernel."""
    return {
        "fill": ([], [(5, 3)], {}), "matmul": ([(5, 7), (7, 3)], [(5, 3)], {}),
        "reduce_sum": ([(5, 7)], [(5,)], {}), "spin": ([], [], {"us": 25}),
        "latch": ([], [], {"flag_ptr": 0xDEAD000, "timeout_us": 7}),
        "add": ([(5,), (5,)], [(5,)], {}), "mul": ([(5,), (5,)], [(5,)], {}),
        "axpy": ([(5,), (5,)], [(5,)], {"alpha": 2.0}),
    }.get(name, ([(5, 7)], [(5, 7)], {}))


@pytest.mark.parametrize("name", FLOAT_KERNELS)
def test_configure_matches_the_cuda_signature(name):
    spec = K.get_kernel(name)
    ins, outs, params = _example(name)
    cfg = spec.configure(ins, outs, spec.resolve_params(params))
    args = _signature(spec)
    assert len(args) == spec.n_in + spec.n_out + len(cfg.scalars)
    assert args[:spec.n_in] == ["const float*"] * spec.n_in
    assert args[spec.n_in:spec.n_in + spec.n_out] == ["float*"] * spec.n_out
    for arg, (value, ctype) in zip(args[spec.n_in + spec.n_out:], cfg.scalars, strict=True):
        want = ctypes.c_ulonglong if arg.endswith("*") else _CTYPE_OF[arg]
        assert ctype is want, (arg, ctype)
        ctype(value)  # marshals
    for entry in _entries(spec):  # a launch may pick any entry: the same parameters
        assert _signature(spec, entry) == args, entry


@pytest.mark.parametrize("name", ["softmax", "layernorm", "reduce_sum"])
def test_row_kernels_pick_their_long_entry_by_row_length(name):
    """Rows of LONG_ROW_COLS columns or more go to sl_<name>_long (float4 loads), shorter ones
    to the plain entry, whose register budget lets an SM hold twice the warps."""
    from streamlane.kernels._common import LONG_ROW_COLS, WIDE_BLOCK_COLS

    spec = K.get_kernel(name)
    assert _entries(spec) == [spec.entry, f"{spec.entry}_long"]
    params = spec.resolve_params(None)
    cases = [(8, None, (32, 8, 1)), (LONG_ROW_COLS - 1, None, (256, 1, 1)),
             (LONG_ROW_COLS, f"{spec.entry}_long", (256, 1, 1)),
             (WIDE_BLOCK_COLS + 1, f"{spec.entry}_long", (1024, 1, 1))]
    for cols, entry, block in cases:
        shape = (3, cols)
        cfg = spec.configure([shape], spec.infer([shape], params), params)
        assert (cfg.entry, cfg.block) == (entry, block), cols


@pytest.mark.parametrize(
    ("name", "ins", "outs"),
    [("copy", [(1 << 40,)], [(1 << 40,)]), ("fill", [], [(1,)]),
     ("add", [(3, 1 << 20), (3, 1 << 20)], [(3, 1 << 20)]),
     ("matmul", [(1 << 22, 1), (1, 1 << 22)], [(1 << 22, 1 << 22)]),
     ("matmul", [(1, 1), (1, 1)], [(1, 1)]),
     ("softmax", [(1 << 20, 1 << 4, 5)], [(1 << 20, 1 << 4, 5)]),
     ("layernorm", [(3, 1 << 20)], [(3, 1 << 20)]), ("reduce_sum", [(1,)], [(1,)])],
)
def test_launch_dims_stay_in_cuda_limits(name, ins, outs):
    cfg = K.get_kernel(name).configure(ins, outs, K.get_kernel(name).resolve_params({}))
    gx, gy, gz = cfg.grid
    assert 1 <= gx <= 2**31 - 1 and 1 <= gy <= 65535 and 1 <= gz <= 65535
    assert math.prod(cfg.block) <= 1024 and all(b >= 1 for b in cfg.block)
    if name in ROWS:
        assert cfg.block[0] % 32 == 0  # the block reductions shuffle across whole warps


@pytest.mark.parametrize("name", ROWS)
def test_row_kernels_give_short_rows_a_warp_and_long_rows_a_block(name):
    spec = K.get_kernel(name)

    def cfg(shape):
        outs = spec.infer([shape], spec.resolve_params({}))
        return spec.configure([shape], outs, spec.resolve_params({}))

    assert cfg((1000, 64)).block == (32, 8, 1) and cfg((1000, 64)).grid == (125, 1, 1)
    assert cfg((3, 1001, 256)).grid == (376, 1, 1)  # 3003 rows of 256: a warp each
    assert cfg((10, 257)).block == (256, 1, 1) and cfg((10, 257)).grid == (10, 1, 1)
    assert cfg((10**6, 3)).grid == (65535, 1, 1)  # the rest by the grid-stride loop
    assert cfg((10**6, 3)).scalars[:2] == ((10**6, ctypes.c_longlong), (3, ctypes.c_longlong))


def test_control_kernels_launch_one_thread():
    spin = K.get_kernel("spin")
    cfg = spin.configure([], [], spin.resolve_params({"us": 25}))
    assert cfg.grid == (1, 1, 1) and cfg.block == (1, 1, 1)
    assert cfg.scalars == ((25_000, ctypes.c_ulonglong),)
    latch = K.get_kernel("latch")
    cfg = latch.configure([], [], latch.resolve_params({"flag_ptr": 4096, "timeout_us": 7}))
    assert cfg.grid == (1, 1, 1)
    assert cfg.scalars == ((4096, ctypes.c_ulonglong), (7000, ctypes.c_ulonglong))


def test_latch_needs_a_flag_or_a_release_event():
    latch = K.get_kernel("latch")
    p = latch.resolve_params({"flag_ptr": 0})
    assert _spec_error(latch.configure, [], [], p).where == "params.flag_ptr"
    latch.configure([], [], {**p, "_release": threading.Event()})  # the host device's way


# -- control kernels' host twins ---------------------------------------------------------------
def test_spin_host_twin_sleeps_about_us():
    spin = K.get_kernel("spin")
    t0 = time.perf_counter()
    spin.host([], [], spin.resolve_params({"us": 30_000}))
    elapsed = time.perf_counter() - t0
    assert 0.029 <= elapsed < 0.5
    assert spin.reference([], {"us": 30_000}) == []


def test_latch_host_twin_holds_until_released():
    latch = K.get_kernel("latch")
    release = threading.Event()
    params = {**latch.resolve_params({"flag_ptr": 0}), "_release": release}
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (latch.host([], [], params), done.set()))
    waiter.start()
    try:
        assert not done.wait(0.1), "the latch opened before release"
        release.set()
        assert done.wait(5), "the latch did not open on release"
    finally:
        release.set()
        waiter.join(5)
    assert latch.reference([], params) == []


def test_latch_host_twin_opens_on_timeout():
    latch = K.get_kernel("latch")
    params = {**latch.resolve_params({"flag_ptr": 0, "timeout_us": 50_000}),
              "_release": threading.Event()}
    t0 = time.perf_counter()
    latch.host([], [], params)
    assert 0.045 <= time.perf_counter() - t0 < 2


def test_latch_host_twin_without_release_fails_fast():
    latch = K.get_kernel("latch")
    err = _spec_error(latch.host, [], [], latch.resolve_params({"flag_ptr": 0}))
    assert err.where == "params._release"


@pytest.mark.parametrize("make", [
    lambda a: a.T,
    lambda a: a[::2, 1::3],
    lambda a: np.asfortranarray(a),
    lambda a: a.reshape(4, 6, 5).transpose(2, 0, 1)[:, 1:, ::2],
], ids=["transpose", "slices", "fortran", "3d"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int8, np.float16])
def test_strided_copy_gathers_any_layout_into_c_order(make, dtype):
    spec = K.get_kernel("strided_copy")
    base = (np.random.default_rng().standard_normal((24, 5)) * 50).astype(dtype)
    view = make(base)
    root = view
    while isinstance(root.base, np.ndarray):  # the array that owns the memory
        root = root.base
    offset = view.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    raw = root.reshape(-1, order="A").view(np.uint8)[offset:]  # bytes from the first element
    meta = np.array([*view.shape, *view.strides], np.int64)
    params = spec.resolve_params({"n": view.size, "rank": view.ndim,
                                  "itemsize": view.itemsize})
    (shape,) = spec.infer([raw.shape, meta.shape], params)
    out = np.full(shape, 0xAB, np.uint8)
    spec.host([raw, meta], [out], params)
    np.testing.assert_array_equal(out.view(dtype).reshape(view.shape), view)
    config = spec.configure([raw.shape, meta.shape], [shape], params)
    assert config.scalars[0][0] == view.size and len(config.scalars) == 3


def test_strided_copy_checks_its_meta():
    spec = K.get_kernel("strided_copy")
    params = spec.resolve_params({"n": 6, "rank": 2, "itemsize": 4})
    with pytest.raises(K.KernelSpecError, match="meta"):
        spec.infer([(24,), (3,)], params)
    with pytest.raises(K.KernelSpecError):
        spec.resolve_params({"n": 6, "rank": 9, "itemsize": 4})


def test_strided_copy_configure_matches_its_cuda_signature():
    spec = K.get_kernel("strided_copy")
    params = spec.resolve_params({"n": 10, "rank": 2, "itemsize": 4})
    cfg = spec.configure([(40,), (4,)], [(40,)], params)
    args = _signature(spec)
    assert args[:3] == ["const unsigned char*", "const long long*", "unsigned char*"]
    assert [ctype for _, ctype in cfg.scalars] == [_CTYPE_OF[a] for a in args[3:]]
    assert [value for value, _ in cfg.scalars] == [10, 2, 4]

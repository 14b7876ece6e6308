"""Tests written in a mutation round on the kernel library (kernels/): each one failed on a
mutant that the rest of the suite let through, and passes on the unmodified code. Expected
values come from first principles (float64 numpy math, shapes, the CUDA signature), never from
the library's own references. Host device everywhere; CUDA too where a GPU is usable."""

from __future__ import annotations

import ctypes
import dataclasses
import math
import re

import numpy as np
import pytest

import streamlane.kernels as K
import streamlane.kernels.compile as compile_mod


def _launch(device, name, ins, params=None):
    spec = K.get_kernel(name)
    s = device.per_thread_stream()
    outs = spec.infer([a.shape for a in ins], spec.resolve_params(params))
    d_ins = [device.to_device(np.ascontiguousarray(a, np.float32), s) for a in ins]
    d_outs = [device.to_device(np.full(o, np.nan, np.float32), s) for o in outs]
    device.launch(name, s, d_ins, d_outs, params)
    return [device.to_host(o, s) for o in d_outs]


# -- numerics ------------------------------------------------------------------------------------
def test_relu_keeps_nan(device):
    """relu's doc: 'NaN stays NaN' (as np.maximum and torch). Mutant: np.fmax, which drops it."""
    x = np.array([np.nan, -1.0, 0.5, -np.inf, np.inf], np.float32)
    (got,) = _launch(device, "relu", [x])
    assert np.isnan(got[0])
    assert got[1:].tolist() == [0.0, 0.5, 0.0, np.inf]


def test_softmax_is_shift_invariant_per_row_on_large_inputs(device):
    """softmax(x + c) == softmax(x), for each row with its own c. Mutants: no max-subtraction
    (exp(1000) overflows: NaN), one max for the whole tensor (the small row underflows: NaN)."""
    base = np.array([0.0, 1.0, 2.0, -3.0])
    want = np.exp(base) / np.exp(base).sum()  # small values: no overflow either way
    x = np.stack([base + 1000.0, base - 1000.0, base, base + 88.0]).astype(np.float32)
    (got,) = _launch(device, "softmax", [x])
    assert np.isfinite(got).all(), got
    np.testing.assert_allclose(got, np.broadcast_to(want, x.shape), rtol=1e-6, atol=1e-9)


def test_layernorm_adds_eps_to_the_variance():
    """(x - mean) / sqrt(var + eps), biased variance. With eps = 1 the placement of eps shows.
    Mutant: d / (sqrt(var) + eps). Host twin and float64 reference both."""
    x = np.array([[1.0, 2.0, 3.0], [-4.0, 0.0, 10.0]])
    eps = 1.0
    mean = x.sum(axis=1, keepdims=True) / 3
    var = ((x - mean) ** 2).sum(axis=1, keepdims=True) / 3  # 2/3 for the first row
    want = (x - mean) / np.sqrt(var + eps)
    assert np.allclose(want[0], np.array([-1.0, 0.0, 1.0]) / math.sqrt(2 / 3 + 1))
    spec = K.get_kernel("layernorm")
    p = spec.resolve_params({"eps": eps})
    out = np.empty(x.shape, np.float32)
    spec.host([x.astype(np.float32)], [out], p)
    np.testing.assert_allclose(out, want, rtol=1e-6)
    np.testing.assert_allclose(spec.reference([x], p)[0], want, rtol=1e-12)


def test_layernorm_default_eps_is_1e_5(device):
    """README: layernorm takes eps (default 1e-5). A row with a variance near eps shows which
    eps ran. Mutant: the default 1e-6."""
    assert K.get_kernel("layernorm").resolve_params({}) == {"eps": 1e-5}
    x = np.array([[0.0, 1e-3]], np.float32)
    xd = x.astype(np.float64)
    d = xd - xd.mean()
    want = d / np.sqrt((d * d).mean() + 1e-5)  # +-0.156; with 1e-6 it would be +-0.447
    (got,) = _launch(device, "layernorm", [x])  # no params: the default
    np.testing.assert_allclose(got, want, rtol=1e-5)


# -- launch configuration ------------------------------------------------------------------------
def test_matmul_passes_m_k_n_in_the_order_of_its_cuda_signature():
    """The scalars follow the pointers in the order the CUDA kernel declares them (m, k, n),
    with m, k, n read off a[m,k] and b[k,n]. Mutant: (m, n, k), whose types all match (long
    long) so the signature test passed; on a GPU non-square products came out wrong."""
    spec = K.get_kernel("matmul")
    m, k, n = 5, 7, 3
    cfg = spec.configure([(m, k), (k, n)], [(m, n)], spec.resolve_params({}))
    params = re.search(r"sl_matmul\(([^)]*)\)", spec.source).group(1).split(",")
    names = [p.split()[-1] for p in params]
    assert names[3:] == ["m", "k", "n"]
    by_name = {"m": m, "k": k, "n": n}
    assert [v for v, _ in cfg.scalars] == [by_name[x] for x in names[3:]]


def test_latch_timeout_accepted_always_fits_the_kernels_u64_nanoseconds():
    """timeout_us reaches the kernel as timeout_us * 1000 in an unsigned long long, which
    ctypes wraps silently past 2**64. Mutant: the bound raised to 2**64 - 1 (a timeout that
    wraps to a few ns: the latch opens at once)."""
    latch = K.get_kernel("latch")
    most = latch.params["timeout_us"].maximum
    cfg = latch.configure([], [], latch.resolve_params({"flag_ptr": 4096, "timeout_us": most}))
    ns = cfg.scalars[1][0]
    assert ns == most * 1000 < 2**64 and ctypes.c_ulonglong(ns).value == ns
    for us in (2**64 // 1000 + 1, 2**63):
        with pytest.raises(K.KernelSpecError) as info:
            latch.resolve_params({"flag_ptr": 4096, "timeout_us": us})
        assert info.value.where == "params.timeout_us"


# -- params --------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), np.float64("nan")])
def test_a_non_finite_value_for_an_int_param_is_a_kernel_spec_error(bad):
    """spin's us = NaN (JSON allows NaN) must be the typed error naming params.us, never a
    bare ValueError from int(nan). Mutant: the finiteness check reordered behind is_integer."""
    with pytest.raises(K.KernelSpecError) as info:
        K.get_kernel("spin").resolve_params({"us": bad})
    assert info.value.where == "params.us"


# -- the cubin cache -----------------------------------------------------------------------------
def test_cache_key_covers_the_nvrtc_version(monkeypatch, tmp_path):
    """A cubin from another NVRTC may not load (or differ): the version is part of the key.
    Mutant: the version left out of the key."""
    cache = K.KernelCache(tmp_path)
    add = K.get_kernel("add")
    monkeypatch.setattr(compile_mod, "nvrtc_version", lambda: (12, 4))
    old = cache.key(add, "sm_90")
    monkeypatch.setattr(compile_mod, "nvrtc_version", lambda: (13, 0))
    assert cache.key(add, "sm_90") != old
    assert cache.key(add, "sm_90") == K.KernelCache(tmp_path / "x").key(add, "sm_90")


def test_cache_key_parts_do_not_run_together(monkeypatch, tmp_path):
    """source "...AB" + entry "C" and source "...A" + entry "BC" are different kernels.
    Mutant: the parts hashed one after another without their lengths (the same bytes)."""
    monkeypatch.setattr(compile_mod, "nvrtc_version", lambda: (12, 8))
    cache = K.KernelCache(tmp_path)
    add = K.get_kernel("add")
    one = dataclasses.replace(add, source="extern AB", entry="C")
    two = dataclasses.replace(add, source="extern A", entry="BC")
    assert cache.key(one, "sm_90") != cache.key(two, "sm_90")


def test_an_edited_source_of_the_same_kernel_is_never_served_from_memory(monkeypatch, tmp_path):
    """One KernelCache, two specs of one name and entry but different sources (an edited
    kernel): each gets its own cubin. Mutant: the in-memory memo keyed by (name, arch,
    options), which served the first source's cubin for the second."""
    monkeypatch.setattr(compile_mod, "nvrtc_version", lambda: (12, 8))
    monkeypatch.setattr(compile_mod, "compile_source",
                        lambda source, entry, arch, options=(), name="k": b"cubin:" +
                        source.encode())
    cache = K.KernelCache(tmp_path)
    add = K.get_kernel("add")
    edited = dataclasses.replace(add, source=add.source + "\n// edited\n")
    assert cache.get_or_compile(add, "sm_90") == b"cubin:" + add.source.encode()
    assert cache.get_or_compile(edited, "sm_90") == b"cubin:" + edited.source.encode()
    assert cache.get_or_compile(add, "sm_90") == b"cubin:" + add.source.encode()


def test_an_entry_larger_than_the_limit_is_a_miss_even_when_whole(monkeypatch, tmp_path):
    """Anything over MAX_ENTRY_BYTES is a miss, never read (a sparse multi-GiB file would be
    read whole). Mutant: the size check dropped, so a whole entry past the limit was
    returned. The limit is lowered here so the test stays small."""
    cache = K.DiskCache(tmp_path)
    cache.put("small", b"s" * 100)
    cache.put("big", b"b" * 8192)  # whole and valid: only its size is wrong
    monkeypatch.setattr(compile_mod, "MAX_ENTRY_BYTES", 4096)
    assert cache.get("small") == b"s" * 100
    assert cache.get("big") is None
    assert cache.get_or_build("big", lambda: b"rebuilt") == b"rebuilt"

"""Every kernel through the runtime's launch path, on every device (host everywhere, CUDA where
a GPU is usable): fresh random data each run, outputs poisoned with NaN, float64 references,
odd sizes (1, primes, non-multiples of the matmul tile)."""

from __future__ import annotations

import secrets

import numpy as np
import pytest

from streamlane.kernels import get_kernel

# Relative error bounds (METHOD.md: float32 arithmetic lands far under 1e-3). Reductions and
# matmul accumulate in float32 over up to ~1000 terms; elementwise kernels round once or twice.
CASES = {
    "copy": ([(1,)], {}, 0.0), "fill": ([], {"value": -2.5}, 0.0),
    "add": ([(1009,), (1009,)], {}, 1e-6), "mul": ([(257, 3), (257, 3)], {}, 1e-6),
    "axpy": ([(4099,), (4099,)], {"alpha": 0.37}, 1e-6), "scale": ([(13, 7)], {"factor": -3.0},
                                                                   1e-6),
    "relu": ([(1000,)], {}, 0.0), "gelu": ([(31, 37)], {}, 1e-5),
    "matmul": ([(1, 1), (1, 1)], {}, 1e-5),
    "softmax": ([(7, 1001)], {}, 1e-5), "layernorm": ([(13, 257)], {"eps": 1e-5}, 1e-5),
    "reduce_sum": ([(17, 999)], {}, 1e-5),
}
MATMULS = [((1, 1), (1, 1)), ((7, 13), (13, 5)), ((17, 33), (33, 19)), ((129, 257), (257, 31))]


def run_kernel(device, name, shapes, params, out_shape=None, seed=None):
    rng = np.random.default_rng(seed)
    spec = get_kernel(name)
    s = device.per_thread_stream()
    ins = [rng.standard_normal(sh).astype(np.float32) for sh in shapes]
    resolved = spec.resolve_params(params)
    outs = [o if o is not None else out_shape for o in spec.infer(shapes, resolved)]
    d_ins = [device.to_device(a, s) for a in ins]
    d_outs = [device.to_device(np.full(o, np.nan, np.float32), s) for o in outs]
    device.launch(name, s, d_ins, d_outs, params)
    got = [device.to_host(o, s) for o in d_outs]
    want = [np.broadcast_to(r, g.shape) for r, g in
            zip(spec.reference([a.astype(np.float64) for a in ins], resolved), got, strict=True)]
    return got, want


def rel_err(got, want):
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@pytest.mark.parametrize("name", sorted(CASES))
def test_every_kernel_matches_its_float64_reference(device, name):
    shapes, params, tol = CASES[name]
    seed = secrets.randbits(32)
    got, want = run_kernel(device, name, shapes, params, out_shape=(11, 3), seed=seed)
    for g, w in zip(got, want, strict=True):
        assert np.isfinite(g).all(), f"{name}: an output element was never written (seed {seed})"
        assert rel_err(g, w) <= tol, f"{name}: error {rel_err(g, w):.2e} (seed {seed})"


@pytest.mark.parametrize("a,b", MATMULS, ids=[f"{a[0]}x{a[1]}x{b[1]}" for a, b in MATMULS])
def test_matmul_at_odd_sizes(device, a, b):
    seed = secrets.randbits(32)
    (got,), (want,) = run_kernel(device, "matmul", [a, b], {}, seed=seed)
    assert np.isfinite(got).all()
    assert rel_err(got, want) <= 1e-5, f"seed {seed}"


def test_layernorm_of_rows_far_from_zero(device):
    """A float32 sum of a row at 10000.3 rounds, and (x - mean) / sqrt(var + eps) magnifies
    the rounding (0.5 for a constant row, where the answer is 0). Summing relative to the
    row's first element makes a constant row exact and keeps an offset row's precision."""
    s = device.per_thread_stream()
    rng = np.random.default_rng(7)
    constant = np.array([np.full(1000, 10000.3), np.full(1000, 1000.1), np.full(1000, -7e5)],
                        np.float32)
    offset = (1e4 + rng.standard_normal((5, 999))).astype(np.float32)
    for x, exact in ((constant, True), (offset, False)):
        d_in = device.to_device(x, s)
        d_out = device.to_device(np.full(x.shape, np.nan, np.float32), s)
        device.launch("layernorm", s, [d_in], [d_out], {"eps": 1e-5})
        got = device.to_host(d_out, s)
        want = get_kernel("layernorm").reference([x.astype(np.float64)], {"eps": 1e-5})[0]
        if exact:
            np.testing.assert_array_equal(got, np.zeros_like(x))
        else:
            assert rel_err(got, want) <= 1e-4, rel_err(got, want)


def test_a_latch_is_launched_by_the_runtime_only_and_a_refusal_keeps_the_device(device):
    """``launch("latch", flag_ptr=...)`` used to be accepted: on the host device its numpy
    twin (which waits on a host-side event) then failed on the stream's worker and the device
    was lost for the rest of the process; on CUDA the kernel read whatever address it was given
    (0x1234: an illegal address, the context lost). The latch is the runtime's to launch, as
    ``strided_copy`` is: ``launch`` and ``prepare`` refuse it saying what to use, and the
    device keeps working."""
    from streamlane.runtime.errors import InvalidArgument

    s = device.create_stream()
    try:
        for flag in (5, 0x1234, 2**40):
            with pytest.raises(InvalidArgument, match=r"runtime only.*create_latch\(\)"):
                device.launch("latch", s, [], [], {"flag_ptr": flag, "timeout_us": 1000})
            with pytest.raises(InvalidArgument, match=r"runtime only.*create_latch\(\)"):
                device.prepare("latch", [], [], {"flag_ptr": flag})
        with pytest.raises(InvalidArgument, match="unknown kernel") as unknown:
            device.prepare("latchh", [], [])
        assert "latch," not in str(unknown.value) and "strided_copy" not in str(unknown.value)
        assert "relu" in str(unknown.value)
        s.synchronize()
        assert not device.lost
        with device.create_latch() as latch:  # the way to hold a stream
            latch.hold(s)
            x = device.to_device(np.ones(4, np.float32), s)
            latch.release()
        assert device.to_host(x, s).tolist() == [1.0] * 4
    finally:
        s.close()

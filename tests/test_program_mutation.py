"""Tests written for the survivors of a mutation round on the program format and builder, the
method's input/output state machine, Result and DLPack (host device; each well under 2 s)."""

from __future__ import annotations

import ctypes
import io
import json
import zipfile

import ml_dtypes
import numpy as np
import pytest

from streamlane.runtime import CallerStream, Program, Result, get_device
from streamlane.runtime.errors import InvalidArgument, InvalidInput, InvalidProgram, InvalidState

GIB = 1 << 30
W = np.arange(16 * 16, dtype=np.float32).reshape(16, 16) / 256


@pytest.fixture
def host():
    dev = get_device("host")
    yield dev
    dev.synchronize()


def relu_program(n=8):
    b = Program.build("r")
    m = b.method("f", x=("float32", [n]))
    m.output(m.step("relu", "x", out="y"))
    return b.finish()


def method_doc(inputs, steps, outputs, buffers=()):
    return {"format": 1, "name": "p",
            "methods": {"forward": {"inputs": list(inputs), "buffers": list(buffers),
                                    "steps": list(steps), "outputs": list(outputs)}}}


def t(name, shape, dtype="float32"):
    return {"name": name, "dtype": dtype, "shape": list(shape)}


def load_error(tmp_path, doc):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(InvalidProgram) as info:
        Program.load(path)
    return info.value


SPIN = {"kernel": "spin", "in": [], "out": [], "params": {"us": 1}}


# -- format 1: validation -------------------------------------------------------------------

def test_format_0_is_refused_at_format(tmp_path):  # P08
    doc = method_doc([t("x", [4])], [{"kernel": "relu", "in": ["x"], "out": ["y"]}],
                     [t("y", [4])])
    doc["format"] = 0
    assert load_error(tmp_path, doc).path == "format"


def test_a_tensor_over_4_gib_is_refused_at_its_shape(tmp_path):  # P06
    # 8 GiB: over the per-tensor limit, under the method's (16 GiB)
    err = load_error(tmp_path, method_doc([t("x", [GIB, 2])], [SPIN], []))
    assert err.path == "methods.forward.inputs[0].shape"


def test_a_method_planning_over_16_gib_is_refused(tmp_path):  # P09
    # five tensors of exactly 4 GiB each (each allowed): 20 GiB in all
    err = load_error(tmp_path, method_doc([t(f"x{i}", [GIB]) for i in range(5)], [SPIN], []))
    assert err.path == "methods.forward"


def test_a_method_without_steps_is_refused(tmp_path):  # P10
    err = load_error(tmp_path, method_doc([t("x", [4])], [], []))
    assert err.path == "methods.forward.steps"


def test_a_step_writing_into_an_input_is_refused(tmp_path):  # P15
    doc = method_doc([t("x", [4])], [{"kernel": "relu", "in": ["x"], "out": ["y"]},
                                     {"kernel": "relu", "in": ["y"], "out": ["x"]}],
                     [t("y", [4])])
    err = load_error(tmp_path, doc)
    assert err.path == "methods.forward.steps[1].out[0]"


def test_a_kernel_dtype_error_names_the_tensor_index(tmp_path):  # P17
    doc = method_doc([t("a", [4]), t("b", [4], "int32")],
                     [{"kernel": "add", "in": ["a", "b"], "out": ["y"]}], [t("y", [4])])
    assert load_error(tmp_path, doc).path == "methods.forward.steps[0].in[1]"


def test_an_npz_member_with_bytes_beyond_its_header_is_refused(tmp_path):  # P24
    doc = method_doc([t("x", [4, 16])], [{"kernel": "matmul", "in": ["x", "w1"], "out": ["y"]}],
                     [t("y", [4, 16])])
    doc["constants"] = "p.npz"
    npy = io.BytesIO()
    np.save(npy, W)
    with zipfile.ZipFile(tmp_path / "p.npz", "w") as z:
        z.writestr("w1.npy", npy.getvalue() + b"\0" * 8)
    err = load_error(tmp_path, doc)
    assert err.path == "constants['w1']"


# -- set_inputs / execute / get_outputs -----------------------------------------------------

def test_too_few_inputs_is_a_count_error_that_keeps_the_previous_inputs(host):  # M02
    m = relu_program().method("f", device=host)
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    m.set_inputs([x])
    with pytest.raises(InvalidInput) as info:
        m.set_inputs([])
    assert info.value.index is None and info.value.method == "r.f"
    m.execute()  # the previous inputs are intact
    np.testing.assert_array_equal(m.get_outputs()[0].to_host(), np.maximum(x, 0))


def test_an_int_scalar_below_its_range_is_an_invalid_input(host):  # M14
    def copy(stream, ins, outs):
        outs[0][...] = ins[0]

    b = Program.build("s")
    m = b.method("f", n=("int32", []))
    m.output(*m.call(copy, ["n"], [("y", "int32", [])]))
    meth = b.finish().method("f", device=host)
    for bad in (-(2 ** 31) - 1, np.int64(-(2 ** 40))):
        with pytest.raises(InvalidInput) as info:  # the message says the range it missed
            meth.set_inputs([bad])
        assert info.value.index == 0 and "-2147483648..2147483647" in str(info.value)
    with pytest.raises(InvalidState):
        meth.execute()


def test_an_input_is_read_as_it_was_when_the_call_returned(host):  # H01
    m = relu_program().method("f", device=host)
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    want = np.maximum(x, 0)
    with host.create_latch() as latch, host.create_stream() as s, CallerStream(s):
        latch.hold(s)  # nothing on s runs until released
        (y,) = m([x])
        x[:] = 100.0  # m(x) returned: the caller may change x
        latch.release()
        np.testing.assert_array_equal(y.to_host(), want)


# -- Result -----------------------------------------------------------------------------------

def test_from_host_copies_the_array_at_once(host):  # H01
    a = np.arange(6, dtype=np.float32)
    with host.create_latch() as latch, host.create_stream() as s, CallerStream(s):
        latch.hold(s)
        r = Result.from_host(a, host)
        a[:] = -1.0
        latch.release()
        np.testing.assert_array_equal(r.to_host(), np.arange(6, dtype=np.float32))


@pytest.mark.parametrize("dtype", ["int16", "uint32", "complex64"])
def test_from_host_refuses_a_dtype_results_do_not_have(host, dtype):  # R05
    with pytest.raises(InvalidArgument, match="not supported"):
        Result.from_host(np.zeros(3, dtype), host)


def test_to_host_returns_memory_of_its_own(host):  # R03
    m = relu_program().method("f", device=host)
    x = np.linspace(-1, 1, 8, dtype=np.float32)
    (y,) = m([x])
    first = y.to_host()
    first[:] = 42.0
    np.testing.assert_array_equal(y.to_host(), np.maximum(x, 0))
    # and the output's buffers are reused later: what to_host gave stays as it was
    kept = y.to_host()
    del y
    for _ in range(3):
        m([x + 5])
    np.testing.assert_array_equal(kept, np.maximum(x, 0))


def test_repr_says_pending_until_the_work_is_done(host):  # R06
    m = relu_program().method("f", device=host)
    x = np.ones(8, np.float32)
    with host.create_latch() as latch, host.create_stream() as s, CallerStream(s):
        latch.hold(s)
        (y,) = m([x])
        assert "pending" in repr(y) and "ready" not in repr(y)
        latch.release()
        y.to_host()
        assert "ready" in repr(y)
    assert repr(y).startswith("<Result float32[8] on host")


def test_from_host_of_a_view_result_is_a_copy_the_next_execute_leaves_alone(host):  # R12
    m = relu_program().method("f", device=host, clone_outputs=False)
    x1 = np.linspace(-1, 1, 8, dtype=np.float32)
    (view,) = m([x1])
    kept = Result.from_host(view, host)
    assert kept is not view
    m([x1 + 10])  # rewrites the view in place
    np.testing.assert_array_equal(kept.to_host(), np.maximum(x1, 0))


class _Capsule:
    """Hands numpy a capsule made beforehand (a DLPack producer's export, consumed once)."""

    def __init__(self, capsule):
        self.capsule = capsule

    def __dlpack__(self, **kwargs):
        return self.capsule

    def __dlpack_device__(self):
        return (1, 0)


def test_dlpack_copy_true_gives_the_consumer_memory_of_its_own(host):  # R07
    (y,) = relu_program().method("f", device=host)([np.ones(8, np.float32)])
    zero_copy = np.from_dlpack(_Capsule(y.__dlpack__()))
    copied = np.from_dlpack(_Capsule(y.__dlpack__(copy=True)))
    assert not np.shares_memory(zero_copy, copied)
    np.testing.assert_array_equal(copied, np.ones(8, np.float32))


# -- DLPack in: a strided host bfloat16 tensor ------------------------------------------------

class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


# our own prototype: setting argtypes on ctypes.pythonapi's would change it for everyone
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 ctypes.c_void_p)(("PyCapsule_New", ctypes.pythonapi))


class _StridedBF16:
    """A host bfloat16 DLPack producer (as torch's ``x.t()`` is): strides in elements."""

    def __init__(self, base: np.ndarray, shape, strides):
        self.base = base
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        self.strides = (ctypes.c_int64 * len(strides))(*strides)
        self.managed = _DLManagedTensor()
        self.managed.dl_tensor = _DLTensor(base.ctypes.data, _DLDevice(1, 0), len(shape),
                                           _DLDataType(4, 16, 1), self.shape, self.strides, 0)

    def __dlpack__(self, **kwargs):
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (1, 0)


def test_a_strided_host_bfloat16_tensor_comes_in_by_its_strides(host):  # D02
    base = np.arange(12, dtype=np.float32).astype(ml_dtypes.bfloat16).reshape(3, 4)
    producer = _StridedBF16(base, (4, 3), (1, 4))  # base.T
    r = Result.from_host(producer, host)
    assert r.dtype_name == "bfloat16" and r.shape == (4, 3)
    np.testing.assert_array_equal(r.to_host().astype(np.float32), base.T.astype(np.float32))


def test_a_builder_constant_is_copied_when_it_is_added():
    """``constant()`` keeps "an array, copied as it is now": a change made to the caller's
    array before ``finish()`` stays out of the program. It kept a reference, so the program
    took whatever the array held at ``finish()`` (found by the mutation round's reviewer)."""
    w = np.ones((2, 2), np.float32)
    b = Program.build("p", constants={"w": w})
    v = np.full(3, 2.0, np.float32)
    b.constant("v", v)
    m = b.method("f", x=("float32", [2, 2]))
    m.output(m.step("matmul", "x", "w", out="y"))
    w[:] = 5
    v[:] = 7
    program = b.finish()
    assert program.constants["w"].tolist() == [[1.0, 1.0], [1.0, 1.0]]
    assert program.constants["v"].tolist() == [2.0, 2.0, 2.0]
    assert not program.constants["w"].flags.writeable
    w[:] = 9  # and after finish(), as before
    assert b.finish().constants["w"].tolist() == [[1.0, 1.0], [1.0, 1.0]]

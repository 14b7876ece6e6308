"""The DLPack producer (the capsule streamlane builds for CUDA memory), exercised on host memory
with numpy as the consumer: layout of the structures, dtype codes, the deleter and the owner's
lifetime."""

from __future__ import annotations

import gc
import weakref

import ml_dtypes
import numpy as np
import pytest

from streamlane.runtime.dlpack import KDL_CPU, export, live_exports


class _Owner:
    pass


class _Exporter:
    def __init__(self, array: np.ndarray, owner: object):
        self.array = array
        self.owner = owner

    def __dlpack__(self, **kwargs):
        return export(self.array.ctypes.data, self.array.shape, self.array.dtype, KDL_CPU, 0,
                      self.owner)

    def __dlpack_device__(self):
        return (KDL_CPU, 0)


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64", "uint8",
                                   "int8", "bool"])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), ()])
def test_numpy_reads_the_capsule_zero_copy(dtype, shape):
    src = np.asarray((np.random.default_rng().standard_normal(shape) * 10).astype(dtype))
    owner = _Owner()
    got = np.from_dlpack(_Exporter(src, owner))
    assert got.shape == src.shape and got.dtype == src.dtype
    np.testing.assert_array_equal(got, src)
    if src.size:
        assert got.ctypes.data == src.ctypes.data


def test_owner_lives_until_the_consumer_lets_go():
    src = np.arange(12, dtype=np.float32)
    owner = _Owner()
    alive = weakref.ref(owner)
    before = live_exports()
    got = np.from_dlpack(_Exporter(src, owner))
    del owner
    gc.collect()
    assert alive() is not None, "the owner died while the consumer still holds the memory"
    assert live_exports() == before + 1
    del got
    gc.collect()
    assert alive() is None and live_exports() == before


def test_an_unconsumed_capsule_releases_its_owner():
    owner = _Owner()
    alive = weakref.ref(owner)
    before = live_exports()
    capsule = _Exporter(np.ones(3, np.float32), owner).__dlpack__()
    del owner
    assert live_exports() == before + 1
    del capsule
    gc.collect()
    assert alive() is None and live_exports() == before


def test_bfloat16_has_its_own_type_code():
    from streamlane.runtime import dlpack

    src = np.ones(4, ml_dtypes.bfloat16)
    capsule = export(src.ctypes.data, src.shape, src.dtype, KDL_CPU, 0, _Owner())
    managed = dlpack.DLManagedTensor.from_address(dlpack.capsule_pointer(capsule))
    assert (managed.dl_tensor.dtype.code, managed.dl_tensor.dtype.bits) == (4, 16)
    assert managed.dl_tensor.ndim == 1 and managed.dl_tensor.shape[0] == 4


def test_a_consumer_that_refuses_the_capsule_releases_its_owner():
    """numpy refuses bfloat16 and drops the capsule with its error already set; the capsule's
    destructor must still release the export (it held the buffer out of its pool for good)."""
    owner = _Owner()
    alive = weakref.ref(owner)
    before = live_exports()
    exporter = _Exporter(np.ones(4, ml_dtypes.bfloat16), owner)
    del owner
    for _ in range(3):
        with pytest.raises((RuntimeError, SystemError, TypeError, BufferError)):
            np.from_dlpack(exporter)
    assert live_exports() == before
    del exporter
    gc.collect()
    assert alive() is None


EXPORTS_HELD_TO_THE_END = """
import sys, numpy as np, ml_dtypes
from streamlane.runtime import get_device, Result
from streamlane.runtime.dlpack import KDL_CPU, export
dev = get_device("host")
memory = np.arange(4, dtype=np.float32)
class Export:
    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        return export(memory.ctypes.data, (4,), memory.dtype, KDL_CPU, 0, memory)
    def __dlpack_device__(self):
        return (KDL_CPU, 0)
class Cycle:
    pass
held = Cycle()
held.self = held
held.capsule = Result.from_host(np.ones(4, ml_dtypes.bfloat16), dev).__dlpack__()
held.array = np.from_dlpack(Export())
sys.held = (held.capsule, held.array,
            Result.from_host(np.ones(2, ml_dtypes.bfloat16), dev).__dlpack__())
print("exiting", float(held.array.sum()))
"""


def test_exports_held_until_the_interpreter_ends_do_not_crash_it():
    """A consumer may hold an export to the end (a tensor in a module global, a capsule in a
    reference cycle): its deleter then ran after the teardown had freed this module's ctypes
    callbacks and the DLManagedTensor they point at: exit status 139, every time."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "STREAMLANE_DEVICE": "host"}
    proc = subprocess.run([sys.executable, "-c", EXPORTS_HELD_TO_THE_END], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "exiting 6.0", proc
    assert "Exception ignored" not in proc.stderr, proc.stderr

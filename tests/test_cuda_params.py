"""The CUDA launcher's parameter block, checked without a GPU: the driver call is replaced by a
function that reads the block back the way cuLaunchKernel does (an array of pointers, one per
parameter, each pointing at that parameter's bytes)."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from streamlane.runtime import Event, InvalidArgument, get_device
from streamlane.runtime.cuda import (
    SPARE_EVENTS_MAX,
    CudaDevice,
    _bound,
    _BoundLaunch,
    _CudaEvent,
)


class _Driver:
    """Stands in for a CudaDevice: records what each launch would hand the driver."""

    def __init__(self) -> None:
        self._context = _bound.context  # already "current": no driver call
        self._plans: dict[int, tuple] = {}
        self.launches: list[tuple] = []
        self.types: tuple = ()

    def _cu_launch(self, fn, gx, gy, gz, bx, by, bz, shared, stream, argv_addr, extra):
        argv = (ctypes.c_void_p * len(self.types)).from_address(argv_addr)
        values = [ctype.from_address(argv[i]).value for i, ctype in enumerate(self.types)]
        self.launches.append(((gx, gy, gz), (bx, by, bz), shared, stream, values))
        return (0,)

    @property
    def _short(self):
        """The GIL-holding launch (Device.hold_gil): the same block, raw handles, an int back."""
        def launch(fn, gx, gy, gz, bx, by, bz, shared, stream, argv_addr, extra):
            assert isinstance(fn, int) and extra is None
            self._cu_launch(fn, gx, gy, gz, bx, by, bz, shared, stream, argv_addr, extra)
            return 0
        return SimpleNamespace(launch=launch)


def _bound_launch(kernel, in_shapes, params):
    prepared = get_device("host").prepare(kernel, in_shapes, None, params)
    fake = _Driver()
    plan = (_Function(), *CudaDevice._plan(fake, prepared)[1:])  # type: ignore[arg-type]
    fake.types = plan[-1]
    return fake, prepared, _BoundLaunch(fake, prepared, plan)  # type: ignore[arg-type]


STREAM = SimpleNamespace(_usable=lambda: "stream-impl", handle=0x2)


class _Function:
    """A stand-in CUfunction handle: int() gives its address, as cuda.bindings' does."""

    def __int__(self) -> int:
        return 0x1234


def arrays(*ptrs):
    """DeviceArrays holding only a pointer (the bound launcher reads nothing else, and takes
    nothing but DeviceArrays)."""
    from streamlane.runtime.memory import DeviceArray

    made = []
    for p in ptrs:
        a = DeviceArray.__new__(DeviceArray)
        a.ptr = p
        made.append(a)
    return made


@pytest.mark.parametrize("kernel, in_shapes, params", [
    ("axpy", [(10,), (10,)], {"alpha": -0.5}),
    ("layernorm", [(4, 6)], {}),
    ("matmul", [(3, 4), (4, 5)], {}),
    ("spin", [], {"us": 5}),
])
@pytest.mark.parametrize("hold_gil", [False, True], ids=["bindings", "gil-held"])
def test_pointers_per_call_and_scalars_once(kernel, in_shapes, params, hold_gil, monkeypatch):
    monkeypatch.setattr(_bound, "hold_gil", hold_gil)
    fake, prepared, bound = _bound_launch(kernel, in_shapes, params)
    spec, cfg = prepared.spec, prepared.config
    n = spec.n_in + spec.n_out
    scalars = [ctype(v).value for v, ctype in cfg.scalars]
    for base in (0x7F00_0000_0000, 0x7F00_1234_5600):  # new pointers each call, same block
        ptrs = [base + 256 * i for i in range(n)]
        bound(STREAM, arrays(*ptrs[:spec.n_in]), arrays(*ptrs[spec.n_in:]))
        grid, block, shared, stream, values = fake.launches[-1]
        assert (grid, block, shared) == (cfg.grid, cfg.block, cfg.shared_mem)
        assert stream == (0x2 if hold_gil else "stream-impl")
        assert values[:n] == ptrs
        assert values[n:] == scalars
    if kernel == "axpy":  # a float scalar keeps its float32 bytes in its slot
        assert values[n + 1] == np.float32(-0.5)


def test_wrong_number_of_arrays_is_refused_before_the_driver():
    fake, _, bound = _bound_launch("axpy", [(10,), (10,)], {"alpha": 1.0})
    with pytest.raises(InvalidArgument, match="takes 2 inputs and 1 outputs, got 1 and 1"):
        bound(STREAM, arrays(1), arrays(2))
    assert fake.launches == []


def test_a_dropped_event_handle_is_kept_for_reuse_without_a_driver_call():
    """Events die on any thread (the event loop's too): their handles go back to the device's
    spares instead of cuEventDestroy, and the next event of the kind takes one (no driver:
    this machine may have none, so any call would fail)."""
    spares: list = []
    handles = [_Function() for _ in range(3)]
    for h in handles:
        _CudaEvent(h, spares)  # dropped at once
    assert spares == handles
    fake = SimpleNamespace(_context=_bound.context, _spare_events={True: spares, False: []})
    impl = CudaDevice._new_event(fake, True)  # type: ignore[arg-type]
    assert impl.handle is handles[-1] and impl.spares is spares and len(spares) == 2
    event = Event(fake, impl, True)  # type: ignore[arg-type]
    # Never recorded: complete, and nothing to wait for, whatever the handle's old record.
    assert CudaDevice._event_query(fake, event) is True  # type: ignore[arg-type]
    assert CudaDevice._event_synchronize(fake, event) is None  # type: ignore[arg-type]
    assert CudaDevice._stream_wait(fake, None, event) is None  # type: ignore[arg-type]
    full = [object()] * SPARE_EVENTS_MAX
    _CudaEvent(_Function(), full)  # at the limit: destroyed (here the call fails, quietly)
    assert len(full) == SPARE_EVENTS_MAX

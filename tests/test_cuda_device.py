"""The CUDA device: streams, events, memory, kernels and interop on a real GPU (``-m cuda``),
plus what a machine without one must say."""

from __future__ import annotations

import dataclasses
import gc
import re
import threading
import time

import numpy as np
import pytest
from thread_helpers import in_thread

from streamlane.kernels import get_kernel
from streamlane.runtime import cuda, get_device
from streamlane.runtime.errors import (
    DeviceError,
    InvalidArgument,
    KernelCompileError,
    StreamClosed,
)


class _Handle:
    """The CUDA stream protocol around a raw handle (for libraries without it)."""

    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


# -- without a GPU ------------------------------------------------------------------------------
def test_forcing_cuda_without_a_gpu_raises_device_error_saying_why():
    reason = cuda.why_unusable()
    if reason is None:
        pytest.skip("a GPU is usable here")
    assert not cuda.usable()
    with pytest.raises(DeviceError) as info:
        get_device("cuda")
    assert reason in str(info.value)
    assert "get_device('host')" in str(info.value)


def test_check_raises_device_error_named_after_the_cuda_error():
    driver = pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(DeviceError) as info:
        cuda.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,))
    assert str(info.value).startswith("CUDA_ERROR_INVALID_VALUE: ")
    assert info.value.code == "CUDA_ERROR_INVALID_VALUE"
    success = driver.CUresult.CUDA_SUCCESS
    assert cuda.check((success,)) is None
    assert cuda.check((success, 7)) == 7
    assert cuda.check((success, 7, "x")) == (7, "x")


# -- on a GPU -------------------------------------------------------------------------------------
@pytest.mark.cuda
def test_check_explains_errors_with_the_driver_text(cuda_device):
    from cuda.bindings import driver

    with pytest.raises(DeviceError, match=r"^CUDA_ERROR_INVALID_VALUE: invalid argument"):
        cuda.check((driver.CUresult.CUDA_ERROR_INVALID_VALUE,))


@pytest.mark.cuda
def test_device_reports_arch_name_and_memory(cuda_device):
    assert re.fullmatch(r"sm_\d{2,3}", cuda_device.arch)
    assert cuda_device.device_name and "\0" not in cuda_device.device_name
    assert cuda_device.total_memory > 1 << 30
    assert cuda_device.device_name in repr(cuda_device)
    assert get_device("cuda:0") is cuda_device


@pytest.mark.cuda
def test_a_device_index_past_the_count_names_the_count(cuda_device):
    with pytest.raises(DeviceError, match=r"does not exist: the driver found \d+ device"):
        get_device("cuda:99")


@pytest.mark.cuda
def test_a_program_device_index_binds_that_gpu_or_names_the_count(cuda_device, monkeypatch):
    from streamlane.runtime import Program
    from streamlane.runtime.examples import load

    monkeypatch.delenv("STREAMLANE_DEVICE", raising=False)
    shipped = load("encoder")

    def placed(index):
        doc = {**shipped.to_manifest(), "device_index": index}
        return Program.from_manifest(doc, shipped.constants)

    assert placed(0).method("forward").device is cuda_device
    with pytest.raises(DeviceError, match=r"does not exist: the driver found \d+ device"):
        placed(99).method("forward")
    assert placed(99).method("forward", device=cuda_device).device is cuda_device


@pytest.mark.cuda
def test_per_thread_stream_differs_between_threads_and_is_one_object_per_thread(cuda_device):
    mine = cuda_device.per_thread_stream()
    assert cuda_device.per_thread_stream() is mine
    assert mine.kind == "per-thread" and mine.handle == 0x2
    assert mine.owner_thread == threading.get_ident()

    def other_thread():
        s = cuda_device.per_thread_stream()
        assert cuda_device.per_thread_stream() is s
        s.record().synchronize()  # a fresh thread gets the context made current by itself
        return s

    other = in_thread(other_thread)
    assert other is not mine and other != mine
    assert other.handle == mine.handle  # one handle, a different stream on every thread
    mine.record().synchronize()


@pytest.mark.cuda
def test_legacy_stream_is_one_object_shared_by_threads(cuda_device):
    legacy = cuda_device.legacy_stream()
    assert legacy.kind == "legacy" and legacy.handle == 0x1
    assert in_thread(cuda_device.legacy_stream) is legacy
    legacy.record().synchronize()
    assert cuda_device.wrap_stream(_Handle(0)) is legacy
    assert cuda_device.wrap_stream(_Handle(1)) is legacy
    assert cuda_device.wrap_stream(_Handle(2)) is cuda_device.per_thread_stream()


@pytest.mark.cuda
def test_created_stream_closes_once_even_with_work_queued(cuda_device):
    s = cuda_device.create_stream()
    assert s.kind == "owned" and s.handle not in (0, 1, 2)
    cuda_device.launch("spin", s, [], [], {"us": 2_000})
    s.close()  # CUDA releases it once its queued work is done
    s.close()
    assert s.closed
    with pytest.raises(StreamClosed):
        s.record()
    cuda_device.synchronize()


def _check_borrowed(device, foreign, handle, still_works):
    borrowed = device.wrap_stream(foreign)
    assert borrowed.kind == "foreign" and borrowed.handle == handle
    x = device.to_device(np.arange(32, dtype=np.float32), borrowed)
    device.launch("scale", borrowed, [x], [x], {"factor": 2.0})
    np.testing.assert_array_equal(device.to_host(x, borrowed), 2 * np.arange(32))
    borrowed.close()
    del borrowed
    gc.collect()
    still_works()  # the stream itself survives our wrapper


@pytest.mark.cuda
def test_torch_stream_is_borrowed_and_never_destroyed(cuda_device):
    torch = pytest.importorskip("torch")
    ts = torch.cuda.Stream()
    foreign = ts if hasattr(ts, "__cuda_stream__") else _Handle(ts.cuda_stream)

    def still_works():
        with torch.cuda.stream(ts):
            y = torch.ones(1000, device="cuda") * 3
        ts.synchronize()
        assert float(y.sum()) == 3000.0

    _check_borrowed(cuda_device, foreign, ts.cuda_stream, still_works)


@pytest.mark.cuda
def test_cupy_stream_is_borrowed_and_never_destroyed(cuda_device):
    cp = pytest.importorskip("cupy")
    cs = cp.cuda.Stream(non_blocking=True)
    foreign = cs if hasattr(cs, "__cuda_stream__") else _Handle(cs.ptr)

    def still_works():
        with cs:
            a = cp.arange(10)
            total = int(a.sum())
        cs.synchronize()
        assert total == 45

    _check_borrowed(cuda_device, foreign, cs.ptr, still_works)


@pytest.mark.cuda
def test_cuda_core_stream_is_borrowed_and_never_destroyed(cuda_device):
    core = pytest.importorskip("cuda.core")
    dev = core.Device(0)
    dev.set_current()
    cs = dev.create_stream()

    def still_works():
        cs.record().sync()

    _check_borrowed(cuda_device, cs, int(cs.handle), still_works)
    cs.close()


@pytest.mark.cuda
@pytest.mark.parametrize("bad", [(0, 1 << 64), (0, -1), (3, 1234), (0, "1234"), (0,)])
def test_bad_cuda_stream_objects_are_refused(cuda_device, bad):
    class Bad:
        def __cuda_stream__(self):
            return bad

    with pytest.raises(InvalidArgument, match="__cuda_stream__"):
        cuda_device.wrap_stream(Bad())


@pytest.fixture(params=[False, True], ids=["bindings", "gil-held"])
def short_calls(request, cuda_device):
    """Run the test's launches, records, queries and stream waits through cuda.bindings (GIL
    released) and through the GIL-holding short calls (``Device.hold_gil``)."""
    cuda_device.hold_gil(request.param)
    assert cuda._bound.hold_gil is request.param
    yield request.param
    cuda_device.hold_gil(False)


@pytest.mark.cuda
def test_holding_the_gil_is_per_thread_and_computes_the_same(cuda_device, short_calls):
    from streamlane.runtime import Program

    b = Program.build("axpy2")
    m = b.method("forward", x=("float32", [4096]), y=("float32", [4096]))
    m.output(m.step("axpy", "x", "y", out="z", alpha=3.0))
    method = b.finish().method("forward", device=cuda_device)
    x, y = (np.random.default_rng(i).standard_normal(4096).astype(np.float32) for i in (1, 2))
    for _ in range(3):
        np.testing.assert_allclose(method([x, y])[0].to_host(), 3 * x + y, rtol=1e-5, atol=1e-5)
    assert in_thread(lambda: cuda._bound.hold_gil) is False, "the setting leaked to a thread"


@pytest.mark.cuda
def test_event_record_query_synchronize_and_elapsed(cuda_device, short_calls):
    with cuda_device.create_stream() as s, cuda_device.create_latch() as latch:
        never = cuda_device.create_event()
        assert never.query() and not never.recorded  # never recorded counts as complete
        start = cuda_device.create_event(timing=True)
        end = cuda_device.create_event(timing=True)
        s.record(start)
        latch.hold(s)
        cuda_device.launch("spin", s, [], [], {"us": 20_000})
        s.record(end)
        assert start.recorded and end.recorded
        time.sleep(0.02)
        assert not end.query()
        with pytest.raises(InvalidArgument, match="completed"):
            start.elapsed_ms(end)
        latch.release()
        end.synchronize()
        assert end.query() and start.query()
        assert 19.0 <= start.elapsed_ms(end) < 10_000


@pytest.mark.cuda
def test_a_reused_event_handle_never_shows_its_old_record(cuda_device):
    """A dropped event's handle is reused by the next event (no cuEventDestroy on whatever
    thread dropped it); its old record, still pending behind a latch, must not be seen."""
    with cuda_device.create_stream() as s, cuda_device.create_stream() as t, \
            cuda_device.create_latch() as latch:
        latch.hold(s)
        old = s.record()
        handle = int(old._impl.handle)
        gc.collect()
        cuda_device._spare_events[False].clear()  # so the next event takes old's handle
        del old
        new = cuda_device.create_event()
        assert int(new._impl.handle) == handle, "the handle was not reused"
        assert new.query(), "a never-recorded event reported its handle's old record"
        t.wait(new)
        t.record(new)
        t0 = time.perf_counter()
        new.synchronize()
        assert time.perf_counter() - t0 < 5, "waited for the latched old record"
        latch.release()


@pytest.mark.cuda
def test_stream_wait_holds_b_until_a_passes_the_event(cuda_device, short_calls):
    dev = cuda_device
    with dev.create_stream() as a, dev.create_stream() as b, dev.create_latch() as latch:
        out = dev.empty((1024,), "float32", b)
        dev.launch("fill", b, [], [out], {"value": 1.0})
        b.record().synchronize()
        latch.hold(a)
        ready = a.record()
        t0 = time.perf_counter()
        b.wait(ready)
        dev.launch("fill", b, [], [out], {"value": 7.0})
        done_b = b.record()
        assert time.perf_counter() - t0 < 0.5, "enqueueing on B waited on the host"
        time.sleep(0.05)
        assert not done_b.query(), "B ran past an event A has not reached"
        np.testing.assert_array_equal(_peek(dev, out), np.ones(1024, np.float32))
        latch.release()
        done_b.synchronize()
        np.testing.assert_array_equal(dev.to_host(out, b), np.full(1024, 7.0, np.float32))


def _peek(dev, array):
    """Read ``array`` on a stream of its own (not ordered after B's pending work)."""
    with dev.create_stream() as s:
        return dev.to_host(array, s)


@pytest.mark.cuda
@pytest.mark.parametrize("count", [1, 1000, 16 << 10, (16 << 10) + 1, 1 << 20, (9 << 20) // 4 + 3])
def test_alloc_copy_round_trip_of_random_data(cuda_device, count):
    """Sizes around the direct/staged boundary (64 KiB) and across several staging chunks."""
    rng = np.random.default_rng(count)
    s = cuda_device.per_thread_stream()
    data = rng.standard_normal(count).astype(np.float32)
    d = cuda_device.to_device(data, s)
    np.testing.assert_array_equal(cuda_device.to_host(d, s), data)
    d2 = cuda_device.empty((count,), "float32", s)
    cuda_device.copy(d2, d, s)
    np.testing.assert_array_equal(cuda_device.to_host(d2, s), data)
    d.buffer.free(s)
    d2.buffer.free(s)


@pytest.mark.cuda
def test_staged_copies_never_wait_for_a_held_stream_and_snapshot_the_source(cuda_device):
    dev = cuda_device
    with dev.create_stream() as s:
        data = np.arange(3 << 20, dtype=np.float32)  # 12 MiB: three staging chunks
        small = np.arange(100, dtype=np.float32)  # direct copy from pageable memory
        d = dev.empty(data.shape, "float32", s)
        d_small = dev.empty(small.shape, "float32", s)
        s.record().synchronize()
        with dev.create_latch() as latch:
            latch.hold(s)
            t0 = time.perf_counter()
            dev.copy_from_host(d, data, s)
            dev.copy_from_host(d_small, small, s)
            assert time.perf_counter() - t0 < 1.0, "a host-to-device copy waited for the stream"
            data[:] = -1
            small[:] = -1
            latch.release()
        np.testing.assert_array_equal(dev.to_host(d, s), np.arange(3 << 20, dtype=np.float32))
        np.testing.assert_array_equal(dev.to_host(d_small, s), np.arange(100, dtype=np.float32))


@pytest.mark.cuda
def test_many_staged_copies_reuse_the_pinned_chunks_correctly(cuda_device):
    dev = cuda_device
    s = dev.per_thread_stream()
    arrays = [np.full(1 << 20, float(i), np.float32) for i in range(24)]  # 24 x 4 MiB
    device_arrays = [dev.to_device(a, s) for a in arrays]
    for i, d in enumerate(device_arrays):
        np.testing.assert_array_equal(dev.to_host(d, s), arrays[i])


@pytest.mark.cuda
def test_host_waits_count_exactly_one_per_synchronize(cuda_device):
    dev = cuda_device
    s = dev.per_thread_stream()
    x = dev.to_device(np.ones(1 << 20, np.float32), s)  # staged: no host wait either
    before = dev.stats.host_waits
    s.record().synchronize()
    assert dev.stats.host_waits - before == 1
    s.synchronize()
    assert dev.stats.host_waits - before == 2
    dev.synchronize()
    assert dev.stats.host_waits - before == 3
    dev.to_host(x, s)
    assert dev.stats.host_waits - before == 4
    ev = s.record()
    ev.query()
    assert dev.stats.host_waits - before == 4  # a query never counts


@pytest.mark.cuda
def test_work_from_a_fresh_thread_runs_on_its_own_per_thread_stream(cuda_device):
    dev = cuda_device

    def work():
        s = dev.per_thread_stream()
        x = dev.to_device(np.arange(256, dtype=np.float32), s)
        dev.launch("scale", s, [x], [x], {"factor": -1.0})
        return dev.to_host(x, s)

    np.testing.assert_array_equal(in_thread(work), -np.arange(256, dtype=np.float32))


@pytest.mark.cuda
def test_prepared_launch_plans_are_dropped_with_the_launch(cuda_device):
    dev = cuda_device
    s = dev.per_thread_stream()
    x = dev.empty((64,), "float32", s)
    prepared = dev.prepare("fill", [], [(64,)], {"value": 2.5})
    prepared.run(s, [], [x])
    key = id(prepared)
    assert key in dev._plans
    del prepared
    gc.collect()
    assert key not in dev._plans
    np.testing.assert_array_equal(dev.to_host(x, s), np.full(64, 2.5, np.float32))


@pytest.mark.cuda
def test_a_kernel_that_does_not_compile_raises_with_the_nvrtc_log(cuda_device):
    broken = dataclasses.replace(get_kernel("spin"), name="broken",
                                 source='extern "C" __global__ void sl_spin( {')
    with pytest.raises(KernelCompileError) as info:
        cuda_device._load_kernel(broken, broken.entry)
    assert info.value.kernel == "broken" and info.value.log
    assert info.value.code.startswith("NVRTC_ERROR")


THREAD_EXIT_SCRIPT = r"""
import threading, time
import numpy as np
from streamlane.runtime import get_device

dev = get_device("cuda")
x = dev.to_device(np.ones(256, np.float32), dev.per_thread_stream())
with dev.create_latch() as latch:
    latch.hold(dev.per_thread_stream())
    ready = dev.per_thread_stream().record()

    def enqueue_and_exit():
        s = dev.per_thread_stream()
        s.wait(ready)
        dev.launch("scale", s, [x], [x], {"factor": 2.0})

    t = threading.Thread(target=enqueue_and_exit)
    threading.Timer(0.5, latch.release).start()
    t0 = time.perf_counter()
    t.start()
    t.join(30)
    assert not t.is_alive()
    assert time.perf_counter() - t0 >= 0.4, "the thread ended before its stream drained"
with dev.create_stream() as s:
    s.record().synchronize()
dev.synchronize()
np.testing.assert_array_equal(dev.to_host(x, dev.per_thread_stream()),
                              np.full(256, 2.0, np.float32))
print("ok")
"""


@pytest.mark.cuda
def test_a_thread_ending_with_queued_work_drains_its_stream_and_leaves_the_device_usable(
        cuda_device):
    """Without the drain at thread exit, the driver wedged: later cuStreamCreate and
    cuCtxSynchronize calls never returned. Run in a subprocess: if it wedges, only that
    process is lost."""
    import subprocess
    import sys

    try:
        out = subprocess.run([sys.executable, "-c", THREAD_EXIT_SCRIPT], capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the device wedged after a thread ended with queued work")
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]


def test_hold_gil_setting_reads_0_or_1_and_refuses_anything_else():
    """``STREAMLANE_HOLD_GIL`` (no GPU needed: only the parsing)."""
    from streamlane.runtime.cuda import _hold_gil_allowed

    assert [_hold_gil_allowed(v) for v in (None, "", " 1 ", "1", "0", " 0")] == \
        [True, True, True, True, False, False]
    for bad in ("yes", "2", "off", "true"):
        with pytest.raises(InvalidArgument, match="STREAMLANE_HOLD_GIL must be 0"):
            _hold_gil_allowed(bad)


HOLD_GIL_SCRIPT = """
import asyncio, numpy as np
from streamlane.runtime import Program, get_device
from streamlane.sched import Scheduler

dev = get_device("cuda")
dev.hold_gil(True)
print("holding", dev.hold_gil(False))
b = Program.build("twice")
m = b.method("forward", x=("float32", [64]))
m.output(m.step("scale", "x", out="y", factor=2.0))
method = b.finish().method("forward", device=dev)

async def main():
    async with Scheduler(dev, lanes=2) as sched:
        outs = [await sched.run(method, [np.full(64, i, np.float32)], lane=0) for i in range(50)]
    return [o[0].to_host() for o in outs]

for i, y in enumerate(asyncio.run(main())):
    np.testing.assert_array_equal(y, np.full(64, 2 * i, np.float32))
print("ok")
"""


@pytest.mark.cuda
@pytest.mark.parametrize("value", ["0", "1"])
def test_streamlane_hold_gil_0_keeps_every_driver_call_in_cuda_bindings(cuda_device, value):
    """With ``STREAMLANE_HOLD_GIL=0`` nothing holds the GIL through a driver call (lanes
    included) and the scheduler computes the same; ``1`` is the default. A fresh process:
    the setting is read when the device opens."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, STREAMLANE_HOLD_GIL=value)
    out = subprocess.run([sys.executable, "-c", HOLD_GIL_SCRIPT], capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-3000:]
    assert f"holding {value == '1'}" in out.stdout


@pytest.mark.cuda
def test_a_bad_streamlane_hold_gil_refuses_to_open_the_device(cuda_device):
    import os
    import subprocess
    import sys

    script = ("from streamlane.runtime import get_device\n"
              "from streamlane.runtime.errors import InvalidArgument\n"
              "try:\n    get_device('cuda')\n"
              "except InvalidArgument as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, env=dict(os.environ, STREAMLANE_HOLD_GIL="yes"))
    assert "refused: STREAMLANE_HOLD_GIL must be 0" in out.stdout, out.stderr[-3000:]

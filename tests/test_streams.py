"""Streams, events, caller-stream selection and memory: the runtime foundation (rules 2-3)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from thread_helpers import in_thread, waits_until_released

from streamlane.runtime import CallerStream, current_stream, get_device
from streamlane.runtime.errors import (
    DeviceError,
    InvalidArgument,
    InvalidState,
    StreamClosed,
)


def test_per_thread_stream_differs_between_threads_and_is_stable_on_one(device):
    mine = device.per_thread_stream()
    assert device.per_thread_stream() is mine
    assert current_stream(device) is mine
    other = in_thread(device.per_thread_stream)
    assert other != mine
    assert other.kind == mine.kind == "per-thread"


def test_per_thread_stream_refuses_use_from_another_thread(device):
    mine = device.per_thread_stream()
    with pytest.raises(InvalidState, match="per-thread stream of another thread"):
        in_thread(lambda: mine.record())


def test_legacy_stream_is_explicit_and_shared(device):
    legacy = device.legacy_stream()
    assert legacy.kind == "legacy"
    assert in_thread(device.legacy_stream) is legacy
    legacy.record().synchronize()


def test_the_shared_streams_cannot_be_closed_and_stay_usable(device):
    legacy, mine = device.legacy_stream(), device.per_thread_stream()
    for shared in (legacy, mine):
        with pytest.raises(InvalidState, match="cannot be closed"):
            shared.close()
        with shared:  # leaving a with block leaves a shared stream open
            pass
        assert not shared.closed
        shared.record().synchronize()
    with current_stream(device) as s:
        assert s is mine
    with CallerStream(None):
        current_stream(device).record().synchronize()
    in_thread(lambda: device.legacy_stream().record().synchronize())


def test_created_stream_close_is_idempotent_and_context_managed(device):
    with device.create_stream() as s:
        assert s.kind == "owned"
        s.record().synchronize()
    assert s.closed
    s.close()
    with pytest.raises(StreamClosed, match="closed"):
        s.record()
    with pytest.raises(StreamClosed):
        device.launch("spin", s, [], [], {"us": 1})


def test_a_pinned_stream_closes_at_its_last_unpin(device):
    """pin(): work promised to the stream (a scheduler job) is enqueued after a close() the
    caller made meanwhile; the stream reads closed at once, new pins are refused."""
    s = device.create_stream()
    s.pin()
    s.pin()
    s.close()
    assert s.closed
    with pytest.raises(StreamClosed):
        s.pin()
    x = device.to_device(np.arange(8, dtype=np.float32), s)  # the promised work
    s.unpin()
    device.launch("scale", s, [x], [x], {"factor": 2.0})
    np.testing.assert_array_equal(device.to_host(x, s), 2 * np.arange(8))
    s.unpin()
    with pytest.raises(StreamClosed):
        s.record()
    s.close()  # still safe to call twice


def test_a_close_on_another_thread_inside_a_pin_never_destroys_a_pinned_stream(host):
    """pin() and close() each announce, then look at the other: a close that lands between
    a pin's announcement and its check makes the pin refuse (the stream closes, once); one
    that lands after the pin waits for its unpin. (Helper review: the stream was destroyed
    under a pin, and the job then failed or hung.) An unpin without a pin is InvalidState."""
    destroyed = []

    class CloseDuringAppend(list):
        def append(self, item):
            super().append(item)
            in_thread(stream.close)  # another thread, between the pin's append and its check

    stream = host.create_stream()
    stream._finalizer = lambda: destroyed.append(True)
    stream._pins = CloseDuringAppend()
    with pytest.raises(StreamClosed):
        stream.pin()
    assert stream.closed and destroyed == [True] and not stream._pins
    stream = host.create_stream()
    stream.pin()
    in_thread(stream.close)
    assert stream.closed and not stream._closed, "destroyed while pinned"
    stream.record()  # the promised work still goes in
    stream.unpin()
    assert stream._closed
    with pytest.raises(InvalidState, match="without a matching pin"):
        stream.unpin()


def test_our_streams_expose_cuda_stream_protocol_and_wrap_back(device):
    with device.create_stream() as s:
        version, handle = s.__cuda_stream__()
        assert version == 0 and handle == s.handle
        assert device.wrap_stream(s) is s


class _Foreign:
    def __init__(self, handle):
        self.handle = handle

    def __cuda_stream__(self):
        return (0, self.handle)


def test_host_work_given_to_a_borrowed_handle_of_a_closed_stream_is_refused(host):
    """The owner closed the stream; work through a wrapper of its handle would never run
    (and a wait for it never return): StreamClosed instead."""
    owner = host.create_stream()
    borrowed = host.wrap_stream(_Foreign(owner.handle))
    owner.close()
    with pytest.raises(StreamClosed, match="destroyed by its owner"):
        host.launch("spin", borrowed, [], [], {"us": 1})


def test_foreign_stream_is_borrowed_never_destroyed(device):
    owner = device.create_stream()
    borrowed = device.wrap_stream(_Foreign(owner.handle))
    assert borrowed.kind == "foreign"
    borrowed.record().synchronize()
    borrowed.close()  # only the wrapper is closed
    owner.record().synchronize()  # the stream itself still works
    owner.close()


@pytest.mark.parametrize("bad", [
    lambda: (0,),
    lambda: (0, "x"),
    lambda: [0, 5],
    lambda: (1, 5),
    lambda: (0, -3),
    lambda: (0, True),
])
def test_malformed_cuda_stream_objects_raise_invalid_argument(device, bad):
    class Bad:
        def __cuda_stream__(self):
            return bad()

    with pytest.raises(InvalidArgument, match="__cuda_stream__"):
        device.wrap_stream(Bad())


def test_cuda_stream_that_raises_is_reported(device):
    class Raising:
        def __cuda_stream__(self):
            raise RuntimeError("boom")

    with pytest.raises(InvalidArgument, match="boom"):
        device.wrap_stream(Raising())
    with pytest.raises(InvalidArgument, match="no __cuda_stream__"):
        device.wrap_stream(object())


def test_caller_stream_none_is_legacy_and_distinct_from_no_guard(device):
    assert current_stream(device).kind == "per-thread"
    with CallerStream(None):
        assert current_stream(device) is device.legacy_stream()
    assert current_stream(device).kind == "per-thread"


def test_caller_stream_guard_is_invisible_to_other_threads(device):
    with device.create_stream() as s, CallerStream(s):
        assert current_stream(device) is s
        seen = in_thread(lambda: current_stream(device))
        assert seen.kind == "per-thread" and seen != s


def test_caller_stream_nesting_restores_outer_selection(device):
    with device.create_stream() as a, device.create_stream() as b:
        with CallerStream(a):
            with CallerStream(b):
                assert current_stream(device) is b
                with CallerStream(None):
                    assert current_stream(device) is device.legacy_stream()
                assert current_stream(device) is b
            assert current_stream(device) is a
        assert current_stream(device).kind == "per-thread"


def test_one_caller_stream_guard_may_be_entered_again_nested_and_on_other_threads(device):
    """A guard kept in a module (LEGACY = CallerStream(None)) is entered by an outer and an
    inner call, and by several threads at once: each entry is its own. Exits out of order
    still leave, then raise."""
    import threading

    legacy = CallerStream(None)
    with device.create_stream() as s:
        shared = CallerStream(s)
        with legacy:
            with CallerStream(s):
                with legacy:
                    assert current_stream(device) is device.legacy_stream()
                assert current_stream(device) is s
            assert current_stream(device) is device.legacy_stream()
        assert current_stream(device).kind == "per-thread"
        inside, leave = threading.Barrier(2), threading.Event()

        def other():
            with shared:
                inside.wait(10)
                leave.wait(10)
                return current_stream(device) is s

        t = threading.Thread(target=lambda: box.append(other()))
        box: list[bool] = []
        t.start()
        with shared:
            inside.wait(10)
            with shared:
                assert current_stream(device) is s
        leave.set()
        t.join(10)
        assert box == [True] and current_stream(device).kind == "per-thread"
        outer, inner = CallerStream(s), CallerStream(None)
        outer.__enter__()
        inner.__enter__()
        with pytest.raises(InvalidState, match="reverse order"):
            outer.__exit__(None, None, None)
        assert current_stream(device) is device.legacy_stream()  # the inner guard still holds
        inner.__exit__(None, None, None)
        assert current_stream(device).kind == "per-thread"


def test_caller_stream_rejects_non_streams():
    with pytest.raises(InvalidArgument, match="CallerStream expects"):
        CallerStream(42)


def test_event_never_recorded_counts_as_complete(device):
    e = device.create_event()
    assert e.query()
    before = device.stats.snapshot().host_waits
    e.synchronize()  # nothing to wait for: no host wait (the host device counted one)
    assert device.stats.snapshot().host_waits == before


def test_a_never_recorded_event_stays_complete_after_a_fault(host):
    """On CUDA a never-recorded event is complete without a driver call, even once the
    context has faulted; the host device raised its fault from query() and synchronize()."""
    try:
        with host.create_stream() as s:
            host.inject_failure(s)
            with pytest.raises(DeviceError):
                s.synchronize()
            e = host.create_event()
            assert e.query()
            e.synchronize()
    finally:
        host.reset_error()


def test_event_record_query_wait_and_elapsed(device):
    s = device.per_thread_stream()
    start = device.create_event(timing=True)
    end = device.create_event(timing=True)
    s.record(start)
    device.launch("spin", s, [], [], {"us": 20_000})
    s.record(end)
    end.synchronize()
    assert start.query() and end.query()
    assert end.recorded
    assert 15.0 <= start.elapsed_ms(end) < 2_000


@pytest.mark.parametrize("timing", ["no", 1, None, np.bool_(True)])
def test_create_event_takes_a_bool_for_timing(device, timing):
    """timing="no" made a timing event (the string is true); as the methods' options, a
    non-bool is refused."""
    with pytest.raises(InvalidArgument, match="True or False"):
        device.create_event(timing=timing)
    assert device.create_event(timing=False).timing is False


def test_elapsed_needs_timing_events(device):
    s = device.per_thread_stream()
    a, b = s.record(), s.record()
    b.synchronize()
    with pytest.raises(InvalidArgument, match="timing"):
        a.elapsed_ms(b)


def test_stream_wait_orders_device_side_without_host_round_trip(device):
    """B waits for A's event on the device: B's work runs only once the latch on A is released,
    and enqueueing on B returns at once."""
    with device.create_stream() as a, device.create_stream() as b, \
            device.create_latch() as latch:
        x = device.to_device(np.ones(64, np.float32), a)
        out = device.empty((64,), "float32", a)
        a.record().synchronize()
        # Load the kernel first: loading a module waits for running kernels, the latch too.
        device.launch("scale", b, [x], [out], {"factor": 0.5})
        b.record().synchronize()
        latch.hold(a)
        ready = a.record()
        t0 = time.perf_counter()
        b.wait(ready)
        device.launch("scale", b, [x], [out], {"factor": 3.0})
        done_b = b.record()
        assert time.perf_counter() - t0 < 0.5  # nothing above waited on the host
        time.sleep(0.05)
        assert not done_b.query(), "B ran before the event it waits on"
        latch.release()
        done_b.synchronize()
        host = np.empty(64, np.float32)
        device.copy_to_host(host, out, b)
        b.record().synchronize()
        np.testing.assert_array_equal(host, np.full(64, 3.0, np.float32))


def test_event_from_another_device_is_refused():
    host = get_device("host")

    class OtherDevice:
        name = "other:0"

    from streamlane.runtime.event import Event

    other = Event(OtherDevice(), None, False)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="own device"):
        host.per_thread_stream().wait(other)
    with pytest.raises(InvalidArgument, match="record an event of the stream's device"):
        host.per_thread_stream().record(other)


@pytest.mark.parametrize("call", ["wait", "record", "elapsed_ms"])
@pytest.mark.parametrize("value", [None, "e", 5, object()])
def test_a_non_event_is_refused_as_an_invalid_argument(call, value):
    host = get_device("host")
    stream = host.create_stream()
    try:
        if call == "elapsed_ms":
            start = stream.record(host.create_event(timing=True))
            start.synchronize()
            with pytest.raises(InvalidArgument, match="end Event"):
                start.elapsed_ms(value)
        elif value is None and call == "record":
            assert stream.record(value).device is host  # None: a new event
        else:
            with pytest.raises(InvalidArgument, match="takes an Event"):
                getattr(stream, call)(value)
    finally:
        stream.close()


def test_host_waits_are_counted_once_per_synchronize(device):
    s = device.per_thread_stream()
    before = device.stats.host_waits
    s.record().synchronize()
    s.synchronize()
    assert device.stats.host_waits - before == 2


def test_memory_round_trip_of_random_data(device):
    rng = np.random.default_rng()
    s = device.per_thread_stream()
    for shape in [(1,), (7,), (257, 13), (3, 5, 7)]:
        data = rng.standard_normal(shape).astype(np.float32)
        d = device.to_device(data, s)
        back = device.to_host(d, s)
        np.testing.assert_array_equal(back, data)
        d2 = device.empty(shape, "float32", s)
        device.copy(d2, d, s)
        np.testing.assert_array_equal(device.to_host(d2, s), data)


def test_copy_from_host_source_may_change_after_return(device):
    s = device.per_thread_stream()
    data = np.arange(1 << 16, dtype=np.float32)
    d = device.empty(data.shape, "float32", s)
    with device.create_latch() as latch:
        latch.hold(s)
        device.copy_from_host(d, data, s)
        data[:] = -1  # the copy must have taken the old values
        latch.release()
    np.testing.assert_array_equal(device.to_host(d, s), np.arange(1 << 16, dtype=np.float32))


@pytest.mark.parametrize("size", [-1, 0, 1 << 50, 2.5, True, "8"])
def test_bad_allocation_sizes_raise(device, size):
    with pytest.raises(InvalidArgument, match="allocation size"):
        device.alloc(size)


@pytest.mark.parametrize("shape", [(-1,), (0, 3), (1 << 31,), ("a",), None])
def test_bad_shapes_raise(device, shape):
    with pytest.raises(InvalidArgument, match="shape"):
        device.empty(shape)


def test_kernel_launch_bad_input(device):
    s = device.per_thread_stream()
    a = device.empty((4, 4), "float32", s)
    b = device.empty((4, 5), "float32", s)
    i = device.empty((4, 4), "int32", s)
    with pytest.raises(InvalidArgument, match="add"):
        device.launch("add", s, [a, b], [a])
    with pytest.raises(InvalidArgument, match="float32"):
        device.launch("relu", s, [i], [i])
    with pytest.raises(InvalidArgument, match="mix dtypes"):
        device.launch("relu", s, [a], [i])
    with pytest.raises(InvalidArgument, match="nosuch"):
        device.launch("nosuch", s, [a], [a])
    with pytest.raises(InvalidArgument, match="DeviceArray"):
        device.launch("relu", s, [np.zeros((4, 4), np.float32)], [a])
    with pytest.raises(InvalidArgument, match="params"):
        device.launch("scale", s, [a], [a], {"factor": float("nan")})
    with pytest.raises(InvalidArgument, match="params"):
        device.launch("spin", s, [], [], {"us": -5})
    with pytest.raises(InvalidArgument, match="inputs"):
        device.launch("add", s, [a], [a])


def test_device_selection(monkeypatch):
    assert get_device("host").kind == "host"
    assert get_device("HOST") is get_device("host")
    with pytest.raises(InvalidArgument, match="valid names"):
        get_device("tpu")
    with pytest.raises(InvalidArgument, match="valid names"):
        get_device("cuda:x")
    for digits in ("cuda:\u00b2", "cuda:\u0661", "host:\uff10", "cuda:" + "9" * 5000):
        # not ASCII digits, or past int()'s digit limit: refused
        with pytest.raises(InvalidArgument, match="valid names"):
            get_device(digits)
    assert get_device("host:00") is get_device("host:0") is get_device("host")  # one name each
    assert get_device("host:" + "0" * 5000) is get_device("host")
    monkeypatch.setenv("STREAMLANE_DEVICE", "host")
    assert get_device().kind == "host"
    assert get_device("auto").kind == "host"
    monkeypatch.setenv("STREAMLANE_DEVICE", "gpu")
    with pytest.raises(InvalidArgument, match=r"'gpu' \(from \$STREAMLANE_DEVICE\)"):
        get_device()
    for auto in ("AUTO", " auto ", "Auto"):  # as "HOST" is host: the variable still forces
        with pytest.raises(InvalidArgument, match=r"'gpu' \(from \$STREAMLANE_DEVICE\)"):
            get_device(auto)


def test_forcing_cuda_without_gpu_is_a_clear_error(monkeypatch):
    from streamlane.runtime import cuda

    reason = cuda.why_unusable()
    if reason is None:
        pytest.skip("a GPU is usable here")
    monkeypatch.setenv("STREAMLANE_DEVICE", "cuda")
    with pytest.raises(DeviceError) as info:
        get_device()
    assert reason in str(info.value)
    assert get_device("auto" if False else "host").kind == "host"


def test_host_device_fault_is_sticky_and_raises_instead_of_hanging(host):
    s = host.create_stream()
    host.inject_failure(s, "kernel exploded")
    ev = s.record()
    with pytest.raises(DeviceError, match="kernel exploded"):
        ev.synchronize()
    with pytest.raises(DeviceError):
        host.per_thread_stream().record().synchronize()
    # Unusable until the process restarts, as its message says: lost, as a faulted CUDA
    # context is (it said False, so code deciding to restart on `lost` went on)
    assert host.lost
    host.reset_error()
    assert not host.lost
    s.close()


def test_host_synchronize_waits_for_every_stream_of_every_thread(host):
    """As cuCtxSynchronize: a live thread's per-thread stream, an ended thread's (still
    draining) and a closed stream's queued work are all waited for."""
    import threading

    events, leave = [], threading.Event()

    def queue_work(hold: bool):
        stream = host.per_thread_stream()
        host.inject_delay(stream, 0.3)
        events.append(stream.record())
        if hold:
            leave.wait(10)

    live = threading.Thread(target=queue_work, args=(True,))
    live.start()
    in_thread(lambda: queue_work(False))
    closed = host.create_stream()
    host.inject_delay(closed, 0.3)
    events.append(closed.record())
    closed.close()
    while len(events) < 3:
        time.sleep(0.01)
    host.synchronize()
    assert all(e.query() for e in events)
    leave.set()
    live.join(10)


def test_host_synchronize_from_a_step_running_on_a_stream_does_not_wait_for_itself(host):
    """A callable step is host code; one that calls device.synchronize() (allowed on CUDA,
    where it runs at enqueue time) must not wait behind itself on the host device."""
    from streamlane.runtime import Program

    def step(stream, ins, outs):
        host.synchronize()
        outs[0][...] = ins[0] * 2

    b = Program.build("p")
    m = b.method("f", x=("float32", [4]))
    m.call(step, ["x"], [("y", "float32", [4])])
    m.output("y")
    method = b.finish().method("f", device=host)
    box = {}
    t = threading.Thread(target=lambda: box.update(y=method([np.ones(4, np.float32)])[0]
                                                   .to_host()), daemon=True)  # may deadlock
    t.start()
    t.join(10)
    assert not t.is_alive(), "synchronize() in a step waited behind its own stream"
    np.testing.assert_array_equal(box["y"], 2 * np.ones(4))


def test_injected_delay_stalls_only_that_stream(host):
    slow, fast = host.create_stream(), host.create_stream()
    host.inject_delay(slow, 0.2)
    a, b = slow.record(), fast.record()
    b.synchronize()
    assert not a.query()
    a.synchronize()
    slow.close()
    fast.close()


def test_device_calls_refuse_arguments_of_the_wrong_kind(device):
    s = device.per_thread_stream()
    a = device.to_device(np.ones(2, np.float32), s)
    o = device.empty((2,), "float32", s)
    prepared = device.prepare("relu", [(2,)])
    big = device.empty((1024,), "float32", s)
    wide = device.empty((4,), "float32", s)

    class Raising:
        @property
        def __cuda_stream__(self):
            raise ZeroDivisionError

    for call in (lambda: device.launch("relu", None, [a], [o]),
                 lambda: device.launch("relu", "s", [a], [o]),
                 lambda: device.launch("scale", s, [a], [o], [1]),
                 lambda: device.launch("relu", s, a, [o]),
                 lambda: device.launch("relu", s, [a], o),
                 lambda: device.prepare("relu", [(2,)], params=[1]),
                 lambda: device.prepare("relu", 2),
                 lambda: prepared.run(None, [a], [o]),
                 lambda: prepared.run(s, a, [o]),
                 lambda: prepared.run(s, [np.ones(2, np.float32)], [o]),
                 lambda: device.to_device(np.array([1.0, None]), s),
                 lambda: device.to_device([[1.0], [1.0, 2.0]], s),
                 lambda: device.to_device(np.ones(2, np.float32), None),
                 lambda: device.empty((2,), object),
                 lambda: device.alloc(8, "stream"),
                 lambda: device.copy_from_host(o, np.ones(2, np.float32), None),
                 lambda: device.copy(o, a, 0),
                 lambda: device.to_host(a, None),
                 lambda: device.to_host(np.ones(2), s),
                 lambda: device.enqueue_callable(None, lambda *x: None, [a], [o]),
                 lambda: device.prepare("relu", [(2,)], extra=5),
                 lambda: device.wrap_stream(Raising()),
                 lambda: prepared.run(s, [a, a], [o]),  # arity: the kernel would misread
                 lambda: prepared.bind()(s, [a, a], [o]),
                 lambda: prepared.bind()(s, [a, o], []),  # the right count, the wrong split
                 lambda: device.copy(a, a, s),  # overlapping: undefined on CUDA
                 lambda: device.copy(wide.buffer.view("float32", (2,), 4),
                                     wide.buffer.view("float32", (2,), 0), s),
                 lambda: prepared.run(s, [big], [big]),  # shapes it was not prepared for
                 lambda: device.prepare("add", [(2,), (2,)]).run(s, [a], [o]),
                 # the dtype it was not prepared for: float64 bits read as float32 (int8: a
                 # read past the end), a fault for good on the host device
                 lambda: prepared.run(s, [device.to_device(np.ones(2, np.int8), s)],
                                      [device.empty((2,), "int8", s)]),
                 lambda: prepared.run(s, [device.to_device(np.ones(2), s)],
                                      [device.empty((2,), "float64", s)]),
                 # a bound launcher takes a Stream and DeviceArrays (AttributeError before)
                 lambda: prepared.bind()(s, [np.ones(2, np.float32)], [o]),
                 lambda: prepared.bind()(None, [a], [o]),
                 lambda: prepared.bind()(s, 5, [o]),
                 lambda: prepared.bind()(s, [a.buffer], [o.buffer])):  # a .ptr and no size
        with pytest.raises(InvalidArgument):
            call()
    assert not device.lost
    prepared.run(s, [a], [o])
    np.testing.assert_array_equal(device.to_host(o, s), np.ones(2, np.float32))
    from collections import deque

    device.launch("relu", s, deque([a]), deque([o]))  # any sequence, as before
    prepared.run(s, deque([a]), deque([o]))
    device.prepare("add", np.array([[2], [2]]), [(2,)])
    for shapes in (np.array(2), "22", None):
        with pytest.raises(InvalidArgument, match="in_shapes must be a list of shapes"):
            device.prepare("relu", shapes)
    device.launch("relu", s, [a], [o])  # and the device is fine
    np.testing.assert_array_equal(device.to_host(o, s), np.ones(2, np.float32))


def test_checked_launch_revalidates_new_signatures(device):
    s = device.per_thread_stream()
    a = device.to_device(np.ones(8, np.float32), s)
    out = device.empty((8,), "float32", s)
    device.launch("scale", s, [a], [out], {"factor": 1})
    with pytest.raises(InvalidArgument, match="params"):
        device.launch("scale", s, [a], [out], {"factor": True})
    with pytest.raises(InvalidArgument, match="params"):
        device.launch("scale", s, [a], [out], {"factor": [1]})
    np.testing.assert_array_equal(device.to_host(out, s), np.ones(8, np.float32))


def test_host_memory_exhaustion_is_a_device_error_like_cudas(host, monkeypatch):
    """The host device reports an allocation it cannot make as CUDA does (a DeviceError named
    CUDA_ERROR_OUT_OF_MEMORY, the device still usable), not numpy's MemoryError."""
    import streamlane.runtime.host as host_module

    real = host_module.np.full

    def exhausted(shape, *args, **kwargs):
        if shape == 12345:
            raise MemoryError("Unable to allocate")
        return real(shape, *args, **kwargs)

    monkeypatch.setattr(host_module.np, "full", exhausted)
    with pytest.raises(DeviceError, match="could not allocate 12345 bytes") as info:
        host.alloc(12345)
    assert info.value.code == "CUDA_ERROR_OUT_OF_MEMORY"
    assert host.alloc(16).nbytes == 16


def test_host_stream_work_given_as_it_stops_runs_or_is_refused(host):
    """The host stream's put() checked that the stream had not stopped, then queued: a stop()
    from another thread in between queued its end first, and the item, behind it, never ran
    (an event recorded that way was never reached, and its waiters hung). Forced at that line
    (sys.settrace), where a debugger's or coverage's tracer can also switch threads."""
    import inspect
    import sys

    from streamlane.runtime import host as host_module

    lines = inspect.getsourcelines(host_module)[0]
    target = next(i for i, text in enumerate(lines, 1) if "self.queue.put(item)" in text)
    stream = host.create_stream()  # kept: a dropped stream closes
    worker = stream._impl
    ran = threading.Event()
    stopper = threading.Thread(target=worker.stop)

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target and not stopper.is_alive() and \
                stopper.ident is None:
            stopper.start()
            stopper.join(0.5)  # done at once without the fix; blocked behind put() with it
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == host_module.__file__ else None

    sys.settrace(tracer)
    try:
        worker.put(ran.set)
    finally:
        sys.settrace(None)
    stopper.join(5)
    assert ran.wait(5), "work queued behind the stream's end never ran"


def test_the_host_device_waits_where_cuda_waits(host):
    """Two waits CUDA makes that the host device did not, so code tested here could hang on
    a GPU: a copy into numpy (pageable) memory returns once the copy is done, and a thread's
    end drains its per-thread stream (its join returns after the work)."""
    x = host.to_device(np.arange(4, dtype=np.float32), host.per_thread_stream())
    out = np.zeros(4, np.float32)
    with host.create_stream() as s, host.create_latch() as latch:
        latch.hold(s)
        waits_until_released(lambda: host.copy_to_host(out, x, s), latch.release,
                             "copy_to_host into numpy memory, its stream held,")
        np.testing.assert_array_equal(out, np.arange(4, dtype=np.float32))
    with host.create_latch() as latch:
        latch.hold(host.per_thread_stream())
        ready = host.per_thread_stream().record()
        done = []

        def enqueue_and_exit():
            t = host.per_thread_stream()
            t.wait(ready)
            host.launch("scale", t, [x], [x], {"factor": 2.0})
            done.append(t.record())

        thread = threading.Thread(target=enqueue_and_exit)
        threading.Timer(0.3, latch.release).start()
        start = time.perf_counter()
        thread.start()
        thread.join(30)
        assert not thread.is_alive() and time.perf_counter() - start >= 0.25, \
            "the thread ended before its stream drained"
        assert done[0].query()


def test_a_stream_or_event_copies_as_itself_and_refuses_pickle(host):
    """``copy.copy(stream)`` made a second object over one queue: closing the copy left the
    original saying it was open (on CUDA its next use would reach the driver with a destroyed
    handle); an event's copy shared its marker. A copy is the object itself now, and pickle
    or deepcopy say what to do (they failed on a lock inside). (A review.)"""
    import copy
    import pickle

    s, e = host.create_stream(), host.create_event()
    assert copy.copy(s) is s and copy.copy(e) is e
    for thing in (s, e):
        with pytest.raises(TypeError, match="does not pickle or deep-copy"):
            pickle.dumps(thing)
        with pytest.raises(TypeError, match="does not pickle or deep-copy"):
            copy.deepcopy(thing)
    copy.copy(s).close()
    assert s.closed


@pytest.mark.parametrize("seconds", [-1, None, "0.1", float("nan"), float("inf"), True, 1e9,
                                     10**400])  # (OverflowError in float())
def test_inject_delay_refuses_a_bad_delay_before_it_faults_the_device(host, seconds):
    """A bad delay was queued as is and raised on the stream's worker, a fault that made the
    whole host device unusable (a review)."""
    s = host.create_stream()
    with pytest.raises(InvalidArgument, match="inject_delay: seconds must be a number"):
        host.inject_delay(s, seconds)
    s.synchronize()
    assert not host.lost


def test_the_injection_hooks_refuse_what_is_not_a_stream(host):
    import numpy as np

    for call in (lambda: host.inject_delay(3, 0.1), lambda: host.inject_failure(None)):
        with pytest.raises(InvalidArgument, match="stream must be a Stream"):
            call()
    host.inject_delay(host.create_stream(), np.float32(0.001))  # numpy's numbers are numbers
    s = host.create_stream()
    for bad in (5, None, b"boom"):  # it became the fault's text as it was, as str()
        with pytest.raises(InvalidArgument, match="inject_failure: message must be a str"):
            host.inject_failure(s, bad)
    s.synchronize()
    assert not host.lost


def test_a_device_wide_wait_takes_a_stream_closed_as_it_looks(host, monkeypatch):
    """``device.synchronize()`` (a method recovering from a failed execute calls it) checked
    each host stream's ``stopped`` and then queued a marker on it: a ``close()`` or a thread's
    end landing between the two raised ``StreamClosed`` for a stream the caller never used
    (197 of 20,000 calls with another thread closing streams). It now waits for that stream
    to drain, as for any stream closed before it looked."""
    from streamlane.runtime import host as host_module

    stream = host.create_stream()
    host.inject_delay(stream, 0.2)
    worker = stream._usable()
    real_put = host_module._Worker.put

    def put_after_a_close(self, item):
        if self is worker:  # the close lands between the device's look and its put
            stream.close()
        return real_put(self, item)

    monkeypatch.setattr(host_module._Worker, "put", put_after_a_close)
    start = time.perf_counter()
    host.synchronize()
    assert time.perf_counter() - start >= 0.15  # waited for the closed stream's queued work
    assert not worker.thread.is_alive()


def test_the_per_thread_stream_of_an_ended_thread_is_closed_and_refused_up_front(host):
    """A thread's per-thread Stream kept after the thread ended: Linux gives a new thread the
    same id, so the owner check (by id) passed and an execute under it failed partway
    (``StreamClosed`` from the stopped queue), leaving the method to wait for the whole
    device at its next execute (rule 6); the stream said ``closed == False``. Now it is
    closed as its thread ends and refused before anything is touched."""
    from streamlane.runtime import Program

    builder = Program.build("stale")
    mb = builder.method("f", x=("float32", [4]))
    mb.output(mb.step("relu", "x"))
    method = builder.finish().method("f", device=host)
    x = np.ones(4, np.float32)
    stale = {}

    def first():
        stale[threading.get_ident()] = host.per_thread_stream()

    for _ in range(5):
        in_thread(first)
    assert stale and all(s.closed for s in stale.values())
    refused = []

    def later():
        s = stale.get(threading.get_ident())  # an ended thread's, if this id was reused
        if s is not None:
            ended = "per-thread stream of a thread that has ended"
            with pytest.raises(StreamClosed, match=ended), CallerStream(s):
                method([x])
            refused.append(s)

    for _ in range(20):
        in_thread(later)
    assert not method.may_wait_on_host()  # refused before it touched anything
    before = host.stats.host_waits
    np.testing.assert_array_equal(method([x])[0].to_host(), x)
    assert host.stats.host_waits == before + 1  # the read alone: no device-wide wait


def test_guards_and_latches_say_what_they_are(host):
    """``CallerStream`` and ``Latch`` showed the default ``<... object at 0x...>``."""
    s = host.create_stream()
    assert repr(CallerStream(s)) == f"CallerStream({s!r})"
    assert repr(CallerStream(None)) == "CallerStream(None)"
    with host.create_latch() as latch:
        assert repr(latch) == f"<Latch {host.name} holding>"
    assert repr(latch) == f"<Latch {host.name} released>"
    s.close()


def test_an_execute_refused_for_its_stream_names_the_method(host):
    """``m(x)`` under a closed caller stream raised ``StreamClosed`` naming only the stream."""
    from streamlane.runtime import Program

    builder = Program.build("named")
    mb = builder.method("f", x=("float32", [4]))
    mb.output(mb.step("relu", "x"))
    method = builder.finish().method("f", device=host)
    s = host.create_stream()
    s.close()
    with pytest.raises(StreamClosed, match=r"^named\.f: execute\(\) refused: .* is closed"), \
            CallerStream(s):
        method([np.ones(4, np.float32)])


def test_a_callable_step_may_record_on_its_stream_after_the_thread_that_queued_it_ended(host):
    """A thread enqueues a callable step and ends; its per-thread stream drains, and the step,
    running then, records an event on the stream it was handed: the stopping queue refused
    the record, which faulted the host device for good."""
    from streamlane.runtime import Program

    ran = threading.Event()

    def step(stream, ins, outs):
        time.sleep(0.05)  # the enqueuing thread has ended by now
        stream.record()
        np.multiply(ins[0], 2.0, out=outs[0])
        ran.set()

    builder = Program.build("handed")
    mb = builder.method("f", x=("float32", [4]))
    mb.output(*mb.call(step, ["x"], [("y", "float32", [4])]))
    method = builder.finish().method("f", device=host)
    box = {}
    in_thread(lambda: box.setdefault("out", method([np.ones(4, np.float32)])))
    assert ran.wait(5) and not host.lost
    host.synchronize()
    np.testing.assert_array_equal(box["out"][0].to_host(), np.full(4, 2.0, np.float32))


# The parent's side of the fork tests: how the child ended, or "hung" (killed after 20 s)
_WAIT_FOR = (
    "import os, time\n"
    "def wait_for(pid):\n"
    "    deadline = time.monotonic() + 20\n"
    "    while time.monotonic() < deadline:\n"
    "        got, status = os.waitpid(pid, os.WNOHANG)\n"
    "        if got:\n"
    "            return f'exit {os.waitstatus_to_exitcode(status)}'\n"
    "        time.sleep(0.05)\n"
    "    os.kill(pid, 9); os.waitpid(pid, 0)\n"
    "    return 'hung'\n")


def _expect_child_exit_7(code: str) -> None:
    proc = subprocess.run([sys.executable, "-W", "ignore::DeprecationWarning", "-c",
                           _WAIT_FOR + code], capture_output=True, text=True, timeout=60)
    assert proc.stdout.strip() == "exit 7", proc.stdout + proc.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_does_not_hang_on_the_host_streams_of_threads_it_lacks():
    """At a fork, the child drops the other threads' thread-locals, so each one's per-thread
    stream was drained there, waiting for a worker thread the child does not have: the child
    hung in os.fork()."""
    code = (
        "import os, threading, time\n"
        "from streamlane.runtime import get_device\n"
        "dev = get_device('host')\n"
        "used, done = threading.Event(), threading.Event()\n"
        "def user():\n"
        "    dev.per_thread_stream().record(); used.set(); done.wait()\n"
        "threading.Thread(target=user, daemon=True).start(); used.wait()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(7)\n"
        "print(wait_for(pid)); done.set()\n")
    _expect_child_exit_7(code)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_using_a_parent_host_stream_is_refused_not_hung():
    """A fork copies only the forking thread: work the child gave a host stream of the parent
    went to a queue no thread drains, and the child hung at its first wait."""
    code = (
        "import os, time, numpy as np\n"
        "from streamlane.runtime import get_device, Program\n"
        "from streamlane.runtime.errors import StreamClosed\n"
        "dev = get_device('host')\n"
        "b = Program.build('p'); m = b.method('f', x=('float32', [4]))\n"
        "m.output(m.step('relu', 'x')); method = b.finish().method('f', device=dev)\n"
        "x = np.ones(4, np.float32); method([x])[0].to_host()\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    try:\n"
        "        method([x])[0].to_host()\n"
        "        os._exit(1)\n"
        "    except StreamClosed as exc:\n"
        "        os._exit(7 if 'parent process' in str(exc) else 2)\n"
        "print(wait_for(pid))\n")
    _expect_child_exit_7(code)

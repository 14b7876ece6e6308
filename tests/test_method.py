"""Methods: the input/output state machine, options, and ordering rules 1, 4, 5 and 6."""

from __future__ import annotations

import inspect
import threading
import time

import numpy as np
import pytest
from thread_helpers import in_thread

from streamlane.runtime import CallerStream, Program, Result
from streamlane.runtime import method as method_module
from streamlane.runtime.errors import (
    DeviceError,
    InvalidArgument,
    InvalidInput,
    InvalidProgram,
    InvalidState,
    MethodBusy,
    NotSupported,
)
from streamlane.runtime.reference import run_reference

RNG = np.random.default_rng()


def mlp(batch=4, width=16, out=8):
    w1 = RNG.standard_normal((width, width)).astype(np.float32)
    w2 = RNG.standard_normal((width, out)).astype(np.float32)
    b = Program.build("mlp", constants={"w1": w1, "w2": w2})
    m = b.method("forward", x=("float32", [batch, width]))
    m.output(m.step("matmul", m.step("relu", m.step("matmul", "x", "w1")), "w2", out="y"))
    return b.finish()


def x_for(program, name="forward"):
    decl = program.methods[name].inputs[0]
    return RNG.standard_normal(decl.shape).astype(np.float32)


def check(program, inputs, results, rtol=1e-4):
    refs = run_reference(program, "forward", inputs)
    for r, ref in zip(results, refs, strict=True):
        got = r.to_host() if isinstance(r, Result) else r
        assert np.linalg.norm(got - ref) <= rtol * np.linalg.norm(ref)


# -- state machine ---------------------------------------------------------------------------

def test_call_runs_and_matches_reference(device):
    p = mlp()
    m = p.method("forward", device=device)
    x = x_for(p)
    out = m([x])
    assert len(out) == 1 and out[0].shape == (4, 8) and out[0].dtype == np.float32
    check(p, [x], out)


def test_execute_before_set_inputs_is_invalid_state(device):
    m = mlp().method("forward", device=device)
    with pytest.raises(InvalidState, match="set_inputs"):
        m.execute()
    with pytest.raises(InvalidState, match="execute"):
        m.get_outputs()


def test_wrong_count_keeps_previous_inputs(device):
    p = mlp()
    m = p.method("forward", device=device)
    x = x_for(p)
    m.set_inputs([x])
    with pytest.raises(InvalidInput, match="1 inputs"):
        m.set_inputs([x, x])
    m.execute()  # previous inputs intact and usable
    check(p, [x], m.get_outputs())


def test_failed_set_inputs_blocks_execute_until_all_inputs_passed_again(device):
    p = mlp()
    m = p.method("forward", device=device)
    x = x_for(p)
    m([x])
    with pytest.raises(InvalidInput) as info:
        m.set_inputs([x.astype(np.float64)])
    assert info.value.index == 0 and info.value.method == "mlp.forward"
    assert "float64" in str(info.value) and "input 0" in str(info.value)
    with pytest.raises(InvalidState, match="failed"):
        m.execute()
    with pytest.raises(InvalidState):
        m.get_outputs()
    m.set_inputs([x])
    m.execute()
    check(p, [x], m.get_outputs())


def test_get_outputs_refused_after_new_inputs_until_execute(device):
    p = mlp()
    m = p.method("forward", device=device)
    x = x_for(p)
    m([x])
    m.set_inputs([x])
    with pytest.raises(InvalidState):
        m.get_outputs()
    m.execute()
    assert len(m.get_outputs()) == 1


@pytest.mark.parametrize("bad,match", [
    (np.zeros((4, 15), np.float32), "shape"),
    (np.zeros((4, 16), np.int32), "dtype"),
    ("text", "str"),
    (None, "NoneType"),
    (3.0, "Python number"),
])
def test_bad_inputs_name_index_and_method(device, bad, match):
    m = mlp().method("forward", device=device)
    with pytest.raises(InvalidInput, match=match) as info:
        m.set_inputs([bad])
    assert info.value.index == 0 and "mlp.forward" in str(info.value)


def test_inputs_must_be_a_list(device):
    m = mlp().method("forward", device=device)
    with pytest.raises(InvalidInput, match="list"):
        m.set_inputs(x_for(mlp()))


def test_transposed_and_strided_inputs_are_copied_into_the_exported_layout(device):
    p = mlp(batch=16, width=16)
    m = p.method("forward", device=device)
    base = RNG.standard_normal((16, 16)).astype(np.float32)
    for x in (base.T, base[::-1, ::-1], np.asfortranarray(base)):
        check(p, [np.ascontiguousarray(x)], m([x]))


def test_results_are_accepted_as_inputs(device):
    p = mlp(width=16, out=16)
    m1 = p.method("forward", device=device)
    m2 = p.method("forward", device=device)
    x = x_for(p)
    h = m1([x])[0]
    y = m2([h])[0]
    check(p, [run_reference(p, "forward", [x])[0].astype(np.float32)], [y], rtol=1e-3)


def test_scalar_inputs_follow_their_declared_kind(device):
    def scale(stream, ins, outs):
        outs[0][...] = ins[0] * ins[1]

    b = Program.build("s")
    m = b.method("forward", x=("float32", [4]), k=("float32", []), n=("int32", []))
    m.call(scale, ["x", "k"], [("y", "float32", [4])])
    m.output("y")
    meth = b.finish().method("forward", device=get_host())
    x = np.arange(4, dtype=np.float32)
    meth.set_inputs([x, 2, 3])  # an int is fine for a float
    with pytest.raises(InvalidInput, match="int32 scalar"):
        meth.set_inputs([x, 2.0, 1.5])
    with pytest.raises(InvalidInput, match="int32 scalar"):
        meth.set_inputs([x, 2.0, True])
    with pytest.raises(InvalidInput, match="float32 scalar"):
        meth.set_inputs([x, True, 1])
    with pytest.raises(InvalidInput, match="str"):
        meth.set_inputs([x, "2", 1])
    np.testing.assert_array_equal(meth([x, 2.5, 1])[0].to_host(), x * 2.5)


def test_scalar_inputs_out_of_their_dtypes_range_are_refused_not_wrapped():
    """numpy's casts wrap integers around (np.int64(2**31) as int32 is -2**31, np.int16(300) as
    uint8 is 44) and overflow finite floats to inf: each is refused, whatever its Python or
    numpy type; values in range, and an explicit inf or nan, pass."""
    def ident(stream, ins, outs):
        outs[0][...] = ins[0]

    def scalar_method(dtype):
        b = Program.build("s")
        m = b.method("forward", v=(dtype, []))
        m.call(ident, ["v"], [("y", dtype, [])])
        m.output("y")
        return b.finish().method("forward", device=get_host())

    bad = {"int32": [2**31, np.int64(2**31), np.int64(2**40), np.uint64(2**32 + 5), -2**31 - 1],
           "uint8": [-1, np.int64(-1), np.int16(300), 256],
           "float32": [1e40, np.float64(-1e39), 2**200],
           "float16": [70000.0, np.float32(1e5)],
           "bfloat16": [1e39, 2**1100]}
    if np.finfo(np.longdouble).max > 1e400:  # x86-64: a long double beyond float64's range
        bad["float32"].append(np.longdouble(10) ** 400)
    for dtype, values in bad.items():
        method = scalar_method(dtype)
        for value in values:
            with pytest.raises(InvalidInput, match=f"{dtype} scalar") as info:
                method.set_inputs([value])
            assert info.value.index == 0, (dtype, value)
    with pytest.raises(InvalidInput) as info:  # reported, not repeated: 4000 digits
        scalar_method("float32").set_inputs([10**4000])
    assert len(str(info.value)) < 400 and info.value.got == 10**4000
    good = {"int32": [2**31 - 1, np.int64(-2**31), np.uint8(7)], "uint8": [255, np.int64(0)],
            "float32": [3.4e38, np.float64(1e-50), float("inf"), float("nan")],
            "float16": [65504.0], "bfloat16": [2**70, -1e38]}
    for dtype, values in good.items():
        method = scalar_method(dtype)
        for value in values:
            got = method([value])[0].to_host()
            np.testing.assert_array_equal(got, np.asarray(float(value)).astype(got.dtype))


def test_zero_d_arrays_are_scalars_and_keep_their_shape(device):
    """numpy's ascontiguousarray turns a 0-d array into shape (1,): a 0-d input once reached
    the kernels as [1] and faulted the device, and Result.from_host made it [1]."""
    b = Program.build("zero_d")
    m = b.method("forward", a=("float32", []))
    m.output(m.step("add", "a", "a", out="y"))
    meth = b.finish().method("forward", device=device)
    (y,) = meth([np.array(2.5, np.float32)])
    assert y.shape == () and y.to_host() == np.float32(5.0)
    r = Result.from_host(np.array(3.0, np.float32), device)
    assert r.shape == () and r.to_host().shape == ()
    assert meth([r])[0].to_host() == np.float32(6.0)
    assert meth([4])[0].to_host() == np.float32(8.0)  # the method was not left broken
    with pytest.raises(InvalidInput, match="shape"):
        meth([np.array([2.5], np.float32)])  # [1] is not a scalar


def test_an_input_whose_array_interface_raises_is_an_invalid_input(device):
    class Broken:
        @property
        def __array_interface__(self):
            raise ZeroDivisionError("broken")

    meth = mlp().method("forward", device=device)
    with pytest.raises(InvalidInput, match=r"input 0 of method .*ZeroDivisionError") as info:
        meth.set_inputs([Broken()])
    assert info.value.index == 0


def get_host():
    from streamlane.runtime import get_device

    return get_device("host")


# -- options (rule 5) ------------------------------------------------------------------------

def test_options_are_validated(device):
    p = mlp()
    with pytest.raises(InvalidArgument, match="unknown option"):
        p.method("forward", device=device, fast=True)
    with pytest.raises(NotSupported) as info:
        p.method("forward", device=device, use_shared_stream=True)
    for alternative in ("lane", "CallerStream", "after="):
        assert alternative in str(info.value)
    with pytest.raises(InvalidArgument, match="bool"):
        p.method("forward", device=device, use_shared_stream=1)
    with pytest.raises(InvalidArgument, match="bool"):
        p.method("forward", device=device, clone_outputs="yes")
    p.method("forward", device=device, use_shared_stream=False)
    with pytest.raises(InvalidArgument, match="no method"):
        p.method("backward", device=device)


# -- rule 6: execute never waits on the host -------------------------------------------------

def test_execute_returns_while_the_stream_is_held(device):
    p = mlp()
    m = p.method("forward", device=device)
    x = x_for(p)
    m([x])[0].to_host()
    stream = device.per_thread_stream()
    with device.create_latch() as latch:
        latch.hold(stream)
        waits = device.stats.host_waits
        t0 = time.perf_counter()
        out = m([x])[0]
        assert time.perf_counter() - t0 < 1.0
        assert device.stats.host_waits == waits
        time.sleep(0.05)
        assert not out.ready()
        latch.release()
    check(p, [x], [out])


def test_two_programs_on_one_thread_serialize_and_overlap_only_under_caller_streams(device):
    """Rule 7, directly: with no guard, a second program on the thread waits behind the first
    (one stream: both held by a latch on it); under a caller stream each, the second runs
    while the first is held."""
    p1, p2 = mlp(), mlp()
    m1, m2 = p1.method("forward", device=device), p2.method("forward", device=device)
    x1, x2 = x_for(p1), x_for(p2)
    m1([x1])[0].to_host()
    m2([x2])[0].to_host()
    with device.create_latch() as latch:
        latch.hold(device.per_thread_stream())
        r1, r2 = m1([x1])[0], m2([x2])[0]
        time.sleep(0.05)
        assert not r1.ready() and not r2.ready(), "the second program did not wait (rule 7)"
        latch.release()
    check(p1, [x1], [r1])
    check(p2, [x2], [r2])
    with device.create_latch() as latch, device.create_stream() as s1, \
            device.create_stream() as s2:
        latch.hold(s1)
        with CallerStream(s1):
            r1 = m1([x1])[0]
        with CallerStream(s2):
            r2 = m2([x2])[0]
        r2.to_host()  # returns while the first program is held: deliberate overlap
        assert not r1.ready()
        latch.release()
    check(p1, [x1], [r1])
    check(p2, [x2], [r2])


def test_a_result_input_from_a_held_stream_is_waited_for_on_the_device(device):
    """Rule 6: a Result made on another stream (held by a latch) is waited for on the device,
    not the host: the consumer's execute returns at once, and its output stays unready until
    the producer's stream runs. (A host wait there would block until the latch opens.)"""
    p = mlp()
    producer, consumer = p.method("forward", device=device), p.method("forward", device=device)
    x = x_for(p)
    consumer([x])[0].to_host()
    b = Program.build("pass")
    mb = b.method("forward", x=("float32", list(x.shape)))
    mb.output(mb.step("copy", "x", out="y"))
    copier = b.finish().method("forward", device=device)
    with device.create_latch() as latch, device.create_stream() as s:
        latch.hold(s)
        with CallerStream(s):
            made = copier([x])[0]  # on s, behind the latch
        waits = device.stats.host_waits
        box: dict[str, Result] = {}
        called, finish = threading.Event(), threading.Event()

        def consume():
            box["out"] = producer([made])[0]
            called.set()
            finish.wait(10)  # a thread ends only once its stream's work is done (CUDA)

        t = threading.Thread(target=consume)
        t.start()
        try:
            assert called.wait(5), "the consumer's execute waited on the host for its input"
            assert device.stats.host_waits == waits
            time.sleep(0.05)
            assert not box["out"].ready()
        finally:
            latch.release()
            finish.set()
            t.join(10)
        check(p, [x], [box["out"]])


# -- rule 1: one stream per execute; the determinism test ------------------------------------

def _cupy_stream(cp, stream):
    """CuPy's view of a streamlane stream: through the CUDA stream protocol where CuPy has it
    (``ExternalStream`` is deprecated there), else by handle."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    return from_external(stream) if from_external else cp.cuda.ExternalStream(stream.handle)


def split_program(device, width=64):
    """A program split across both backends (kernel and callable steps), each step with its own
    buffer. On the host device callables run numpy in stream order."""

    def shift(stream, ins, outs):
        if device.kind == "host":
            np.add(ins[0], 1.0, out=outs[0])
        else:
            cp = pytest.importorskip("cupy")
            with _cupy_stream(cp, stream):
                cp.add(cp.asarray(ins[0]), 1.0, out=cp.asarray(outs[0]))

    def square(stream, ins, outs):
        if device.kind == "host":
            np.multiply(ins[0], ins[0], out=outs[0])
        else:
            cp = pytest.importorskip("cupy")
            with _cupy_stream(cp, stream):
                a = cp.asarray(ins[0])
                cp.multiply(a, a, out=cp.asarray(outs[0]))

    w = (RNG.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    b = Program.build("split", constants={"w": w})
    m = b.method("forward", x=("float32", [16, width]))
    a = m.step("matmul", "x", "w")
    m.call(shift, [a], [("b", "float32", [16, width])])
    c = m.step("gelu", "b")
    m.call(square, [c], [("d", "float32", [16, width])])
    e = m.step("layernorm", "d")
    m.output(m.step("scale", e, out="y", factor=0.5))
    return b.finish(), w


def split_reference(x, w):
    from streamlane.kernels import get_kernel

    gelu = get_kernel("gelu").reference
    ln = get_kernel("layernorm").reference
    h = x.astype(np.float64) @ w.astype(np.float64) + 1.0
    h = gelu([h], {})[0]
    return 0.5 * ln([h * h], {"eps": 1e-5})[0]


def run_determinism(device, runs=100, delay=None):
    program, w = split_program(device)
    m = program.method("forward", device=device)
    x = RNG.standard_normal((16, 64)).astype(np.float32)
    if delay is not None:  # also the first run: later ones may read the equal values it left
        delay(m)
    first = m([x])[0].to_host()
    ref = split_reference(x, w)
    assert np.linalg.norm(first - ref) <= 1e-4 * np.linalg.norm(ref), "first result is wrong"
    for i in range(runs):
        if delay is not None:
            delay(m)
        again = m([x])[0].to_host()
        assert np.array_equal(again, first), f"run {i + 2} differs from the first"


def test_split_program_is_deterministic(device):
    run_determinism(device)


def test_private_stream_per_step_breaks_the_determinism_test(host, monkeypatch):
    """The old bug (a stream per step, nothing between them) must make the test fail: stall
    the stream of a producing step so its consumer reads the buffer before it is written."""
    monkeypatch.setattr(method_module, "_PRIVATE_STREAM_PER_STEP", True)
    program, w = split_program(host)
    m = program.method("forward", device=host)
    x = RNG.standard_normal((16, 64)).astype(np.float32)
    m._private_stream(0)
    host.inject_delay(m._private_streams[1], 0.05)  # the first callable step runs late
    got = m([x])[0].to_host()
    ref = split_reference(x, w)
    assert not np.linalg.norm(got - ref) <= 1e-4 * np.linalg.norm(ref)
    with pytest.raises(AssertionError):
        run_determinism(host, runs=3,
                        delay=lambda m: host.inject_delay(m._private_stream(1), 0.05))
    for s in m._private_streams:
        s.close()


# -- rule 4: handoff between streams ---------------------------------------------------------

def test_a_handoff_back_to_the_first_stream_waits_for_the_second(device):
    """A -> B -> A: back on the thread's stream after an execute under a caller stream, the
    method must wait for that execute (held by a latch) on the device. Not remembering the
    caller stream as the last one skipped the wait, and no test noticed (found by breaking
    rule 4 on purpose)."""
    p = mlp()
    m = p.method("forward", device=device)
    x0, x1, x2 = x_for(p), x_for(p), x_for(p)
    m([x0])[0].to_host()  # last on this thread's stream (A)
    with device.create_latch() as latch, device.create_stream() as s:
        latch.hold(s)
        with CallerStream(s):
            r1 = m([x1])[0]  # B, held
        r2 = m([x2])[0]  # back on A
        time.sleep(0.05)
        assert not r2.ready(), "the execute back on A ran before B's held execute"
        latch.release()
        check(p, [x1], [r1])
        check(p, [x2], [r2])


def test_a_result_read_on_another_stream_waits_for_the_executes_last_step(host):
    """The execute's event (what a reader on another stream waits for) is recorded after its
    last step: recorded before it, a read under another stream saw the buffer unwritten, and
    only timing luck in unrelated tests noticed (found by breaking rule 8 on purpose)."""
    def slow_copy(stream, ins, outs):
        time.sleep(0.1)
        outs[0][...] = ins[0]

    b = Program.build("slowlast")
    mb = b.method("forward", x=("float32", [4]))
    mb.call(slow_copy, [mb.step("relu", "x")], [("y", "float32", [4])])
    mb.output("y")
    m = b.finish().method("forward", device=host)
    x = np.arange(4, dtype=np.float32)
    r = m([x])[0]
    with host.create_stream() as s, CallerStream(s):
        np.testing.assert_array_equal(r.to_host(), x)


def test_handoff_to_another_thread_waits_on_the_device(device):
    """One method behind a lock, driven from another thread: the second execute must not start
    before the first (held by a latch) on the device."""
    p = mlp()
    m = p.method("forward", device=device)
    lock = threading.Lock()
    x1, x2 = x_for(p), x_for(p)
    box = {}
    with device.create_latch() as latch:
        with lock:
            latch.hold(device.per_thread_stream())
            r1 = m([x1])[0]

        done, finish = threading.Event(), threading.Event()

        def other():
            with lock:
                box["r2"] = m([x2])[0]
            done.set()
            # A thread must not end with work still queued on its per-thread stream (on CUDA
            # that wedges the context), so it stays until the latch is released.
            finish.wait(10)

        t = threading.Thread(target=other)
        t.start()
        assert done.wait(10)
        r2 = box["r2"]
        time.sleep(0.05)
        assert not r2.ready(), "the handed-off execute ran before the previous one"
        latch.release()
        finish.set()
        t.join(10)
    check(p, [x1], [r1])
    check(p, [x2], [r2])


def _held_work_orders_a_caller_stream_execute(device, p, before_on_held):
    """With the thread's per-thread stream held by a latch, ``before_on_held(x)`` gives a
    method of program ``p`` after putting its last work there; its execute on a caller stream
    must wait for that work on the device (rule 4), and come out right once the latch lets
    go."""
    x = x_for(p)
    with device.create_latch() as latch, device.create_stream() as s:
        latch.hold(device.per_thread_stream())
        m = before_on_held(x)
        with CallerStream(s):
            r = m([x])[0]
        time.sleep(0.05)
        assert not r.ready()
        latch.release()
        with CallerStream(s):
            check(p, [x], [r])


def test_handoff_to_a_caller_stream_waits_on_the_device(device):
    p = mlp()
    m = p.method("forward", device=device)  # made (its kernels loaded) before the latch

    def executed_on_held(x):
        m([x])
        return m

    _held_work_orders_a_caller_stream_execute(device, p, executed_on_held)


def test_the_constants_upload_orders_the_first_execute_on_another_stream(host):
    """A method uploads its constants on its maker's stream; its first execute, on another
    stream, waits for that upload on the device (rule 4: the upload is the method's last work)
    instead of reading constants not yet written. (Host device only: on CUDA a method made
    behind a held latch waits for it on the host, to load its kernels and to copy pageable
    memory.)"""
    p = mlp()
    _held_work_orders_a_caller_stream_execute(  # its constants' upload waits behind the latch
        host, p, lambda x: p.method("forward", device=host))


def test_a_thread_reusing_an_ended_threads_id_is_still_handed_off(host):
    """CPython gives a new thread the id of one that ended. A thread's end drains its
    per-thread stream, as on CUDA (before, the host device let a thread end with its stream
    held, which on a GPU hangs until the latch opens): the ended thread's execute is done
    before a thread that reuses its id runs, and each computes its own inputs."""
    p = mlp()
    m = p.method("forward", device=host)
    x1, x2 = x_for(p), x_for(p)
    box = {}
    with host.create_latch() as latch:
        def first():
            latch.hold(host.per_thread_stream())
            box["r1"] = m([x1])[0]
            return threading.get_ident()

        def second():
            box["r2"] = m([x2])[0]
            return threading.get_ident()

        threading.Timer(0.3, latch.release).start()
        start = time.perf_counter()
        ident = in_thread(first)
        assert time.perf_counter() - start >= 0.25, "the thread ended before its stream drained"
        assert box["r1"].ready()
        reused = in_thread(second) == ident
    check(p, [x1], [box["r1"]])
    check(p, [x2], [box["r2"]])
    if not reused:
        pytest.skip("the second thread did not get the ended thread's id (both were checked)")


def test_a_method_driven_from_many_threads_and_streams_keeps_bounded_state(host):
    """Each thread's stream and each created stream is its own queue (a serial in its key):
    the method must not keep one entry per queue it ever ran on (it has waited for them)."""
    p = mlp()
    m = p.method("forward", device=host)
    x = x_for(p)
    for _ in range(50):
        in_thread(lambda: m([x]))
    for _ in range(50):
        with host.create_stream() as s, CallerStream(s):
            m([x])
    assert len(m._uses) == 1
    check(p, [x], [m([x])[0]])


def test_a_stream_created_after_one_was_closed_is_handed_off(device):
    """A closed stream's work may still be running (CUDA releases it afterwards) while the next
    create_stream() could return the same handle: the method must still hand off to the new
    one. (Driver 580 on an H200 gave five distinct handles in five close/create cycles with
    work pending, so this guards against a reuse not seen there; host stream ids never
    repeat.)"""
    p = mlp()
    m = p.method("forward", device=device)
    x1, x2 = x_for(p), x_for(p)
    with device.create_latch() as latch:
        first = device.create_stream()
        latch.hold(first)
        with CallerStream(first):
            r1 = m([x1])[0]
        first.close()
        with device.create_stream() as second:
            with CallerStream(second):
                r2 = m([x2])[0]
            time.sleep(0.05)
            assert not r2.ready(), "the execute on the new stream ran before the held one"
            latch.release()
            check(p, [x1], [r1])
            check(p, [x2], [r2])


def test_concurrent_execute_from_two_threads_is_refused(host):
    p = mlp()
    m = p.method("forward", device=host)
    x = x_for(p)
    m.set_inputs([x])
    inside, go_on = threading.Event(), threading.Event()
    run, ins, outs = m._steps[0]

    def slow_run(stream, a, b):
        inside.set()
        go_on.wait(5)
        run(stream, a, b)

    m._steps[0] = (slow_run, ins, outs)
    t = threading.Thread(target=m.execute)
    t.start()
    assert inside.wait(5)
    with pytest.raises(InvalidState, match="another thread"):
        m.execute()
    with pytest.raises(InvalidState, match="another thread"):
        m.set_inputs([x])
    # get_outputs() took no guard: "no outputs to get; call execute()", or, depending on
    # timing, the outputs of the other thread's call (README: each call is held the same way)
    with pytest.raises(MethodBusy, match=r"get_outputs.*in use.*another thread"):
        m.get_outputs()
    go_on.set()
    t.join(5)
    check(p, [x], m.get_outputs())


def test_a_method_called_from_within_its_own_call_is_told_so(host):
    """An input's ``__array__`` calling the method back on the same thread was refused as
    "while another thread is using this method"."""
    p = mlp()
    m = p.method("forward", device=host)
    x = x_for(p)
    seen = []

    class Reentrant:
        def __array__(self, dtype=None, copy=None):
            with pytest.raises(MethodBusy, match="a call of it this one comes from") as info:
                m([x])
            seen.append(info.value)
            return x

    check(p, [x], m([Reentrant()]))
    assert len(seen) == 1


def test_calls_a_thread_pool_hands_over_in_order_are_never_refused(device):
    """A task that runs set_inputs / execute / get_outputs one after another on a thread pool
    (as ``asyncio.to_thread`` does) lands them on whichever workers are free: an ordered
    hand-over with no lock the method can see. It must run, with the task's own outputs
    (a refusal by thread, tried once, refused some of these). Three one-thread workers,
    picked at random for each call, stand for the pool."""
    from concurrent.futures import ThreadPoolExecutor

    p = mlp()
    m = p.method("forward", device=device)
    xs = [x_for(p) for _ in range(3)]
    rng = np.random.default_rng(7)
    workers = [ThreadPoolExecutor(1) for _ in range(3)]
    try:
        def on_pool(fn, *args):
            return workers[rng.integers(3)].submit(fn, *args).result(30)

        for turn in range(200):
            x = xs[turn % 3]
            on_pool(m.set_inputs, [x])
            on_pool(m.execute)
            if turn % 4 == 1:
                on_pool(m.execute)  # again, what is installed
            check(p, [x], on_pool(m.get_outputs))
            if turn % 5 == 2:
                check(p, [x], on_pool(m, [x]))
    finally:
        for w in workers:
            w.shutdown()


def test_threads_taking_turns_under_a_lock_are_never_refused(host):
    """The lock README asks for works: four threads driving one method with the three calls
    under a lock (and now and then m(x), or an execute of what is installed) are never
    refused, and each gets the outputs of its own inputs."""
    p = mlp()
    m = p.method("forward", device=host)
    xs = [x_for(p) for _ in range(4)]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def drive(i: int) -> None:
        try:
            for turn in range(60):
                with lock:
                    if turn % 5 == 4:
                        (y,) = m([xs[i]])
                    else:
                        m.set_inputs([xs[i]])
                        m.execute()
                        if turn % 7 == 3:
                            m.execute()  # again, what is installed: this thread's
                        (y,) = m.get_outputs()
                check(p, [xs[i]], [y])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors[0]


def test_a_call_from_another_thread_at_any_point_of_m_x_never_changes_its_result(host):
    """``m(x)`` is one call under rule 4: at every point inside it (each return from a function
    of runtime/method.py, reached by a profile hook in the calling thread), a second thread
    calling ``m(y)`` is refused or gets its own result, and the first still gets ``f(x)``.
    Calling set_inputs/execute/get_outputs one after another, with the guard released in
    between, let the second thread's inputs into the first's execute."""
    import sys

    import streamlane.runtime.method as method_module

    p = mlp()
    m = p.method("forward", device=host)
    x, y = x_for(p), x_for(p)
    paused, resume = threading.Event(), threading.Event()
    outcomes: list[str] = []
    here = method_module.__file__

    def pause_at_returns(frame, event, arg):
        if event == "return" and frame.f_code.co_filename == here:
            paused.set()
            assert resume.wait(5)
            resume.clear()

    def first() -> None:
        sys.setprofile(pause_at_returns)
        try:
            results.append(m([x]))
        finally:
            sys.setprofile(None)
            paused.set()

    results: list[list[Result]] = []
    t = threading.Thread(target=first)
    t.start()
    while t.is_alive() or paused.is_set():
        if not paused.wait(0.05):
            continue
        paused.clear()
        if not t.is_alive() and results:
            break
        try:
            check(p, [y], m([y]))
            outcomes.append("ran")
        except InvalidState as exc:
            assert "another thread" in str(exc)
            outcomes.append("refused")
        resume.set()
    t.join(5)
    assert len(outcomes) >= 5, outcomes  # it did pause inside the call
    check(p, [x], results[0])


def test_objects_that_refuse_host_conversion_raise_invalid_input(host):
    class DeviceOnly:
        def __array__(self, *args, **kwargs):
            raise TypeError("implicit conversion to a host array is not allowed")

    m = mlp().method("forward", device=host)
    with pytest.raises(InvalidInput, match="implicit conversion") as info:
        m.set_inputs([DeviceOnly()])
    assert info.value.index == 0


class _CudaArrayInterface:
    """An object exposing only ``__cuda_array_interface__`` (as CuPy or torch arrays do)."""

    def __init__(self, array, stream=None):
        self.array = array  # keeps the memory alive
        self.__cuda_array_interface__ = {
            "shape": array.shape, "typestr": array.dtype.str, "version": 3,
            "data": (array.__array_interface__["data"][0], False),
            "strides": None if array.flags.c_contiguous else array.strides, "stream": stream}


def emulated_cuda_host():
    """The host device presenting itself as CUDA, so the ``__cuda_array_interface__`` input path
    (borrowed memory, and the on-device gather of other layouts) runs on host memory."""
    from streamlane.runtime.host import HostDevice

    class Emulated(HostDevice):
        kind = "cuda"

    return Emulated()


@pytest.mark.parametrize("make", [lambda a: a, lambda a: a.T, lambda a: a[::2, ::3].T,
                                  lambda a: np.asfortranarray(a)[:, 1:]],
                         ids=["contiguous", "transposed", "sliced", "fortran"])
def test_device_arrays_in_another_layout_are_gathered_on_the_device(make):
    dev = emulated_cuda_host()
    base = RNG.standard_normal((16, 24)).astype(np.float32)
    x = make(base)
    b = Program.build("twice")
    m_ = b.method("forward", x=("float32", list(x.shape)))
    m_.output(m_.step("scale", "x", out="y", factor=2.0))
    m = b.finish().method("forward", device=dev)
    out = m([_CudaArrayInterface(x)])[0]
    np.testing.assert_array_equal(out.to_host(), 2 * x)
    x2 = make(RNG.standard_normal((16, 24)).astype(np.float32))
    np.testing.assert_array_equal(m([_CudaArrayInterface(x2)])[0].to_host(), 2 * x2)


def test_malformed_cuda_array_interfaces_raise_invalid_input():
    dev = emulated_cuda_host()
    m = mlp().method("forward", device=dev)
    good = _CudaArrayInterface(RNG.standard_normal((4, 16)).astype(np.float32))
    for bad in ({"shape": (4, 16)}, {**good.__cuda_array_interface__, "strides": (4,)},
                {**good.__cuda_array_interface__, "strides": ("x", 4)},
                {**good.__cuda_array_interface__, "typestr": "<f8"}):
        obj = _CudaArrayInterface(good.array)
        obj.__cuda_array_interface__ = bad
        with pytest.raises(InvalidInput) as info:
            m.set_inputs([obj])
        assert info.value.index == 0


@pytest.mark.cuda
def test_torch_and_cupy_inputs_in_other_layouts_are_gathered_on_the_gpu(cuda_device):
    torch = pytest.importorskip("torch")
    b = Program.build("twice")
    m_ = b.method("forward", x=("float32", [24, 16]))
    m_.output(m_.step("scale", "x", out="y", factor=2.0))
    m = b.finish().method("forward", device=cuda_device)
    base = RNG.standard_normal((16, 24)).astype(np.float32)
    t = torch.from_numpy(base).cuda().T  # a transposed view: strides (1, 24) elements
    assert not t.is_contiguous()
    np.testing.assert_array_equal(m([t])[0].to_host(), 2 * base.T)
    cp = pytest.importorskip("cupy")
    c = cp.asarray(base.T.copy())[::-1]  # negative strides
    np.testing.assert_array_equal(m([c])[0].to_host(), 2 * base.T[::-1])


def test_binding_a_long_chain_takes_time_linear_in_its_steps(host):
    """An untrusted manifest may hold ~100,000 steps within the size limit: binding rebuilt a
    table of every tensor per step (8,000 steps: 4.6 s, quadratic). Best of three, 1,000
    against 8,000 steps: linear is ~8x, quadratic 64x."""

    def chain(n):
        b = Program.build(f"chain{n}")
        m = b.method("forward", x=("float32", [1]))
        h = "x"
        for i in range(n):
            h = m.step("relu", h, out="y" if i == n - 1 else None)
        m.output("y")
        return b.finish()

    def bind_s(program):
        best = float("inf")
        for _ in range(3):
            t = time.perf_counter()
            program.method("forward", device=host)
            best = min(best, time.perf_counter() - t)
        return best

    short, long = bind_s(chain(1000)), bind_s(chain(8000))
    assert long < 30 * short, f"1,000 steps bind in {short:.3f} s, 8,000 in {long:.3f} s"


# -- an execute that fails partway ------------------------------------------------------------

def _fail_pool_growth(monkeypatch):
    """The next growth of an output pool fails as a full device does (the allocation raises)."""
    from streamlane.runtime.result import OutputPool

    def grow(self, stream):
        raise DeviceError("injected: out of memory", "CUDA_ERROR_OUT_OF_MEMORY")

    monkeypatch.setattr(OutputPool, "_grow", grow)


def test_an_execute_that_failed_partway_still_hands_over_in_device_order(device, monkeypatch):
    """An execute that raised after enqueuing part of its work (its input's upload; then its
    output pool could not grow) left the method's last event at the execute before it: the
    next execute on another stream did not wait for the upload, which, held back on its stream,
    could land in the input slot after the next execute's own upload (rule 4)."""
    p = mlp()
    m = p.method("forward", device=device)
    x1, x2 = x_for(p), x_for(p)
    held = [m([x1])[0] for _ in range(2)]  # both output buffers held: the next execute grows
    with device.create_latch() as latch, device.create_stream() as s1, \
            device.create_stream() as s2:
        latch.hold(s1)
        _fail_pool_growth(monkeypatch)
        with CallerStream(s1), pytest.raises(DeviceError, match="out of memory"):
            m([x1])
        monkeypatch.undo()
        with pytest.raises(InvalidState):  # its outputs may be half written: none are given
            m.get_outputs()
        with CallerStream(s2):
            r = m([x2])[0]
        time.sleep(0.05)
        assert not r.ready(), "the next execute ran before the failed one's upload"
        latch.release()
        with CallerStream(s2):
            check(p, [x2], [r])
    check(p, [x1], held[:1])


def _lines_of(*functions):
    import dis

    return [(f.__code__, line) for f in functions
            for line in sorted({line for _, line in dis.findlinestarts(f.__code__)
                                if line is not None})]


def test_an_execute_cut_short_with_nothing_to_mark_its_end_makes_the_next_wait_for_the_device(
        host, monkeypatch):
    """An execute interrupted partway whose end cannot be marked either (the record itself cut
    short: a second Ctrl-C, or its stream closed by another thread): the next execute, on
    another stream, waits for the whole device before it rewrites the output buffers the
    first one's held work is still writing (rules 4 and 8)."""
    import sys

    from sched_helpers import Interrupt, RaiseAt

    b = Program.build("two", constants={"c": np.full((8, 8), 0.5, np.float32)})
    mb = b.method("forward", x=("float32", [8, 8]))
    h = mb.step("add", "x", "c")
    mb.output(mb.step("scale", h, out="y0", factor=2.0), mb.step("relu", h, out="y1"))
    m = b.finish().method("forward", device=host)
    x0, x1, x2 = (np.full((8, 8), v, np.float32) for v in (1.0, 2.0, 3.0))
    kept = m([x0])  # both outputs' first buffers held: the next executes take the second ones
    record = host._record

    def mark_cut_short(event, impl):
        if sys._getframe(1).f_code.co_name == "_order_after_failure":
            raise Interrupt
        return record(event, impl)

    with host.create_latch() as latch, host.create_stream() as s1, \
            host.create_stream() as s2:
        latch.hold(s1)
        monkeypatch.setattr(host, "_record", mark_cut_short)
        # Cut short before its third step: the first two (the second writes y0) wait on s1.
        cut = RaiseAt(method_module.Method._enqueue, "run(stream, [arrays[k]", nth=3)
        with pytest.raises(Interrupt), cut, CallerStream(s1):
            m([x1])
        monkeypatch.undo()
        assert m.may_wait_on_host()
        opener = threading.Timer(0.5, latch.release)
        opener.start()
        started = time.monotonic()
        with CallerStream(s2):
            again = m([x2])
        waited = time.monotonic() - started
        opener.join()
        host.synchronize()
    for r, want in zip(again, (2 * (x2 + 0.5), x2 + 0.5), strict=True):
        np.testing.assert_array_equal(r.to_host(), want)
    for r, want in zip(kept, (2 * (x0 + 0.5), x0 + 0.5), strict=True):
        np.testing.assert_array_equal(r.to_host(), want)
    assert waited >= 0.4, waited  # it waited for the held work: the latch, then that work
    assert not m.may_wait_on_host()


class _InterruptedAsTaken:
    """A method's guard whose take is interrupted as it returns (a Ctrl-C landing as the
    acquire call returns, before the next statement): the lock is held, the caller sees the
    exception."""

    def __init__(self, real):
        self.real, self.armed = real, True

    def acquire(self, blocking=True):
        from sched_helpers import Interrupt

        got = self.real.acquire(blocking)
        if got and self.armed:
            self.armed = False
            raise Interrupt
        return got

    def release(self):
        self.real.release()

    def _is_owned(self):
        return self.real._is_owned()


@pytest.mark.parametrize("call", ["__call__", "set_inputs", "execute", "get_outputs"])
def test_a_ctrl_c_as_the_guard_is_taken_leaves_the_method_usable(host, call):
    """The guard was taken before the `try` that gives it back: a Ctrl-C landing as the take
    returned left the method refusing every later call (MethodBusy, for good; a README known
    gap until the twenty-sixth session). It is taken inside the try now."""
    from sched_helpers import Interrupt

    p = mlp()
    m = p.method("forward", device=host)
    x = x_for(p)
    m([x])
    m._guard = _InterruptedAsTaken(m._guard)
    with pytest.raises(Interrupt):
        {"__call__": lambda: m([x]), "set_inputs": lambda: m.set_inputs([x]),
         "execute": m.execute, "get_outputs": m.get_outputs}[call]()
    check(p, [x], m([x]))  # usable: every call takes the guard again
    m.set_inputs([x])
    m.execute()
    check(p, [x], m.get_outputs())


def test_a_ctrl_c_anywhere_in_execute_leaves_the_next_execute_ordered(host):
    """A Ctrl-C raised at each line of execute in turn (sys.settrace line events: where a
    signal lands), while that execute's earlier work is held on its stream by a latch. The
    next execute, on another stream, must still come out right after the latch lets go: it
    did not when the Ctrl-C landed after the work was enqueued but before its event was noted
    (its output buffer, taken again, was then rewritten by the held work)."""
    import sys

    from sched_helpers import Interrupt

    b = Program.build("two", constants={"c": np.full((8, 8), 0.5, np.float32)})
    mb = b.method("forward", x=("float32", [8, 8]))
    h = mb.step("add", "x", "c")  # an internal buffer
    mb.output(mb.step("scale", h, out="y0", factor=2.0), mb.step("relu", h, out="y1"))
    program = b.finish()
    x0, x1, x2 = (np.full((8, 8), v, np.float32) for v in (1.0, 2.0, 3.0))
    hit = []
    for code, line in _lines_of(method_module.Method._execute, method_module.Method._enqueue):
        m = program.method("forward", device=host)
        kept = m([x0])  # both outputs' first buffers held
        armed = [True]

        def local(frame, event, arg, code=code, line=line, armed=armed):
            if event == "line" and frame.f_lineno == line and armed[0]:
                armed[0] = False
                raise Interrupt

        def tracer(frame, event, arg, code=code, local=local):
            return local if frame.f_code is code else None

        with host.create_latch() as latch, host.create_stream() as s1, \
                host.create_stream() as s2:
            latch.hold(s1)
            sys.settrace(tracer)
            try:
                with CallerStream(s1):
                    m([x1])
            except Interrupt:
                hit.append(line)
            finally:
                sys.settrace(None)
            with CallerStream(s2):
                again = m([x2])
            deadline = time.monotonic() + 0.05  # run now, unless it waits for s1 (it should
            while not again[0].ready() and time.monotonic() < deadline:  # once any of the
                time.sleep(0.002)  # interrupted execute's work was enqueued there)
            latch.release()
            host.synchronize()
            for r, want in zip(again, (2 * (x2 + 0.5), x2 + 0.5), strict=True):
                np.testing.assert_array_equal(r.to_host(), want, err_msg=f"line {line}")
        for r, want in zip(kept, (2 * (x0 + 0.5), x0 + 0.5), strict=True):
            np.testing.assert_array_equal(r.to_host(), want, err_msg=f"line {line}")
    assert len(hit) > 20, hit  # the interrupt landed on most lines (some only run elsewhere)


@pytest.mark.parametrize("failure", ["closed stream", "last step"])
@pytest.mark.parametrize("clone", [True, False], ids=["own buffers", "views"])
def test_a_failed_execute_keeps_the_last_outputs_unless_it_may_have_rewritten_them(
        host, clone, failure):
    """The last execute's outputs, in buffers of their own, stand after an execute that failed
    partway (here its last step), as they did before a failure was recorded; views it may have
    half rewritten do not. An execute refused for its stream (closed) touches nothing: every
    output stands."""
    from streamlane.runtime.errors import DeviceError, StreamClosed

    p = mlp()
    m = p.method("forward", device=host, clone_outputs=clone)
    x = x_for(p)
    m.set_inputs([x])
    m.execute()
    first = m.get_outputs()
    stream = host.create_stream()
    with CallerStream(stream):
        if failure == "closed stream":
            stream.close()
            error = StreamClosed
        else:
            def fail(stream, ins, outs):
                raise DeviceError("injected: the last step failed", "CUDA_ERROR_LAUNCH_FAILED")

            last = m._steps[-1]
            m._steps[-1] = (fail, *last[1:])
            error = DeviceError
        with pytest.raises(error):
            m.execute()
        if failure == "last step":
            m._steps[-1] = last
    if clone or failure == "closed stream":
        assert [r.array.ptr for r in m.get_outputs()] == [r.array.ptr for r in first]
        check(p, [x], first)
    else:
        with pytest.raises(InvalidState):
            m.get_outputs()
    m.execute()
    check(p, [x], m.get_outputs())


def test_a_caller_stream_closed_by_another_thread_before_the_last_record_hangs_nothing(host):
    """Another thread closed the execute's caller stream (a CallerStream does not pin it)
    between the last step and the execute's final event record. The record reused the stream
    checked before the first step and failed after marking the event recorded: the method's
    last event and its output buffer's event then waited for a marker nothing would reach,
    and the next execute, from this thread's stream, hung in its rule-4 wait. Forced here at
    that line (sys.settrace); it also happened by chance, about 1 run in 80."""
    import inspect
    import sys
    import threading

    from streamlane.runtime import method as method_module
    from streamlane.runtime.errors import StreamClosed

    p = mlp()
    m = p.method("forward", device=host)
    x = x_for(p)
    lines = inspect.getsourcelines(method_module)[0]
    target = next(i for i, text in enumerate(lines, 1) if "device._record(event, impl" in text)
    stream = host.create_stream()
    with CallerStream(stream):
        m([x])[0].to_host()
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target and not fired:
            fired.append(True)
            closer = threading.Thread(target=stream.close)
            closer.start()
            closer.join()
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename == method_module.__file__ else None

    sys.settrace(tracer)
    try:
        with CallerStream(stream), pytest.raises(StreamClosed):
            m([x])
    finally:
        sys.settrace(None)
    assert fired
    result = []
    thread = threading.Thread(target=lambda: result.append(m([x])[0].to_host()), daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "the next execute waited for an event nothing will reach"
    check(p, [x], [Result.from_host(result[0], host)])


# -- callable steps, from a review (each failed on the code before it) ------------------------
def _one_call(fn, outs=(("y", "float32", [4]),)):
    b = Program.build("p")
    m = b.method("f", x=("float32", [4]))
    m.call(fn, ["x"], list(outs))
    m.output(outs[0][0])
    return b.finish()


def test_a_callable_step_may_use_the_stream_it_is_handed(device):
    """On the host device the step ran on the stream's worker but was handed the caller's
    per-thread Stream, which refuses other threads: s.record() faulted the device. And
    s.synchronize() inside a step hung (a marker behind the running step)."""
    x = np.arange(4, dtype=np.float32)

    def record_then_double(s, ins, outs):
        s.record()
        if device.kind == "host":
            s.synchronize()  # what ran before the step is done: returns at once
            outs[0][...] = ins[0] * 2

    if device.kind != "host":
        pytest.skip("the step's work is numpy here; on CUDA a step enqueues device work")
    method = _one_call(record_then_double).method("f", device=device)
    np.testing.assert_array_equal(method([x])[0].to_host(), 2 * x)
    with device.create_stream() as s, CallerStream(s):
        np.testing.assert_array_equal(method([x])[0].to_host(), 2 * x)
    assert not device.lost


def test_a_step_waiting_for_an_event_after_it_on_its_own_stream_is_refused(host):
    seen = []

    def wait_for_later(s, ins, outs):
        later = s.record()  # behind this step on its own stream: never reached while it runs
        try:
            later.synchronize()
        except InvalidState as exc:
            seen.append(exc)
        outs[0][...] = ins[0]

    _one_call(wait_for_later).method("f", device=host)([np.ones(4, np.float32)])[0].to_host()
    assert seen and "cannot be reached until the step returns" in str(seen[0])


def test_callable_steps_that_would_not_run_are_refused_when_added():
    """An async def was accepted and never ran (outputs left as they were), and a callable of
    the wrong arity faulted the device at its first run."""
    async def not_a_step(s, ins, outs):
        outs[0][...] = ins[0]

    def generator(s, ins, outs):
        yield

    for bad in (not_a_step, generator):
        with pytest.raises(InvalidProgram, match="not an async def or a generator"):
            _one_call(bad)
    with pytest.raises(InvalidProgram, match=r"taking \(stream, ins, outs\)"):
        _one_call(lambda s, ins: None)


def test_a_step_returning_an_awaitable_is_an_error_not_a_silent_no_op(device):
    class AsyncStep:  # an object whose __call__ is async: not caught when the step is added
        async def __call__(self, s, ins, outs):
            outs[0][...] = ins[0]

    method = _one_call(AsyncStep()).method("f", device=device)
    if device.kind == "host":  # run in stream order: the device faults, as for any raise
        try:
            with pytest.raises(DeviceError) as info:
                method([np.ones(4, np.float32)])[0].to_host()
        finally:
            device.reset_error()
        assert isinstance(info.value.__cause__, InvalidArgument)
        assert "returned an awaitable" in str(info.value.__cause__)
    else:
        with pytest.raises(InvalidArgument, match="returned an awaitable"):
            method([np.ones(4, np.float32)])


def test_call_outputs_are_checked_when_added_and_agree_with_earlier_declarations():
    """outs were checked only at finish() (the bad step stayed in the builder, which could not
    be repaired), numpy dims were refused, and an output naming an existing buffer with
    another dtype or shape was taken, silently keeping the first declaration."""
    def same(s, ins, outs):
        outs[0][...] = ins[0]

    b = Program.build("p")
    m = b.method("f", x=("float32", [4]))
    with pytest.raises(InvalidProgram, match=r"steps\[0\]\.out\[0\]\.dtype"):
        m.call(same, ["x"], [("z", "bogus", [4])])
    with pytest.raises(InvalidProgram, match=r"steps\[0\]\.out\[0\]\.shape\[0\]"):
        m.call(same, ["x"], [("z", "float32", [-1])])
    h = m.step("relu", "x", out="h")
    with pytest.raises(InvalidProgram, match=r"'h' as declared before: float32\[4\]"):
        m.call(same, [h], [("h", "int64", [2, 3])])
    m.call(same, [h], [("y", np.float32, [np.int64(4)])])
    m.output("y")
    x = np.arange(4, dtype=np.float32) - 2
    from streamlane.runtime import get_device

    out = b.finish().method("f", device=get_device("host"))([x])[0].to_host()
    np.testing.assert_array_equal(out, np.maximum(x, 0))


def test_call_returns_its_output_names_and_output_says_what_it_got():
    """step() returns its output's name, call() returned None, and m.output(m.call(...)) then
    failed at finish() with "expected a name", saying nothing of call() or None."""
    def split(s, ins, outs):
        outs[0][...] = ins[0]
        outs[1][...] = -ins[0]

    b = Program.build("p")
    m = b.method("f", x=("float32", [4]))
    names = m.call(split, ["x"], [("a", "float32", [4]), ("b", "float32", [4])])
    assert names == ("a", "b")
    for bad in (None, names):
        with pytest.raises(InvalidProgram, match=r"outputs\[0\]\.name.*m\.output\(\*m\.call"):
            m.output(bad)  # type: ignore[arg-type]
    m.output(*names)
    from streamlane.runtime import get_device

    x = np.arange(4, dtype=np.float32)
    a, neg = b.finish().method("f", device=get_device("host"))([x])
    np.testing.assert_array_equal(neg.to_host(), -a.to_host())


def test_a_callable_step_gets_read_only_inputs_on_the_host_device(host):
    """A step wrote into its input views: a constant drifted from call to call, and another
    method's Result passed in was rewritten."""
    errors = []

    def scribble(s, ins, outs):
        try:
            ins[0][...] = 99
        except ValueError as exc:
            errors.append(exc)
        outs[0][...] = ins[0]

    x = Result.from_host(np.ones(4, np.float32), host)
    _one_call(scribble).method("f", device=host)([x])[0].to_host()
    assert errors and "read-only" in str(errors[0])
    np.testing.assert_array_equal(x.to_host(), np.ones(4, np.float32))


def test_a_host_fault_is_raised_fresh_each_time_with_the_steps_error_as_cause(host):
    """One DeviceError instance was raised again and again: its traceback grew with every
    raise and kept every caller's frames alive, and the step's own exception was lost."""
    def boom(s, ins, outs):
        raise RuntimeError("boom in a step")

    method = _one_call(boom).method("f", device=host)
    seen = []
    try:
        for _ in range(3):
            with pytest.raises(DeviceError) as info:
                method([np.ones(4, np.float32)])[0].to_host()
            seen.append(info.value)
    finally:
        host.reset_error()
    assert len({id(e) for e in seen}) == 3
    assert all(isinstance(e.__cause__, RuntimeError) for e in seen)
    assert "boom in a step" in str(seen[0])


@pytest.mark.parametrize("consumer", ["reduce_sum", "softmax", "layernorm", "matmul"])
def test_the_reference_gives_a_fill_its_declared_shape(device, consumer):
    """fill's float64 reference is a 0-d value: a step reading it saw a scalar, so reduce_sum
    gave [2.] for [8, 8, 8], softmax 1.0 for 0.25s, and layernorm and matmul raised numpy
    errors, while the device was right."""
    b = Program.build("f")
    m = b.method("forward", x=("float32", [3, 4]))
    f = m.step("fill", shape=(3, 4), value=2.0)
    if consumer == "matmul":
        m.output(m.step("matmul", f, m.step("fill", shape=(4, 2), value=1.0), out="y"))
    else:
        m.output(m.step(consumer, f, out="y"))
    p = b.finish()
    x = np.ones((3, 4), np.float32)
    (want,) = run_reference(p, "forward", [x])
    (got,) = p.method("forward", device=device)([x])
    assert want.shape == got.shape
    np.testing.assert_allclose(got.to_host(), want, rtol=1e-6, atol=1e-6)


def test_the_reference_checks_its_inputs_as_set_inputs_does():
    """run_reference checked only the count: a (2, 3) input to a [4, 16] method gave a (2, 3)
    'reference', and a string a raw numpy ValueError."""
    p = Program.build("r")
    m = p.method("forward", x=("float32", [4, 16]))
    m.output(m.step("relu", "x", out="y"))
    p = p.finish()
    for bad, match in ((np.ones((2, 3)), r"shape \[2, 3\]"), (np.array(["a"] * 64).reshape(4, 16),
                       "dtype <U1"), (object(), "float32"), ("abc", "dtype")):
        with pytest.raises(InvalidInput, match=match) as info:
            run_reference(p, "forward", [bad])
        assert info.value.index == 0
    with pytest.raises(InvalidInput, match="1 inputs"):
        run_reference(p, "forward", [])
    with pytest.raises(InvalidArgument, match="no method 'back'"):
        run_reference(p, "back", [np.ones((4, 16))])
    x = np.arange(64, dtype=np.float64).reshape(4, 16) - 30  # any real dtype: float64 here
    np.testing.assert_array_equal(run_reference(p, "forward", [x])[0], np.maximum(x, 0))


def test_check_inputs_checks_what_it_can_now_and_installs_nothing():
    """``check_inputs`` raises what ``set_inputs`` raises for the count, numpy arrays, Results,
    numbers and objects no input can be; returns checked copies of host data (C order) and
    leaves objects read later, and the types the caller checks, as given. The method's state
    does not change: an execute still needs set_inputs first."""
    b = Program.build("check")
    m = b.method("forward", x=("float32", [2, 3]), k=("float32", []))
    m.output(m.step("scale", "x", out="y", factor=2.0))
    meth = b.finish().method("forward", device=get_host())

    class Later:
        def __array__(self, dtype=None, copy=None):
            return np.zeros(7)  # wrong, but read only by set_inputs

    class Mine:
        pass

    class Broken:
        @property
        def __cuda_array_interface__(self):
            return 1 / 0

    class BadFloat(float):
        def __float__(self):
            raise RuntimeError("no")

    class BadRepr(int):
        def __repr__(self):
            raise RuntimeError("no")

    x = np.arange(6, dtype=np.float32).reshape(3, 2).T  # another layout
    checked = meth.check_inputs([x, 2])
    assert checked[0].flags.c_contiguous and not np.shares_memory(checked[0], x)
    np.testing.assert_array_equal(checked[0], x)
    assert checked[1].shape == () and checked[1].dtype == np.float32
    plain = np.ones((2, 3), np.float32)
    copied = meth.check_inputs((plain, 1.5))[0]
    plain[:] = 5
    assert (copied == 1).all()  # a copy the caller's later change does not reach
    later, mine = Later(), Mine()
    assert meth.check_inputs([later, 1])[0] is later
    for unchecked in (Mine, (Mine,), [Mine]):
        assert meth.check_inputs([mine, 1], unchecked=unchecked)[0] is mine
    for wrong in ("Mine", (Mine, 3)):
        with pytest.raises(InvalidArgument, match="takes a type or a tuple of types"):
            meth.check_inputs([mine, 1], unchecked=wrong)
    r = Result.from_host(plain, get_host())
    assert meth.check_inputs([r, 1])[0] is r
    for values, index, message in [
        ([plain], None, "expected 2 inputs, got 1"),
        ("ab", None, "expected a list of inputs, got str"),
        ([plain.astype(np.int32), 1], 0, "got dtype int32"),
        ([Result.from_host(np.ones(3, np.float32), get_host()), 1], 0, r"got shape \[3\]"),
        ([mine, 1], 0, "got Mine"),
        ([plain, "2"], 1, "got str$"),
        ([Broken(), 1], 0, "ZeroDivisionError"),
        ([plain, 2**200], 1, "float32 scalar within its range"),
        ([plain, 10**5000], 1, "an int of 16610 bits"),  # past str()'s digit limit
        ([10**5000, 1], 0, "an int of 16610 bits"),
        ([plain, BadFloat(1.0)], 1, "converting it raised RuntimeError"),
        ([BadRepr(3), 1], 0, "whose repr\\(\\) raised RuntimeError"),
        ([plain, np.str_("2")], 1, "got dtype <U1"),  # numpy scalars are checked now too
        ([plain, np.datetime64("2026-01-01")], 1, "got dtype datetime64"),
    ]:
        with pytest.raises(InvalidInput, match=message) as info:
            meth.check_inputs(values)
        assert info.value.index == index
    with pytest.raises(InvalidState):
        meth.execute()  # nothing was installed
    meth.set_inputs(checked)
    meth.execute()
    np.testing.assert_array_equal(meth.get_outputs()[0].to_host(), 2 * x)


@pytest.mark.parametrize("kernel, params, x", [
    ("layernorm", {"eps": 0.0}, np.ones((2, 4), np.float32)),
    ("softmax", {}, np.array([[np.inf, 1, 2]], np.float32)),
])
def test_the_reference_gives_ieee_results_without_warnings(host, kernel, params, x):
    """``run_reference`` warned (raised under ``-W error``) where the device gives NaN: a
    constant row's layernorm without eps, a softmax of a row holding inf (a review)."""
    import warnings

    b = Program.build("p")
    m = b.method("f", x=("float32", list(x.shape)))
    m.output(m.step(kernel, "x", **params))
    p = b.finish()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ref = run_reference(p, "f", [x])[0]
    dev = p.method("f", device=host)([x])[0].to_host()
    np.testing.assert_array_equal(np.isnan(ref), np.isnan(dev))


def test_a_second_ctrl_c_in_a_failed_execute_leaves_the_next_execute_ordered(host,
                                                                            monkeypatch):
    """A Ctrl-C after the steps were enqueued (at the record), then a second one at the first
    line of the failure's handling, before it marks where that part ends: the method's next
    execute on another stream ran unordered with the failed part, still queued behind a
    delay, and its output read 30 (5 * 2 * 3, the failed call's) instead of 6."""
    import sys

    from streamlane.runtime import method as method_module

    b = Program.build("two")
    mb = b.method("forward", x=("float32", [1 << 12]))
    h = mb.step("scale", "x", factor=2.0)
    mb.output(mb.step("scale", h, out="y", factor=3.0))
    m = b.finish().method("forward", device=host)
    x = np.ones(1 << 12, np.float32)
    s, t = host.create_stream(), host.create_stream()
    code = method_module.Method._execute.__code__
    # the handler's first step (its first line, `except` itself, is no place a fix can reach)
    target = next(i for i, line in enumerate(inspect.getsourcelines(code)[0],
                                             code.co_firstlineno)
                  if "self._outputs = previous" in line)
    state = {"interrupts": 0}

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def line(f, e, a):
            if e == "line" and f.f_lineno == target and state["interrupts"] == 1:
                state["interrupts"] += 1
                raise KeyboardInterrupt
            return line
        return line

    with CallerStream(s):
        m([x])
        host.inject_delay(s, 0.3)  # the failed call's part runs late on s
        real = type(host)._record

        def record(self, event, impl):
            monkeypatch.setattr(type(host), "_record", real)
            state["interrupts"] += 1
            raise KeyboardInterrupt

        monkeypatch.setattr(type(host), "_record", record)
        sys.settrace(tracer)
        try:
            with pytest.raises(KeyboardInterrupt):
                m([x * 5])
        finally:
            sys.settrace(None)
    assert state["interrupts"] == 2
    with CallerStream(t):
        (y,) = m([x])
        time.sleep(0.6)  # the failed part, were it unordered, has run over y's buffer by now
        np.testing.assert_array_equal(y.to_host(), 6 * x)
    s.close()
    t.close()


def test_inputs_come_in_any_sequence_but_a_str_or_an_array(host):
    """``Method`` took only a list or a tuple (``UserList`` refused as "expected a list of
    inputs") while ``Scheduler.submit`` and the annotation (``Sequence``) took any sequence."""
    from collections import UserList

    p = mlp()
    m = p.method("forward", device=host)
    x = x_for(p)
    check(p, [x], m(UserList([x])))
    m.set_inputs(UserList([x]))
    assert len(m.check_inputs(UserList([x]))) == 1
    import array

    for bad in ("x", b"x", x, {0: x}, memoryview(b"\x01"), array.array("f", [1.0])):
        with pytest.raises(InvalidInput, match="a list of inputs"):
            m(bad)

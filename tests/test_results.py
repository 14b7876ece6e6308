"""Results without copies: two buffers taking turns, safe reuse across streams (rule 8),
one host wait per call (rule 6), interop."""

from __future__ import annotations

import gc
import itertools
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from thread_helpers import waits_until_released

from streamlane.runtime import CallerStream, Program, Result
from streamlane.runtime.errors import InvalidArgument, InvalidInput
from streamlane.runtime.result import TRIM_AFTER

RNG = np.random.default_rng()


def scaler(shape=(64, 64), factor=2.0):
    b = Program.build("scaler")
    m = b.method("forward", x=("float32", list(shape)))
    m.output(m.step("scale", "x", out="y", factor=factor))
    return b.finish()


def adder(shape=(64, 64)):
    b = Program.build("adder")
    m = b.method("forward", a=("float32", list(shape)), b=("float32", list(shape)))
    m.output(m.step("add", "a", "b", out="y"))
    return b.finish()


def rand(shape=(64, 64)):
    return RNG.standard_normal(shape).astype(np.float32)


def test_outputs_alternate_between_exactly_two_buffers(device):
    m = scaler().method("forward", device=device)
    x = rand()
    out = m([x])[0]
    ptrs = []
    allocs = None
    for i in range(20):
        out = m([x])[0]
        ptrs.append(out.array.ptr)
        if i == 2:
            allocs = device.stats.allocations
    assert len(set(ptrs)) == 2
    assert all(a != b for a, b in itertools.pairwise(ptrs))
    assert device.stats.allocations == allocs, "steady state must not allocate"
    np.testing.assert_array_equal(out.to_host(), 2 * x)


def test_dropped_result_buffer_is_reused(device):
    m = scaler().method("forward", device=device)
    x = rand()
    first = m([x])[0]
    ptr = first.array.ptr
    del first
    gc.collect()
    assert m([x])[0].array.ptr == ptr


def test_held_result_keeps_its_values_across_100_executes(device):
    m = scaler().method("forward", device=device)
    x = rand()
    held = m([x])[0]
    for _ in range(100):
        m([rand()])
    np.testing.assert_array_equal(held.to_host(), 2 * x)


def test_when_both_buffers_are_held_the_next_execute_allocates(device):
    m = scaler().method("forward", device=device)
    xs = [rand() for _ in range(3)]
    held = [m([x])[0] for x in xs]
    assert len({r.array.ptr for r in held}) == 3
    for r, x in zip(held, xs, strict=True):
        np.testing.assert_array_equal(r.to_host(), 2 * x)
    del held, r
    gc.collect()
    for _ in range(TRIM_AFTER + 2):
        out = m([xs[0]])[0]
    assert len(m._pools[0]) == 2, "extra buffers are returned once free for a while"
    np.testing.assert_array_equal(out.to_host(), 2 * xs[0])


def test_many_results_held_in_waves_reuse_their_buffers(device):
    """A lane with a queue of jobs of one method holds one output per job in flight, in waves:
    after the first wave the pool has them all, and later waves allocate nothing (a pool that
    trimmed to the moment's demand reallocated every wave)."""
    m = scaler(shape=(16,)).method("forward", device=device)
    x = rand((16,))
    wave = 2 * TRIM_AFTER
    held = [m([x])[0] for _ in range(wave)]
    del held
    before = device.stats.allocations
    for _ in range(5):
        held = [m([x])[0] for _ in range(wave)]
        np.testing.assert_array_equal(held[-1].to_host(), 2 * x)
        del held
    assert device.stats.allocations == before, "a steady wave of results reallocated buffers"


def test_a_burst_of_held_results_is_freed_after_two_windows(device):
    m = scaler(shape=(16,)).method("forward", device=device)
    x = rand((16,))
    burst = [m([x])[0] for _ in range(3 * TRIM_AFTER)]
    size = len(m._pools[0])
    assert size == 3 * TRIM_AFTER
    del burst
    for _ in range(2 * size):  # back to holding one result while computing the next
        out = m([x])[0]
    assert len(m._pools[0]) == 2
    np.testing.assert_array_equal(out.to_host(), 2 * x)


class _Looked(list):
    """A pool's buffer list that counts the buffers its search looks at (by index)."""

    looked = 0

    def __getitem__(self, i):
        _Looked.looked += 1
        return super().__getitem__(i)


def test_holding_thousands_of_results_costs_no_search_each(device):
    """Submit-then-gather holds one output per call: every execute searched the whole pool,
    found every buffer held and grew it, so a call cost grew with the Results held (1.2 ms
    each with 8,000 held on the host device, quadratic overall). The pool remembers that all
    were held until one is let go."""
    m = scaler(shape=(16,)).method("forward", device=device)
    x = rand((16,))
    held = [m([x])[0] for _ in range(1000)]
    pool = m._pools[0]
    pool.buffers = _Looked(pool.buffers)
    _Looked.looked = 0
    held += [m([x])[0] for _ in range(200)]
    assert _Looked.looked <= 2 * 1250, "each execute searched the held buffers"
    assert len(pool) == 1200
    for r in held[-5:]:
        np.testing.assert_array_equal(r.to_host(), 2 * x)
    # One let go: the next execute searches and takes it, growing nothing.
    freed = held.pop(600).array.ptr
    gc.collect()
    (y,) = m([x])
    assert y.array.ptr == freed and len(pool) == 1200
    np.testing.assert_array_equal(y.to_host(), 2 * x)


def test_a_failed_execute_leaves_the_buffer_it_grew_to_the_next_one(device, monkeypatch):
    """An execute that grew a pool (every buffer held) and then failed before its Results
    were made leaves that buffer free with no let-go counted: each retry grew another."""
    b = Program.build("two")
    m2 = b.method("forward", x=("float32", [16]))
    m2.output(m2.step("scale", "x", out="y", factor=2.0))
    m2.output(m2.step("scale", "x", out="z", factor=3.0))
    m = b.finish().method("forward", device=device)
    x = rand((16,))
    held = [m([x]) for _ in range(200)]
    first, second = m._pools
    size = len(first)
    real = second.make

    def fail(stream):
        raise MemoryError("out of memory (test)")

    monkeypatch.setattr(second, "make", fail)
    for _ in range(20):
        with pytest.raises(MemoryError):
            m([x])
    assert len(first) == size + 1, "each failed execute grew the first pool again"
    monkeypatch.setattr(second, "make", real)
    y, z = m([x])
    np.testing.assert_array_equal(y.to_host(), 2 * x)
    np.testing.assert_array_equal(z.to_host(), 3 * x)
    assert len(held) == 200


def _until_interrupted(m, x, executes=10 * TRIM_AFTER):
    """Execute ``m`` until a call is interrupted (a Ctrl-C injected into a trim); whether
    one was."""
    for _ in range(executes):
        try:
            m([x])
        except KeyboardInterrupt:
            return True
    return False


@pytest.mark.parametrize("burst", [100, 103])
def test_a_ctrl_c_inside_a_trim_never_leaves_a_freed_buffer_in_the_pool(device, monkeypatch,
                                                                        burst):
    """The trim freed its idle buffers, then took them out of the pool: a Ctrl-C between the
    two (after the first free) left a freed buffer listed as free, and the next execute wrote
    its output into memory the device had taken back (on CUDA, another allocation's). Taking
    them out first, it then left the pool's turn past its end (burst 100): IndexError on
    every execute while three Results were held."""
    from streamlane.runtime import memory

    m = scaler(shape=(16,)).method("forward", device=device)
    x = rand((16,))
    held = [m([x]) for _ in range(burst)]
    del held
    gc.collect()
    real = memory.Buffer.free
    interrupted = []

    def free_then_ctrl_c(self, stream=None):
        monkeypatch.setattr(memory.Buffer, "free", real)
        real(self, stream)
        interrupted.append(self)
        raise KeyboardInterrupt

    monkeypatch.setattr(memory.Buffer, "free", free_then_ctrl_c)
    assert _until_interrupted(m, x) and interrupted, "no trim ran"
    assert not any(p.array.buffer.freed for p in m._pools[0].buffers)
    held = [m([x * i]) for i in range(5)]  # a search over more than two buffers
    for i, (y,) in enumerate(held):
        np.testing.assert_array_equal(y.to_host(), 2 * x * i)
    del held
    for i in range(3 * TRIM_AFTER):
        (y,) = m([x * i])
        np.testing.assert_array_equal(y.to_host(), 2 * x * i)


def test_a_buffer_a_ctrl_c_leaves_unfreed_in_a_trim_is_freed_after_its_uses(host,
                                                                            monkeypatch):
    """The trim cleared a buffer's uses (prepare_write) before freeing it: one a Ctrl-C left
    unfreed was freed by its finalizer after nothing, while its stream's work on it could
    still be queued (on CUDA a created stream is not ordered with the free's)."""
    from streamlane.runtime import memory

    m = scaler(shape=(16,)).method("forward", device=host)
    x = rand((16,))
    s = host.create_stream()
    frees = []
    real_free_memory = type(host)._free_memory

    def spy(self, ptr, impl, stream_impl, after):
        frees.append((stream_impl is None, len(after)))
        return real_free_memory(self, ptr, impl, stream_impl, after)

    monkeypatch.setattr(type(host), "_free_memory", spy)
    real = memory.Buffer.free

    def ctrl_c(self, stream=None):  # at the first free, before it
        monkeypatch.setattr(memory.Buffer, "free", real)
        raise KeyboardInterrupt

    with CallerStream(s):
        burst = [m([x]) for _ in range(100)]
        del burst
        gc.collect()
        monkeypatch.setattr(memory.Buffer, "free", ctrl_c)
        assert _until_interrupted(m, x) and memory.Buffer.free is real, "no trim ran"
        gc.collect()
        by_finalizer = [waits for finalizer, waits in frees if finalizer]
        assert by_finalizer and all(by_finalizer), "a buffer was freed after nothing"
        (y,) = m([x])
        np.testing.assert_array_equal(y.to_host(), 2 * x)
    s.close()


def test_a_trim_cut_short_never_frees_a_buffer_read_on_an_unknown_stream_before_a_device_wait(
        host, monkeypatch):
    """Buffers handed to consumers on streams nobody could mark (DLPack stream=-1,
    __cuda_array_interface__) need a device-wide wait before they are freed. The trim took
    them out of the pool before that wait: a Ctrl-C in between (here at the line after) left
    them to their finalizers, which free after their marked uses only."""
    import inspect
    import sys

    from streamlane.runtime import result as result_module

    m = scaler(shape=(16,)).method("forward", device=host)
    x = rand((16,))
    log = []
    real_free, real_sync = type(host)._free_memory, type(host).synchronize

    def free_memory(self, ptr, impl, stream_impl, after):
        log.append(("free", ptr))
        return real_free(self, ptr, impl, stream_impl, after)

    def synchronize(self):
        log.append(("sync", None))
        return real_sync(self)

    monkeypatch.setattr(type(host), "_free_memory", free_memory)
    monkeypatch.setattr(type(host), "synchronize", synchronize)
    code = result_module.OutputPool._check.__code__
    lines = list(enumerate(inspect.getsourcelines(code)[0], code.co_firstlineno))
    decided = next(i for i, line in lines if "freed = idle[" in line)
    target = next(i for i, line in lines if "self.quiet = self.most = 0" in line)
    armed, marks, blind = [], [], set()

    def tracer(frame, event, arg):
        if frame.f_code is not code:
            return None

        def line(f, e, a):
            if e == "line" and f.f_lineno == decided and armed:
                marks.append(len(log))  # the trim is choosing what it frees: which are blind
                blind.clear()
                blind.update(p.array.ptr for p in f.f_locals["self"].buffers if p.blind)
            if e == "line" and f.f_lineno == target and armed:
                armed.clear()
                raise KeyboardInterrupt
            return line
        return line

    s = host.create_stream()
    with CallerStream(s):
        held = [m([x])[0] for _ in range(100)]
        for r in held:  # each read on a stream nobody could mark, then let go
            r._holder.pooled.export_to(None)
        del held, r
        gc.collect()
        armed.append(True)
        sys.settrace(tracer)
        try:
            for _ in range(10 * TRIM_AFTER):
                try:
                    (r,) = m([x])
                    r._holder.pooled.export_to(None)  # every output too
                    del r
                except KeyboardInterrupt:
                    break
        finally:
            sys.settrace(None)
        assert not armed, "no trim ran"
        gc.collect()
        events = log[marks[-1]:]  # from the trim that was cut short
        first_sync = next((i for i, e in enumerate(events) if e[0] == "sync"), len(events))
        early = [ptr for kind, ptr in events[:first_sync] if kind == "free" and ptr in blind]
        assert blind and not early, f"{len(early)} freed before any device-wide wait"
        (y,) = m([x])
        np.testing.assert_array_equal(y.to_host(), 2 * x)
    s.close()


def test_a_lost_count_of_let_go_buffers_costs_a_quarter_more_at_most(device):
    """Results are let go on any thread, and the pool's count of them is a plain `+= 1`:
    two threads interleaving inside it lose one. Then the pool believes every buffer is still
    held; it grows without searching for a quarter of its size at most, then searches."""
    m = scaler(shape=(16,)).method("forward", device=device)
    x = rand((16,))
    held = [m([x])[0] for _ in range(400)]
    pool = m._pools[0]
    assert pool.all_held is not None
    count = pool.let_go[0]
    del held[:200]
    gc.collect()
    pool.let_go[0] = count  # as if every one of those increments was lost
    for _ in range(200):
        held.append(m([x])[0])
    assert 400 < len(pool) <= 400 + 400 // 4 + 1
    for r in held[-3:]:
        np.testing.assert_array_equal(r.to_host(), 2 * x)


def test_a_buffer_still_read_elsewhere_is_neither_rewritten_nor_freed_while_others_are_free(
        device):
    """A pool of four: one dropped buffer still read by a consumer held behind a latch on
    another stream. The search took it in its turn (the producer's execute then waited for
    the latch though three other buffers were free), and the trim freed it on the writer's
    stream after its readers (the execute that trims waited the same way). Both now pass it
    by; once the read is done, the pool shrinks as before."""
    p = scaler(shape=(16,)).method("forward", device=device)
    consumer = scaler(shape=(16,), factor=3.0).method("forward", device=device)
    x = rand((16,))
    s1 = device.create_stream()
    with CallerStream(s1):
        outs = [p([x])[0] for _ in range(4)]
        outs[-1].to_host()
    assert len(p._pools[0]) == 4
    with device.create_latch() as latch, device.create_stream() as held:
        latch.hold(held)
        with CallerStream(held):
            read = consumer([outs[2]])[0]
        consumer.set_inputs([x])  # it lets go of the Result; its read is still queued
        del outs
        for i in range(3 * TRIM_AFTER):  # every buffer's turn, and two trims
            with CallerStream(s1):
                (y,) = p([x])
                done = s1.record()
            deadline = time.monotonic() + 5
            while not done.query() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert done.query(), f"execute {i} waited for the read held on another stream"
        assert not read.ready()
        latch.release()
        with CallerStream(held):
            np.testing.assert_array_equal(read.to_host(), 6 * x)
    for _ in range(3 * TRIM_AFTER):
        with CallerStream(s1):
            (y,) = p([x])
    assert len(p._pools[0]) == 2
    with CallerStream(s1):
        np.testing.assert_array_equal(y.to_host(), 2 * x)


def test_a_result_known_ready_needs_no_device_wait(device, monkeypatch):
    """An input uploaded once and reused (weights, a constant) costs no stream wait per execute
    once it is known ready; until then every consumer stream waits for it."""
    from streamlane.runtime import Stream

    waits = []
    real_wait = Stream.wait
    monkeypatch.setattr(Stream, "wait", lambda s, ev: (waits.append(ev), real_wait(s, ev))[1])
    x = Result.from_host(rand(), device)
    other = device.create_stream()
    x.wait_on(other)
    assert len(waits) == 1, "a result not known ready is waited on"
    np.testing.assert_array_equal(x.to_host(), x.to_host())
    waits.clear()
    x.wait_on(other)
    with CallerStream(other):
        scaler().method("forward", device=device)([x])
    assert waits == [] and x.ready()


def test_clone_outputs_false_returns_views_the_next_execute_overwrites(device):
    m = scaler().method("forward", device=device, clone_outputs=False)
    x1, x2 = rand(), rand()
    r1 = m([x1])[0]
    r2 = m([x2])[0]
    assert r1.array.ptr == r2.array.ptr and r1.view_only
    np.testing.assert_array_equal(r1.to_host(), 2 * x2)


def test_a_view_read_on_another_stream_is_not_overwritten_before_the_read(device):
    """clone_outputs=False: the next execute writes the same buffer, but a read already
    enqueued on another stream (held by a latch) must see the old data (rule 8)."""
    m = scaler().method("forward", device=device, clone_outputs=False)
    consumer = scaler(factor=3.0).method("forward", device=device)
    x1, x2 = rand(), rand()
    with device.create_latch() as latch, device.create_stream() as held:
        latch.hold(held)
        r1 = m([x1])[0]
        with CallerStream(held):
            read = consumer([r1])[0]
        r2 = m([x2])[0]
        time.sleep(0.05)
        assert not r2.ready(), "the next execute overwrote the view before its read"
        latch.release()
        with CallerStream(held):
            np.testing.assert_allclose(read.to_host(), 6 * x1, rtol=1e-6)
    np.testing.assert_array_equal(r2.to_host(), 2 * x2)


def test_a_views_to_host_enqueued_on_another_stream_is_not_overwritten(device):
    """clone_outputs=False: the same with the read a to_host() on another thread's stream (held
    by a latch): it never noted its read among the buffer's readers, so the next execute
    rewrote the view first and the reader got the new data (10 of 10 in a review)."""
    m = scaler().method("forward", device=device, clone_outputs=False)
    x1, x2 = rand(), rand()
    with device.create_latch() as latch, device.create_stream() as held:
        (r1,) = m([x1])
        r1.to_host()
        latch.hold(held)
        box = {}

        def reader() -> None:
            with CallerStream(held):
                box["read"] = r1.to_host()

        t = threading.Thread(target=reader)
        t.start()
        time.sleep(0.2)  # its copy is enqueued behind the latch; to_host() now waits
        (r2,) = m([x2])
        time.sleep(0.05)
        assert not r2.ready(), "the next execute overwrote the view before its read"
        latch.release()
        t.join(10)
        assert not t.is_alive()
    np.testing.assert_allclose(box["read"], 2 * x1, rtol=1e-6)
    np.testing.assert_array_equal(r2.to_host(), 2 * x2)


def test_a_view_read_after_it_on_its_own_stream_is_waited_for_by_another_thread(host):
    """clone_outputs=False, "one method behind a lock": thread A runs the method, then a
    consumer reads the view on A's stream behind a delay; the main thread's next execute must
    wait for that read, not only for A's execute (rule 4 gives the latter, rule 8 the former)."""
    import threading

    m = scaler().method("forward", device=host, clone_outputs=False)
    consumer = scaler(factor=3.0).method("forward", device=host)
    x1, x2 = rand(), rand()
    lock, box = threading.Lock(), {}

    def thread_a():
        with lock:
            view = m([x1])[0]
            host.inject_delay(host.per_thread_stream(), 0.2)
            box["read"] = consumer([view])[0]
        box["queued"].set()
        box["finish"].wait(10)  # keep the thread (and its stream) until the end

    box["queued"], box["finish"] = threading.Event(), threading.Event()
    a = threading.Thread(target=thread_a)
    a.start()
    assert box["queued"].wait(10)
    with lock:
        again = m([x2])[0]
    np.testing.assert_allclose(again.to_host(), 2 * x2, rtol=1e-6)
    box["finish"].set()
    a.join(10)
    np.testing.assert_allclose(box["read"].to_host(), 6 * x1, rtol=1e-6)


def test_a_views_method_refuses_its_own_output_as_input(device):
    """With clone_outputs=False an execute writes its outputs in place: fed back as an input,
    an output would be read and overwritten by the same execute (on CUDA a tiled matmul races
    with itself). Refused, naming the way out; another method may read the view."""
    m = scaler().method("forward", device=device, clone_outputs=False)
    other = scaler(factor=3.0).method("forward", device=device)
    x = rand()
    r = m([x])[0]
    with pytest.raises(InvalidInput, match="clone_outputs") as info:
        m([r])
    assert info.value.index == 0
    np.testing.assert_array_equal(other([r])[0].to_host(), 6 * x)
    again = Result.from_host(r.to_host(), device)
    np.testing.assert_array_equal(m([again])[0].to_host(), 4 * x)


def rewrite_waits_for_the_held_read(producer, x, latch, stream, read, want, factor=2.0):
    """Rule 8: ``producer``'s next execute reuses the buffer of its dropped output, which
    ``read`` (queued on ``stream`` behind ``latch``) still reads: it must wait for that read."""
    gc.collect()
    again = producer([x])[0]
    time.sleep(0.05)
    assert not again.ready(), "the producer rewrote a buffer another stream still reads"
    latch.release()
    with CallerStream(stream):
        np.testing.assert_array_equal(read.to_host(), want)
    np.testing.assert_array_equal(again.to_host(), factor * x)


def test_a_finished_read_does_not_tie_the_producer_to_the_readers_later_work(device):
    """C read P's output on s2 and finished; later C ran again on s3, behind a latch, on other
    input. The read's mark on P's buffer was C's reusable output event, which C's later
    execute re-recorded on s3: P's next execute waited for the latch on s3 (a deadlock when
    the latch is released only after P's result is read). Rule 8 asks for the read only."""
    p, c = scaler().method("forward", device=device), scaler(factor=3.0).method(
        "forward", device=device)
    s1, s2, s3 = device.create_stream(), device.create_stream(), device.create_stream()
    x = rand()
    with CallerStream(s1):
        (y,) = p([x])
    with CallerStream(s2):
        (z,) = c([y])
    np.testing.assert_array_equal(z.to_host(), 6 * x)
    del y, z
    other = Result.from_host(rand(), device)
    with device.create_latch() as latch:
        latch.hold(s3)
        with CallerStream(s3):
            (held,) = c([other])  # C's later work, behind the latch
        for _ in range(3):  # both of P's buffers, and again
            with CallerStream(s1):
                (y,) = p([2 * x])
            done = s1.record()
            deadline = time.monotonic() + 5
            while not done.query() and time.monotonic() < deadline:
                time.sleep(0.001)
            assert done.query(), "P's execute on s1 waited for C's later work on s3"
            with CallerStream(s1):
                np.testing.assert_array_equal(y.to_host(), 4 * x)
        assert not held.ready()  # (the latch still holds C's later work)
        latch.release()
    with CallerStream(s3):
        np.testing.assert_array_equal(held.to_host(), 3 * other.to_host())


def test_consumer_on_another_stream_never_sees_overwritten_data(device):
    """Rule 8: the producer's next execute must not rewrite a buffer that a consumer on another
    stream has not read yet, even after the result object was dropped."""
    producer = scaler().method("forward", device=device)
    consumer = scaler(factor=3.0).method("forward", device=device)
    x1, x2 = rand(), rand()
    r = producer([x1])[0]
    with device.create_stream() as other, device.create_latch() as latch:
        with CallerStream(other):
            latch.hold(other)  # the consumer's read waits behind the latch
            c = consumer([r])[0]
            consumer.set_inputs([rand()])  # the consumer lets go of r; its read is still queued
        del r
        rewrite_waits_for_the_held_read(producer, x2, latch, other, c, 6 * x1)


def test_a_long_lived_input_read_under_a_stream_per_request_stays_bounded(device):
    """A Result read under a new stream per request kept an entry per stream in its buffer's
    uses (rule 8's readers) for as long as it lived: 100,000 requests, 100,000 entries (on
    CUDA, as many events kept). Finished readers are now dropped at 64 entries and each
    doubling; one still reading (behind a latch) is kept, and the buffer's rewrite waits
    for it."""
    from streamlane.runtime.memory import PRUNE_USES_AT

    producer = scaler().method("forward", device=device)
    consumer = scaler(factor=3.0).method("forward", device=device)
    reader = scaler(factor=3.0).method("forward", device=device)  # the held one (rule 4
    x1, x2 = rand(), rand()  # would order the consumer's later calls after it)
    r = producer([x1])[0]
    uses = r.array.buffer.uses
    with device.create_stream() as held, device.create_latch() as latch:
        with CallerStream(held):
            latch.hold(held)  # this reader's work is not finished
            c = reader([r])[0]
        for _ in range(5 * PRUNE_USES_AT):
            with device.create_stream() as s, CallerStream(s):
                consumer([r])[0].to_host()  # a request, finished
        assert len(uses) < 2 * PRUNE_USES_AT, len(uses)
        assert held.key in uses
        consumer.set_inputs([rand()])  # the readers let go of r
        reader.set_inputs([rand()])
        del r
        rewrite_waits_for_the_held_read(producer, x2, latch, held, c, 6 * x1)


def test_pruning_a_buffers_readers_keeps_every_stream_a_shared_event_orders(host):
    """A method's pooled output event was re-recorded on each stream the method ran on, and
    its reads of a Result were marked with it, so several readers' entries held one event. An
    earlier pruning kept one key per event: here s1's, while the event's latest record was on
    s2, held by a latch; a rewrite on s1 skipped its own stream's entry and overwrote the
    buffer s2 had yet to read (found by a review of the pruning). Reads are now marked with
    events of their own (test_a_finished_read_does_not_tie_the_producer_to_the_readers_...):
    the same sequence must still keep the held read safe through the pruning."""
    from streamlane.runtime.memory import PRUNE_USES_AT

    producer = scaler(shape=(4,), factor=1.0).method("forward", device=host)
    reader = scaler(shape=(4,), factor=10.0).method("forward", device=host)  # one output:
    filler = scaler(shape=(4,), factor=3.0).method("forward", device=host)  # pooled events
    x0, x1 = np.full(4, 1.0, np.float32), np.full(4, 7.0, np.float32)
    r = producer([x0])[0]
    uses = r.array.buffer.uses
    s1, s2, s3 = (host.create_stream() for _ in range(3))
    latch = host.create_latch()
    try:
        # The reader's buffers A and B take turns (the method holds its last outputs): A on
        # s2, B on s3, A on s1, B on s3, then A on s2 behind the latch.
        for stream in (s2, s3, s1, s3):
            with CallerStream(stream):
                reader([r])
        with CallerStream(s2):
            latch.hold(s2)
            held = reader([r])[0]  # must read x0
        assert uses[s1.key] is not uses[s2.key], "each read keeps a mark of its own"
        for _ in range(PRUNE_USES_AT - len(uses)):  # readers on new streams: the pruning runs
            with host.create_stream() as t, CallerStream(t):
                filler([r])[0].to_host()
        for method in (reader, filler):
            method.set_inputs([x0])  # they let go of r
        del r
        with CallerStream(s1):  # reuses r's buffer: must wait for the read held on s2
            rewrite_waits_for_the_held_read(producer, x1, latch, s2, held, 10 * x0, factor=1.0)
    finally:
        latch.release()
        for stream in (s1, s2, s3):
            stream.close()


def test_pruning_keeps_a_use_noted_again_while_it_decides():
    """Another thread may re-record a method's pooled event and note it again for the same
    stream between the pruning's query (reached) and its removal; identity cannot tell the
    new note from the old one (the same event object), so the removal re-checks the event
    (found by a review of the pruning, with a hook switching threads inside the query)."""
    from streamlane.runtime.memory import PRUNE_USES_AT, prune_uses

    class Event:
        def __init__(self, done):
            self.done, self.on_query = done, None

        def query(self):
            done, hook, self.on_query = self.done, self.on_query, None
            if hook is not None:
                hook()
            return done

    shared = Event(done=True)  # its last use on "k" has finished...
    uses = {"k": shared}
    uses.update({i: Event(done=False) for i in range(PRUNE_USES_AT - 2)})
    uses["now"] = Event(done=False)  # the use just noted

    def noted_again():  # ...and, as it is queried, its method runs again on "k"
        shared.done = False
        uses["k"] = shared

    shared.on_query = noted_again
    prune_uses(uses, "now")
    assert uses.get("k") is shared, "a use still running was forgotten"
    assert len(uses) == PRUNE_USES_AT


def test_a_buffers_consumer_marks_stay_bounded(host, monkeypatch):
    """A held output that another library wraps again on every request (CUDA:
    ``__cuda_array_interface__`` on each read, DLPack per call) noted one consumer per wrap,
    until the buffer's next write: a list growing with every request; later one per distinct
    stream. Each let-go now leaves one mark per stream among the buffer's readers, and those
    the device has passed are pruned from 64 streams on."""
    from streamlane.runtime.memory import PRUNE_USES_AT
    from streamlane.runtime.result import PooledBuffer

    monkeypatch.setattr(PooledBuffer, "blind_exports_seen", False)  # restored after the test
    r = scaler().method("forward", device=host)([rand()])[0]
    pooled = r._holder.pooled
    readers = pooled.array.buffer.uses  # the producer's own stream, then the consumers'
    with host.create_stream() as a, host.create_stream() as b:
        for _ in range(1000):
            for consumer in (a, b, a):
                pooled.export_to(consumer)()  # exported, then let go
        assert len(readers) == 3 and a.key in readers and b.key in readers
        assert not pooled.needs_device_wait and not PooledBuffer.blind_exports_seen
    for _ in range(10 * PRUNE_USES_AT):  # a new stream per request, each finished
        with host.create_stream() as s:
            pooled.export_to(s)()
            s.synchronize()
    assert len(readers) < 2 * PRUNE_USES_AT
    for _ in range(1000):
        assert pooled.export_to(None) is None  # an unknown stream: nothing to mark
    assert pooled.needs_device_wait and PooledBuffer.blind_exports_seen


def _foreign_read_held(host, stream):
    """A method's output ``r`` (of ``x1``) that another library reads on ``stream`` behind a
    latch, as after ``__dlpack__(stream=...)``: a raw copy (no method, so no rule-8 reader
    entry) into a scratch array. Returns the method, x1, the latch, the scratch array and
    what the consumer calls when it lets go (its DLPack deleter); ``r`` itself is dropped, so
    the method's next execute rewrites its buffer."""
    m = scaler().method("forward", device=host)
    x1 = rand()
    r = m([x1])[0]
    latch = host.create_latch()
    latch.hold(stream)
    scratch = host.empty(r.shape, "float32", stream)
    host.copy(scratch, r.array, stream)
    return m, x1, latch, scratch, r._holder.pooled.export_to(stream)


def _rewrite_after_the_held_read(host, m, x1, latch, scratch, stream):
    """The method's next execute rewrites the buffer ``stream`` reads behind ``latch`` (a
    timer releases it): that read must see ``x1``'s output, the rewrite its own. Closes
    ``stream``."""
    import threading

    timer = threading.Timer(0.1, latch.release)
    timer.start()
    try:
        x2 = rand()
        np.testing.assert_array_equal(m([x2])[0].to_host(), 2 * x2)
        np.testing.assert_array_equal(host.to_host(scratch, stream), 2 * x1)
    finally:
        timer.join()
        stream.close()


def _destroyed(host, monkeypatch, stream):
    """From now on the driver refuses ``stream`` (its owner destroyed it), as CUDA did with
    "context is destroyed" (at other times it crashed the process)."""
    from streamlane.runtime.errors import DeviceError

    impl, real = stream._impl, type(host)._record

    def record(self, event, stream_impl):
        if stream_impl is impl:
            raise DeviceError("CUDA_ERROR_CONTEXT_IS_DESTROYED: context is destroyed")
        return real(self, event, stream_impl)

    monkeypatch.setattr(type(host), "_record", record)


@pytest.mark.parametrize("when", ["after it let go", "before it let go"])
def test_a_consumer_stream_its_owner_destroyed_is_never_touched_by_the_rewrite(
        host, monkeypatch, when):
    """Seen on the H200: a DLPack consumer that let go of a result and then destroyed its
    stream (CuPy's go with their object) made the producer's next execute that rewrote the
    buffer fail with CUDA's "context is destroyed", or crash the process: the rewrite recorded
    an event on the consumer's stream. The stream is now marked when the consumer lets go, and
    the rewrite waits on that mark. A stream already gone then (the deleter's record refused)
    leaves a device-wide wait. Either way the consumer's queued read (held by a latch a timer
    releases) comes before the rewrite."""
    import threading

    gone = host.create_stream()
    m, x1, latch, scratch, let_go = _foreign_read_held(host, gone)
    x2 = rand()
    if when == "after it let go":
        let_go()
        _destroyed(host, monkeypatch, gone)
    else:
        _destroyed(host, monkeypatch, gone)
        let_go()
    gc.collect()
    assert m.may_wait_on_host() is (when == "before it let go")
    timer = threading.Timer(0.1, latch.release)
    timer.start()
    try:
        again = m([x2])[0]  # rewrites the buffer the consumer read: after its read
        np.testing.assert_array_equal(again.to_host(), 2 * x2)
        host.synchronize()  # the "destroyed" stream takes no more work: read from another
        np.testing.assert_array_equal(host.to_host(scratch, host.per_thread_stream()), 2 * x1)
    finally:
        timer.join()
        gone.close()


@pytest.mark.parametrize("lets_go_on", ["its own thread", "another thread"])
def test_a_consumer_on_a_per_thread_stream_is_waited_for_from_any_thread(host, lets_go_on):
    """A consumer on its thread's per-thread stream (DLPack ``stream=2``), the buffer then
    rewritten by another thread (a scheduler's lane): the rewrite recorded on that stream from
    its own thread, which raised ``InvalidState`` ("the per-thread stream of another
    thread") and failed the execute. Marked when the consumer lets go, on its own thread, it
    is waited for on the device from any thread; let go on another thread (which cannot mark
    it), the rewrite waits for the whole device. ``may_wait_on_host`` says it may, either way,
    from the export until the rewrite (it cannot know where the let-go will come)."""
    import threading

    mine = host.per_thread_stream()
    m, x1, latch, scratch, let_go = _foreign_read_held(host, mine)
    x2 = rand()
    if lets_go_on == "its own thread":
        let_go()
    else:
        elsewhere = threading.Thread(target=let_go)
        elsewhere.start()
        elsewhere.join(10)
    gc.collect()
    assert m.may_wait_on_host()  # a per-thread consumer may turn it blind: until the rewrite
    box = {}

    def rewrite():
        waits = host.stats.host_waits
        out = m([x2])[0]
        box["device-wide waits"] = host.stats.host_waits - waits
        box["again"] = out.to_host()

    thread = threading.Thread(target=rewrite)
    timer = threading.Timer(0.1, latch.release)
    thread.start()
    timer.start()
    thread.join(10)
    timer.join()
    np.testing.assert_array_equal(box.get("again"), 2 * x2)
    np.testing.assert_array_equal(host.to_host(scratch, mine), 2 * x1)
    assert box["device-wide waits"] == (lets_go_on == "another thread")


def test_an_interrupt_in_a_let_go_or_in_the_blind_wait_keeps_the_consumers_read_safe(
        host, monkeypatch):
    """Two Ctrl-C windows a review found: an interrupt inside the DLPack deleter's mark left
    the buffer neither marked nor blind, and one inside the rewrite's device-wide wait had
    already cleared the blindness, so the rewrite that followed waited for nothing; both
    overwrote what the consumer (behind a latch) had yet to read."""
    gone = host.create_stream()
    m, x1, latch, scratch, let_go = _foreign_read_held(host, gone)
    real_record, real_sync = type(host)._record, type(host)._device_synchronize

    def record(self, event, stream_impl):
        if stream_impl is gone._impl:
            raise KeyboardInterrupt
        return real_record(self, event, stream_impl)

    monkeypatch.setattr(type(host), "_record", record)
    with pytest.raises(KeyboardInterrupt):
        let_go()  # (a ctypes deleter prints it and goes on)
    monkeypatch.setattr(type(host), "_record", real_record)
    gc.collect()
    assert m.may_wait_on_host()

    def interrupted(self):
        raise KeyboardInterrupt

    monkeypatch.setattr(type(host), "_device_synchronize", interrupted)
    with pytest.raises(KeyboardInterrupt):
        m([rand()])  # the rewrite's device-wide wait, cut short
    monkeypatch.setattr(type(host), "_device_synchronize", real_sync)
    assert m.may_wait_on_host(), "the interrupted wait forgot the consumer"
    _rewrite_after_the_held_read(host, m, x1, latch, scratch, gone)


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # ctypes'
def test_an_interrupt_as_a_let_go_begins_leaves_the_buffer_pinned_not_overwritten(host):
    """A Ctrl-C landing as the DLPack deleter begins the mark (before any handler of its own
    can run) released the export without the consumer's mark, and the rewrite overwrote what
    the consumer had yet to read (found by a review, with a tracer standing in for the
    signal handler). The export is now dropped only after the mark: the interrupt leaves it
    held (its memory pinned, a leak) and the method writes another buffer."""
    import sys

    from streamlane.runtime import dlpack

    m = scaler().method("forward", device=host)
    x1 = rand()
    r = m([x1])[0]
    gone = host.create_stream()
    latch = host.create_latch()
    latch.hold(gone)
    scratch = host.empty(r.shape, "float32", gone)
    host.copy(scratch, r.array, gone)  # the consumer's read, held
    capsule = dlpack.export(r.array.ptr, r.shape, r.dtype, dlpack.KDL_CPU, 0, r._holder,
                            on_release=r._holder.pooled.export_to(gone))
    del r
    live = dlpack.live_exports()

    def tracer(frame, event, arg):  # Ctrl-C's handler, run as mark_release is entered
        if event == "call" and frame.f_code.co_name == "mark_release":
            sys.settrace(None)
            raise KeyboardInterrupt
        return None

    sys.settrace(tracer)
    try:
        del capsule  # the consumer lets go (ctypes prints the interrupt and goes on)
    finally:
        sys.settrace(None)
    gc.collect()
    assert dlpack.live_exports() == live, "the export was released without its mark"
    _rewrite_after_the_held_read(host, m, x1, latch, scratch, gone)


def test_a_per_thread_consumer_keeps_the_event_loop_from_rewriting_until_the_rewrite(host):
    """A consumer on a per-thread stream turns the buffer blind only when it lets go, and only
    if on another thread; that could come after ``may_wait_on_host()`` said no, just before
    the rewrite (a garbage collection during the scheduler's inline execute, found by a
    review), and the event loop thread then waited for the whole device. Such an export now
    counts as a possible device-wide wait from the export to the rewrite."""
    import threading

    m = scaler().method("forward", device=host)
    r = m([rand()])[0]
    pooled = r._holder.pooled
    box = {}

    def consumer():  # DLPack stream=2 on its own thread: its per-thread stream
        box["let_go"] = pooled.export_to(host.per_thread_stream())

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join(10)
    assert m.may_wait_on_host()  # before it let go: where it lets go is not known yet
    box.pop("let_go")()  # here, not on the consumer's thread: the buffer goes blind
    del r
    gc.collect()
    assert m.may_wait_on_host()
    waits = host.stats.host_waits
    m([rand()])  # the rewrite: the device-wide wait it announced
    assert host.stats.host_waits == waits + 1 and not m.may_wait_on_host()


def test_an_uploaded_results_free_waits_for_a_consumer_that_let_go(host, monkeypatch):
    """A ``Result.from_host`` owns its memory: exported (DLPack) and dropped, its memory was
    freed ordered after our own work only, so an allocation could reuse it under a read the
    consumer still had queued. The consumer's let-go now marks its stream among the buffer's
    readers, and the free waits for them (the host device frees with its last reference, so
    the free's orders are what is checked)."""
    from streamlane.runtime.result import mark_release

    freed = []
    monkeypatch.setattr(type(host), "_free_memory",
                        lambda self, ptr, impl, stream, after: freed.append(after))
    r = Result.from_host(rand(), host)
    with host.create_stream() as consumer:
        mark_release(r.array.buffer, consumer, None)  # what its DLPack deleter does on CUDA
        mark = r.array.buffer.uses[consumer.key]
        del r
        gc.collect()
    assert len(freed) == 1 and any(event is mark for event in freed[0])


def test_consumer_on_another_thread_with_injected_delay(host):
    """The same race with a consumer on another thread whose stream runs late (injected delay):
    the producer's next execute must wait for that thread's read on the device."""
    import threading

    producer = scaler().method("forward", device=host)
    consumer = scaler(factor=3.0).method("forward", device=host)
    for _ in range(5):
        x = rand()
        box = {"r": producer([x])[0]}
        handed_over = threading.Event()

        def read(box=box, handed_over=handed_over):
            host.inject_delay(host.per_thread_stream(), 0.03)
            r = box.pop("r")
            box["c"] = consumer([r])[0]
            consumer.set_inputs([rand()])
            del r
            handed_over.set()
            box["value"] = box["c"].to_host()

        t = threading.Thread(target=read)
        t.start()
        assert handed_over.wait(5)
        gc.collect()
        producer([rand()])  # reuses the buffer the other thread has not read yet
        t.join(5)
        np.testing.assert_array_equal(box["value"], 6 * x)


def test_one_host_wait_per_chain_of_calls(device):
    m = adder().method("forward", device=device)
    xs = [rand() for _ in range(9)]
    m([xs[0], xs[1]])[0].to_host()
    before = device.stats.host_waits
    acc = Result.from_host(xs[0], device)
    for x in xs[1:]:
        acc = m([acc, x])[0]  # one host upload per call
        assert device.stats.host_waits == before, "a call inside the chain waited on the host"
    got = acc.to_host()
    assert device.stats.host_waits - before == 1
    np.testing.assert_allclose(got, np.sum(xs, axis=0, dtype=np.float64), rtol=1e-5, atol=1e-5)


def test_to_host_reads_on_the_current_stream_after_what_was_queued_there(device):
    """to_host follows torch's .cpu(): it waits for work queued before it on this thread's
    stream, not only for the producer; read under an idle caller stream to skip that work."""
    b = Program.build("spin")
    b.method("forward").step("spin", us=300_000)
    slow = b.finish().method("forward", device=device)
    x = RNG.standard_normal((64, 64)).astype(np.float32)
    (y,) = scaler().method("forward", device=device)([x])
    y.to_host()  # warm (and known ready from here)
    (y,) = scaler().method("forward", device=device)([x])
    slow([])  # queued on this thread's stream after y's producer
    with device.create_stream() as idle, CallerStream(idle):
        t = time.perf_counter()
        np.testing.assert_allclose(y.to_host(), 2 * x, rtol=1e-6)
        assert time.perf_counter() - t < 0.2  # the producer only
    (z,) = scaler().method("forward", device=device)([x])
    slow([])
    t = time.perf_counter()
    np.testing.assert_allclose(z.to_host(), 2 * x, rtol=1e-6)
    assert time.perf_counter() - t > 0.25  # behind the spin on this thread's stream


def test_result_api(device):
    x = rand((3, 5))
    r = Result.from_host(x, device)
    assert r.shape == (3, 5) and r.dtype == np.float32 and r.dtype_name == "float32"
    assert r.device is device
    np.testing.assert_array_equal(r.to_host(), x)
    assert "float32[3, 5]" in repr(r) and device.name in repr(r)
    assert ("ready" in repr(r)) or ("pending" in repr(r))


def test_from_host_keeps_bfloat16_and_accepts_a_result(device):
    x = rand((4, 4)).astype(ml_dtypes.bfloat16)
    r = Result.from_host(x, device)
    assert r.dtype_name == "bfloat16"
    back = r.to_host()
    assert back.dtype == x.dtype
    np.testing.assert_array_equal(back.view(np.uint16), x.view(np.uint16))
    again = Result.from_host(r, device)
    np.testing.assert_array_equal(again.to_host().view(np.uint16), x.view(np.uint16))


def test_host_bfloat16_exports_over_dlpack_with_its_own_code(host):
    from streamlane.runtime import dlpack
    from streamlane.runtime.host import HostDevice

    x = rand((3, 4)).astype(ml_dtypes.bfloat16)
    r = Result.from_host(x, host)
    capsule = r.__dlpack__()
    managed = dlpack.DLManagedTensor.from_address(dlpack.capsule_pointer(capsule))
    t = managed.dl_tensor
    assert (t.dtype.code, t.dtype.bits, t.device.device_type) == (4, 16, dlpack.KDL_CPU)
    assert [t.shape[i] for i in range(t.ndim)] == [3, 4]
    assert t.data == HostDevice.view(r.array).ctypes.data  # zero-copy
    for bad in ("x", 1.5, True):
        with pytest.raises(InvalidArgument, match="stream"):
            r.__dlpack__(stream=bad)


def test_dlpack_arguments_are_checked_alike_on_every_device(device):
    """The host device took any int as a stream (-5, 0, 2**70), any max_version and a truthy
    copy='yes', where CUDA refuses the streams: code that passed on the host device raised
    on a GPU."""
    r = Result.from_host(rand((2, 3)), device)
    for bad in (-5, 0, 2**70, "x", 1.5, True):
        with pytest.raises(InvalidArgument, match="stream"):
            r.__dlpack__(stream=bad)
    for bad in ("x", (1,), (True, 0), [1, 0]):
        with pytest.raises(InvalidArgument, match="max_version"):
            r.__dlpack__(max_version=bad)
    with pytest.raises(InvalidArgument, match="copy"):
        r.__dlpack__(copy="yes")
    for ok in ({}, {"stream": -1}, {"max_version": (1, 0)}, {"copy": False}):
        assert r.__dlpack__(**ok) is not None


def test_from_host_rejects_unsupported_dtypes(device):
    with pytest.raises(InvalidArgument):
        Result.from_host(np.array(["a", "b"]), device)
    with pytest.raises(InvalidArgument):
        Result.from_host(np.zeros(3, np.complex64), device)


class _CudaMemory:
    __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4", "data": (4096, False),
                                "version": 3}


@pytest.mark.parametrize("value", [None, 2**80, object(), {"a": 1}])
def test_from_host_of_what_numpy_makes_an_object_array_names_what_was_given(device, value):
    """It said "object arrays cannot go to a device (object)" for None, a huge int or a dict."""
    with pytest.raises(InvalidArgument, match=rf"from_host: {type(value).__name__} .numpy "
                                              rf"reads it as an object array.*numpy array"):
        Result.from_host(value, device)


def test_cuda_memory_given_to_the_host_device_is_named_as_such(host):
    from streamlane.runtime.examples import path

    with pytest.raises(InvalidArgument, match="CUDA memory: copy it to the host first"):
        Result.from_host(_CudaMemory(), host)
    method = Program.load(path("encoder")).method("forward", device=host)
    with pytest.raises(InvalidInput, match=r"CUDA memory .__cuda_array_interface__., which "
                                           r"the host device cannot read"):
        method.set_inputs([_CudaMemory()])


class _ArrayRaises:
    def __array__(self, *args, **kwargs):
        raise ValueError("cannot be read")


@pytest.mark.parametrize("value", [[[1.0], [1.0, 2.0]], ((1.0,), (1.0, 2.0)), _ArrayRaises()],
                         ids=["ragged list", "ragged tuple", "__array__ raises"])
def test_what_numpy_cannot_read_is_an_invalid_argument_everywhere_it_is_taken(device, value):
    """A ragged sequence or an ``__array__`` that raises gave numpy's ValueError from
    ``Result.from_host``, ``copy_from_host`` and a program's constants (``to_device`` alone
    mapped it)."""
    stream = device.per_thread_stream()
    calls = {
        "from_host": lambda: Result.from_host(value, device),
        "to_device": lambda: device.to_device(value, stream),
        "copy_from_host": lambda: device.copy_from_host(device.empty((2,), np.float32, stream),
                                                        value, stream),
        "constants": lambda: Program.build("p", constants={"w": value}),
        "constant": lambda: Program.build("p").constant("w", value),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidArgument, match="not array-like"):
            call()
            pytest.fail(f"{name} accepted it")


def test_host_dlpack_is_zero_copy_and_pins_the_buffer(host):
    m = scaler().method("forward", device=host)
    x = rand()
    r = m([x])[0]
    assert r.__dlpack_device__() == (1, 0)
    arr = np.from_dlpack(r)
    np.testing.assert_array_equal(arr, 2 * x)
    ptr = r.array.ptr
    del r
    gc.collect()
    for _ in range(3):
        assert m([rand()])[0].array.ptr != ptr, "an exported buffer was rewritten"
    np.testing.assert_array_equal(arr, 2 * x)


def test_dlpack_arguments_are_checked_and_a_host_copy_is_one(host):
    """``dl_device`` must be a (type, id) pair; ``copy=True`` on the host device gives the
    consumer memory of its own (DLPack), which the next execute cannot touch."""
    m = scaler().method("forward", device=host)
    x = rand()
    r = m([x])[0]
    for bad in (1, "cpu", (1,), (1, 0, 0), (1.0, 0), (True, 0)):
        with pytest.raises(InvalidArgument, match="dl_device"):
            r.__dlpack__(dl_device=bad)
    r.__dlpack__(dl_device=(np.int64(1), np.int32(0)))  # numpy integers are ints
    r.__dlpack__(dl_device=iter((1, 0)))  # any iterable of two
    with pytest.raises(InvalidArgument, match="DLPack device"):
        r.__dlpack__(dl_device=(2, 0))
    copied = np.from_dlpack(r, copy=True)
    assert copied.ctypes.data != r.array.ptr
    np.testing.assert_array_equal(copied, 2 * x)
    copied[:] = 0
    np.testing.assert_array_equal(r.to_host(), 2 * x)


def test_a_dlpack_export_it_cannot_give_is_a_buffer_error_and_a_copy_says_so(host):
    """The array API standard has a producer raise ``BufferError`` for a device it cannot
    export to (a consumer falls back on it): it was only an ``InvalidArgument``; a versioned
    capsule of a ``copy=True`` export lacked DLPack's IS_COPIED flag (numpy's has it)."""
    import ctypes

    from streamlane.runtime.dlpack import DLTensor
    from streamlane.runtime.errors import DLPackUnsupported

    r = Result.from_host(rand(), host)
    for dl_device in ((2, 0), (1, 1)):
        with pytest.raises(BufferError, match="DLPack device") as info:
            r.__dlpack__(dl_device=dl_device)
        assert isinstance(info.value, (InvalidArgument, DLPackUnsupported))

    class Version(ctypes.Structure):
        _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]

    class Versioned(ctypes.Structure):  # DLManagedTensorVersioned
        _fields_ = [("version", Version), ("manager_ctx", ctypes.c_void_p),
                    ("deleter", ctypes.c_void_p), ("flags", ctypes.c_uint64),
                    ("dl_tensor", DLTensor)]

    get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object, ctypes.c_char_p)(
        ("PyCapsule_GetPointer", ctypes.pythonapi))
    capsule = r.__dlpack__(max_version=(1, 0), copy=True)
    flags = Versioned.from_address(get_pointer(capsule, b"dltensor_versioned")).flags
    assert flags & 2 and not flags & 1  # IS_COPIED, and writable
    del capsule  # unconsumed: its own deleter frees the copy


@pytest.mark.cuda
def test_torch_takes_results_zero_copy_without_device_sync(cuda_device):
    torch = pytest.importorskip("torch")
    m = scaler((256, 256)).method("forward", device=cuda_device)
    x = rand((256, 256))
    r = m([x])[0]
    waits = cuda_device.stats.host_waits
    t = torch.from_dlpack(r)
    assert cuda_device.stats.host_waits == waits
    assert t.data_ptr() == r.array.ptr
    assert t.shape == (256, 256) and t.dtype == torch.float32
    np.testing.assert_array_equal(t.cpu().numpy(), 2 * x)


@pytest.mark.cuda
def test_torch_reads_stay_safe_when_the_buffer_returns(cuda_device):
    """A result handed to torch is not rewritten until torch's queued reads are done."""
    torch = pytest.importorskip("torch")
    m = scaler((1024, 1024)).method("forward", device=cuda_device)
    x = rand((1024, 1024))
    r = m([x])[0]
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        t = torch.from_dlpack(r)
        torch.cuda._sleep(50_000_000)  # keep torch's stream busy before it reads
        total = (t * 1.0).sum()
    del t, r
    gc.collect()
    m([rand((1024, 1024))])
    expected = float((2 * x).astype(np.float64).sum())
    assert abs(float(total.cpu()) - expected) <= 1e-3 * abs(expected) + 1e-2


@pytest.mark.cuda
def test_a_dlpack_consumer_stream_destroyed_before_the_rewrite_is_not_an_error(cuda_device):
    """A consumer lets go of a result and destroys its stream; the producer's next execute
    rewrites the buffer. It failed with CUDA_ERROR_CONTEXT_IS_DESTROYED (driver 580), or
    crashed the process, recording on the gone stream; the stream is now marked when the
    consumer lets go, and the rewrite waits on that mark."""
    from cuda.bindings import driver as cu

    m = scaler().method("forward", device=cuda_device)
    x1, x2 = rand(), rand()
    r = m([x1])[0]
    err, handle = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
    assert err == cu.CUresult.CUDA_SUCCESS
    capsule = r.__dlpack__(stream=int(handle))  # a consumer on its own stream...
    del capsule, r  # ...lets go,
    assert cu.cuStreamDestroy(handle)[0] == cu.CUresult.CUDA_SUCCESS  # and destroys it
    gc.collect()
    np.testing.assert_array_equal(m([x2])[0].to_host(), 2 * x2)
    np.testing.assert_array_equal(m([x1])[0].to_host(), 2 * x1)
    assert not cuda_device.lost


@pytest.mark.cuda
def test_a_dlpack_consumer_on_its_per_thread_stream_then_a_rewrite_from_another_thread(
        cuda_device):
    """DLPack ``stream=2`` names the consumer thread's per-thread stream; a rewrite from
    another thread raised InvalidState recording on it. It is marked when the consumer lets go
    (here on its own thread), and the rewrite waits on the mark."""
    import threading

    m = scaler().method("forward", device=cuda_device)
    x1, x2 = rand(), rand()
    r = m([x1])[0]
    capsule = r.__dlpack__(stream=2)
    del capsule, r
    gc.collect()
    box = {}

    def rewrite():
        box["again"] = m([x2])[0].to_host()

    thread = threading.Thread(target=rewrite)
    thread.start()
    thread.join(30)
    np.testing.assert_array_equal(box.get("again"), 2 * x2)


@pytest.mark.cuda
def test_cupy_reading_on_a_stream_it_then_destroys_is_safe(cuda_device):
    """CuPy reads a result on its own stream, lets go, and destroys the stream (CuPy's go with
    their object) while its read may still run; the producer's next execute rewrites the
    buffer. That rewrite used to record on the destroyed stream (an error, or a crash)."""
    cp = pytest.importorskip("cupy")
    m = scaler((2048, 2048)).method("forward", device=cuda_device)
    x = rand((2048, 2048))
    r = m([x])[0]
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        a = cp.from_dlpack(r)
        total = (a.astype(cp.float64) * 1.0).sum()
    del a, r
    gc.collect()  # CuPy let go: the mark is on its stream
    del stream
    gc.collect()  # CuPy destroyed its stream
    for _ in range(3):
        m([rand((2048, 2048))])
    cp.cuda.Device().synchronize()
    expected = float((2 * x).astype(np.float64).sum())
    assert abs(float(total.get()) - expected) <= 1e-6 * abs(expected) + 1e-3
    assert not cuda_device.lost


@pytest.mark.cuda
def test_an_uploaded_result_notes_its_dlpack_consumer_when_it_lets_go(cuda_device):
    """``Result.from_host`` memory is freed, not rewritten: its DLPack consumer's stream is
    noted among the buffer's readers when the consumer lets go, so the free waits for it."""
    r = Result.from_host(rand(), cuda_device)
    with cuda_device.create_stream() as s:
        capsule = r.__dlpack__(stream=s.handle)
        readers = dict(r.array.buffer.uses)
        del capsule  # let go unconsumed: the deleter runs
        new = set(r.array.buffer.uses) - set(readers)
        assert len(new) == 1, (readers, r.array.buffer.uses)


@pytest.mark.cuda
def test_cupy_takes_results_zero_copy(cuda_device):
    cp = pytest.importorskip("cupy")
    m = scaler().method("forward", device=cuda_device)
    x = rand()
    r = m([x])[0]
    a = cp.from_dlpack(r)
    assert a.data.ptr == r.array.ptr
    np.testing.assert_array_equal(cp.asnumpy(a), 2 * x)
    b = cp.asarray(r)  # __cuda_array_interface__
    np.testing.assert_array_equal(cp.asnumpy(b), 2 * x)


@pytest.mark.cuda
def test_freeing_a_result_waits_for_readers_on_other_streams(cuda_device):
    """Rule 8 for frees: memory of a dropped Result is not handed back (and reused by the next
    allocation) while another stream still has a queued read of it."""
    consumer = scaler((1024, 1024), factor=3.0).method("forward", device=cuda_device)
    x = rand((1024, 1024))
    with cuda_device.create_stream() as other, cuda_device.create_latch() as latch:
        with CallerStream(other):
            latch.hold(other)
            r = Result.from_host(x, cuda_device)
            c = consumer([r])[0]
            consumer.set_inputs([rand((1024, 1024))])
        del r
        gc.collect()
        clobber = [Result.from_host(np.full((1024, 1024), 7.0, np.float32), cuda_device)
                   for _ in range(4)]
        for k in clobber:
            k.to_host()
        latch.release()
        with CallerStream(other):
            np.testing.assert_array_equal(c.to_host(), 3 * x)


def test_an_execute_that_failed_partway_keeps_an_output_buffers_readers(device, monkeypatch):
    """An execute readied output 0's free buffer for rewriting (its stream waits for the
    buffer's reader, a consumer held on another stream, and the buffer forgets that reader),
    then failed: output 1's pool could not grow. The next execute, from another stream, took
    the same buffer, found no reader and overwrote it before the consumer read it (rule 8)."""
    from streamlane.runtime.errors import DeviceError
    from streamlane.runtime.result import OutputPool

    b = Program.build("two")
    mb = b.method("forward", x=("float32", [64, 64]))
    mb.output(mb.step("scale", "x", out="y0", factor=2.0), mb.step("copy", "x", out="y1"))
    m = b.finish().method("forward", device=device)
    consumer = scaler(factor=3.0).method("forward", device=device)
    x1, x2 = rand(), rand()
    with device.create_latch() as latch, device.create_stream() as held, \
            device.create_stream() as s1, device.create_stream() as s2:
        first, kept = m([x1])  # kept holds output 1's only buffer: the next execute grows it
        latch.hold(held)
        with CallerStream(held):
            read = consumer([first])[0]  # reads output 0's buffer once the latch lets go
        consumer.set_inputs([rand()])  # the consumer lets go of it; so do we:
        del first  # output 0's buffer is free, with one reader still to come

        def grow(self, stream):
            raise DeviceError("injected: out of memory", "CUDA_ERROR_OUT_OF_MEMORY")

        monkeypatch.setattr(OutputPool, "_grow", grow)
        with CallerStream(s1), pytest.raises(DeviceError):
            m([x2])
        monkeypatch.undo()
        with CallerStream(s2):
            again = m([x2])[0]  # output 0's buffer again
        time.sleep(0.05)
        assert not again.ready(), "the next execute rewrote the buffer before its reader ran"
        latch.release()
        with CallerStream(held):
            np.testing.assert_allclose(read.to_host(), 6 * x1, rtol=1e-6)
        with CallerStream(s2):
            np.testing.assert_allclose(again.to_host(), 2 * x2, rtol=1e-6)
    np.testing.assert_array_equal(kept.to_host(), x1)


@pytest.mark.parametrize("refused", ["closed", "another thread's"])
def test_an_execute_refused_for_its_stream_forgets_no_reader(host, refused):
    """An execute on a closed stream (or on another thread's per-thread stream), the stream the
    method last ran on, readied its output buffer for rewriting before its first step was
    refused: the buffer forgot its reader, a consumer queued on that stream, and nothing was
    recorded to order by. The next execute, from this thread's stream, rewrote the buffer
    while the consumer had yet to read it (rule 8). The consumer's read comes 0.3 s after the
    producer's write (an injected delay), so a rewrite that does not wait for it wins."""
    import threading

    from streamlane.runtime.errors import InvalidState, StreamClosed

    m = scaler().method("forward", device=host)
    consumer = scaler(factor=3.0).method("forward", device=host)
    x1, x2 = rand(), rand()
    first_input = Result.from_host(x1, host)
    first_input.to_host()  # complete: the executes below wait on no stream for their input
    box, go, finish = {}, threading.Event(), threading.Event()

    def produce_and_read(latch):  # on the stream to be refused, held until the latch lets go
        stream = box["stream"] = host.create_stream() if refused == "closed" else \
            host.per_thread_stream()
        latch.hold(stream)
        with CallerStream(stream):
            first = m([first_input])[0]
            host.inject_delay(stream, 0.3)
            box["read"] = consumer([first])[0]
        consumer.set_inputs([rand()])
        m.set_inputs([first_input])
        del first  # the buffer is free to rewrite, its reader still queued

    with host.create_latch() as latch:
        if refused == "closed":
            produce_and_read(latch)
            box["stream"].close()  # its queued work still runs
            error = StreamClosed
        else:
            def other_thread():
                produce_and_read(latch)
                go.set()
                finish.wait(10)  # the stream lives as long as its thread

            thread = threading.Thread(target=other_thread)
            thread.start()
            assert go.wait(10)
            error = InvalidState
        try:
            with CallerStream(box["stream"]), pytest.raises(error):
                m.execute()
            m.set_inputs([x2])
            m.execute()  # this thread's stream: it must wait for the reader
            again = m.get_outputs()[0]
            latch.release()
            np.testing.assert_allclose(box["read"].to_host(), 6 * x1, rtol=1e-6)
            np.testing.assert_allclose(again.to_host(), 2 * x2, rtol=1e-6)
        finally:
            finish.set()
            if refused != "closed":
                thread.join(10)


def test_a_failed_execute_that_could_not_mark_its_end_orders_the_next_after_the_device(
        host, monkeypatch):
    """A Ctrl-C in a step, then a second one in the failure's own event record: nothing marks
    where the execute's part ends, and the output buffer it readied has forgotten its reader,
    a consumer held on that stream. The next execute, from another thread, waits for the
    whole device instead (rule 8), and says beforehand that it may wait on the host."""

    second = []
    record = type(host)._record

    def interrupted_record(self, event, impl):
        if second:
            second.clear()
            raise KeyboardInterrupt  # the second Ctrl-C, as the failure records its event
        return record(self, event, impl)


    def interrupted_enqueue(self, *args):  # the first Ctrl-C, as the callable step is enqueued
        second.append(True)
        raise KeyboardInterrupt

    def step(stream, ins, outs):
        pass

    b = Program.build("interrupted")
    mb = b.method("forward", x=("float32", [64, 64]))
    y = mb.step("scale", "x", out="y", factor=2.0)
    mb.call(step, [y], [("z", "float32", [64, 64])])
    mb.output(y)
    m = b.finish().method("forward", device=host)
    consumer = scaler(factor=3.0).method("forward", device=host)
    x1, x2 = rand(), rand()
    with host.create_latch() as latch, host.create_stream() as held:
        done = Result.from_host(x1, host)
        done.to_host()
        latch.hold(held)
        with CallerStream(held):
            first = m([done])[0]
            read = consumer([first])[0]  # queued on `held` behind the latch
        consumer.set_inputs([rand()])
        m.set_inputs([done])
        del first
        monkeypatch.setattr(type(host), "enqueue_callable", interrupted_enqueue)
        monkeypatch.setattr(type(host), "_record", interrupted_record)
        with CallerStream(held), pytest.raises(KeyboardInterrupt):
            m.execute()
        monkeypatch.undo()
        assert m.may_wait_on_host()
        result = []
        waits_until_released(lambda: result.append(m([x2])[0]), latch.release,
                             "the next execute (it must wait for the device)")
        np.testing.assert_allclose(read.to_host(), 6 * x1, rtol=1e-6)
        np.testing.assert_allclose(result[0].to_host(), 2 * x2, rtol=1e-6)
        assert not m.may_wait_on_host()


def test_a_views_reader_added_while_the_producer_waits_for_the_others_is_kept(host):
    """clone_outputs=False: the producer's execute waits for every stream that read its views,
    while a consumer on another thread may be adding its own read of a view to the same record.
    That raised ``RuntimeError: dictionary changed size during iteration`` from execute(), and
    the record was then cleared, dropping the new reader. Made deterministic: the consumer's
    execute runs at the producer's first wait (sys.settrace), as another thread's would."""
    import inspect
    import sys

    from streamlane.runtime import method as method_module

    m = scaler().method("forward", device=host, clone_outputs=False)
    consumer = scaler(factor=3.0).method("forward", device=host)
    x1, x2 = rand(), rand()
    lines = inspect.getsourcelines(method_module)[0]
    target = next(i for i, text in enumerate(lines, 1) if "stream.wait(used_by)" in text)
    with host.create_stream() as a, host.create_stream() as b, host.create_stream() as late:
        with CallerStream(a):
            view = m([x1])[0]
        with CallerStream(b):
            consumer([view])  # a reader of the view on b: the next execute waits for it
        fired = []

        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == target and not fired:
                fired.append(True)
                with CallerStream(late):
                    box.append(consumer([view])[0])  # a read of the old view, added now
            return local

        def tracer(frame, event, arg):
            return local if frame.f_code.co_filename == method_module.__file__ else None

        box = []
        sys.settrace(tracer)
        try:
            again = m([x2])[0]
        finally:
            sys.settrace(None)
        assert fired and late.key in m._uses, "the reader that came meanwhile was dropped"
        np.testing.assert_allclose(again.to_host(), 2 * x2, rtol=1e-6)


def test_numpy_does_not_silently_wrap_a_result_in_an_object_array(device):
    """``np.asarray(result)`` gave a 0-d object array holding the Result: no error, no data."""
    r = Result.from_host(np.arange(4, dtype=np.float32), device)
    for convert in (np.asarray, np.array):
        with pytest.raises(InvalidArgument, match="to_host"):
            convert(r)
    np.testing.assert_array_equal(r.to_host(), np.arange(4))


def test_a_result_refuses_pickle_and_deepcopy_saying_what_to_do(device):
    """Both failed inside, on a lock (``cannot pickle '_thread.lock' object``)."""
    import copy
    import pickle

    r = Result.from_host(np.arange(4, dtype=np.float32), device)
    for refuse in (pickle.dumps, copy.deepcopy):
        with pytest.raises(TypeError, match=r"to_host\(\)"):
            refuse(r)
    assert copy.copy(r) is r
    np.testing.assert_array_equal(r.to_host(), np.arange(4))


def test_host_bfloat16_comes_in_over_dlpack_as_it_goes_out(host):
    """bfloat16 left over DLPack (its own type code) but could not come back in: numpy has
    no such code, so a method input (a torch tensor, our own export) was refused with a
    leaked ``SystemError`` text, and ``Result.from_host`` of a DLPack-only object spoke of
    "object arrays"."""
    from streamlane.runtime.dlpack import live_exports

    class DLPackOnly:
        def __init__(self, inner):
            self.inner = inner

        def __dlpack__(self, **kwargs):
            return self.inner.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return self.inner.__dlpack_device__()

    def same(stream, ins, outs):
        outs[0][...] = ins[0]

    builder = Program.build("bf16")
    mb = builder.method("f", x=("bfloat16", [2, 3]))
    mb.output(*mb.call(same, ["x"], [("y", "bfloat16", [2, 3])]))
    method = builder.finish().method("f", device=host)
    values = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    exported = Result.from_host(values, host)
    held = live_exports()  # (another test's, not yet collected)
    out = method([DLPackOnly(exported)])[0].to_host()
    assert out.dtype == ml_dtypes.bfloat16 and np.array_equal(out, values)
    assert live_exports() == held  # consumed: its deleter ran
    again = Result.from_host(DLPackOnly(exported), host)
    assert again.dtype_name == "bfloat16" and np.array_equal(again.to_host(), values)
    plain = Result.from_host(DLPackOnly(np.ones(3, np.float32)), host)
    assert np.array_equal(plain.to_host(), np.ones(3, np.float32))
    with pytest.raises(InvalidInput, match="bfloat16"):
        method([DLPackOnly(np.ones((2, 3), np.float32))])
    assert live_exports() == held


def test_a_bfloat16_tensor_is_checked_before_it_is_copied_and_taken_beside_array(host):
    """A bfloat16 method input over DLPack was copied whole before its shape was checked
    (``expand(2**30)`` of one element: 13.7 s and 2 GB, then the shape error; a larger one
    ran out of memory and was reported as unreadable); ``Result.from_host`` of a tensor whose
    ``__array__`` refuses bfloat16 (torch's) was refused although it offers DLPack."""
    from streamlane.runtime.dlpack import KDL_CPU, export, live_exports

    one = np.zeros(1, ml_dtypes.bfloat16)

    class Huge:  # claims 2**40 elements over one: read, it would fault; checked, refused
        def __dlpack__(self, **kwargs):
            return export(one.ctypes.data, (1 << 40,), one.dtype, KDL_CPU, 0, one)

        def __dlpack_device__(self):
            return (KDL_CPU, 0)

    def same(stream, ins, outs):
        outs[0][...] = ins[0]

    builder = Program.build("bf16shape")
    mb = builder.method("f", x=("bfloat16", [2, 3]))
    mb.output(*mb.call(same, ["x"], [("y", "bfloat16", [2, 3])]))
    method = builder.finish().method("f", device=host)
    held = live_exports()
    with pytest.raises(InvalidInput, match=r"1099511627776"):
        method([Huge()])
    gc.collect()
    assert live_exports() == held  # refused before consumed: its producer freed it

    values = np.arange(6, dtype=np.float32).reshape(2, 3).astype(ml_dtypes.bfloat16)
    source = Result.from_host(values, host)

    class TorchLike:  # an __array__ that refuses bfloat16, as torch's does
        def __array__(self, dtype=None, copy=None):
            raise TypeError("Got unsupported ScalarType BFloat16")

        def __dlpack__(self, **kwargs):
            return source.__dlpack__(**kwargs)

        def __dlpack_device__(self):
            return source.__dlpack_device__()

    uploaded = Result.from_host(TorchLike(), host)
    assert uploaded.dtype_name == "bfloat16" and np.array_equal(uploaded.to_host(), values)
    np.testing.assert_array_equal(method([TorchLike()])[0].to_host(), values)

"""Runtime benchmarks (issues 2-4), streamlane beside raw cuda-python and torch in one run.

  launch      host cost of one kernel launch: streamlane vs raw cuLaunchKernel
  compile     NVRTC compile cold vs disk-cache hit, each in a fresh process
  kernels     every kernel on the device vs its float64 reference (max relative error)
  execute     host cost of execute() for 1- and 8-step methods vs the same raw launches;
              rule-4 handoff cost (stream change every call vs none)
  split       the split (kernel + callable) program: latency per-thread vs private streams,
              and wrong results per 40 runs with private streams
  loop        out = m([x])[0] on 2048x2048 float32: per call and allocations vs torch
  chain       8 dependent calls each with a host upload: per call and host waits vs torch

Usage: python bench/bench_runtime.py [--device auto|cuda|host] [--quick] [--only launch,execute]
       [--out F]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(__file__))
from _common import Report, median_us

from streamlane.kernels import KernelCache, get_kernel, kernel_names
from streamlane.runtime import Program, Result, get_device
from streamlane.runtime import method as method_module

RNG = np.random.default_rng()


def peer(rep: Report, dev: Any, name: str) -> bool:
    """Whether the peer ``name`` ("raw", "torch", "cupy") can run here; if not, the report
    says it was not measured and why (its rows are missing, not made up)."""
    if dev.kind != "cuda":
        rep.absent(name if name != "raw" else "raw cuda-python",
                   f"needs a CUDA device; this run is on {dev.name}")
        return False
    if name != "raw" and importlib.util.find_spec(name) is None:
        rep.absent(name, f"{name} is not installed")
        return False
    return True


def cupy_stream(cp: Any, stream: Any) -> Any:
    """CuPy's view of a streamlane stream: through the CUDA stream protocol where CuPy has it
    (``ExternalStream`` is deprecated there), else by handle."""
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    return from_external(stream) if from_external else cp.cuda.ExternalStream(stream.handle)


def rand(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape).astype(np.float32)


class RawLaunch:
    """The floor: the same kernel launched with cuda.bindings directly."""

    def __init__(self, dev: Any, name: str, ins: list, outs: list, params: dict):
        from cuda.bindings import driver

        self.driver = driver
        prepared = dev.prepare(name, [a.shape for a in ins], [a.shape for a in outs], params)
        spec, cfg = prepared.spec, prepared.config
        cubin = KernelCache().get_or_compile(spec, dev.arch)
        err, module = driver.cuModuleLoadData(cubin)
        assert err == driver.CUresult.CUDA_SUCCESS, err
        err, self.fn = driver.cuModuleGetFunction(module, spec.entry.encode())
        assert err == driver.CUresult.CUDA_SUCCESS, err
        self.module = module
        self.cfg = cfg
        self.args = (tuple(a.ptr for a in (*ins, *outs)) + tuple(v for v, _ in cfg.scalars),
                     (ctypes.c_void_p,) * (len(ins) + len(outs))
                     + tuple(t for _, t in cfg.scalars))
        self.stream = driver.CUstream(2)  # CU_STREAM_PER_THREAD
        # The same parameters packed once into C memory (void* per parameter): the cheapest
        # way cuda.bindings takes them, the floor under any Python launcher.
        self._values = [ctype(v) for v, ctype in zip(self.args[0], self.args[1], strict=True)]
        self._argv = (ctypes.c_void_p * len(self._values))(
            *[ctypes.addressof(v) for v in self._values])
        self.packed_args = ctypes.addressof(self._argv)

    def __call__(self) -> None:
        c = self.cfg
        err, = self.driver.cuLaunchKernel(self.fn, *c.grid, *c.block, c.shared_mem, self.stream,
                                          self.args, 0)
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(err)

    def packed(self) -> None:  # written out like __call__: the floor gets no extra call
        c = self.cfg
        err, = self.driver.cuLaunchKernel(self.fn, *c.grid, *c.block, c.shared_mem, self.stream,
                                          self.packed_args, 0)
        if err != self.driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(err)


def sync(dev: Any) -> Any:
    return lambda: dev.per_thread_stream().synchronize()


# -- sections ---------------------------------------------------------------------------------

def bench_launch(dev: Any, rep: Report, q: bool) -> None:
    s = dev.per_thread_stream()
    x, y = dev.to_device(rand(1024), s), dev.empty((1024,), "float32", s)
    prepared = dev.prepare("scale", [(1024,)], [(1024,)], {"factor": 2.0})
    reps, inner = (5, 200) if q else (31, 1000)
    bound = prepared.bind()
    rows = [{"path": "streamlane PreparedLaunch.bind() launcher (what a method step does)",
             "us_per_launch": median_us(lambda: bound(s, (x,), (y,)), reps, inner, sync(dev))},
            {"path": "streamlane PreparedLaunch.run",
             "us_per_launch": median_us(lambda: prepared.run(s, (x,), (y,)), reps, inner,
                                        sync(dev))}]
    t_checked = median_us(lambda: dev.launch("scale", s, [x], [y], {"factor": 2.0}), reps,
                          inner, sync(dev))
    rows.append({"path": "streamlane device.launch (validates every call)",
                 "us_per_launch": t_checked})
    if peer(rep, dev, "raw"):
        raw = RawLaunch(dev, "scale", [x], [y], {"factor": 2.0})
        t_raw = median_us(raw, reps, inner, sync(dev))
        rows.append({"path": "raw cuLaunchKernel (cuda.bindings), (values, types) args",
                     "us_per_launch": t_raw})
        rows.append({"path": "raw cuLaunchKernel, args packed once in C memory",
                     "us_per_launch": median_us(raw.packed, reps, inner, sync(dev))})
        for r in rows:
            r["x_raw"] = r["us_per_launch"] / t_raw
    rep.section("launch: host cost per kernel launch", rows,
                "goal: prepared path <= 1.3x raw cuLaunchKernel ((values, types) args, the "
                "usual form); x_raw is against that row")


COMPILE_SCRIPT = r"""
import json, time, sys
from streamlane.kernels import KernelCache, compile_count, get_kernel, kernel_names
cache = KernelCache()
t0 = time.perf_counter()
for name in kernel_names():
    cache.get_or_compile(get_kernel(name), sys.argv[1])
print(json.dumps({"seconds": time.perf_counter() - t0, "nvrtc_compiles": compile_count()}))
"""


def bench_compile(dev: Any, rep: Report, q: bool) -> None:
    arch = getattr(dev, "arch", "sm_90")
    rows = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, STREAMLANE_CACHE_DIR=cache)
        for label in ("cold (empty cache)", "cache hit (fresh process)"):
            out = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT, arch], env=env,
                                 capture_output=True, text=True, timeout=300)
            if out.returncode != 0:
                raise RuntimeError(out.stderr[-2000:])
            r = json.loads(out.stdout.strip().splitlines()[-1])
            rows.append({"run": label, "kernels": len(kernel_names()),
                         "seconds": r["seconds"], "nvrtc_compiles": r["nvrtc_compiles"]})
    rep.section("compile: all kernels, cold vs disk-cache hit", rows,
                "a cache hit must not invoke NVRTC (nvrtc_compiles == 0)")


def kernel_cases() -> dict[str, tuple[list[tuple[int, ...]], dict]]:
    ew = (1_000_003,)
    return {"fill": ([], {"value": 1.5}), "copy": ([ew], {}), "add": ([ew, ew], {}),
            "mul": ([ew, ew], {}), "axpy": ([ew, ew], {"alpha": -0.7}),
            "scale": ([ew], {"factor": 3.25}), "relu": ([ew], {}), "gelu": ([ew], {}),
            "matmul": ([(257, 129), (129, 301)], {}), "softmax": ([(513, 1001)], {}),
            "layernorm": ([(513, 1001)], {}), "reduce_sum": ([(513, 1001)], {})}


def bench_kernels(dev: Any, rep: Report, q: bool) -> None:
    s = dev.per_thread_stream()
    rows = []
    for name, (shapes, params) in kernel_cases().items():
        spec = get_kernel(name)
        ins = [rand(*sh) for sh in shapes]
        resolved = spec.resolve_params(params)
        outs_shape = spec.infer(shapes, resolved)
        outs_shape = [o if o is not None else (4099,) for o in outs_shape]
        d_ins = [dev.to_device(a, s) for a in ins]
        d_outs = [dev.to_device(np.full(o, np.nan, np.float32), s) for o in outs_shape]
        dev.launch(name, s, d_ins, d_outs, params)
        got = [dev.to_host(o, s) for o in d_outs]
        ref = spec.reference([a.astype(np.float64) for a in ins], resolved)
        for g, r in zip(got, ref, strict=True):
            r = np.broadcast_to(r, g.shape)
            err = float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30))
            rows.append({"kernel": name, "shapes": str(shapes or outs_shape),
                         "rel_err": err, "max_abs_err": float(np.max(np.abs(g - r))),
                         "all_written": bool(np.isfinite(g).all())})
    start, end = dev.create_event(timing=True), dev.create_event(timing=True)
    s.record(start)
    dev.launch("spin", s, [], [], {"us": 2000})
    s.record(end)
    end.synchronize()
    rows.append({"kernel": "spin", "shapes": "us=2000", "rel_err": None,
                 "max_abs_err": None, "measured": f"{start.elapsed_ms(end):.3f} ms"})
    with dev.create_latch() as latch:
        latch.hold(s)
        held = s.record()
        time.sleep(0.05)
        was_held = not held.query()
        latch.release()
        held.synchronize()
    rows.append({"kernel": "latch", "shapes": "", "rel_err": None, "max_abs_err": None,
                 "measured": f"held={was_held}, released"})
    rep.section("kernels: device vs float64 reference (fresh random data, NaN-poisoned out)",
                rows)


def chain_program(steps: int, n: int) -> Program:
    b = Program.build(f"chain{steps}")
    m = b.method("forward", x=("float32", [n]))
    h = "x"
    for i in range(steps):
        h = m.step("scale", h, out="y" if i == steps - 1 else None, factor=1.0001)
    m.output("y")
    return b.finish()


def bench_execute(dev: Any, rep: Report, q: bool) -> None:
    from streamlane.runtime import CallerStream

    s = dev.per_thread_stream()
    reps, inner = (5, 100) if q else (31, 500)
    rows = []
    x = Result.from_host(rand(1024), dev)
    for steps in (1, 8):
        m = chain_program(steps, 1024).method("forward", device=dev)
        m.set_inputs([x])
        m.execute()
        t_exec = median_us(m.execute, reps, inner, sync(dev))
        t_call = median_us(lambda m=m: m([x]), reps, inner, sync(dev))
        row = {"steps": steps, "execute_us": t_exec, "call_us": t_call}
        if peer(rep, dev, "raw"):
            bufs = [dev.empty((1024,), "float32", s) for _ in range(steps + 1)]
            raws = [RawLaunch(dev, "scale", [bufs[i]], [bufs[i + 1]], {"factor": 1.0001})
                    for i in range(steps)]
            driver = raws[0].driver
            _, ev = driver.cuEventCreate(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)

            def raw_all(raws=raws, ev=ev, driver=driver) -> None:
                for r in raws:
                    r()
                driver.cuEventRecord(ev, raws[0].stream)

            t_raw = median_us(raw_all, reps, inner, sync(dev))
            row.update({"raw_launches+record_us": t_raw, "execute_x_raw": t_exec / t_raw})
        rows.append(row)
    m = chain_program(1, 1024).method("forward", device=dev)
    m.set_inputs([x])
    a, b = dev.create_stream(), dev.create_stream()

    def same() -> None:
        with CallerStream(a):
            m.execute()

    flip = [a, b]

    def switching() -> None:
        flip.reverse()
        with CallerStream(flip[0]):
            m.execute()

    t_same = median_us(same, reps, inner, lambda: dev.synchronize())
    t_switch = median_us(switching, reps, inner, lambda: dev.synchronize())
    rows.append({"steps": "1 (rule 4)", "execute_us": t_same,
                 "call_us": None, "handoff_every_call_us": t_switch,
                 "handoff_cost_us": t_switch - t_same})
    rep.section("execute: host cost per call", rows,
                "goal: 1-step execute <= 1.5x raw launches + event record")
    a.close()
    b.close()


def split_program(dev: Any, width: int = 256, rows: int = 64) -> tuple[Program, np.ndarray]:
    """Kernel and callable steps alternating, each with its own buffer."""

    def shift(stream: Any, ins: list, outs: list) -> None:
        if dev.kind == "host":
            np.add(ins[0], 1.0, out=outs[0])
        else:
            import cupy as cp

            with cupy_stream(cp, stream):
                cp.add(cp.asarray(ins[0]), 1.0, out=cp.asarray(outs[0]))

    def square(stream: Any, ins: list, outs: list) -> None:
        if dev.kind == "host":
            np.multiply(ins[0], ins[0], out=outs[0])
        else:
            import cupy as cp

            with cupy_stream(cp, stream):
                a = cp.asarray(ins[0])
                cp.multiply(a, a, out=cp.asarray(outs[0]))

    w = (RNG.standard_normal((width, width)) / np.sqrt(width)).astype(np.float32)
    b = Program.build("split", constants={"w": w})
    m = b.method("forward", x=("float32", [rows, width]))
    h = "x"
    for i in range(4):
        h = m.step("matmul", h, "w")
        m.call(shift, [h], [(f"s{i}", "float32", [rows, width])], name="shift")
        h = m.step("gelu", f"s{i}")
        m.call(square, [h], [(f"q{i}", "float32", [rows, width])], name="square")
        h = m.step("layernorm", f"q{i}", out="y" if i == 3 else None)
    m.output("y")
    return b.finish(), w


def split_reference(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    gelu, ln = get_kernel("gelu").reference, get_kernel("layernorm").reference
    h = x.astype(np.float64)
    for _ in range(4):
        h = gelu([h @ w.astype(np.float64) + 1.0], {})[0]
        h = ln([h * h], {"eps": 1e-5})[0]
    return h


def bench_split(dev: Any, rep: Report, q: bool) -> None:
    if dev.kind == "cuda" and importlib.util.find_spec("cupy") is None:
        rep.absent("split", "its callable steps run CuPy on CUDA, and cupy is not installed")
        return
    program, w = split_program(dev)
    runs = 10 if q else 40
    rows = []
    for mode in ("per-thread stream (rule 1)", "private stream per step (old bug)"):
        method_module._PRIVATE_STREAM_PER_STEP = mode.startswith("private")
        try:
            m = program.method("forward", device=dev)
            wrong, times = 0, []
            for _ in range(runs):
                x = rand(64, 256)
                t0 = time.perf_counter()
                got = m([x])[0].to_host()
                times.append((time.perf_counter() - t0) * 1e6)
                ref = split_reference(x, w)
                if not np.linalg.norm(got - ref) <= 1e-3 * np.linalg.norm(ref):
                    wrong += 1
            same = m([x])[0].to_host()
            repeats = 10 if q else 100
            repeat_equal = all(np.array_equal(m([x])[0].to_host(), same)
                               for _ in range(repeats))
            rows.append({"mode": mode, "median_latency_us": float(np.median(times)),
                         f"wrong_of_{runs}": wrong, f"same_input_{repeats}x_equal": repeat_equal})
            dev.synchronize()
        finally:
            method_module._PRIVATE_STREAM_PER_STEP = False
    rep.section("split program (20 steps: kernels + callables)", rows,
                "fresh random input each run, checked against float64")


def bench_loop(dev: Any, rep: Report, q: bool) -> None:
    n = 512 if q else 2048
    b = Program.build("relu")
    m_ = b.method("forward", x=("float32", [n, n]))
    m_.output(m_.step("relu", "x", out="y"))
    m = b.finish().method("forward", device=dev)
    x = Result.from_host(rand(n, n), dev)
    reps, inner = (5, 20) if q else (21, 200)
    out = m([x])[0]
    for _ in range(10):
        out = m([x])[0]
    allocs = dev.stats.allocations

    def call() -> None:
        nonlocal out
        out = m([x])[0]

    t_ours = median_us(call, reps, inner, sync(dev))
    rows = [{"impl": "streamlane: out = m(x)[0]", "us_per_call": t_ours,
             "allocations_in_loop": dev.stats.allocations - allocs}]
    np.testing.assert_array_equal(out.to_host(), np.maximum(x.to_host(), 0))
    if peer(rep, dev, "torch"):
        import torch

        xt = torch.from_numpy(x.to_host()).cuda()
        before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
        box = {}

        def tcall() -> None:
            box["o"] = torch.relu(xt)

        t_torch = median_us(tcall, reps, inner, torch.cuda.synchronize)
        rows.append({"impl": "torch out = torch.relu(x)", "us_per_call": t_torch,
                     "allocations_in_loop": "caching allocator: "
                     f"{torch.cuda.memory_stats().get('allocation.all.allocated', 0) - before}"
                     " block requests"})
    rep.section(f"loop: {n}x{n} float32, one kernel per call", rows,
                "goal: <= 0.03 ms per call on the H200 and zero allocations")


def bench_chain(dev: Any, rep: Report, q: bool) -> None:
    n = 256
    b = Program.build("adder")
    m_ = b.method("forward", a=("float32", [n, n]), b=("float32", [n, n]))
    m_.output(m_.step("add", "a", "b", out="y"))
    m = b.finish().method("forward", device=dev)
    xs = [rand(n, n) for _ in range(9)]
    expected = np.sum(xs, axis=0, dtype=np.float64)
    reps = 5 if q else 51
    times, waits = [], []
    for _ in range(reps):
        w0 = dev.stats.host_waits
        t0 = time.perf_counter()
        acc = Result.from_host(xs[0], dev)
        for x in xs[1:]:
            acc = m([acc, x])[0]
        got = acc.to_host()
        times.append((time.perf_counter() - t0) / 8 * 1e6)
        waits.append((dev.stats.host_waits - w0) / 8)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    rows = [{"impl": "streamlane", "us_per_call": float(np.median(times)),
             "host_waits_per_call": float(np.median(waits))}]
    if peer(rep, dev, "torch"):
        import torch

        ttimes = []
        for _ in range(reps):
            t0 = time.perf_counter()
            acc = torch.from_numpy(xs[0]).cuda()
            for x in xs[1:]:
                acc = acc + torch.from_numpy(x).cuda()
            acc.cpu()
            ttimes.append((time.perf_counter() - t0) / 8 * 1e6)
        rows.append({"impl": "torch (x.cuda() per call, .cpu() at the end)",
                     "us_per_call": float(np.median(ttimes)),
                     "host_waits_per_call": "not instrumented"})
    rep.section("chain: 8 dependent calls, one 256x256 host upload each, one to_host()", rows)


SECTIONS = {"launch": bench_launch, "compile": bench_compile, "kernels": bench_kernels,
            "execute": bench_execute, "split": bench_split, "loop": bench_loop,
            "chain": bench_chain}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto", help="auto, cuda or host")
    ap.add_argument("--quick", action="store_true", help="fewer repeats and smaller sizes")
    ap.add_argument("--only", default="", metavar="A,B",
                    help=f"sections to run, of {', '.join(SECTIONS)} (default: all)")
    ap.add_argument("--out", default=None, help="the JSON to write (default: "
                    "bench/results/runtime-<device kind>.json)")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s] or list(SECTIONS)
    unknown = [s for s in only if s not in SECTIONS]
    if unknown:
        ap.error(f"--only: no section {', '.join(unknown)}; sections: {', '.join(SECTIONS)}")
    dev = get_device(args.device)
    rep = Report("runtime", dev, args.quick)
    for name in only:
        try:
            SECTIONS[name](dev, rep, args.quick)
        except Exception as exc:  # one broken section must not lose the others' figures
            rep.error(name, exc)
        gc.collect()
    rep.write(args.out)


if __name__ == "__main__":
    main()

"""The peer the scheduler is measured against: raw cuda-python (``cuda.bindings.driver`` and
NVRTC), no streamlane, no asyncio. Two kernels: ``twice`` (y = 2x, the 1-kernel program) and
``spin`` (one thread busy-waits on %globaltimer, the overlap yardstick)."""

from __future__ import annotations

import ctypes
import statistics
import time
from typing import Any

SOURCE = r"""
extern "C" __global__ void twice(const float* x, float* y, unsigned long long n) {
    unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
    if (i < n) y[i] = 2.0f * x[i];
}
extern "C" __global__ void spin(unsigned long long ns) {
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now)); } while (now - start < ns);
}
"""


class RawCuda:
    """One context (the primary one, shared with streamlane and torch), two kernels."""

    def __init__(self, index: int = 0):
        from cuda.bindings import driver, nvrtc

        self.cu = cu = driver
        self._ok = cu.CUresult.CUDA_SUCCESS
        self.check(cu.cuInit(0))
        self.device = self.check(cu.cuDeviceGet(index))
        self.context = self.check(cu.cuDevicePrimaryCtxRetain(self.device))
        self.make_current()
        attr = cu.CUdevice_attribute
        major = self.check(cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device))
        minor = self.check(cu.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device))
        prog = self._nvrtc(nvrtc, nvrtc.nvrtcCreateProgram(SOURCE.encode(), b"bench.cu", 0, [],
                                                           []))
        opts = [f"--gpu-architecture=sm_{major}{minor}".encode()]
        result = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            size = self._nvrtc(nvrtc, nvrtc.nvrtcGetProgramLogSize(prog))
            log = b" " * size
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC failed: {log.decode(errors='replace')}")
        size = self._nvrtc(nvrtc, nvrtc.nvrtcGetCUBINSize(prog))
        cubin = b" " * size
        self._nvrtc(nvrtc, nvrtc.nvrtcGetCUBIN(prog, cubin))
        self.module = self.check(cu.cuModuleLoadData(cubin))
        self.twice_fn = self.check(cu.cuModuleGetFunction(self.module, b"twice"))
        self.spin_fn = self.check(cu.cuModuleGetFunction(self.module, b"spin"))

    def check(self, result: tuple[Any, ...]) -> Any:
        if result[0] != self._ok:
            raise RuntimeError(f"CUDA call failed: {result[0]!r}")
        return result[1] if len(result) == 2 else result[1:]

    @staticmethod
    def _nvrtc(nvrtc: Any, result: tuple[Any, ...]) -> Any:
        if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            raise RuntimeError(f"NVRTC call failed: {result[0]!r}")
        return result[1] if len(result) == 2 else None

    def make_current(self) -> None:
        self.check(self.cu.cuCtxSetCurrent(self.context))

    def stream(self) -> Any:
        return self.check(self.cu.cuStreamCreate(self.cu.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def event(self, timing: bool = False) -> Any:
        flags = 0 if timing else self.cu.CUevent_flags.CU_EVENT_DISABLE_TIMING
        return self.check(self.cu.cuEventCreate(flags))

    def alloc(self, nbytes: int) -> int:
        return int(self.check(self.cu.cuMemAlloc(nbytes)))

    def twice(self, stream: Any, x: int, y: int, n: int) -> None:
        self.check(self.cu.cuLaunchKernel(
            self.twice_fn, (n + 255) // 256, 1, 1, 256, 1, 1, 0, stream,
            ((x, y, n), (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_ulonglong)), 0))

    def spin(self, stream: Any, us: float) -> None:
        self.check(self.cu.cuLaunchKernel(
            self.spin_fn, 1, 1, 1, 1, 1, 1, 0, stream,
            ((int(us * 1000),), (ctypes.c_ulonglong,)), 0))

    def record(self, event: Any, stream: Any) -> None:
        self.check(self.cu.cuEventRecord(event, stream))

    def sync(self, event: Any) -> None:
        self.check(self.cu.cuEventSynchronize(event))

    def elapsed_ms(self, start: Any, end: Any) -> float:
        return float(self.check(self.cu.cuEventElapsedTime(start, end)))

    def spin_walls(self, streams: list[Any], events: list[Any], n: int, parallel: bool,
                   spin_us: float, reps: int, then: Any = None) -> float:
        """The overlap benchmarks' raw peer: per stream (``streams[i]``, or ``streams[0]`` for
        all when not ``parallel``) a spin, then ``then(stream)`` if given, then an event; then
        wait for every event. The median host wall time of ``reps`` such rounds, seconds."""
        walls = []
        for _ in range(reps):
            t = time.perf_counter()
            for i in range(n):
                s = streams[i if parallel else 0]
                self.spin(s, spin_us)
                if then is not None:
                    then(s)
                self.record(events[i], s)
            for i in range(n):
                self.sync(events[i])
            walls.append(time.perf_counter() - t)
        return statistics.median(walls)

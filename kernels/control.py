"""Test kernels that control time rather than compute: spin and latch.

- ``spin`` busy-waits ``us`` microseconds in one single-thread block: the yardstick for overlap
  (two spins on two streams take ~1x, on one stream ~2x).
- ``latch`` holds its stream until the host sets a flag: deterministic ordering tests and tests
  of non-blocking calls, without relying on timing.

Both read the GPU's nanosecond ``%globaltimer``, which keeps wall time regardless of clock
boosts (unlike ``clock64``).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ._common import InferFn, check_ins, checked_configure
from .spec import KernelSpec, KernelSpecError, LaunchConfig, Param, Shape, c_ulonglong

GLOBALTIMER_CUDA = r"""
__device__ __forceinline__ unsigned long long sl_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
"""

SPIN_CUDA = GLOBALTIMER_CUDA + r"""
extern "C" __global__ void sl_spin(unsigned long long ns) {
    const unsigned long long start = sl_now_ns();
    while (sl_now_ns() - start < ns) {
    }
}
"""

# The flag lives in host-mapped pinned memory, so the volatile load goes over the bus to the
# host's copy every time: the compiler may not hoist it out of the loop. __nanosleep between
# polls bounds that traffic at the price of ~1 us release latency. The timeout guarantees a
# test that forgets to release never wedges the GPU; the final system fence orders the
# flag read before anything this thread does after.
LATCH_CUDA = GLOBALTIMER_CUDA + r"""
extern "C" __global__ void sl_latch(const volatile unsigned int* flag,
                                    unsigned long long timeout_ns) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;  // one waiter holds the stream
    const unsigned long long start = sl_now_ns();
    while (*flag == 0u) {
        if (sl_now_ns() - start >= timeout_ns) break;
        __nanosleep(1000);
    }
    __threadfence_system();
}
"""

ONE_THREAD = ((1, 1, 1), (1, 1, 1))
MAX_TIMEOUT_US = 24 * 3600 * 1_000_000  # a day; us * 1000 must fit the kernel's u64


def _no_ins(name: str) -> InferFn:
    def infer(in_shapes: Sequence[Shape], params: Mapping[str, Any]) -> list[Shape | None]:
        check_ins(name, in_shapes, 0)
        return []

    return infer


# -- spin --------------------------------------------------------------------------------------
def _spin_launch(ins: list[Shape], outs: list[Shape], p: Mapping[str, Any]) -> LaunchConfig:
    return LaunchConfig(*ONE_THREAD, scalars=((p["us"] * 1000, c_ulonglong),))


def _spin_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
               p: Mapping[str, Any]) -> None:
    time.sleep(p["us"] / 1e6)  # releases the GIL, as a GPU spin leaves the CPU free


SPIN = KernelSpec(
    name="spin", n_in=0, n_out=0, source=SPIN_CUDA, entry="sl_spin", infer=_no_ins("spin"),
    configure=checked_configure("spin", _no_ins("spin"), _spin_launch), host=_spin_host,
    reference=lambda ins, p: [],
    params={"us": Param(int, None, minimum=0, maximum=10_000_000,
                        doc="microseconds to busy-wait")},
    doc="One single-thread block busy-waits `us` microseconds (%globaltimer). "
        "Host twin: time.sleep.")


# -- latch -------------------------------------------------------------------------------------
RELEASE_KEY = "_release"


def _latch_launch(ins: list[Shape], outs: list[Shape], p: Mapping[str, Any]) -> LaunchConfig:
    if p["flag_ptr"] == 0 and p.get(RELEASE_KEY) is None:
        raise KernelSpecError("params.flag_ptr", "the nonzero device address of a host-mapped "
                              "flag (or a '_release' event for the host device)", 0)
    return LaunchConfig(*ONE_THREAD, scalars=((p["flag_ptr"], c_ulonglong),
                                              (p["timeout_us"] * 1000, c_ulonglong)))


def _latch_host_check(p: Mapping[str, Any]) -> None:
    release = p.get(RELEASE_KEY)
    if not callable(getattr(release, "wait", None)):
        # Waiting out the timeout instead would turn a wiring bug into a silent minute-long hang.
        raise KernelSpecError(f"params.{RELEASE_KEY}", "a threading.Event set on release (on "
                              "the host device a latch comes from device.create_latch())",
                              release)


def _latch_host(ins: Sequence[np.ndarray], outs: Sequence[np.ndarray],
                p: Mapping[str, Any]) -> None:
    _latch_host_check(p)
    p[RELEASE_KEY].wait(p["timeout_us"] / 1e6)  # returns on release or timeout, as on the GPU


LATCH = KernelSpec(
    name="latch", n_in=0, n_out=0, source=LATCH_CUDA, entry="sl_latch",
    infer=_no_ins("latch"), configure=checked_configure("latch", _no_ins("latch"), _latch_launch),
    host=_latch_host, host_check=_latch_host_check, reference=lambda ins, p: [],
    in_programs=False, internal=True,
    instead="use device.create_latch(): its hold(stream) enqueues the latch, release() opens it",
    params={
        "flag_ptr": Param(int, None, minimum=0, maximum=2**64 - 1,
                          doc="device address of a host-mapped uint32 flag; the latch opens "
                              "when it becomes nonzero (0 on the host device)"),
        "timeout_us": Param(int, 60_000_000, minimum=0, maximum=MAX_TIMEOUT_US,
                            doc="the latch opens by itself after this long, so a test that "
                                "never releases cannot hang the GPU"),
    },
    doc="Holds its stream until the host releases it, or `timeout_us` passes. Not usable in "
        "programs: it needs a host-side object; launched by the runtime only (Latch): an "
        "address a caller passed would be read unchecked, a fault for the whole context. "
        "CUDA: `flag_ptr` is the device address of a "
        "host-mapped pinned uint32 (passed as an unsigned long long scalar); the host writes a "
        "nonzero value to release. Host device: the resolved params additionally carry "
        "'_release', a threading.Event, which the host twin waits on. resolve_params rejects "
        "unknown keys, so the runtime adds '_release' after resolve_params (it reaches "
        "configure and host, which read it with .get).")

SPECS = (SPIN, LATCH)

"""The kernel library: CUDA C sources, numpy twins and float64 references, by name.

Knows nothing of devices, programs or scheduling (it must not import streamlane.runtime or
streamlane.sched). ``spec.py`` defines the contract; ``library.py`` the registry.
"""

from .compile import (
    CompileError,
    DiskCache,
    KernelCache,
    NvrtcUnavailable,
    compile_count,
    compile_source,
    default_cache_dir,
)
from .library import KERNELS, UnknownKernel, get_kernel, kernel_names
from .spec import KernelSpec, KernelSpecError, LaunchConfig, Param, Shape

__all__ = [
    "KERNELS",
    "CompileError",
    "DiskCache",
    "KernelCache",
    "KernelSpec",
    "KernelSpecError",
    "LaunchConfig",
    "NvrtcUnavailable",
    "Param",
    "Shape",
    "UnknownKernel",
    "compile_count",
    "compile_source",
    "default_cache_dir",
    "get_kernel",
    "kernel_names",
]

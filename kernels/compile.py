"""NVRTC compilation of kernel sources, with an on-disk cubin cache.

Two parts, testable apart:

- ``DiskCache``: bytes by key in one directory, safe across threads and processes. It knows
  nothing of NVRTC.
- ``KernelCache``: keys a ``KernelSpec`` (source, entry, options, arch, NVRTC version) and
  compiles on a miss through cuda.core's ``Program``.

cuda.core / NVRTC are imported only when something is compiled or keyed, so
``import streamlane.kernels`` works on machines without CUDA.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import tempfile
import threading
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .spec import KernelSpec

__all__ = [
    "CompileError",
    "DiskCache",
    "KernelCache",
    "NvrtcUnavailable",
    "compile_count",
    "compile_source",
    "default_cache_dir",
    "nvrtc_version",
]

# Real NVRTC compiles run by this process (cache hits do not count): tests assert on it.
nvrtc_compiles = 0
_count_lock = threading.Lock()

_ARCH = re.compile(r"sm_\d{2,3}[af]?")
_KEY = re.compile(r"[0-9A-Za-z_.-]{1,128}")
_RESERVED_OPTIONS = frozenset({"arch", "name"})


def compile_count() -> int:
    """How many times this process has run NVRTC (successful or not)."""
    return nvrtc_compiles


class CompileError(Exception):
    """NVRTC rejected a kernel. ``kernel`` names it, ``log`` is NVRTC's log, ``code`` the
    NVRTC result name (e.g. ``NVRTC_ERROR_COMPILATION``)."""

    def __init__(self, kernel: str, log: str, code: str):
        self.kernel = kernel
        self.log = log
        self.code = code
        super().__init__(f"compiling kernel {kernel!r} failed ({code}); NVRTC log:\n{log}")


class NvrtcUnavailable(RuntimeError):
    """cuda.core or the NVRTC library cannot be loaded on this machine."""


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """NVRTC's (major, minor), asked once per process: it is part of every cache key."""
    try:
        from cuda.bindings import nvrtc

        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # ImportError, or cuda.pathfinder failing to find the library
        raise NvrtcUnavailable(f"NVRTC cannot be loaded ({type(exc).__name__}: {exc}); "
                               "install cuda-python and nvidia-cuda-nvrtc") from exc
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise NvrtcUnavailable(f"nvrtcVersion failed: {err!r}")
    return int(major), int(minor)


def _parse_options(options: Sequence[str]) -> dict[str, Any]:
    """``("use_fast_math", "max_register_count=64", "std=c++20")`` as ProgramOptions kwargs.

    Each option names a ``cuda.core.ProgramOptions`` field; a bare name means True, a value
    reads as true/false, an int, or else a string.
    """
    parsed: dict[str, Any] = {}
    for opt in options:
        if not isinstance(opt, str) or not opt:
            raise ValueError(f"a compile option must be a non-empty str, got {opt!r}")
        key, sep, raw = opt.partition("=")
        if key in _RESERVED_OPTIONS:
            raise ValueError(f"compile option {key!r} is set by the cache; pass arch= instead")
        value: Any = True
        if sep:
            low = raw.lower()
            if low in ("true", "false"):
                value = low == "true"
            else:
                try:
                    value = int(raw)
                except ValueError:
                    value = raw
        if key in parsed and parsed[key] != value:
            raise ValueError(f"compile option {key!r} given twice with different values")
        parsed[key] = value
    return parsed


def _check_arch(arch: str) -> None:
    if not isinstance(arch, str) or not _ARCH.fullmatch(arch):
        raise ValueError(f"arch must look like 'sm_90' (cubin target), got {arch!r}")


def compile_source(source: str, entry: str, arch: str, options: Sequence[str] = (),
                   name: str = "kernel") -> bytes:
    """Compile CUDA C ``source`` to a cubin for ``arch`` with NVRTC (C++17).

    Raises ``CompileError`` with the NVRTC log when the source does not compile or lacks
    ``entry``, ``NvrtcUnavailable`` when NVRTC cannot be loaded, ``ValueError`` for a bad
    ``arch`` or option.
    """
    global nvrtc_compiles
    _check_arch(arch)
    kwargs = {"std": "c++17", **_parse_options(options), "arch": arch, "name": name}
    nvrtc_version()  # turns a missing library into NvrtcUnavailable, before anything else
    from cuda.core import ProgramOptions

    try:
        program_options = ProgramOptions(**kwargs)
    except TypeError as exc:
        raise ValueError(f"unknown compile option in {tuple(options)!r}: {exc}") from None
    with _count_lock:
        nvrtc_compiles += 1
    try:
        cubin = _run_nvrtc(source, program_options)
    except Exception as exc:
        # cuda.core's NVRTCError reads "<n>: NVRTC_ERROR_X, compilation log:\n\n<log>\0"; it
        # is not a public class, so it is recognised by its message.
        text = str(exc)
        code = re.search(r"NVRTC_ERROR_[A-Z_]+", text)
        if code is None:
            raise
        log = text.split("compilation log:", 1)[-1].strip().rstrip("\x00").strip()
        raise CompileError(name, log, code.group(0)) from exc
    # extern "C" keeps the entry's name verbatim in the ELF symbol table.
    if entry.encode() not in cubin:
        raise CompileError(name, f"entry point {entry!r} is not defined by the source",
                           "ENTRY_NOT_FOUND")
    return cubin


def _run_nvrtc(source: str, program_options: Any) -> bytes:
    from cuda.core import Program

    program = Program(source, "c++", program_options)
    try:
        return bytes(program.compile("cubin").code)
    finally:
        program.close()
        # A raised error's traceback keeps this frame alive; if the Program rode along, the
        # cycle collector would later clear it and its __dealloc__ would raise (unraisable).
        del program


# -- the pure cache ------------------------------------------------------------------------------
_MAGIC = b"streamlane-cache-1\n"
_DIGEST = hashlib.sha256().digest_size


class DiskCache:
    """Bytes by key, one file per key in ``directory``.

    Guarantees:
    - a reader never sees a partial file: each write goes to its own ``mkstemp`` file in the
      same directory, is fsynced, then ``os.replace``d onto the final name (atomic). Two
      writers of one key, in threads or processes, never share a temp path; the last rename
      wins and both wrote the same bytes.
    - a truncated, empty or otherwise corrupt file (checked by magic and sha256) is a miss:
      it is rebuilt and overwritten, never returned and never an exception.
    - within one instance, concurrent misses of one key build once (a lock per key).
    - failing to write the cache (read-only disk) only warns: the built bytes are returned.
    """

    def __init__(self, directory: str | os.PathLike[str], suffix: str = ".bin"):
        self.directory = Path(directory)
        self.suffix = suffix
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()

    def path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"a cache key is 1-128 characters of [0-9A-Za-z_.-], got {key!r}")
        return self.directory / f"{key}{self.suffix}"

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss (absent, unreadable or corrupt)."""
        try:
            blob = self.path(key).read_bytes()
        except OSError:
            return None
        head = len(_MAGIC) + _DIGEST
        if len(blob) < head or not blob.startswith(_MAGIC):
            return None
        data = blob[head:]
        if hashlib.sha256(data).digest() != blob[len(_MAGIC):head]:
            return None
        return data

    def put(self, key: str, data: bytes) -> Path:
        """Store ``data`` under ``key`` atomically; returns the final path."""
        final = self.path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f"{key}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(data).digest() + data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return final

    def get_or_build(self, key: str, build: Callable[[], bytes]) -> bytes:
        """The bytes under ``key``; on a miss, ``build()`` them and store them."""
        data = self.get(key)
        if data is not None:
            return data
        with self._lock_for(key):
            data = self.get(key)  # another thread of this instance may have built it meanwhile
            if data is not None:
                return data
            data = bytes(build())
            try:
                self.put(key, data)
            except OSError as exc:
                warnings.warn(f"kernel cache {self.directory} is not writable ({exc}); "
                              "continuing without caching", RuntimeWarning, stacklevel=2)
            return data

    def _lock_for(self, key: str) -> threading.Lock:
        with self._locks_lock:
            return self._locks.setdefault(key, threading.Lock())


# -- kernels on top of it ------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """``$STREAMLANE_CACHE_DIR``, else ``~/.cache/streamlane/kernels``."""
    env = os.environ.get("STREAMLANE_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "streamlane" / "kernels"


class KernelCache:
    """Cubins of kernel specs, compiled once per (source, entry, options, arch, NVRTC).

    A hit reads the file (or this instance's memory) and never runs NVRTC; only the NVRTC
    version, part of the key, is asked once per process.
    """

    def __init__(self, directory: str | os.PathLike[str] | None = None):
        self.disk = DiskCache(directory if directory is not None else default_cache_dir(),
                              suffix=".cubin")
        self._memo: dict[str, bytes] = {}

    @property
    def directory(self) -> Path:
        return self.disk.directory

    def key(self, spec: KernelSpec, arch: str, options: Sequence[str] = ()) -> str:
        _check_arch(arch)
        _parse_options(options)  # a malformed option fails before any hashing or compiling
        h = hashlib.sha256()
        major, minor = nvrtc_version()
        # length-prefixed parts: no two different inputs concatenate to the same bytes
        opts = sorted(options)
        for part in ("streamlane-kernel-1", spec.source, spec.entry, str(len(opts)), *opts,
                     arch, f"{major}.{minor}"):
            raw = part.encode()
            h.update(len(raw).to_bytes(8, "little") + raw)
        return h.hexdigest()

    def get_or_compile(self, spec: KernelSpec, arch: str, options: tuple[str, ...] = ()) -> bytes:
        """The cubin of ``spec`` for ``arch`` (e.g. ``"sm_90"``), compiled on a miss."""
        key = self.key(spec, arch, options)
        cubin = self._memo.get(key)
        if cubin is None:
            cubin = self.disk.get_or_build(
                key, lambda: compile_source(spec.source, spec.entry, arch, options, spec.name))
            self._memo[key] = cubin
        return cubin

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
import stat
import struct
import tempfile
import threading
import time
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
_TRUE, _FALSE = frozenset({"true", "yes", "on"}), frozenset({"false", "no", "off"})
# The largest cache entry read (a cubin of the library is ~10-100 KiB): anything bigger, or
# not a regular file (a FIFO would block the read, /dev/zero never end), is a miss.
MAX_ENTRY_BYTES = 64 << 20
# Temp files older than this were left by a process killed mid-write: removed at a later put.
STALE_TEMP_S = 3600.0
_IMPORT_LOCK = threading.Lock()


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
    reads as true/yes/on or false/no/off (any case), an int, or else a string.
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
            if low in _TRUE or low in _FALSE:  # "no" and "off" were strings: truthy, so on
                value = low in _TRUE
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
    program_class, options_class = _cuda_core()
    try:
        program_options = options_class(**kwargs)
    except TypeError as exc:
        raise ValueError(f"unknown compile option in {tuple(options)!r}: {exc}") from None
    with _count_lock:
        nvrtc_compiles += 1
    try:
        cubin = _run_nvrtc(program_class, source, program_options)
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
    if not defines_entry(cubin, entry):
        raise CompileError(name, f"entry point {entry!r} is not defined by the source",
                           "ENTRY_NOT_FOUND")
    return cubin


@functools.cache
def _cuda_core_classes() -> tuple[Any, Any]:
    from cuda.core import Program, ProgramOptions

    return Program, ProgramOptions


def _cuda_core() -> tuple[Any, Any]:
    """cuda.core's ``Program`` and ``ProgramOptions``, imported once, by one thread: cuda.core
    (1.2) fills its namespace from a submodule while it imports, and a second thread
    importing meanwhile saw it half made (``ImportError: cannot import name
    'ProgramOptions'``, in 7 of 8 threads compiling at once in a fresh process)."""
    with _IMPORT_LOCK:
        try:
            return _cuda_core_classes()
        except ImportError as exc:
            raise NvrtcUnavailable(f"cuda.core cannot be imported ({exc}); install "
                                   f"cuda-core") from exc


def defines_entry(cubin: bytes, entry: str) -> bool:
    """Whether the ELF ``cubin`` defines the function ``entry`` (a global function symbol of
    that exact name): not a substring of it, nor a string constant holding it."""
    symbols = _elf_functions(cubin)
    return symbols is not None and entry in symbols


def _elf_functions(blob: bytes) -> set[str] | None:
    """The names of the global and weak function symbols of a little-endian ELF64 file (a
    cubin), or None if ``blob`` is not one that parses."""
    try:
        if blob[:6] != b"\x7fELF\x02\x01":
            return None
        shoff, = struct.unpack_from("<Q", blob, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", blob, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", blob, shoff + i * shentsize)
                    for i in range(shnum)]
        names: set[str] = set()
        for _, kind, _, _, offset, size, link, _, _, entsize in sections:
            if kind != 2 or entsize < 24:  # SHT_SYMTAB, Elf64_Sym
                continue
            strtab = sections[link][4]
            for j in range(size // entsize):
                st_name, st_info = struct.unpack_from("<IB", blob, offset + j * entsize)
                if st_info & 0xF == 2 and st_info >> 4 in (1, 2):  # STT_FUNC, global/weak
                    start = strtab + st_name
                    names.add(blob[start:blob.index(b"\0", start)].decode(errors="replace"))
        return names
    except (struct.error, IndexError, ValueError):
        return None


def _run_nvrtc(program_class: Any, source: str, program_options: Any) -> bytes:
    program = program_class(source, "c++", program_options)
    try:
        return bytes(program.compile("cubin").code)
    finally:
        program.close()
        # A raised error's traceback keeps this frame alive; if the Program rode along, the
        # cycle collector would later clear it and its __dealloc__ would raise (unraisable).
        del program


# -- the pure cache ------------------------------------------------------------------------------
# An entry: magic, its key's length (one byte) and the key, sha256 of the data, the data. The
# key inside makes an entry renamed onto another key's name (a copied cache, an sm_80 cubin
# under the sm_90 key) a miss; the digest, a damaged one.
_MAGIC = b"streamlane-cache-2\n"
_DIGEST = hashlib.sha256().digest_size


class DiskCache:
    """Bytes by key, one file per key in ``directory``.

    Guarantees:
    - a reader never sees a partial file: each write goes to its own ``mkstemp`` file in the
      same directory, is fsynced, then ``os.replace``d onto the final name (atomic). Two
      writers of one key, in threads or processes, never share a temp path; the last rename
      wins and both wrote the same bytes.
    - a truncated, empty or otherwise corrupt file (checked by magic and sha256), an entry
      of another key (the key is stored in it), or anything but a regular file of at most
      ``MAX_ENTRY_BYTES`` (a FIFO, a link to ``/dev/zero``) is a miss: it is rebuilt and
      overwritten, never returned, never read past the limit and never an exception.
    - temp files a killed writer left behind are removed by a later ``put`` once they are
      ``STALE_TEMP_S`` old.
    - within one instance, concurrent misses of one key build once (a lock per key).
    - failing to write the cache (read-only disk) only warns: the built bytes are returned.
    """

    def __init__(self, directory: str | os.PathLike[str], suffix: str = ".bin"):
        # absolute: a relative folder ($STREAMLANE_CACHE_DIR=cache) must not follow chdir()
        self.directory = Path(directory)
        self._unplaced: OSError | None = None
        try:
            self.directory = self.directory.absolute()
        except OSError as exc:  # no current folder (deleted): no cache for this instance,
            self._unplaced = exc  # whatever folder the process moves to later (writes warn)
        self.suffix = suffix
        self._locks: dict[str, threading.Lock] = {}
        self._locks_lock = threading.Lock()
        self._swept = False

    def path(self, key: str) -> Path:
        if not isinstance(key, str) or not _KEY.fullmatch(key):
            raise ValueError(f"a cache key is 1-128 characters of [0-9A-Za-z_.-], got {key!r}")
        return self.directory / f"{key}{self.suffix}"

    def get(self, key: str) -> bytes | None:
        """The stored bytes, or None on a miss (absent, unreadable, corrupt, another key's,
        or not a regular file within the size limit)."""
        path = self.path(key)
        if self._unplaced is not None:
            return None
        blob = _read_entry(path)
        tag = _MAGIC + bytes([len(key)]) + key.encode()
        head = len(tag) + _DIGEST
        if blob is None or len(blob) < head or not blob.startswith(tag):
            return None
        data = blob[head:]
        if hashlib.sha256(data).digest() != blob[len(tag):head]:
            return None
        return data

    def put(self, key: str, data: bytes) -> Path:
        """Store ``data`` under ``key`` atomically; returns the final path."""
        final = self.path(key)
        if self._unplaced is not None:
            raise OSError(self._unplaced.errno, f"{self._unplaced.strerror} (the current folder, "
                          f"when the cache was made: a relative folder has no place)",
                          str(self.directory))
        self.directory.mkdir(parents=True, exist_ok=True)
        if not self._swept:
            self._swept = True
            self._sweep()
        fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f"{key}.{_TEMP_MARK}",
                                   suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                os.fchmod(f.fileno(), 0o644)  # mkstemp's 0600 kept other users from hitting
                f.write(_MAGIC + bytes([len(key)]) + key.encode() +
                        hashlib.sha256(data).digest() + data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return final

    def _sweep(self) -> None:
        """Remove temp files of this cache that a killed writer left (``STALE_TEMP_S`` old):
        named as ``put`` names them and holding the start of an entry (or nothing yet), so
        that a file of someone else's in a shared folder (``draft.tmp``) is never touched."""
        cutoff = time.time() - STALE_TEMP_S
        with contextlib.suppress(OSError):
            for entry in os.scandir(self.directory):
                with contextlib.suppress(OSError):
                    if _TEMP_NAME.fullmatch(entry.name) \
                            and entry.is_file(follow_symlinks=False) \
                            and entry.stat(follow_symlinks=False).st_mtime < cutoff \
                            and _starts_an_entry(entry.path):
                        os.unlink(entry.path)

    def get_or_build(self, key: str, build: Callable[[], bytes],
                     valid: Callable[[bytes], bool] | None = None) -> bytes:
        """The bytes under ``key``; on a miss, ``build()`` them and store them. ``valid``:
        stored bytes it refuses count as a miss too."""
        def hit() -> bytes | None:
            data = self.get(key)
            return data if data is not None and (valid is None or valid(data)) else None

        data = hit()
        if data is not None:
            return data
        with self._lock_for(key):
            data = hit()  # another thread of this instance may have built it meanwhile
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


# put()'s temp files: mkstemp(prefix=f"{key}.{_TEMP_MARK}", suffix=".tmp"), whose random part
# is 8 of [a-z0-9_]: the sweep takes nothing named otherwise (notes.draft.tmp).
_TEMP_MARK = "streamlane-"
_TEMP_NAME = re.compile(r"[0-9A-Za-z_.-]{1,128}\." + _TEMP_MARK + r"[a-z0-9_]{8}\.tmp")


def _starts_an_entry(path: str) -> bool:
    """Whether the file at ``path`` holds a prefix of an entry (empty included): what a
    writer killed partway through ``put`` leaves."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0))
    try:
        head = os.read(fd, len(_MAGIC))
    finally:
        os.close(fd)
    return _MAGIC.startswith(head)


def _read_entry(path: Path) -> bytes | None:
    """The bytes of ``path`` if it is a regular file of at most ``MAX_ENTRY_BYTES``, else None.
    Opened without waiting (a FIFO nobody writes to would block the open) and checked before
    reading (``/dev/zero`` never ends, a sparse file may claim gigabytes)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_ENTRY_BYTES:
            return None
        chunks, left = [], info.st_size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


# -- kernels on top of it ------------------------------------------------------------------------
def default_cache_dir() -> Path:
    """``$STREAMLANE_CACHE_DIR``, else ``~/.cache/streamlane/kernels``; where no home folder can
    be found (no ``$HOME``, no passwd entry), a folder in the system's temp folder, with a
    warning."""
    env = os.environ.get("STREAMLANE_CACHE_DIR")
    try:
        if env:
            return Path(env).expanduser()
        return Path.home() / ".cache" / "streamlane" / "kernels"
    except RuntimeError as exc:  # pathlib: "Could not determine home directory."
        fallback = Path(tempfile.gettempdir()) / f"streamlane-{os.getuid()}" / "kernels"
        warnings.warn(f"kernel cache: {exc} (from {env or '~'}); using {fallback}; set "
                      f"STREAMLANE_CACHE_DIR to choose the folder", RuntimeWarning,
                      stacklevel=2)
        return fallback


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
            raw = part.encode("utf-8", "surrogatepass")  # a lone surrogate: NVRTC's to judge
            h.update(len(raw).to_bytes(8, "little") + raw)
        return h.hexdigest()

    def get_or_compile(self, spec: KernelSpec, arch: str, options: tuple[str, ...] = ()) -> bytes:
        """The cubin of ``spec`` for ``arch`` (e.g. ``"sm_90"``), compiled on a miss."""
        key = self.key(spec, arch, options)
        cubin = self._memo.get(key)
        if cubin is None:
            cubin = self.disk.get_or_build(
                key, lambda: compile_source(spec.source, spec.entry, arch, options, spec.name),
                valid=lambda blob: defines_entry(blob, spec.entry))
            self._memo[key] = cubin
        return cubin

"""The cubin cache and NVRTC: DiskCache guarantees (no NVRTC needed), then real compiles of
every kernel for sm_90 (skipped with the reason where NVRTC cannot be loaded). No GPU needed."""

from __future__ import annotations

import dataclasses
import os
import tempfile
import threading
import time

import pytest

import streamlane.kernels as K
import streamlane.kernels.compile as compile_mod

ARCH = "sm_90"


# -- DiskCache: the pure cache logic -------------------------------------------------------------
@pytest.fixture
def mkstemp_calls(monkeypatch):
    """Every temp path DiskCache creates."""
    calls: list[str] = []
    lock = threading.Lock()
    real = tempfile.mkstemp

    def recording(*args, **kwargs):
        fd, path = real(*args, **kwargs)
        with lock:
            calls.append(path)
        return fd, path

    monkeypatch.setattr(compile_mod.tempfile, "mkstemp", recording)
    return calls


def _leftovers(directory) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def test_concurrent_writers_of_one_key_never_share_a_temp_path(tmp_path, mkstemp_calls):
    # Eight caches on one directory stand for eight processes: each misses and writes.
    payload = os.urandom(4096)
    builds = []
    start = threading.Barrier(8)

    def build() -> bytes:
        builds.append(1)
        time.sleep(0.05)  # all eight are inside build at once
        return payload

    results: list[bytes | BaseException] = [b""] * 8

    def worker(i: int) -> None:
        start.wait()
        try:
            results[i] = K.DiskCache(tmp_path).get_or_build("samekey", build)
        except BaseException as exc:
            results[i] = exc

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert results == [payload] * 8
    assert len(builds) == 8 and len(mkstemp_calls) == 8
    assert len(set(mkstemp_calls)) == 8, "two writers shared a temp path"
    assert all(os.path.dirname(p) == str(tmp_path) for p in mkstemp_calls)  # same filesystem
    assert _leftovers(tmp_path) == []
    final = K.DiskCache(tmp_path).path("samekey")
    assert final.exists() and K.DiskCache(tmp_path).get("samekey") == payload


def test_one_cache_builds_a_key_once_under_concurrency(tmp_path, mkstemp_calls):
    cache = K.DiskCache(tmp_path)
    calls = []

    def build() -> bytes:
        calls.append(1)
        time.sleep(0.05)
        return b"cubin"

    with_results: list[bytes] = []
    threads = [threading.Thread(target=lambda: with_results.append(
        cache.get_or_build("k", build))) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert with_results == [b"cubin"] * 8 and len(calls) == 1 and len(mkstemp_calls) == 1


def test_hit_does_not_build(tmp_path):
    K.DiskCache(tmp_path).get_or_build("k", lambda: b"first")
    assert K.DiskCache(tmp_path).get_or_build("k", lambda: pytest.fail("rebuilt")) == b"first"


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "bitflip"])
def test_corrupt_file_is_a_miss_and_is_overwritten(tmp_path, damage):
    cache = K.DiskCache(tmp_path)
    cache.put("k", b"good bytes" * 100)
    path = cache.path("k")
    blob = path.read_bytes()
    path.write_bytes({"empty": b"", "garbage": b"\x7fELF not a cache file",
                      "truncated": blob[:-7],
                      "bitflip": blob[:-1] + bytes([blob[-1] ^ 1])}[damage])
    assert cache.get("k") is None
    assert K.DiskCache(tmp_path).get_or_build("k", lambda: b"rebuilt") == b"rebuilt"
    assert cache.get("k") == b"rebuilt"


def test_failed_build_leaves_nothing_behind(tmp_path):
    def build() -> bytes:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        K.DiskCache(tmp_path).get_or_build("k", build)
    assert list(tmp_path.iterdir()) == []


def test_failed_write_removes_its_temp_file(tmp_path, monkeypatch):
    def broken_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(compile_mod.os, "replace", broken_replace)
    with pytest.raises(OSError, match="disk full"):
        K.DiskCache(tmp_path).put("k", b"data")
    assert list(tmp_path.iterdir()) == []


def test_unwritable_cache_warns_and_still_returns(tmp_path, monkeypatch):
    monkeypatch.setattr(compile_mod.os, "replace", lambda s, d: (_ for _ in ()).throw(
        OSError("read-only")))
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert K.DiskCache(tmp_path).get_or_build("k", lambda: b"x") == b"x"


@pytest.mark.parametrize("key", ["", "../escape", "a/b", "x" * 129, None])
def test_keys_cannot_escape_the_directory(tmp_path, key):
    with pytest.raises(ValueError, match="cache key"):
        K.DiskCache(tmp_path).path(key)


def test_default_directory(monkeypatch, tmp_path):
    monkeypatch.setenv("STREAMLANE_CACHE_DIR", str(tmp_path / "c"))
    assert K.KernelCache().directory == tmp_path / "c"
    monkeypatch.delenv("STREAMLANE_CACHE_DIR")
    assert K.default_cache_dir().parts[-3:] == (".cache", "streamlane", "kernels")


# -- NVRTC ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nvrtc() -> tuple[int, int]:
    try:
        return compile_mod.nvrtc_version()
    except K.NvrtcUnavailable as exc:
        pytest.skip(f"NVRTC cannot be loaded on this machine: {exc}")


@pytest.mark.parametrize("name", K.kernel_names())
def test_every_kernel_compiles_for_sm90(nvrtc, tmp_path, name):
    spec = K.get_kernel(name)
    cubin = K.KernelCache(tmp_path).get_or_compile(spec, ARCH)
    assert cubin.startswith(b"\x7fELF") and spec.entry.encode() in cubin


def test_cache_hit_never_runs_nvrtc(nvrtc, tmp_path, monkeypatch):
    spec = K.get_kernel("add")
    before = K.compile_count()
    first = K.KernelCache(tmp_path).get_or_compile(spec, ARCH)
    assert K.compile_count() == before + 1
    monkeypatch.setattr(compile_mod, "compile_source",
                        lambda *a, **k: pytest.fail("NVRTC ran on a cache hit"))
    assert K.KernelCache(tmp_path).get_or_compile(spec, ARCH) == first  # from disk
    cache = K.KernelCache(tmp_path)
    cache.get_or_compile(spec, ARCH)
    (tmp_path / f"{cache.key(spec, ARCH)}.cubin").unlink()
    assert cache.get_or_compile(spec, ARCH) == first  # from this instance's memory
    assert K.compile_count() == before + 1


def test_corrupt_cubin_is_recompiled(nvrtc, tmp_path):
    spec = K.get_kernel("relu")
    cache = K.KernelCache(tmp_path)
    good = cache.get_or_compile(spec, ARCH)
    path = tmp_path / f"{cache.key(spec, ARCH)}.cubin"
    path.write_bytes(b"")
    before = K.compile_count()
    assert K.KernelCache(tmp_path).get_or_compile(spec, ARCH) == good
    assert K.compile_count() == before + 1 and path.stat().st_size > len(good)


def test_key_covers_source_entry_options_and_arch(nvrtc, tmp_path):
    cache = K.KernelCache(tmp_path)
    add = K.get_kernel("add")
    key = cache.key(add, ARCH)
    assert key == K.KernelCache(tmp_path / "other").key(add, ARCH)
    assert cache.key(add, ARCH, ("lineinfo", "use_fast_math")) == cache.key(
        add, ARCH, ("use_fast_math", "lineinfo"))  # options are sorted
    others = {
        cache.key(dataclasses.replace(add, source=add.source + "\n"), ARCH),
        cache.key(dataclasses.replace(add, entry="sl_other"), ARCH),
        cache.key(add, ARCH, ("use_fast_math",)),
        cache.key(add, "sm_80"),
    }
    assert key not in others and len(others) == 4


def test_options_reach_nvrtc(nvrtc, tmp_path):
    cache = K.KernelCache(tmp_path)
    gelu = K.get_kernel("gelu")
    fast = cache.get_or_compile(gelu, ARCH, ("use_fast_math", "max_register_count=32"))
    assert fast.startswith(b"\x7fELF") and fast != cache.get_or_compile(gelu, ARCH)


@pytest.mark.parametrize(("arch", "options"), [("90", ()), ("compute_90", ()),
                                                (ARCH, ("arch=sm_80",)), (ARCH, ("",)),
                                                (ARCH, ("no_such_option",))])
def test_bad_arch_or_option_is_a_value_error(nvrtc, tmp_path, arch, options):
    with pytest.raises(ValueError):
        K.KernelCache(tmp_path).get_or_compile(K.get_kernel("copy"), arch, options)


def test_compile_error_carries_the_log(nvrtc, tmp_path):
    broken = dataclasses.replace(
        K.get_kernel("add"),
        source='extern "C" __global__ void sl_add(float* out) { out[0] = undefined_name; }')
    with pytest.raises(K.CompileError) as info:
        K.KernelCache(tmp_path).get_or_compile(broken, ARCH)
    err = info.value
    assert err.kernel == "add" and err.code == "NVRTC_ERROR_COMPILATION"
    assert "undefined_name" in err.log and "error" in err.log
    assert "undefined_name" in str(err) and "\x00" not in err.log
    assert list(tmp_path.iterdir()) == []  # nothing cached


def test_missing_entry_is_a_compile_error(nvrtc, tmp_path):
    wrong = dataclasses.replace(K.get_kernel("copy"), entry="sl_nowhere")
    with pytest.raises(K.CompileError) as info:
        K.KernelCache(tmp_path).get_or_compile(wrong, ARCH)
    assert info.value.code == "ENTRY_NOT_FOUND" and "sl_nowhere" in info.value.log


# -- found by a review of the cache (each failed on the code before it) -------------------------
def test_an_entry_renamed_onto_another_key_is_a_miss(tmp_path):
    """The header's digest proved an entry whole, not that it was this key's: a copied or
    renamed entry (an sm_80 cubin under the sm_90 key) was served as it."""
    cache = K.DiskCache(tmp_path)
    cache.put("a", b"the bytes of a")
    os.replace(cache.path("a"), cache.path("b"))
    assert cache.get("b") is None
    assert cache.get_or_build("b", lambda: b"b's own") == b"b's own"


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "huge"])
def test_an_entry_that_is_not_a_small_regular_file_is_a_miss_without_reading_it(tmp_path, kind):
    """A FIFO blocked the read forever, a link to /dev/zero read until memory ran out, a
    sparse 3 GiB file was read whole before it was found wrong."""
    cache = K.DiskCache(tmp_path)
    path = cache.path("k")
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        if not os.path.exists("/dev/zero"):
            pytest.skip("no /dev/zero")
        os.symlink("/dev/zero", path)
    else:
        with open(path, "wb") as f:
            f.truncate(compile_mod.MAX_ENTRY_BYTES + 1)
    start = time.perf_counter()
    assert cache.get("k") is None
    assert time.perf_counter() - start < 5


def test_temp_files_a_killed_writer_left_are_swept_once_stale(tmp_path):
    """Only put()'s own temp files go: a killed writer's (a start of an entry, or empty) once
    stale. The sweep took every old ``*.tmp`` of the folder, someone's ``draft.tmp`` in a
    shared $STREAMLANE_CACHE_DIR too."""
    half = compile_mod._MAGIC[:7]
    stale, empty, fresh = (tmp_path / f"k.streamlane-{r}.tmp"
                           for r in ("abc12_xy", "q0000000", "def34_zw"))
    stale.write_bytes(half)
    empty.write_bytes(b"")
    fresh.write_bytes(half)
    others = {"draft.tmp": half, "notes.abc12_xy.tmp": b"", "k.abc12_xy.tmp": half,
              "notes.draft.tmp": b"", "a.b.tmp": b"stream", "k.streamlane-abc.tmp": half,
              "k.streamlane-abc12_xy.tmp.bak": half, "k.streamlane-ABCDEFGH.tmp": half,
              "notes.streamlane-abc12_xy.tmp": b"my notes"}
    for name, data in others.items():
        (tmp_path / name).write_bytes(data)
    old = time.time() - compile_mod.STALE_TEMP_S - 10
    for path in (stale, empty, *(tmp_path / name for name in others)):
        os.utime(path, (old, old))
    K.DiskCache(tmp_path).put("k", b"data")
    assert not stale.exists() and not empty.exists() and fresh.exists()
    assert all((tmp_path / name).read_bytes() == data for name, data in others.items())
    assert os.stat(K.DiskCache(tmp_path).path("k")).st_mode & 0o044 == 0o044  # others may hit


def test_a_relative_cache_folder_stays_where_it_was_when_the_process_changes_folder(
        tmp_path, monkeypatch):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    cache = K.DiskCache("cache")
    cache.put("k1", b"one")
    monkeypatch.chdir(tmp_path / "b")
    cache.put("k2", b"two")
    assert cache.get("k1") == b"one"
    assert sorted(p.name for p in (tmp_path / "a" / "cache").iterdir()) == ["k1.bin", "k2.bin"]
    assert not (tmp_path / "b" / "cache").exists()


def test_a_relative_cache_folder_with_no_current_folder_only_warns(tmp_path, monkeypatch):
    """Making the folder absolute needs the current folder: a deleted one raised
    FileNotFoundError from the constructor, where writing the cache only warns."""
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    cache = K.DiskCache("cache")
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert cache.get_or_build("k", lambda: b"built") == b"built"
    # and never a folder under wherever the process goes next (a review)
    monkeypatch.chdir(tmp_path)
    with pytest.warns(RuntimeWarning, match="not writable"):
        assert cache.get_or_build("k2", lambda: b"two") == b"two"
    assert not (tmp_path / "cache").exists()


def test_an_unresolvable_home_falls_back_to_a_temp_folder_with_a_warning(monkeypatch):
    monkeypatch.setenv("STREAMLANE_CACHE_DIR", "~no_such_user_here/cache")
    with pytest.warns(RuntimeWarning, match="STREAMLANE_CACHE_DIR"):
        folder = K.default_cache_dir()
    assert str(folder).startswith(tempfile.gettempdir())


def test_boolean_option_words_mean_what_they_say():
    """use_fast_math=no was the string "no", truthy, so the option went on."""
    for word, value in (("no", False), ("OFF", False), ("false", False), ("yes", True),
                        ("On", True), ("true", True)):
        assert compile_mod._parse_options((f"use_fast_math={word}",)) == {
            "use_fast_math": value}
    assert compile_mod._parse_options(("max_register_count=1",)) == {"max_register_count": 1}


def test_the_entry_is_looked_up_among_the_function_symbols(nvrtc, tmp_path):
    """The check was a substring of the cubin: "sl_ad" passed for sl_add, and so did a name
    held only by a string constant."""
    add = K.get_kernel("add")
    for entry in ("sl_ad", "sl_ghost"):
        spec = dataclasses.replace(add, entry=entry, source=add.source +
                                   '\n__device__ const char tag[] = "sl_ghost";\n')
        with pytest.raises(K.CompileError) as info:
            K.KernelCache(tmp_path).get_or_compile(spec, ARCH)
        assert info.value.code == "ENTRY_NOT_FOUND"
    cache = K.KernelCache(tmp_path)
    good = cache.get_or_compile(add, ARCH)
    assert compile_mod.defines_entry(good, "sl_add") and not compile_mod.defines_entry(
        good, "sl_ad")
    # an entry whose bytes are whole but are not this kernel is compiled again
    cache.disk.put(cache.key(add, ARCH), b"\x7fELF but not a cubin")
    assert K.KernelCache(tmp_path).get_or_compile(add, ARCH) == good


def test_threads_compiling_at_once_in_a_fresh_process_all_succeed(nvrtc, tmp_path):
    """cuda.core fills its namespace from a submodule while it imports: threads importing it
    at once saw it half made (ImportError: cannot import name 'ProgramOptions', 7 of 8)."""
    import subprocess
    import sys

    script = (
        "import sys, threading, streamlane.kernels as K\n"
        "errors = []\n"
        "def work(name):\n"
        "    try: K.KernelCache(sys.argv[1]).get_or_compile(K.get_kernel(name), 'sm_90')\n"
        "    except Exception as exc: errors.append(repr(exc))\n"
        "threads = [threading.Thread(target=work, args=(n,)) for n in K.kernel_names()[:8]]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(errors); sys.exit(1 if errors else 0)\n")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr

"""Programs: format 1 round trip, the builder, and validation of untrusted manifests."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from streamlane.runtime import Program
from streamlane.runtime.errors import InvalidArgument, InvalidProgram, NotSupported
from streamlane.runtime.examples import build_encoder, load

W = np.random.default_rng(0).standard_normal((16, 16)).astype(np.float32)


def manifest():
    return {"format": 1, "name": "p", "constants": "p.npz",
            "methods": {"forward": {
                "inputs": [{"name": "x", "dtype": "float32", "shape": [4, 16]}],
                "buffers": [{"name": "h", "dtype": "float32", "shape": [4, 16]}],
                "steps": [{"kernel": "matmul", "in": ["x", "w1"], "out": ["h"]},
                          {"kernel": "gelu", "in": ["h"], "out": ["y"]},
                          {"kernel": "spin", "in": [], "out": [], "params": {"us": 5}}],
                "outputs": [{"name": "y", "dtype": "float32", "shape": [4, 16]}]}}}


def write(tmp_path, doc, constants=None):
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
    np.savez(tmp_path / "p.npz", **(constants if constants is not None else {"w1": W}))
    return path


def test_design_example_loads(tmp_path):
    p = Program.load(write(tmp_path, manifest()))
    assert list(p.methods) == ["forward"]
    assert [s.target for s in p.methods["forward"].steps] == ["matmul", "gelu", "spin"]


def test_save_round_trips_exactly(tmp_path):
    p = Program.load(write(tmp_path, manifest()))
    out = tmp_path / "out" / "q.json"
    out.parent.mkdir()
    p.save(out)
    q = Program.load(out)
    assert q == p
    q.save(tmp_path / "out" / "r.json")
    assert (tmp_path / "out" / "r.json").read_text() == out.read_text().replace('"q.npz"',
                                                                               '"r.npz"')


def test_params_are_written_back_as_the_kernel_takes_them(tmp_path):
    """An int param given as an integral float ("us": 50.0) runs as 50, and a float param
    given as an int as 2.0; save() and to_manifest() wrote them back as given (50.0), so the
    file said something other than what ran. Params left out stay out (their defaults)."""
    doc = manifest()
    steps = doc["methods"]["forward"]["steps"]
    steps[2]["params"]["us"] = 50.0
    steps.insert(2, {"kernel": "scale", "in": ["y"], "out": ["z"], "params": {"factor": 2}})
    y = next(t for t in doc["methods"]["forward"]["outputs"] if t["name"] == "y")
    doc["methods"]["forward"]["buffers"].append({**y, "name": "z"})
    p = Program.load(write(tmp_path, doc))
    written = p.to_manifest()["methods"]["forward"]["steps"]
    assert type(written[3]["params"]["us"]) is int and written[3]["params"]["us"] == 50
    assert type(written[2]["params"]["factor"]) is float and written[2]["params"]["factor"] == 2
    assert "params" not in written[0]
    p.save(tmp_path / "q.json")
    saved = json.loads((tmp_path / "q.json").read_text())["methods"]["forward"]["steps"]
    assert type(saved[3]["params"]["us"]) is int and type(saved[2]["params"]["factor"]) is float
    assert Program.load(tmp_path / "q.json") == p


@pytest.mark.parametrize("value", [np.float32(2.5), np.array(7, np.int32)], ids=["f32", "i32"])
def test_a_scalar_constant_loads_as_saved_and_from_a_hand_written_npz(tmp_path, value):
    """A 0-d constant (shape [], like a scalar input) was refused by load(), even from a file
    save() had just written ("expected float32[1], as the constants .npz holds"), and from a
    hand-written .npz with a message saying the file changed while it was read: the load
    made it 1-d (np.ascontiguousarray does) before comparing it with its header."""
    b = Program.build("p", constants={"s": value})
    m = b.method("forward", x=("float32", [4]))
    m.output(m.step("add", "x", "x", out="y"))
    p = b.finish()
    p.save(tmp_path / "p.json")
    q = Program.load(tmp_path / "p.json")
    assert q == p and q.constants["s"].shape == () and q.constants["s"] == value
    doc = manifest()
    doc["methods"]["forward"]["steps"].pop()
    hand = tmp_path / "hand"
    hand.mkdir()
    assert Program.load(write(hand, doc, {"w1": W, "s": value})).constants["s"].shape == ()


def small(w: float) -> Program:
    b = Program.build("p", constants={"w": np.full((2, 2), w, np.float32)})
    m = b.method("f", x=("float32", [2, 2]))
    m.output(m.step("matmul", "x", "w", out="y"))
    return b.finish()


def test_manifests_differing_after_their_last_dot_keep_their_own_constants(tmp_path):
    one, two = small(1.0), small(2.0)
    one.save(tmp_path / "model.v1")
    two.save(tmp_path / "model.v2")
    assert Program.load(tmp_path / "model.v1") == one
    assert Program.load(tmp_path / "model.v2") == two
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "model.v1", "model.v1.npz", "model.v2", "model.v2.npz"]
    one.save(tmp_path / "weights.npz")  # a manifest named .npz does not overwrite itself
    assert Program.load(tmp_path / "weights.npz") == one


@pytest.mark.parametrize("name", ["2024-enc.json", "my model.json", "enc+v2.json",
                                  "modèle.json", "enc(1).json", "x" * 200 + ".json",
                                  "nb\u00a0sp.json", "fam\u200d.json", "a.b.c.json",
                                  "enc.JSON"])
def test_what_save_writes_load_reads(tmp_path, name):
    small(3.0).save(tmp_path / name)
    assert Program.load(tmp_path / name) == small(3.0)


def loads_w(path) -> float:
    return float(Program.load(path).constants["w"][0, 0])


def test_save_never_replaces_a_file_that_is_not_its_own(tmp_path):
    """The constants replace a file only if the manifest now at the path reads it; any other
    file of that name is kept and the constants take the next free name. No program's files
    are lost to another's save, and no legitimate save is refused."""
    small(1.0).save(tmp_path / "model")  # model.npz
    small(2.0).save(tmp_path / "model.json")  # model.npz is model's: model-1.npz
    assert (loads_w(tmp_path / "model"), loads_w(tmp_path / "model.json")) == (1.0, 2.0)
    assert json.loads((tmp_path / "model.json").read_text())["constants"] == "model-1.npz"
    small(3.0).save(tmp_path / "model.json")  # its own file now: replaced, no third one
    assert loads_w(tmp_path / "model.json") == 3.0 and loads_w(tmp_path / "model") == 1.0
    assert not (tmp_path / "model-2.npz").exists()
    with pytest.raises(InvalidArgument, match="zip archive"):
        small(2.0).save(tmp_path / "model.npz")  # a manifest over model's constants

    # A manifest written by hand (or by an older save) reading a file of the default name
    doc = small(1.0).to_manifest()
    np.savez(tmp_path / "shared.npz", w=np.full((2, 2), 1.0, np.float32))
    doc["constants"] = "shared.npz"
    (tmp_path / "by-hand.json").write_text(json.dumps(doc))
    small(2.0).save(tmp_path / "shared.json")
    assert (loads_w(tmp_path / "by-hand.json"), loads_w(tmp_path / "shared.json")) == (1.0, 2.0)

    # Constants, then none, then constants again at one path; a file that is no archive
    small(1.0).save(tmp_path / "p.json")
    b = Program.build("p")
    m = b.method("f", x=("float32", [2, 2]))
    m.output(m.step("relu", "x", out="y"))
    b.finish().save(tmp_path / "p.json")
    small(5.0).save(tmp_path / "p.json")
    assert loads_w(tmp_path / "p.json") == 5.0
    (tmp_path / "notes.npz").write_bytes(b"not a zip")
    small(1.0).save(tmp_path / "notes.json")
    assert (tmp_path / "notes.npz").read_bytes() == b"not a zip"
    assert loads_w(tmp_path / "notes.json") == 1.0

    # A neighbour that is not a manifest at all does not get in the way
    (tmp_path / "deep").write_text("[" * 100_000)
    small(1.0).save(tmp_path / "deep.json")
    assert loads_w(tmp_path / "deep.json") == 1.0
    assert not list(tmp_path.glob(".streamlane-save-*")), "a temporary file was left"


def test_a_copied_manifest_shares_constants_until_the_copy_is_saved(tmp_path):
    """README: a manifest copied by hand reads the original's constants file; re-saving the
    original rewrites that file for both, re-saving the copy gives the copy its own file and
    leaves the original's alone."""
    small(1.0).save(tmp_path / "a.json")
    shutil.copy(tmp_path / "a.json", tmp_path / "copy.json")
    small(2.0).save(tmp_path / "a.json")  # a.npz is a.json's own: rewritten, read by both
    assert (loads_w(tmp_path / "a.json"), loads_w(tmp_path / "copy.json")) == (2.0, 2.0)
    small(3.0).save(tmp_path / "copy.json")  # copy.npz, its own name: a.npz is kept
    assert json.loads((tmp_path / "copy.json").read_text())["constants"] == "copy.npz"
    assert (loads_w(tmp_path / "a.json"), loads_w(tmp_path / "copy.json")) == (2.0, 3.0)


def test_a_save_that_fails_leaves_the_program_there_intact(tmp_path, monkeypatch):
    import streamlane.runtime.program as program_module

    small(1.0).save(tmp_path / "p.json")
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())

    def full_disk(*args, **kw):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(program_module.json, "dumps", full_disk)  # the manifest's write
    with pytest.raises(OSError, match="No space left"):
        small(2.0).save(tmp_path / "p.json")
    monkeypatch.undo()
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()) == before
    assert loads_w(tmp_path / "p.json") == 1.0


def test_save_checks_its_path_before_writing(tmp_path):
    (tmp_path / "adir").mkdir()
    (tmp_path / "afile").write_text("")
    for bad, match in ((tmp_path / "adir", "folder"), (tmp_path / "no" / "p.json", "create it"),
                       # a file on the way: it said "does not exist; create it first"
                       (tmp_path / "afile" / "p.json", "afile' is not a folder; name a path"),
                       (str(tmp_path / "a\0b.json"), "NUL"), (3, "a path"),
                       (tmp_path / ("x" * 256), "not a plain file name|too long")):
        with pytest.raises(InvalidArgument, match=match):
            small(1.0).save(bad)  # type: ignore[arg-type]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "afile"]


def test_a_path_ending_in_a_separator_names_a_folder_for_save_and_load(tmp_path):
    """pathlib drops a trailing "/": save("models/") wrote a file "models" (and models.npz)
    where the user meant a folder, and load("p.json/") read the file p.json."""
    for folder in (tmp_path / "models", tmp_path / "exists"):
        with pytest.raises(InvalidArgument, match="names a folder"):
            small(1.0).save(str(folder) + os.sep)
        (tmp_path / "exists").mkdir(exist_ok=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]
    small(1.0).save(tmp_path / "p.json")
    with pytest.raises(InvalidProgram, match="names a folder"):
        Program.load(str(tmp_path / "p.json") + "/")
    assert Program.load(tmp_path / "p.json") == small(1.0)


def test_a_symlinked_manifest_saves_to_its_target_and_loads_through_the_link(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "link").mkdir()
    small(9.0).save(tmp_path / "link" / "c.json")  # reads link/c.npz
    small(1.0).save(tmp_path / "real" / "m.json")
    (tmp_path / "link" / "m.json").symlink_to(tmp_path / "real" / "m.json")
    np.savez(tmp_path / "link" / "m.npz", w=np.zeros((2, 2), np.float32))  # a stale one
    small(2.0).save(tmp_path / "link" / "m.json")
    assert (tmp_path / "link" / "m.json").is_symlink()
    assert loads_w(tmp_path / "link" / "m.json") == 2.0  # the target's constants, not the stale
    assert loads_w(tmp_path / "real" / "m.json") == 2.0
    assert loads_w(tmp_path / "link" / "c.json") == 9.0
    (tmp_path / "loop.json").symlink_to(tmp_path / "loop.json")
    with pytest.raises(InvalidArgument):
        small(1.0).save(tmp_path / "loop.json")
    with pytest.raises(InvalidProgram):
        Program.load(tmp_path / "loop.json")


def test_a_save_that_fails_between_its_renames_puts_the_old_constants_back(tmp_path,
                                                                           monkeypatch):
    import streamlane.runtime.program as program_module

    small(1.0).save(tmp_path / "p.json")
    before = sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir())
    real = os.replace

    def replace(src, dst):
        if Path(dst).name == "p.json":  # the manifest's rename, after the constants'
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(program_module.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        small(2.0).save(tmp_path / "p.json")
    monkeypatch.undo()
    assert sorted((p.name, p.read_bytes()) for p in tmp_path.iterdir()) == before
    assert loads_w(tmp_path / "p.json") == 1.0


def test_a_save_keeps_the_mode_of_what_it_replaces_and_refuses_special_files(tmp_path):
    small(1.0).save(tmp_path / "p.json")
    for name in ("p.json", "p.npz"):
        os.chmod(tmp_path / name, 0o600)
    small(2.0).save(tmp_path / "p.json")
    assert [(tmp_path / n).stat().st_mode & 0o777 for n in ("p.json", "p.npz")] == [0o600] * 2
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        small(1.0).save(tmp_path / "fifo")
    b = Program.build("hidden")  # no constants: any name the system takes
    m = b.method("f", x=("float32", [2]))
    m.output(m.step("relu", "x", out="y"))
    b.finish().save(tmp_path / ".prog.json")
    assert Program.load(tmp_path / ".prog.json").name == "hidden"


def test_save_refuses_a_name_whose_constants_file_load_would_refuse(tmp_path):
    with pytest.raises(InvalidArgument, match="choose another manifest name"):
        small(1.0).save(tmp_path / ("x" * 253))  # x...x.npz: 257 bytes
    assert list(tmp_path.iterdir()) == []  # nothing written
    with pytest.raises(InvalidArgument, match="a path"):
        small(1.0).save(3)  # type: ignore[arg-type]


def test_builder_makes_the_same_object_as_a_file(tmp_path):
    built = build_encoder()
    built.save(tmp_path / "encoder.json")
    assert Program.load(tmp_path / "encoder.json") == built
    assert load("encoder") == built


def test_builder_mistakes_are_invalid_program_with_a_path():
    b = Program.build("p")
    m = b.method("forward", x=("float32", [4]))
    with pytest.raises(InvalidProgram, match="relu") as info:
        m.step("nope", "x")  # the message lists the kernels there are
    assert info.value.path == "methods.forward.steps[0].kernel"
    with pytest.raises(InvalidProgram) as info:
        m.call(5, ["x"], [("y", "float32", [4])])  # not a callable: refused now, not at run
    assert info.value.path == "methods.forward.steps[0].callable"
    m.output(m.step("relu", "x", out="y"))  # the builder still works after both
    assert [s.target for s in b.finish().methods["forward"].steps] == ["relu"]
    # Inputs are checked where they are declared, with the path a manifest's would get.
    for decl, path in ((("float32", [4, -1]), "inputs[0].shape[1]"),
                       (("float31", [4]), "inputs[0].dtype"), ("float32", "inputs[0]")):
        with pytest.raises(InvalidProgram) as info:
            b.method("other", x=decl)
        assert info.value.path == f"methods.other.{path}"


@pytest.mark.parametrize("bad", [None, 5, 1.5, ["a.json"]])
def test_load_takes_a_path(bad):
    with pytest.raises(InvalidArgument, match="path"):
        Program.load(bad)


def test_bfloat16_constants_round_trip(tmp_path):
    import ml_dtypes

    w = np.random.default_rng().standard_normal((4, 4)).astype(ml_dtypes.bfloat16)
    b = Program.build("bf", constants={"w": w, "v": W[:4, :4]})
    m = b.method("forward", x=("float32", [4, 4]))
    m.output(m.step("matmul", "x", "v", out="y"))
    p = b.finish()
    p.save(tmp_path / "bf.json")
    q = Program.load(tmp_path / "bf.json")
    assert q.constants["w"].dtype == w.dtype
    np.testing.assert_array_equal(q.constants["w"].view(np.uint16), w.view(np.uint16))


def test_big_endian_bfloat16_constants_load(tmp_path):
    """bfloat16 travels as uint16 bits; another machine's np.save writes them big-endian
    ('>u2'). Both the file loader's header pass and its data pass take them."""
    import json

    import ml_dtypes

    w = np.arange(16, dtype=np.float32).reshape(4, 4).astype(ml_dtypes.bfloat16)
    doc = manifest()
    doc["constant_tensors"] = [{"name": "w1", "dtype": "float32", "shape": [16, 16]},
                               {"name": "wb", "dtype": "bfloat16", "shape": [4, 4]}]
    (tmp_path / "p.json").write_text(json.dumps(doc))
    np.savez(tmp_path / "p.npz", w1=W, wb=w.view(np.uint16).astype(">u2"))
    q = Program.load(tmp_path / "p.json")
    assert q.constants["wb"].dtype == w.dtype
    np.testing.assert_array_equal(q.constants["wb"].astype(np.float32), w.astype(np.float32))


def test_a_constant_table_must_declare_every_constant_of_the_npz(tmp_path):
    """A table leaving out a constant the .npz holds (and a step reads) loaded, and the
    undeclared constant was bound and used: the table would not describe what the program
    reads. Without a table, the .npz alone describes the constants (DESIGN's format)."""
    doc = manifest()
    doc["constant_tensors"] = [{"name": "w1", "dtype": "float32", "shape": [16, 16]}]
    path = write(tmp_path, doc, constants={"w1": W, "w2": W})
    with pytest.raises(InvalidProgram, match="'w2'") as info:
        Program.load(path)
    assert info.value.path == "constant_tensors"
    doc["constant_tensors"].append({"name": "w2", "dtype": "float32", "shape": [16, 16]})
    assert sorted(Program.load(write(tmp_path, doc, {"w1": W, "w2": W})).constants) == \
        ["w1", "w2"]
    del doc["constant_tensors"]
    assert sorted(Program.load(write(tmp_path, doc, {"w1": W, "w2": W})).constants) == \
        ["w1", "w2"]
    with pytest.raises(InvalidProgram, match="'w2'"):
        Program.from_manifest({**manifest(), "constant_tensors": [
            {"name": "w1", "dtype": "float32", "shape": [16, 16]}]}, {"w1": W, "w2": W})


def test_a_program_is_immutable(tmp_path):
    """A renamed program saved a manifest that load() refused; every field is fixed once
    validated (the tables were read-only already)."""
    p = small(1.0)
    for attr, value in (("name", "bad name/../x"), ("device_index", 3),
                        ("constants_file", "x.npz"), ("methods", {}), ("new", 1)):
        with pytest.raises(AttributeError, match="immutable"):
            setattr(p, attr, value)
    with pytest.raises(AttributeError, match="immutable"):
        del p.name
    assert p == small(1.0) and p.name == "p"
    p.save(tmp_path / "p.json")
    assert Program.load(tmp_path / "p.json") == p


def test_a_constants_file_changed_between_the_two_reads_is_refused(tmp_path, monkeypatch):
    """The manifest is validated against the .npz headers, then the data is read: a file
    replaced in between must not give a program whose constants do not fit its methods."""
    from streamlane.runtime import program as program_module

    path = write(tmp_path, manifest())
    real = program_module._read_npz

    def read_then_replace(folder, name, headers_only=False):
        arrays = real(folder, name, headers_only)
        if headers_only:
            np.savez(tmp_path / "p.npz", w1=np.zeros((16, 9), np.float32))
        return arrays

    monkeypatch.setattr(program_module, "_read_npz", read_then_replace)
    with pytest.raises(InvalidProgram, match="unchanged while it was read") as info:
        Program.load(path)
    assert info.value.path == "constants['w1']"


def test_two_layer_mlp_in_a_few_lines():
    w2 = np.random.default_rng().standard_normal((16, 8)).astype(np.float32)
    b = Program.build("mlp", constants={"w1": W, "w2": w2})
    m = b.method("forward", x=("float32", [4, 16]))
    h = m.step("relu", m.step("matmul", "x", "w1"))
    m.output(m.step("matmul", h, "w2", out="y"))
    p = b.finish()
    assert p.methods["forward"].outputs[0].shape == (4, 8)


def test_programs_with_callables_refuse_to_save(tmp_path):
    b = Program.build("c")
    m = b.method("forward", x=("float32", [4]))
    m.call(lambda s, i, o: None, ["x"], [("y", "float32", [4])], name="noop")
    m.output("y")
    with pytest.raises(NotSupported, match="callable"):
        b.finish().save(tmp_path / "c.json")


def test_a_callable_step_refuses_a_bad_ins_without_changing_the_builder():
    b = Program.build("c")
    m = b.method("forward", x=("float32", [4]))

    def double(stream, ins, outs):
        pass

    for ins, path in ((5, "methods.forward.steps[0].in"), (None, "methods.forward.steps[0].in"),
                      (["nope"], "methods.forward.steps[0].in[0]"),
                      ([1], "methods.forward.steps[0].in[0]")):
        with pytest.raises(InvalidProgram) as info:
            m.call(double, ins, [("y", "float32", [4])])  # type: ignore[arg-type]
        assert info.value.path == path
    m.call(double, ["x"], [("y", "float32", [4])])  # the builder is as it was: this works
    m.output("y")
    assert list(b.finish().callables) == ["double"]


def test_from_manifest_refuses_a_callable_that_is_not_callable():
    doc = {"format": 1, "name": "c", "methods": {"f": {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [2]}], "buffers": [],
        "steps": [{"callable": "double", "in": ["x"], "out": ["y"]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [2]}]}}}
    with pytest.raises(InvalidProgram, match="not callable") as info:
        Program.from_manifest(doc, callables={"double": 5})
    assert info.value.path == "methods.f.steps[0].callable"
    assert Program.from_manifest(doc, callables={"double": lambda s, i, o: None})


def test_examples_are_written_to_a_folder_given_as_str(tmp_path):
    from streamlane.runtime.examples import write_examples

    write_examples(str(tmp_path))
    assert Program.load(tmp_path / "encoder.json") == load("encoder")
    write_examples(tmp_path)  # again: its own files, replaced
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "decoder.json", "decoder.npz", "encoder.json", "encoder.npz"]
    (tmp_path / "b").mkdir()
    write_examples(os.fsencode(tmp_path / "b"))  # bytes, as everywhere else (TypeError before)
    assert Program.load(tmp_path / "b" / "decoder.json") == load("decoder")


def test_examples_path_refuses_an_unknown_name():
    from streamlane.runtime.examples import path

    with pytest.raises(InvalidArgument, match="encoder, decoder"):
        path("nope")
    with pytest.raises(InvalidArgument):
        path(["encoder"])  # type: ignore[arg-type]


def broken_as_the_scheduler_makes_it():
    from streamlane.sched.errors import SchedulerBroken

    error = SchedulerBroken("the scheduler is broken: a fault")
    error.code = "HOST_DEVICE_FAULT"  # set after, as Scheduler.break_ does: not in the text
    return error


def test_errors_survive_pickle_and_copy_with_their_fields():
    import pickle

    from streamlane.runtime.errors import DeviceError, InvalidInput, KernelCompileError
    from streamlane.sched.errors import SchedulerBroken

    cases = [(InvalidProgram("methods.f.steps[0].kernel", "a kernel", "nope"),
              ("path", "expected", "got")),
             (InvalidInput("p.f", 0, "float32[2]", "float64", "cast it"),
              ("method", "index", "expected", "got", "hint")),
             (DeviceError("boom", "CUDA_ERROR_ILLEGAL_ADDRESS"), ("code",)),
             (KernelCompileError("relu", "NVRTC_ERROR_COMPILATION", "log"),
              ("kernel", "code", "log")),
             (SchedulerBroken("lost", "CUDA_ERROR_LAUNCH_FAILED"), ("code",)),
             (broken_as_the_scheduler_makes_it(), ("code",))]
    for error, fields in cases:
        for twin in (pickle.loads(pickle.dumps(error)), copy.copy(error)):
            assert type(twin) is type(error) and str(twin) == str(error)
            assert twin.args == error.args
            for name in fields:
                assert getattr(twin, name) == getattr(error, name), name
    # what a process pool does with an untrusted manifest's error
    with pytest.raises(InvalidProgram) as info:
        Program.from_manifest({"format": 2})
    rebuilt = pickle.loads(pickle.dumps(info.value))
    assert rebuilt.path == "name"  # the first field checked


def mutate(doc, path, value):
    doc = copy.deepcopy(doc)
    node = doc
    for key in path[:-1]:
        node = node[key]
    if value is DELETE:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return doc


DELETE = object()
F = ("methods", "forward")
CASES = [
    ((*F, "steps", 0, "kernel"), "nope", "methods.forward.steps[0].kernel"),
    ((*F, "steps", 0, "kernel"), "latch", "methods.forward.steps[0].kernel"),
    ((*F, "steps", 0, "in"), ["x"], "methods.forward.steps[0].in"),
    ((*F, "steps", 1, "out"), [], "methods.forward.steps[1].out"),
    ((*F, "inputs", 0, "dtype"), "float128", "methods.forward.inputs[0].dtype"),
    ((*F, "inputs", 0, "shape"), [4, -16], "methods.forward.inputs[0].shape[1]"),
    ((*F, "inputs", 0, "shape"), [1 << 20, 1 << 20], "methods.forward.inputs[0].shape"),
    ((*F, "inputs", 0, "shape"), [4, 15], "methods.forward.steps[0].in[1]"),
    ((*F, "buffers", 0, "shape"), [4, 8], "methods.forward.steps[0].out[0]"),
    ((*F, "steps", 1, "in", 0), "ghost", "methods.forward.steps[1].in[0]"),
    ((*F, "buffers", 0, "name"), "x", "methods.forward.buffers[0].name"),
    ((*F, "steps", 0, "in", 0), "h", "methods.forward.steps[0].in[0]"),
    ((*F, "steps", 2, "params", "us"), -1, "methods.forward.steps[2].params.us"),
    ((*F, "steps", 2, "params", "bogus"), 1, "methods.forward.steps[2].params.bogus"),
    (("format",), 2, "format"),
    (("device_index",), -1, "device_index"),
    (("methods",), {}, "methods"),
    ((*F, "outputs", 0, "name"), "h", "methods.forward.outputs[0].name"),
    ((*F, "steps", 0, "out", 0), "x", "methods.forward.steps[0].out[0]"),
    (("name",), 7, "name"),
    ((*F, "extra"), 1, "methods.forward.extra"),
]


@pytest.mark.parametrize("path,value,where", CASES)
def test_invalid_manifests_name_the_json_path(tmp_path, path, value, where):
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, mutate(manifest(), path, value)))
    assert info.value.path == where, str(info.value)
    assert str(info.value).startswith(where)


def test_output_nothing_writes(tmp_path):
    doc = manifest()
    doc["methods"]["forward"]["outputs"].append({"name": "z", "dtype": "float32",
                                                  "shape": [2]})
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc))
    assert info.value.path == "methods.forward.outputs[1].name"


@pytest.mark.parametrize("damage", ["closing brace", "descr", "header length"])
def test_a_damaged_npy_header_is_an_invalid_program(tmp_path, damage):
    """numpy parses a member's header with ast.literal_eval: one changed byte raised
    tokenize.TokenError or SyntaxError out of Program.load (a differential fuzz, 4 of 4,600
    damaged files; 425 of 1,792 single-byte edits of the header)."""
    import zipfile

    small(1.0).save(tmp_path / "p.json")
    npz = tmp_path / "p.npz"
    with zipfile.ZipFile(npz) as z:
        (member,) = z.namelist()
        raw = bytearray(z.read(member))
    if damage == "closing brace":
        raw[raw.index(b"}")] = ord(" ")
    elif damage == "descr":
        raw[raw.index(b"'<f4'") + 1] = ord(",")
    else:
        raw[8] = 0x20  # the header's length, shortened
    with zipfile.ZipFile(npz, "w") as z:
        z.writestr(member, bytes(raw))
    with pytest.raises(InvalidProgram, match=r"readable \.npz") as info:
        Program.load(tmp_path / "p.json")
    assert info.value.path == "constants"


def test_constants_missing_or_of_wrong_shape(tmp_path):
    with pytest.raises(InvalidProgram, match=r"steps\[0\]\.in\[1\]"):
        Program.load(write(tmp_path, manifest(), constants={"other": W}))
    with pytest.raises(InvalidProgram, match=r"steps\[0\]\.in\[1\]"):
        Program.load(write(tmp_path, manifest(), constants={"w1": W[:8]}))
    doc = manifest()
    doc["constant_tensors"] = [{"name": "w1", "dtype": "float32", "shape": [16, 8]}]
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc))
    assert info.value.path == "constant_tensors[0]"
    # The field is the manifest's declaration: what it should say is what the .npz holds, and
    # what it got is the declaration (the two were swapped, blaming the .npz).
    assert info.value.expected.startswith(f"float32{list(W.shape)}"), info.value.expected
    assert info.value.got == "float32[16, 8]"


def test_malformed_json_and_files(tmp_path):
    with pytest.raises(InvalidProgram, match="JSON"):
        Program.load(write(tmp_path, "{not json"))
    with pytest.raises(InvalidProgram, match="JSON"):
        Program.load(write(tmp_path, '{"format": NaN}'))
    text = json.dumps(manifest())
    twice = text.replace('"name": "p"', '"name": "p", "name": "q"', 1)
    assert twice != text
    with pytest.raises(InvalidProgram, match="'name' appears twice"):
        Program.load(write(tmp_path, twice))
    with pytest.raises(InvalidProgram, match="readable"):
        Program.load(tmp_path / "missing.json")
    path = write(tmp_path, manifest())
    (tmp_path / "p.npz").write_bytes(b"garbage")
    with pytest.raises(InvalidProgram) as info:
        Program.load(path)
    assert info.value.path == "constants"
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, mutate(manifest(), ("constants",), "../etc/passwd")))
    assert info.value.path == "constants"


def test_a_bad_manifest_is_reported_before_its_constants_are_read(tmp_path):
    """The manifest's own fields are checked before the .npz is opened: a wrong format or
    name is reported as such even when the constants beside it are damaged or missing."""
    for where, value in ((("format",), 2), (("name",), "1p"), (("device_index",), -1)):
        path = write(tmp_path, mutate(manifest(), where, value))
        (tmp_path / "p.npz").write_bytes(b"garbage")
        with pytest.raises(InvalidProgram) as info:
            Program.load(path)
        assert info.value.path == where[0], str(info.value)
        (tmp_path / "p.npz").unlink()
        with pytest.raises(InvalidProgram) as info:
            Program.load(path)
        assert info.value.path == where[0], str(info.value)
    path = write(tmp_path, manifest())
    (tmp_path / "p.npz").unlink()
    with pytest.raises(InvalidProgram, match=r"readable \.npz") as info:
        Program.load(path)
    assert info.value.path == "constants"


def test_a_bad_method_is_reported_before_the_constants_data_is_read(tmp_path):
    """The manifest is validated against the .npz members' headers; their data is read only
    once all of it is valid, so a typo next to 64 MB of constants allocates none of them."""
    import tracemalloc

    big = np.zeros((4096, 4096), np.float32)
    doc = mutate(manifest(), ("methods", "forward", "steps", 0, "kernel"), "matmull")
    path = write(tmp_path, doc, {"w1": big})
    del big
    tracemalloc.start()
    try:
        with pytest.raises(InvalidProgram) as info:
            Program.load(path)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.path == "methods.forward.steps[0].kernel"
    assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB allocated before the error"


def test_device_index_picks_the_gpu_only_when_the_device_is_left_to_auto(tmp_path, monkeypatch):
    """A program's ``device_index`` chooses the GPU when ``method()`` is given no device (or
    "auto") and nothing forces one; a named device or ``STREAMLANE_DEVICE`` wins; the host
    device takes any program."""
    from streamlane.runtime import device as device_module
    from streamlane.runtime import get_device
    from streamlane.runtime import method as method_module

    program = Program.load(write(tmp_path, mutate(manifest(), ("device_index",), 3)))
    monkeypatch.delenv("STREAMLANE_DEVICE", raising=False)
    host = get_device("host")
    monkeypatch.setattr(device_module, "get_device", lambda name=None: host)  # auto: no GPU
    assert program.method("forward").device is host

    class FakeGpu:
        kind = "cuda"

        def __init__(self, name):
            self.name = name

    def fake_get_device(name=None):
        return FakeGpu("cuda:0" if name in (None, "auto", "cuda") else name)

    monkeypatch.setattr(device_module, "get_device", fake_get_device)
    monkeypatch.setattr(device_module, "Device", FakeGpu)
    monkeypatch.setattr(method_module, "Method", lambda program, mdef, device, options: device)
    assert program.method("forward").name == "cuda:3"
    assert program.method("forward", device="auto").name == "cuda:3"
    assert program.method("forward", device=" AUTO ").name == "cuda:3"  # as get_device reads it
    assert program.method("forward", device="cuda:0").name == "cuda:0"
    assert program.method("forward", device=FakeGpu("cuda:1")).name == "cuda:1"
    monkeypatch.setenv("STREAMLANE_DEVICE", "cuda")
    assert program.method("forward").name == "cuda:0"


def test_a_program_keeps_its_own_read_only_constants(tmp_path):
    """A program is immutable: changing the array it was built from changes nothing, and its
    own constants cannot be written."""
    from streamlane.runtime import get_device

    w = np.eye(2, dtype=np.float32)
    b = Program.build("p", {"w": w})
    m = b.method("forward", x=("float32", [1, 2]))
    m.output(m.step("matmul", "x", "w", out="y"))
    program = b.finish()
    w[:] = 7
    x = np.array([[1, 2]], np.float32)
    np.testing.assert_array_equal(program.method("forward", device=get_device("host"))([x])[0]
                                  .to_host(), x)
    with pytest.raises(ValueError, match="read-only"):
        program.constants["w"][0, 0] = np.nan
    loaded = Program.load(write(tmp_path, manifest()))
    assert not loaded.constants["w1"].flags.writeable


def test_names_holding_dots_are_quoted_in_error_paths(tmp_path):
    """Names may hold '.', so a path never joins such a name with dots: "methods['a.b']" is
    one method, "methods.a.b" would read as two levels."""
    doc = manifest()
    doc["methods"]["enc.v2"] = copy.deepcopy(doc["methods"]["forward"])
    doc["methods"]["enc.v2"]["steps"][0]["kernel"] = "nope"
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc))
    assert info.value.path == "methods['enc.v2'].steps[0].kernel"
    doc = mutate(manifest(), ("methods", "forward", "steps", 2, "params", "us.max"), 1)
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc))
    assert info.value.path == "methods.forward.steps[2].params['us.max']"
    doc = mutate(manifest(), ("methods", "forward", "in.puts"), [])
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc))
    assert info.value.path == "methods.forward['in.puts']"
    builder = Program.build("p", {"w1": W})
    m = builder.method("enc.v2", x=("float32", (4, 16)))
    with pytest.raises(InvalidProgram) as info:
        m.step("nope", "x")
    assert info.value.path == "methods['enc.v2'].steps[0].kernel"
    with pytest.raises(InvalidProgram) as info:
        builder.method("dec-v2", x=("float32", (4, 16))).step("nope", "x")
    assert info.value.path == "methods.dec-v2.steps[0].kernel"


def _npz_with(tmp_path, members, compression=None):
    """Write p.json and a p.npz holding ``members`` ({member name: bytes}) as given."""
    import zipfile

    path = write(tmp_path, manifest())
    with zipfile.ZipFile(tmp_path / "p.npz", "w",
                         compression=compression or zipfile.ZIP_STORED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def _npy(array, header_shape=None):
    import io

    from numpy.lib import format as npy_format

    buf = io.BytesIO()
    if header_shape is None:
        np.save(buf, array)
    else:  # a header that lies about the data after it
        npy_format.write_array_header_1_0(buf, {"descr": array.dtype.str,
                                                "fortran_order": False, "shape": header_shape})
        buf.write(array.tobytes())
    return buf.getvalue()


def test_a_lying_or_damaged_constants_file_is_invalid_program_before_any_allocation(tmp_path):
    """An untrusted .npz: a 16-byte member claiming 10**12 elements must not reach numpy's
    allocator (MemoryError), and a damaged or unsupported archive raises InvalidProgram, not
    zlib.error / NotImplementedError / RuntimeError."""
    import zipfile

    small = np.zeros(4, np.float32)
    cases = {
        "huge header": {"w1.npy": _npy(W), "big.npy": _npy(small, (10**12,))},
        "short header": {"w1.npy": _npy(W, (16, 17))},
        "not .npy": {"w1.npy": _npy(W), "notes.txt": b"hello"},
        "pickled": {"w1.npy": _npy(np.array([{}], dtype=object))},
    }
    for label, members in cases.items():
        with pytest.raises(InvalidProgram) as info:
            Program.load(_npz_with(tmp_path, members))
        assert info.value.path.startswith("constants"), (label, info.value)
    path = _npz_with(tmp_path, {"w1.npy": _npy(W)})
    with zipfile.ZipFile(tmp_path / "p.npz", "a") as zf, pytest.warns(UserWarning):
        zf.writestr("w1.npy", _npy(2 * W))  # which one would a reader take?
    with pytest.raises(InvalidProgram, match="distinct"):
        Program.load(path)
    path = _npz_with(tmp_path, {"w1.npy": _npy(W)}, zipfile.ZIP_DEFLATED)
    raw = bytearray((tmp_path / "p.npz").read_bytes())
    start = raw.find(b"w1.npy") + 40
    raw[start:start + 200] = bytes(b ^ 0x5A for b in raw[start:start + 200])
    (tmp_path / "p.npz").write_bytes(bytes(raw))
    with pytest.raises(InvalidProgram, match=r"readable \.npz"):
        Program.load(path)
    for method, offsets in ((99, (8, 10)), ("encrypted", (6, 8))):
        path = _npz_with(tmp_path, {"w1.npy": _npy(W)})
        raw = bytearray((tmp_path / "p.npz").read_bytes())
        for signature, offset in zip((b"PK\x03\x04", b"PK\x01\x02"), offsets, strict=True):
            at = raw.find(signature)
            if method == "encrypted":
                raw[at + offset] |= 1
            else:
                raw[at + offset:at + offset + 2] = method.to_bytes(2, "little")
        (tmp_path / "p.npz").write_bytes(bytes(raw))
        with pytest.raises(InvalidProgram, match=r"readable \.npz"):
            Program.load(path)


def _raw_npy(header: str, data: bytes) -> bytes:
    """An .npy member with the header dict written as given (numpy's writer checks it)."""
    import struct

    text = header.encode("latin1")
    text += b" " * (-(len(text) + 11) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text + data


def test_hostile_constants_headers_and_compressions_are_invalid_program(tmp_path):
    """From a security review of untrusted files: a bool in an .npy header's shape (numpy's
    reader takes ``(4, True)``) crashed the load with TypeError; a damaged LZMA member with
    ``LZMAError``; a subarray dtype was described as another shape; and a bzip2 member
    declaring 192 bytes inflated whole blocks before zipfile cut them to size (3 KB took
    8 GiB and 45 s, before the manifest was even checked)."""
    import bz2
    import time
    import zipfile

    headers = {
        "a bool in the shape": _raw_npy("{'descr': '<f4', 'fortran_order': False, "
                                        "'shape': (16, True), }", W[:, :1].tobytes()),
        "only bools": _raw_npy("{'descr': '<f4', 'fortran_order': False, "
                               "'shape': (True, True), }", bytes(4)),
        "a subarray dtype": _raw_npy("{'descr': ('<f4', (16,)), 'fortran_order': False, "
                                     "'shape': (16,), }", W.tobytes()),
    }
    for label, member in headers.items():
        with pytest.raises(InvalidProgram) as info:
            Program.load(_npz_with(tmp_path, {"w1.npy": member}))
        assert info.value.path == "constants['w1']", (label, info.value)
    for compression in (zipfile.ZIP_LZMA, zipfile.ZIP_BZIP2):
        path = _npz_with(tmp_path, {"w1.npy": _npy(W)}, compression)
        with pytest.raises(InvalidProgram, match="stored or deflated"):
            Program.load(path)
    # The bomb: a real member's header and size, followed by 256 MiB of zeros in bzip2
    path = _npz_with(tmp_path, {"w1.npy": _npy(W)}, zipfile.ZIP_BZIP2)
    raw = (tmp_path / "p.npz").read_bytes()
    info = zipfile.ZipFile(tmp_path / "p.npz").infolist()[0]
    bomb = bz2.compress(_npy(W) + bytes(256 << 20))
    start = info.header_offset + 30 + len(info.filename) + len(info.extra)
    packed = raw[:start] + bomb + raw[start + info.compress_size:]
    (tmp_path / "p.npz").write_bytes(packed)  # sizes in the headers now lie: any error will do
    began = time.perf_counter()
    with pytest.raises(InvalidProgram):
        Program.load(path)
    assert time.perf_counter() - began < 2


def test_an_unused_buffer_a_hostile_name_and_an_unencodable_path_are_refused(tmp_path):
    """A buffer no step writes (none reads it either) was accepted and allocated at bind: three
    1 GiB buffers in a 414-byte manifest; a constants name holding U+2028 or a bidi override
    was echoed into messages as it was (forged lines); a path with a lone surrogate raised
    ``UnicodeEncodeError`` from ``os.open``."""
    doc = manifest()
    doc["methods"]["forward"]["buffers"].append(
        {"name": "spare", "dtype": "float32", "shape": [1 << 28]})
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc, {"w1": W}))
    assert info.value.path == "methods.forward.buffers[1].name"
    for name in ("w.npz\u2028ERROR all checks passed", "w\u202e.npz"):
        doc = manifest()
        doc["constants"] = name
        with pytest.raises(InvalidProgram, match="plain file name") as info:
            Program.load(write(tmp_path, doc, {"w1": W}))
        assert info.value.path == "constants"
    with pytest.raises(InvalidArgument, match="cannot be encoded"):
        Program.load(str(tmp_path / "\ud800.json"))


def test_big_endian_and_fortran_constants_arrive_native_with_their_values(tmp_path):
    """Uploads copy bytes: another machine's big-endian np.save must not reach a kernel as
    native float32 (on CUDA, 0.02 read as 3.6e25)."""
    from streamlane.runtime import Result, get_device

    big = W.astype(">f4")
    path = _npz_with(tmp_path, {"w1.npy": _npy(np.asfortranarray(big))})
    program = Program.load(path)
    w1 = program.constants["w1"]
    assert w1.dtype == np.float32 and w1.dtype.isnative and w1.flags.c_contiguous
    np.testing.assert_array_equal(w1, W)
    r = Result.from_host(big, get_device("host"))
    assert r.dtype == np.float32 and r.dtype.isnative
    np.testing.assert_array_equal(r.to_host(), W)


def test_names_keys_and_literals_in_errors(tmp_path):
    """A name with a trailing newline is not a name; a megabyte-long key does not make a
    megabyte-long error; a NaN literal is located like any other JSON error; a constant
    declared twice is refused."""
    for where, value in ((("name",), "p\n"), (("methods", "forward", "inputs", 0, "name"), "x\n")):
        with pytest.raises(InvalidProgram, match="a name of letters"):
            Program.load(write(tmp_path, mutate(manifest(), where, value)))
    doc = manifest()
    doc["methods"]["m" * 1_000_000] = doc["methods"]["forward"]
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc))
    assert len(str(info.value)) < 400 and len(info.value.path) < 200
    doc = manifest()
    doc["methods"]["forward"]["k" * 1_000_000] = 1
    with pytest.raises(InvalidProgram) as info:
        Program.load(write(tmp_path, doc))
    assert len(str(info.value)) < 400 and info.value.path.startswith("methods.forward.kkk")
    text = json.dumps(manifest()).replace('"us": 5', '"us": NaN')
    with pytest.raises(InvalidProgram, match=r"NaN is not valid JSON: line 1 column \d+"):
        Program.load(write(tmp_path, text))
    doc = manifest()
    decl = {"name": "w1", "dtype": "float32", "shape": [16, 16]}
    doc["constant_tensors"] = [decl, dict(decl)]
    with pytest.raises(InvalidProgram, match="declared once") as info:
        Program.load(write(tmp_path, doc))
    assert info.value.path == "constant_tensors[1].name"


def _leaves(doc, prefix=()):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield (*prefix, k)
            yield from _leaves(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            yield (*prefix, i)
            yield from _leaves(v, (*prefix, i))


PATHS = list(_leaves(manifest()))
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-2**40, 2**40),
                 st.floats(allow_nan=True), st.text(max_size=8),
                 st.lists(st.integers(-3, 1 << 33), max_size=4),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
                 st.just(DELETE))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(PATHS), JUNK), min_size=1, max_size=3))
def test_fuzzed_manifests_raise_only_invalid_program(mutations):
    doc = manifest()
    for path, value in mutations:
        try:
            doc = mutate(doc, path, value)
        except (KeyError, IndexError, TypeError):
            continue
    try:
        Program.from_manifest(doc, {"w1": W})
    except InvalidProgram:
        pass


def test_wrong_types_in_the_python_api_raise_streamlane_errors():
    """Each of these escaped as TypeError / AttributeError / ValueError."""
    from streamlane.runtime import get_device

    with pytest.raises(InvalidArgument, match="constants must be a mapping"):
        Program.build("p", constants=[("w", np.ones(2))])
    m = Program.build("q").method("f", x=("float32", [3]))
    with pytest.raises(InvalidProgram, match=r"\(name, dtype, shape\)") as info:
        m.call(lambda s, i, o: None, ["x"], [("y", "float32")])
    assert info.value.path == "methods.f.steps[0].out[0]"
    with pytest.raises(InvalidProgram) as info:
        Program.from_manifest({"format": 1, "name": "p", "methods": {1: {}}})
    assert info.value.path == "methods['1']"
    program = Program.build("id")
    mb = program.method("f", x=("float32", [3]))
    mb.output(mb.step("relu", "x", out="y"))
    program = program.finish()
    with pytest.raises(InvalidArgument, match="has no method"):
        program.method(["f"], device=get_device("host"))
    method = program.method("f", device=get_device("host"))
    method.set_inputs([np.ones(3, np.float32)])
    with pytest.raises(InvalidArgument, match="start="):
        method.execute(start=123)
    method.execute()
    np.testing.assert_array_equal(method.get_outputs()[0].to_host(), np.ones(3))


def test_builder_errors_are_as_precise_as_the_file_validators():
    """The builder names the field (params.alpha, in[1]), lists only kernels programs may use,
    and refuses those (latch) as a file would."""
    from streamlane.runtime import get_device

    def step_error(kernel, *ins, **params):
        m = Program.build("p").method("f", x=("float32", [3]))
        with pytest.raises(InvalidProgram) as info:
            m.step(kernel, *ins, **params)
        return info.value

    error = step_error("axpy", "x", "x", alpha="2")
    assert error.path == "methods.f.steps[0].params.alpha"
    error = step_error("add", "x", "ghost")
    assert error.path == "methods.f.steps[0].in[1]" and error.got == "ghost"
    for kernel in ("matmull", "latch", "strided_copy"):
        error = step_error(kernel, "x")
        assert error.path == "methods.f.steps[0].kernel"
        assert "latch" not in error.expected and "strided_copy" not in error.expected
    with pytest.raises(InvalidProgram, match="dtype object"):
        Program.build("p", {"w": np.array([None])}).finish()
    b = Program.build("r")
    m = b.method("f", x=("float32", [3]))
    m.output(m.step("relu", "x", out="y"))
    method = b.finish().method("f", device=get_device("host"))
    from streamlane.runtime import Result
    from streamlane.runtime.errors import InvalidInput

    wrong = Result.from_host(np.ones(3, np.float64), get_device("host"))
    with pytest.raises(InvalidInput, match="a Result has no astype"):
        method([wrong])


def test_a_huge_or_endless_manifest_is_refused_before_it_is_read(tmp_path):
    """The size limit holds before the bytes are read: a sparse file of 1 GiB, and a file that
    never ends, are refused at once."""
    import os
    import time

    from streamlane.runtime.program import MAX_MANIFEST_BYTES

    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(1 << 30)
    started = time.perf_counter()
    with pytest.raises(InvalidProgram, match="at most") as info:
        Program.load(big)
    assert info.value.got == 1 << 30
    if os.path.exists("/dev/zero"):
        with pytest.raises(InvalidProgram, match=f"more than {MAX_MANIFEST_BYTES}"):
            Program.load("/dev/zero")
    assert time.perf_counter() - started < 2


def test_the_builder_refuses_what_a_file_would_and_takes_what_it_can():
    """A method named twice is refused (a file naming it twice is); constant names are
    checked as a file's are; a constant added after a method was started can be used in it;
    ``fill``, whose output shape nothing infers, takes ``shape=``."""
    from streamlane.runtime import get_device

    b = Program.build("p")
    b.method("f", x=("float32", [3]))
    with pytest.raises(InvalidProgram) as info:
        b.method("f", z=("float32", [3]))
    assert info.value.path == "methods.f"
    with pytest.raises(InvalidProgram) as info:
        Program.build("p", constants={1: np.ones(2, np.float32)}).finish()
    assert info.value.path == "constants[1]"
    for what in ("constants", "callables"):
        with pytest.raises(InvalidArgument, match=f"{what} must be a mapping"):
            Program.from_manifest({"format": 1}, **{what: [np.ones(2)]})

    b = Program.build("late")
    m = b.method("f", x=("float32", [1, 2]))
    b.constant("w", np.array([[1, 2], [3, 4]], np.float32))
    m.output(m.step("matmul", "x", "w", out="y"))
    host = get_device("host")
    (y,) = b.finish().method("f", device=host)([np.ones((1, 2), np.float32)])
    np.testing.assert_array_equal(y.to_host(), [[4, 6]])

    m = Program.build("p").method("f", x=("float32", [3]))
    with pytest.raises(InvalidProgram, match="shape=") as info:
        m.step("fill", out="y", value=1.0)
    assert info.value.path == "methods.f.steps[0].shape"
    with pytest.raises(InvalidProgram) as info:
        m.step("relu", "x", shape=(4,))
    assert info.value.path == "methods.f.steps[0].shape"
    for bad in (3, "3", (3.0,), (True,), {3}, np.array(3), bytearray(b"\x03"), range(3)):
        with pytest.raises(InvalidProgram) as info:
            m.step("fill", shape=bad, value=1.0)
        assert info.value.path == "methods.f.steps[0].shape"
    for bad in (["y"], {"y": 1}, 3, b"y", True, "9y", "a b"):  # refused at the step (a list
        with pytest.raises(InvalidProgram) as info:  # raised TypeError: unhashable)
            m.step("relu", "x", out=bad)  # type: ignore[arg-type]
        assert info.value.path == "methods.f.steps[0].out[0]"
    for bad, field in (((0,), "shape[0]"), ((2, -3), "shape[1]"), ((2 ** 31,), "shape[0]"),
                       ((1,) * 9, "shape")):  # refused at the step, not blamed on its reader
        with pytest.raises(InvalidProgram) as info:
            m.step("fill", shape=bad, value=1.0)
        assert info.value.path == f"methods.f.steps[0].{field}"
    assert m.step("fill", shape=np.array([3]), value=1.0)  # numpy integers are ints
    b = Program.build("filled")
    m = b.method("f", x=("float32", [3]))
    m.output(m.step("add", "x", m.step("fill", shape=(3,), value=7.5), out="y"))
    (y,) = b.finish().method("f", device=host)([np.ones(3, np.float32)])
    np.testing.assert_array_equal(y.to_host(), [8.5, 8.5, 8.5])


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
@pytest.mark.parametrize("kind", ["/dev/zero", "a FIFO", "a directory"])
def test_a_constants_file_that_is_no_regular_file_is_refused_at_once(tmp_path, kind):
    """A symlink to /dev/zero (no size, endless) was read whole: memory ran out. A FIFO made
    the load wait for a writer forever."""
    path = tmp_path / "p.json"
    path.write_text(json.dumps(manifest()))
    constants = tmp_path / "p.npz"
    if kind == "/dev/zero":
        if not Path("/dev/zero").exists():
            pytest.skip("no /dev/zero")
        constants.symlink_to("/dev/zero")
    elif kind == "a FIFO":
        os.mkfifo(constants)
    else:
        constants.mkdir()
    with pytest.raises(InvalidProgram, match=r"regular \.npz file") as info:
        Program.load(path)
    assert info.value.path == "constants"


def test_validation_time_does_not_grow_with_the_product_of_two_sizes(tmp_path):
    """A step naming a million inputs and thousands of outputs checked each output against
    every input (minutes for a 4 MB manifest); a thousand methods each rebuilt the table of
    ten thousand constants (16 s). Both are linear now; the generous bound only catches the
    old quadratic cost."""
    import time

    doc = manifest()
    outs = [f"o{i}" for i in range(5000)]
    doc["methods"]["forward"]["buffers"] += [{"name": n, "dtype": "float32", "shape": [1]}
                                             for n in outs]
    doc["methods"]["forward"]["steps"][1] = {"kernel": "gelu", "in": ["h"] * 1_000_000,
                                             "out": outs}
    path = write(tmp_path, doc)
    start = time.perf_counter()
    with pytest.raises(InvalidProgram, match="1 inputs for gelu"):
        Program.load(path)
    assert time.perf_counter() - start < 10

    constants = {f"c{i}": np.zeros(1, np.float32) for i in range(10_000)}
    method = {"inputs": [{"name": "x", "dtype": "float32", "shape": [1]}],
              "steps": [{"kernel": "relu", "in": ["x"], "out": ["y"]}],
              "outputs": [{"name": "y", "dtype": "float32", "shape": [1]}]}
    doc = {"format": 1, "name": "p", "constants": "p.npz",
           "methods": {f"m{i}": method for i in range(1000)}}
    path = write(tmp_path, doc, constants)
    start = time.perf_counter()
    program = Program.load(path)
    assert time.perf_counter() - start < 10
    assert len(program.methods) == 1000 and len(program.constants) == 10_000


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs (POSIX)")
def test_a_manifest_path_that_is_a_fifo_nobody_writes_to_does_not_hang(tmp_path):
    """The open waited for a writer forever; one that does write is still read."""
    import threading

    fifo = tmp_path / "p.json"
    os.mkfifo(fifo)
    with pytest.raises(InvalidProgram, match="well-formed JSON"):
        Program.load(fifo)  # nobody writes: empty
    text = json.dumps({**manifest(), "constants": None} | {"methods": {"forward": {
        "inputs": [{"name": "x", "dtype": "float32", "shape": [4]}],
        "steps": [{"kernel": "relu", "in": ["x"], "out": ["y"]}],
        "outputs": [{"name": "y", "dtype": "float32", "shape": [4]}]}}})

    def write():
        with open(fifo, "w") as f:  # blocks until the load has opened it
            f.write(text)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        deadline = time.monotonic() + 10
        while True:  # the load may open before the writer does: then it reads nothing
            try:
                program = Program.load(fifo)
                break
            except InvalidProgram:
                assert time.monotonic() < deadline
                time.sleep(0.01)
    finally:
        writer.join(10)
    assert list(program.methods) == ["forward"]


def test_a_missing_constants_file_is_named_where_it_was_looked_for(tmp_path, monkeypatch):
    """Loaded by a relative path, the error named "nope.npz" without the folder it looked in
    (and "[Errno 2] ..." instead of the reason)."""
    write(tmp_path, mutate(manifest(), ("constants",), "nope.npz"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidProgram, match="No such file or directory") as info:
        Program.load("p.json")
    assert str(tmp_path / "nope.npz") in str(info.value) and "Errno" not in str(info.value)


def test_a_path_holding_a_nul_is_invalid_argument():
    with pytest.raises(InvalidArgument, match="NUL"):
        Program.load("model\0.json")


def test_a_manifest_that_cannot_be_read_is_reported_by_its_path(tmp_path):
    """A folder's error read "[Errno 21] Is a directory: 3", naming the file descriptor, and
    an empty path was reported as "at ."."""
    with pytest.raises(InvalidProgram) as info:
        Program.load(tmp_path)
    assert str(tmp_path) in str(info.value) and "Is a directory" in str(info.value)
    assert "Errno" not in str(info.value)
    with pytest.raises(InvalidProgram, match="No such file or directory") as info:
        Program.load(tmp_path / "missing.json")
    assert str(tmp_path / "missing.json") in str(info.value)
    with pytest.raises(InvalidArgument, match="empty"):
        Program.load("")


def test_a_step_named_for_the_builder_never_writes_into_a_users_tensor():
    """A step without ``out=`` is named ``t<step>_<k>``; a buffer, input or constant the user
    had named so was taken as that output, and the step wrote into it: relu(x) + 3x came
    back as 3x + 3x, silently."""
    from streamlane.runtime import get_device

    b = Program.build("p", {"t3_0": np.ones(4, np.float32)})
    m = b.method("forward", x=("float32", [4]), t4_0=("float32", [4]))
    a = m.step("relu", "x", out="t2_0")  # the user's name
    m.step("scale", "x", factor=2.0)  # t1_0
    c = m.step("scale", "x", factor=3.0)  # would be t2_0: a's buffer
    d = m.step("add", a, c)  # would be t3_0: the constant
    e = m.step("add", d, "t4_0")  # would be t4_0: the second input
    assert len({a, c, d, e, "t3_0", "t4_0"}) == 6
    m.output(m.step("add", e, "t3_0", out="y"))
    x = np.array([-1, 1, 2, -3], np.float32)
    y = b.finish().method("forward", device=get_device("host"))([x, x])[0].to_host()
    np.testing.assert_array_equal(y, np.maximum(x, 0) + 3 * x + x + 1)


@pytest.mark.parametrize("how", ["step", "call"])
def test_a_later_step_cannot_write_into_a_name_the_builder_gave(how):
    """The other way round: ``step()`` named relu(x)'s output ``t0_0`` and returned it; a
    later ``out="t0_0"`` (or a callable's output of that name) wrote into it, and the
    method's output, asked for as relu(x), came back as 10x, silently (a review)."""
    b = Program.build("p")
    m = b.method("f", x=("float32", [4]))
    r = m.step("relu", "x")
    with pytest.raises(InvalidProgram, match=r"steps\[1\]\.out\[0\].*the builder gave step 0"):
        if how == "step":
            m.step("scale", "x", out=r, factor=10.0)
        else:
            m.call(lambda stream, ins, outs: None, [], [(r, "float32", [4])])
    m.step("scale", "x", out="mine", factor=10.0)
    m.step("scale", "x", out="mine", factor=20.0)  # a name of the user's own: rewritten
    m.output(r, "mine")
    assert [s["out"] for s in b.finish().to_manifest()["methods"]["f"]["steps"]] == \
        [[r], ["mine"], ["mine"]]


def test_a_step_that_writes_nothing_refuses_out():
    b = Program.build("p")
    m = b.method("f", x=("float32", [4]))
    with pytest.raises(InvalidProgram, match=r"steps\[0\]\.out: expected no out="):
        m.step("spin", out="z", us=1)


@pytest.mark.parametrize("name", ["file", "allow_pickle", "arr_0"])
def test_constants_named_like_savez_arguments_are_saved(tmp_path, name):
    """``np.savez(f, **constants)`` took a constant named ``file`` as its own argument (a
    TypeError) and one named ``allow_pickle`` as its option (an empty .npz that load then
    refused): the constants file is written member by member."""
    b = Program.build("p", constants={name: np.full(4, 7, np.float32)})
    m = b.method("f", x=("float32", [4]))
    m.output(m.step("add", "x", name))
    p = b.finish()
    p.save(tmp_path / "p.json")
    q = Program.load(tmp_path / "p.json")
    assert q == p and list(np.load(tmp_path / "p.npz").keys()) == [name]
    q.save(tmp_path / "again.json")
    assert Program.load(tmp_path / "again.json") == p


def test_a_program_with_a_nan_constant_equals_itself_saved_and_loaded(tmp_path):
    b = Program.build("p", constants={"c": np.array([np.nan, 1.0], np.float32)})
    m = b.method("f", x=("float32", [2]))
    m.output(m.step("add", "x", "c"))
    p = b.finish()
    p.save(tmp_path / "p.json")
    assert p == p and Program.load(tmp_path / "p.json") == p
    b2 = Program.build("p", constants={"c": np.array([np.nan, 2.0], np.float32)})
    m2 = b2.method("f", x=("float32", [2]))
    m2.output(m2.step("add", "x", "c"))
    assert b2.finish() != p


def test_a_name_must_start_with_a_letter_or_underscore_and_says_so():
    b = Program.build("p")
    m = b.method("f", x=("float32", [4]))
    with pytest.raises(InvalidProgram, match="starting with a letter or '_'"):
        m.step("relu", "x", out="-y")


def test_the_builder_takes_numpy_scalars_as_the_numbers_they_hold(tmp_path):
    """``factor=np.float32(2)`` and an input shape ``(np.int64(4),)`` were refused while
    ``shape=np.array([4])`` was taken; numpy scalars now count as the numbers they hold (a
    numpy bool as a bool: refused), and ``save()`` writes them as plain JSON numbers."""
    from streamlane.runtime import get_device

    b = Program.build("p")
    m = b.method("forward", x=(np.float32, (np.int64(4),)))  # numpy's dtypes too
    y = m.step("scale", "x", factor=np.float32(2))
    m.step("spin", us=np.int64(5))
    m.output(y)
    program = b.finish()
    path = tmp_path / "p.json"
    program.save(path)
    assert json.loads(path.read_text())["methods"]["forward"]["steps"][0]["params"] == {
        "factor": 2.0}
    x = np.ones(4, np.float32)
    np.testing.assert_array_equal(Program.load(path).method(
        "forward", device=get_device("host"))([x])[0].to_host(), 2 * x)
    for bad in (np.bool_(True), np.float32("nan")):
        with pytest.raises(InvalidProgram, match="factor"):
            Program.build("q").method("f", x=("float32", [4])).step("scale", "x", factor=bad)
    q = Program.build("q").method("f", x=(np.dtype("float32"), [4]))
    with pytest.raises(InvalidProgram, match=r"params\.us: expected an int \(required"):
        q.step("spin")
    with pytest.raises(InvalidProgram, match=r"inputs\[0\]\.dtype: expected one of"):
        Program.build("r").method("f", x=(object, [4]))


@pytest.mark.parametrize("mistake", [
    "method_named_none", "method_named_with_a_space", "method_named_by_a_list",
    "input_named_like_a_constant", "constant_named_like_an_input", "constant_named_by_a_list",
    "constant_of_objects", "constant_of_nothing", "step_out_an_input", "step_out_a_constant",
    "call_out_an_input", "output_an_input"])
def test_a_builder_mistake_is_refused_at_once_and_the_builder_goes_on(mistake):
    """Each was taken (or a TypeError), and every later finish() raised: the builder could not
    be mended, having no way to remove a method or a step."""
    b = Program.build("p", constants={"w": np.ones(4, np.float32)})
    m = b.method("f", x=("float32", [4]))
    calls = {
        "method_named_none": lambda: b.method(None, y=("float32", [4])),
        "method_named_with_a_space": lambda: b.method("a b", y=("float32", [4])),
        "method_named_by_a_list": lambda: b.method(["g"], y=("float32", [4])),
        "input_named_like_a_constant": lambda: b.method("g", w=("float32", [4])),
        "constant_named_like_an_input": lambda: b.constant("x", np.ones(4, np.float32)),
        "constant_named_by_a_list": lambda: b.constant(["v"], np.ones(4, np.float32)),
        "constant_of_objects": lambda: b.constant("v", np.array([object()])),
        "constant_of_nothing": lambda: b.constant("v", np.ones(0, np.float32)),
        "step_out_an_input": lambda: m.step("relu", "w", out="x"),
        "step_out_a_constant": lambda: m.step("relu", "x", out="w"),
        "call_out_an_input": lambda: m.call(lambda s, i, o: None, ["w"],
                                            [("x", "float32", [4])]),
        "output_an_input": lambda: m.output("x"),
    }
    with pytest.raises(InvalidProgram) as info:
        calls[mistake]()
    assert info.value.path
    m.output(m.step("add", "x", "w"))
    program = b.finish()
    assert list(program.methods) == ["f"] and list(program.constants) == ["w"]
    from streamlane.runtime import get_device

    got = program.method("f", device=get_device("host"))([np.arange(4, dtype=np.float32)])
    np.testing.assert_array_equal(got[0].to_host(), np.arange(4, dtype=np.float32) + 1)


def test_the_builders_checks_stay_linear_in_the_inputs():
    """Each step() and output() name was looked up in a list of the inputs: 4,000 inputs and
    steps took ~2 s (0.04 s before those checks)."""
    import time

    n = 4000
    b = Program.build("wide")
    m = b.method("f", **{f"x{i}": ("float32", [2]) for i in range(n)})
    start = time.perf_counter()
    outs = [m.step("copy", f"x{i}", out=f"y{i}") for i in range(n)]
    m.output(*outs)
    assert time.perf_counter() - start < 0.6


def test_the_builder_refuses_an_output_declared_twice():
    """``m.output(y, y)`` was taken as one output, silently; a file saying so is refused."""
    b = Program.build("p")
    m = b.method("forward", x=("float32", [4]))
    y = m.step("relu", "x")
    with pytest.raises(InvalidProgram, match="declared once") as info:
        m.output(y, y)
    assert info.value.path == "methods.forward.outputs[1].name"
    m.output(y)
    with pytest.raises(InvalidProgram, match="declared once"):
        m.output(y)
    assert len(b.finish().methods["forward"].outputs) == 1
    import time

    start = time.perf_counter()  # the check is linear: 40,000 names took 9 s when it was not
    b.method("wide", x=("float32", [4])).output(*[f"o{i}" for i in range(40_000)])
    assert time.perf_counter() - start < 3


@pytest.mark.parametrize("where", ["file", "under_file", "folder_named_like_a_manifest",
                                   "dangling_link", "under_a_dangling_link", "link_loop",
                                   "under_file_with_a_newline"])
def test_examples_command_refuses_a_folder_it_cannot_write_in_one_line(tmp_path, where):
    """``python -m streamlane.runtime.examples DIR`` where DIR cannot take the files: one
    line on stderr naming it (quoted: a newline in it stays on that line), status 1, no
    traceback, and the reason ``open()`` would give, not mkdir's "File exists"."""
    (tmp_path / "f").write_text("x")
    (tmp_path / "d" / "encoder.json").mkdir(parents=True)
    (tmp_path / "gone").symlink_to(tmp_path / "nowhere")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    folder = {"file": tmp_path / "f", "under_file": tmp_path / "f" / "sub",
              "folder_named_like_a_manifest": tmp_path / "d",
              "dangling_link": tmp_path / "gone", "under_a_dangling_link": tmp_path / "gone/s",
              "link_loop": tmp_path / "loop",
              "under_file_with_a_newline": tmp_path / "f" / "new\nline"}[where]
    done = subprocess.run([sys.executable, "-m", "streamlane.runtime.examples", str(folder)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done
    assert "Traceback" not in done.stderr and "File exists" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and repr(str(folder)) in lines[0], done.stderr
    assert done.stdout == ""


def test_examples_command_refuses_an_empty_folder_name_as_a_bad_argument(tmp_path):
    """``""`` wrote the examples into the current folder (Path("") is "."), status 0, where
    ``streamlane demo --out ""`` is refused."""
    done = subprocess.run([sys.executable, "-m", "streamlane.runtime.examples", ""],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done
    assert "empty; name a folder" in done.stderr and "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_examples_main_refuses_a_nul_in_the_folder_in_one_line(capsys):
    from streamlane.runtime.examples.__main__ import main

    assert main(["a\x00b"]) == 1
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_examples_command_writes_both_programs(tmp_path):
    done = subprocess.run([sys.executable, "-m", "streamlane.runtime.examples",
                           str(tmp_path / "new")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done
    for name in ("encoder", "decoder"):
        assert Program.load(tmp_path / "new" / f"{name}.json").name == name

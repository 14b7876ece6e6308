"""Programs: format 1 round trip, the builder, and validation of untrusted manifests."""

from __future__ import annotations

import copy
import json

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

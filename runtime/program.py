"""Programs: immutable, validated definitions of named methods (format 1 on disk, or built in
Python). Files are untrusted: everything is validated before anything is allocated, and every
problem in a file raises ``InvalidProgram`` naming the JSON path of the bad field (a wrong kind
of argument, such as ``Program.load(123)``, is an ``InvalidArgument``)."""

from __future__ import annotations

import errno
import inspect
import json
import lzma
import math
import os
import re
import stat
import tokenize
import unicodedata
import uuid
import zipfile
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, SupportsIndex

import numpy as np
from numpy.lib import format as npy_format

from streamlane.kernels import KernelSpec, KernelSpecError, UnknownKernel, get_kernel
from streamlane.kernels.spec import member_path, plain_number

from .dtypes import DTYPES, as_host_array, dtype_name
from .errors import InvalidArgument, InvalidProgram, NotSupported

if TYPE_CHECKING:
    from .device import Device
    from .method import Method
    from .stream import Stream

__all__ = ["MethodBuilder", "MethodDef", "Program", "ProgramBuilder", "StepDef", "TensorDecl"]

FORMAT = 1
MAX_TENSOR_BYTES = 4 << 30  # one tensor
MAX_METHOD_BYTES = 16 << 30  # all planned memory of one method
MAX_MANIFEST_BYTES = 16 << 20
MAX_CONSTANTS_BYTES = 8 << 30
MAX_DIM = (1 << 31) - 1
MAX_RANK = 8
MAX_DEVICE_INDEX = 1024
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,127}")  # fullmatch: "x\n" is not a name
# A callable step: fn(stream, ins, outs) enqueues its work on the stream it is handed (the
# execute's resolved stream); ins and outs are its device arrays. What it returns is ignored
# (an awaitable is refused: it would never run).
StepFn = Callable[["Stream", list[Any], list[Any]], object]
# A tensor given to the builder: (dtype, shape), numpy's dtypes and integers allowed.
DTypeArg = str | np.dtype[Any] | type[np.generic]
ShapeArg = Sequence[SupportsIndex] | np.ndarray
# What open() takes as a file's name (bytes in the file system's encoding).
FilePath = str | bytes | os.PathLike[str] | os.PathLike[bytes]


@dataclass(frozen=True)
class TensorDecl:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "dtype": self.dtype, "shape": list(self.shape)}


@dataclass(frozen=True)
class StepDef:
    """One step: a ``kernel`` of the library, or a ``callable`` (user code handed the resolved
    stream and the step's device arrays)."""

    kind: str  # "kernel" | "callable"
    target: str  # kernel name or callable name
    ins: tuple[str, ...]
    outs: tuple[str, ...]
    params: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {self.kind: self.target, "in": list(self.ins), "out": list(self.outs)}
        if self.params:
            d["params"] = dict(self.params)
        return d


@dataclass(frozen=True)
class MethodDef:
    name: str
    inputs: tuple[TensorDecl, ...]
    buffers: tuple[TensorDecl, ...]
    steps: tuple[StepDef, ...]
    outputs: tuple[TensorDecl, ...]

    def to_json(self) -> dict[str, Any]:
        return {"inputs": [t.to_json() for t in self.inputs],
                "buffers": [t.to_json() for t in self.buffers],
                "steps": [s.to_json() for s in self.steps],
                "outputs": [t.to_json() for t in self.outputs]}


class Program:
    """A validated program. Load one with ``Program.load(path)`` or build one with
    ``Program.build(name)``; bind a method to a device with ``program.method(name, device=...)``.
    """

    name: str
    methods: Mapping[str, MethodDef]  # read-only views, in the order the program gives them
    constants: Mapping[str, np.ndarray]
    callables: Mapping[str, StepFn]
    device_index: int | None
    constants_file: str | None  # the .npz the manifest named, when loaded from a file

    def __init__(self, name: str, methods: Mapping[str, MethodDef],
                 constants: Mapping[str, np.ndarray], callables: Mapping[str, StepFn],
                 device_index: int | None = None, constants_file: str | None = None):
        fields = self.__dict__  # set once here: __setattr__ refuses
        fields["name"] = name
        fields["methods"] = MappingProxyType(dict(methods))
        fields["constants"] = MappingProxyType(dict(constants))
        fields["callables"] = MappingProxyType(dict(callables))
        fields["device_index"] = device_index
        fields["constants_file"] = constants_file

    def __setattr__(self, attr: str, value: Any) -> None:
        # Validated once, used by methods bound since: a renamed program would save a manifest
        # load() refuses, and a changed table would disagree with the methods built from it.
        raise AttributeError(f"a Program is immutable (validated when built or loaded): "
                             f"cannot set {attr!r}; build a new one with Program.build() or "
                             f"Program.from_manifest(program.to_manifest() edited)")

    def __delattr__(self, attr: str) -> None:
        raise AttributeError(f"a Program is immutable: cannot delete {attr!r}")

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def load(cls, path: FilePath) -> Program:
        """Read a format-1 program: the JSON manifest at ``path`` and its sibling ``.npz``."""
        text = path_text(path, "Program.load")
        if not text:  # Path("") is ".", which would be reported as "at ."
            raise InvalidArgument("Program.load: the path is empty")
        if "\0" in text:
            raise InvalidArgument(f"Program.load: the path {text!r} holds a NUL character")
        if _names_folder(text):  # Path() would drop the "/" and read the file "x"
            raise InvalidProgram("", f"a manifest file at {text}",
                                 "a path ending in a separator, which names a folder")
        path = Path(text)
        try:  # never more than the limit read: the file may be huge, or endless (/dev/zero)
            with _open_without_waiting(path) as f:
                size = os.fstat(f.fileno()).st_size  # 0 for a pipe or a device
                raw = b"" if size > MAX_MANIFEST_BYTES else _read_at_most(
                    f, size + 1 if size else MAX_MANIFEST_BYTES + 1)
        except OSError as exc:  # strerror: the message without the file descriptor's number
            raise InvalidProgram("", f"a readable manifest file at {path}",
                                 exc.strerror or str(exc)) from None
        if size > MAX_MANIFEST_BYTES or len(raw) > MAX_MANIFEST_BYTES:
            raise InvalidProgram("", f"a manifest of at most {MAX_MANIFEST_BYTES} bytes",
                                 size if size > MAX_MANIFEST_BYTES else
                                 f"more than {MAX_MANIFEST_BYTES} bytes")
        try:
            doc = json.loads(raw, parse_constant=_reject_constant,
                             object_pairs_hook=_unique_keys)
        except (ValueError, RecursionError) as exc:
            raise InvalidProgram("", "well-formed JSON", _located(str(exc), raw)) from None
        # The .npz's data is read only once the whole manifest has been validated against
        # the members' headers: a bad manifest is reported as such, whatever lies beside it,
        # and costs no memory for its constants.
        return _Validator(doc, {}, {}, folder=_manifest_file(path).parent).program()

    @classmethod
    def from_manifest(cls, doc: Any, constants: Mapping[str, np.ndarray] | None = None,
                      callables: Mapping[str, StepFn] | None = None) -> Program:
        """Validate a manifest (already parsed) with its constants and callables."""
        for what, value in (("constants", constants), ("callables", callables)):
            if value is not None and not isinstance(value, Mapping):
                raise InvalidArgument(f"Program.from_manifest: {what} must be a mapping of name "
                                      f"to {'array' if what == 'constants' else 'callable'}, "
                                      f"got {type(value).__name__}")
        return _Validator(doc, dict(constants or {}), dict(callables or {})).program()

    @staticmethod
    def build(name: str, constants: Mapping[str, Any] | None = None) -> ProgramBuilder:
        """Start building a program in Python (see ``ProgramBuilder``)."""
        return ProgramBuilder(name, constants)

    # -- persistence ------------------------------------------------------------------------
    def to_manifest(self) -> dict[str, Any]:
        """The program as a format-1 manifest (a JSON-ready dict; ``save`` writes it with the
        constants beside it)."""
        doc: dict[str, Any] = {"format": FORMAT, "name": self.name}
        if self.device_index is not None:
            doc["device_index"] = self.device_index
        if self.constants:
            doc["constants"] = self.constants_file or f"{self.name}.npz"
            doc["constant_tensors"] = [
                {"name": k, "dtype": dtype_name(v.dtype), "shape": list(v.shape)}
                for k, v in self.constants.items()]
        doc["methods"] = {k: m.to_json() for k, m in self.methods.items()}
        return doc

    def save(self, path: FilePath) -> None:
        """Write the manifest to ``path`` and the constants beside it: ``encoder.json`` →
        ``encoder.npz``; a name not ending in ``.json`` gets ``.npz`` appended (``model.v1`` →
        ``model.v1.npz``). The manifest records the constants file's name.

        A save replaces its own earlier files only: the manifest at ``path`` and the
        constants file that manifest reads. Any other file of the constants' name (another
        program's, a left-over) is kept, and the constants take the first free name
        ``encoder-1.npz``, ``encoder-2.npz``, ... Both files are written under temporary
        names and renamed into place, the manifest last; a save that fails puts the old
        constants back, so the program that was there stays whole. A replaced file keeps its
        mode. A symlinked manifest is saved at its target, beside which ``load`` then looks
        for the constants (as it does for any symlinked manifest)."""
        path = _save_path(path)
        if self.callables:
            raise NotSupported(f"program {self.name!r} has callable steps "
                               f"({', '.join(self.callables)}), which are Python code; format 1 "
                               f"stores kernel steps only. Keep callable programs in Python")
        doc = self.to_manifest()
        npz = None
        if self.constants:
            npz = _free_constants_path(path)
            doc["constants"] = npz.name
        written: list[Path] = []  # temporary files: removed unless renamed into place
        backup: Path | None = None  # the old constants, while the new ones take their place
        try:
            if npz is not None:
                with new_hidden_file(path.parent, written, like=npz) as f:
                    _write_npz(f, {k: _npz_safe(v) for k, v in self.constants.items()})
            with new_hidden_file(path.parent, written, like=path) as f:
                f.write((json.dumps(doc, indent=1) + "\n").encode("utf-8"))
            if npz is not None:
                if npz.exists():  # its own earlier constants (_free_constants_path)
                    backup = path.parent / f".streamlane-save-{uuid.uuid4().hex}.old"
                    os.replace(npz, backup)
                os.replace(written[0], npz)
            os.replace(written[-1], path)  # last: until here the old manifest is in place
        except BaseException:
            if backup is not None and npz is not None:  # the old manifest reads these
                os.replace(backup, npz)
                backup = None
            raise
        finally:
            for temp in written:
                temp.unlink(missing_ok=True)  # gone once renamed
            if backup is not None:
                backup.unlink(missing_ok=True)

    # -- binding --------------------------------------------------------------------------
    def method(self, name: str, device: Device | str | None = None, *,
               clone_outputs: bool = True, use_shared_stream: bool = False,
               **options: Any) -> Method:
        """Bind method ``name`` to ``device`` (a Device or a name for ``get_device``).

        ``clone_outputs``: outputs are Results in two buffers that take turns (the default);
        False gives views that the next execute overwrites. ``use_shared_stream=True`` is
        refused (``NotSupported``: rule 5). Any other option is an ``InvalidArgument``.

        With ``device=None`` (or ``"auto"``) the device is ``get_device()``'s choice; when that
        is a GPU and the program names a ``device_index`` (and ``STREAMLANE_DEVICE`` is unset),
        it is that GPU. The host device has one index and takes any program."""
        from .device import Device, get_device, is_auto
        from .method import Method

        if not isinstance(name, str) or name not in self.methods:
            raise InvalidArgument(f"program {self.name!r} has no method {name!r}; methods: "
                                  f"{', '.join(self.methods)}")
        if not isinstance(device, Device):
            chosen = device is None or is_auto(device)
            device = get_device(device)
            if (chosen and device.kind == "cuda" and self.device_index is not None
                    and not os.environ.get("STREAMLANE_DEVICE")
                    and device.name != f"cuda:{self.device_index}"):
                device = get_device(f"cuda:{self.device_index}")
        return Method(self, self.methods[name], device,
                      {"clone_outputs": clone_outputs, "use_shared_stream": use_shared_stream,
                       **options})

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Program):
            return NotImplemented
        mine, theirs = self.to_manifest(), other.to_manifest()
        mine.pop("constants", None)  # the file name is where it was saved, not what it is
        theirs.pop("constants", None)
        return (mine == theirs
                and self.constants.keys() == other.constants.keys()
                and all(_same_array(v, other.constants[k]) for k, v in self.constants.items())
                and dict(self.callables) == dict(other.callables))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<Program {self.name!r} methods={list(self.methods)}>"


# -- the builder ----------------------------------------------------------------------------

def _own_copy(array: np.ndarray) -> np.ndarray:
    """A read-only copy of ``array``, native byte order and C-ordered, as a program keeps it
    (``np.array`` keeps a 0-d array 0-d, where ``np.ascontiguousarray`` makes it 1-d)."""
    copy = np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)
    copy.flags.writeable = False
    return copy


class ProgramBuilder:
    """Build a program in Python; ``finish()`` validates it exactly as a file is validated.

    A two-layer MLP::

        b = Program.build("mlp", constants={"w1": w1, "w2": w2})
        m = b.method("forward", x=("float32", [8, 256]))
        h = m.step("relu", m.step("matmul", "x", "w1"))
        m.output(m.step("matmul", h, "w2", out="y"))
        mlp = b.finish()
    """

    def __init__(self, name: str, constants: Mapping[str, Any] | None = None):
        if constants is not None and not isinstance(constants, Mapping):
            raise InvalidArgument(f"Program.build({name!r}): constants must be a mapping of "
                                  f"name to array, got {type(constants).__name__}")
        self.name = name
        self._constants: dict[str, np.ndarray] = {}
        self._methods: dict[str, MethodBuilder] = {}
        self._callables: dict[str, StepFn] = {}
        for k, v in (constants or {}).items():
            self.constant(k, v)

    def constant(self, name: str, value: Any) -> str:
        """Add a constant tensor (an array, copied as it is now); returns its name, for steps.
        Its name and array are checked now, as ``finish()`` would (a refused one is not
        added: the builder stays usable)."""
        where = f"constants[{_key(name)!r}]"
        _check_name(name, where)
        array = as_host_array(value, f"constant {name!r}")
        _check_constant(array, where)
        for m in self._methods.values():  # one added after a method was started
            if name in m._shapes:
                raise InvalidProgram(f"{where}.name", f"a name not already used by an input "
                                     f"or buffer of method {m.name!r}", name)
        self._constants[name] = _own_copy(array)  # the caller may change theirs before finish()
        return name

    def method(self, name: str, /, **inputs: tuple[DTypeArg, ShapeArg]) -> MethodBuilder:
        """Start method ``name`` with inputs given as ``name=(dtype, shape)``, in order."""
        _check_name(name, member_path("methods", name) if isinstance(name, str) else "methods")
        if name in self._methods:  # as a manifest naming it twice is refused
            raise InvalidProgram(member_path("methods", name), "a method name not used yet in "
                                 "this program", name)
        mb = MethodBuilder(self, name, inputs)
        self._methods[name] = mb
        return mb

    def finish(self) -> Program:
        """Validate the program as ``Program.load`` validates a file, and return it."""
        doc = {"format": FORMAT, "name": self.name,
               "methods": {k: m._json() for k, m in self._methods.items()}}
        if self._constants:
            doc["constants"] = f"{self.name}.npz"
        # The constants are the builder's own read-only copies (constant()): no second copy.
        return _Validator(doc, dict(self._constants), dict(self._callables),
                          owned=True).program()


class MethodBuilder:
    """One method of a ``ProgramBuilder`` (``builder.method(name, x=(dtype, shape), ...)``):
    ``step`` adds a kernel step, ``call`` a callable step, ``output`` names the outputs."""

    def __init__(self, parent: ProgramBuilder, name: str,
                 inputs: Mapping[str, tuple[DTypeArg, ShapeArg]]):
        self._parent = parent
        self.name = name
        self._inputs = []
        for i, (k, decl) in enumerate(inputs.items()):
            where = f"{member_path('methods', name)}.inputs[{i}]"
            if not isinstance(decl, (tuple, list)) or len(decl) != 2:
                raise InvalidProgram(where, "(dtype, shape)", decl)
            if k in parent._constants:
                raise InvalidProgram(f"{where}.name", "a name not already used by an input, "
                                     "buffer, output or constant", k)
            self._inputs.append(_tensor_given(k, *decl, where))
        self._buffers: list[dict[str, Any]] = []
        self._steps: list[dict[str, Any]] = []
        self._outputs: list[str] = []
        self._auto: dict[str, int] = {}  # the names the builder made: the step that made each
        # its inputs' and buffers' (dtype, shape); constants are looked up in the parent, so
        # one added after this method was started is usable too (_known)
        self._shapes = {it["name"]: (it["dtype"], tuple(it["shape"])) for it in self._inputs}
        self._input_names = {it["name"] for it in self._inputs}  # (a set: thousands of them)

    def _known(self, name: Any) -> tuple[str, tuple[int, ...]] | None:
        if not isinstance(name, str):
            return None
        if name in self._shapes:
            return self._shapes[name]
        value = self._parent._constants.get(name)
        if value is None:
            return None
        try:
            return dtype_name(value.dtype), tuple(value.shape)
        except Exception:  # not a dtype programs take: finish() reports the constant
            return str(value.dtype), tuple(value.shape)

    def step(self, kernel: str, *ins: str, out: str | None = None,
             shape: Sequence[int] | None = None, **params: Any) -> str:
        """Append a kernel step; its single output buffer is declared with the shape the kernel
        infers, or ``shape`` where it cannot (``fill``: no input to take it from). Returns the
        output's name (``out`` or a fresh one)."""
        where = f"{member_path('methods', self.name)}.steps[{len(self._steps)}]"
        spec = _program_kernel(kernel, where)  # as the file validator says it
        if out is not None:
            if spec.n_out == 0:  # it was dropped, and the name reported later, elsewhere
                raise InvalidProgram(f"{where}.out", f"no out= ({kernel} writes no buffer)",
                                     out)
            _check_name(out, f"{where}.out[0]")
            self._check_not_auto(out, f"{where}.out[0]")
            self._check_writable(out, f"{where}.out[0]")
        known = []
        for j, name in enumerate(ins):
            decl = self._known(name)
            if decl is None:
                raise InvalidProgram(f"{where}.in[{j}]", "the name of an input, constant or "
                                     "earlier step's output of this method", name)
            known.append(decl)
        try:
            shapes = spec.infer([decl[1] for decl in known], spec.resolve_params(params))
        except KernelSpecError as exc:
            raise InvalidProgram(f"{where}.{exc.where}", exc.expected, exc.got) from None
        if shape is not None:
            given = _shape_given(shape)
            if given is None or len(shapes) != 1:
                raise InvalidProgram(f"{where}.shape", f"a list of ints, the shape of "
                                     f"{kernel}'s one output", shape)
            if shapes[0] is not None and tuple(shapes[0]) != given:
                raise InvalidProgram(f"{where}.shape", f"no shape (it is inferred: "
                                     f"{list(shapes[0])}), or that one", list(given))
            _check_dims(given, where)  # here, where the bad shape= is
            shapes = [given]
        outs = []
        for k, inferred in enumerate(shapes):
            if inferred is None:
                raise InvalidProgram(f"{where}.shape", f"the shape of {kernel}'s output, which "
                                     f"it cannot infer: step({kernel!r}, out=..., shape=(...))",
                                     None)
            name = out if (out is not None and k == 0) else self._fresh_name(k)
            if name != out:
                self._auto[name] = len(self._steps)
            dtype = known[0][0] if ins else "float32"
            self._declare(name, dtype, inferred)
            outs.append(name)
        d = {"kernel": kernel, "in": list(ins), "out": outs}
        if params:  # numpy scalars as the plain numbers a manifest holds (save() writes JSON)
            d["params"] = {k: plain_number(v) for k, v in params.items()}
        self._steps.append(d)
        return outs[0] if outs else ""

    def call(self, fn: StepFn, ins: Sequence[str],
             outs: Sequence[tuple[str, DTypeArg, ShapeArg]],
             name: str | None = None) -> tuple[str, ...]:
        """Append a callable step: ``fn(stream, ins, outs)`` enqueues its work on ``stream``
        (device arrays in, device arrays out). Returns the names of the buffers it writes, in
        order: ``m.output(*m.call(fn, ["x"], [("y", "float32", [8])]))``."""
        step = f"{member_path('methods', self.name)}.steps[{len(self._steps)}]"
        if not callable(fn):
            raise InvalidProgram(f"{step}.callable", "a callable fn(stream, ins, outs)",
                                 type(fn).__name__)
        if inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn) or \
                inspect.isgeneratorfunction(fn):  # called, it would return without running
            raise InvalidProgram(f"{step}.callable", "a plain function fn(stream, ins, outs) "
                                 "that enqueues its work before it returns (not an async def "
                                 "or a generator)", getattr(fn, "__name__", fn))
        try:
            inspect.signature(fn).bind(None, [], [])
        except TypeError:
            raise InvalidProgram(f"{step}.callable", "a callable taking (stream, ins, outs)",
                                 f"{getattr(fn, '__name__', fn)}"
                                 f"{inspect.signature(fn)}") from None
        except ValueError:  # no signature to read (some builtins): it is called as it is
            pass
        if not isinstance(ins, (list, tuple)):
            raise InvalidProgram(f"{step}.in", "a list of tensor names", ins)
        for j, n in enumerate(ins):  # checked before the builder changes (as step() does)
            if not isinstance(n, str) or self._known(n) is None:
                raise InvalidProgram(f"{step}.in[{j}]", "the name of an input, constant or "
                                     "earlier step's output of this method", n)
        if name is not None and not isinstance(name, str):
            raise InvalidProgram(f"{step}.callable", "a str name for the callable (or None)",
                                 name)
        name = name or getattr(fn, "__name__", "callable")
        if not isinstance(name, str):
            name = "callable"
        base, n = name, 1
        while name in self._parent._callables and self._parent._callables[name] is not fn:
            name, n = f"{base}_{n}", n + 1
        where = f"{step}.out"
        if not isinstance(outs, (list, tuple)):
            raise InvalidProgram(where, "a list of (name, dtype, shape) outputs", outs)
        declared = []
        for j, out in enumerate(outs):  # all checked before the builder changes
            if not isinstance(out, (list, tuple)) or len(out) != 3:
                raise InvalidProgram(f"{where}[{j}]", "(name, dtype, shape)", out)
            oname = out[0]
            item = _tensor_given(*out, f"{where}[{j}]")
            self._check_not_auto(oname, f"{where}[{j}]")
            self._check_writable(oname, f"{where}[{j}]")
            known = self._known(oname)
            if known is not None and known != (item["dtype"], tuple(item["shape"])):
                raise InvalidProgram(f"{where}[{j}]", f"{oname!r} as declared before: "
                                     f"{known[0]}{list(known[1])}",
                                     f"{item['dtype']}{item['shape']}")
            declared.append(item)
        self._parent._callables[name] = fn
        for item in declared:
            self._declare(item["name"], item["dtype"], tuple(item["shape"]))
        names = tuple(o[0] for o in outs)
        self._steps.append({"callable": name, "in": list(ins), "out": list(names)})
        return names

    def output(self, *names: str) -> None:
        """Declare the method's outputs, in order (names of steps' outputs); one name once."""
        declared = set(self._outputs)
        for j, name in enumerate(names):
            where = f"{member_path('methods', self.name)}.outputs[{len(self._outputs) + j}]"
            if not isinstance(name, str):  # finish() would only say "a name", not why
                raise InvalidProgram(f"{where}.name", "the name (a str) of a buffer a step "
                                     "writes; m.call() returns a tuple of them: "
                                     "m.output(*m.call(...))", name)
            if name in declared:
                raise InvalidProgram(f"{where}.name", "an output declared once", name)
            if name in self._input_names or name in self._parent._constants:
                raise InvalidProgram(f"{where}.name", "the name of a buffer a step writes (an "
                                     "input or constant cannot be an output: copy it)", name)
            declared.add(name)
        self._outputs.extend(names)

    def _check_not_auto(self, name: str, where: str) -> None:
        """A step may not write into a buffer the builder named for an earlier step's output:
        the name ``step()`` returned would then hold this step's result (a later
        ``out="t0_0"`` silently replaced relu(x) with what it wrote)."""
        made_by = self._auto.get(name)
        if made_by is not None:
            raise InvalidProgram(where, f"a name other than {name!r}, which the builder gave "
                                 f"step {made_by}'s output (returned by its step()); writing "
                                 f"into it would change that step's result", name)

    def _check_writable(self, name: str, where: str) -> None:
        """A step writes a buffer or an output, never an input or a constant (read-only)."""
        if name in self._parent._constants or name in self._input_names:
            raise InvalidProgram(where, "a buffer or output (inputs and constants are "
                                 "read-only)", name)

    def _fresh_name(self, k: int) -> str:
        """A name for this step's ``k``-th output that nothing in the method or program uses
        yet: ``t<step>_<k>``, suffixed while taken (a user may have named a buffer that way,
        and the step must not write into it)."""
        base = name = f"t{len(self._steps)}_{k}"
        n = 1
        while self._known(name) is not None:  # inputs, buffers, constants
            name, n = f"{base}_{n}", n + 1
        return name

    def _declare(self, name: str, dtype: str, shape: Sequence[int]) -> None:
        if self._known(name) is None:
            self._buffers.append({"name": name, "dtype": dtype, "shape": list(shape)})
            self._shapes[name] = (dtype, tuple(shape))

    def _json(self) -> dict[str, Any]:
        outs = [b for b in self._buffers if b["name"] in self._outputs]
        order = {n: i for i, n in enumerate(self._outputs)}
        outs.sort(key=lambda b: order[b["name"]])
        missing = [n for n in self._outputs if n not in {b["name"] for b in outs}]
        outs += [{"name": n, "dtype": "float32", "shape": [1]} for n in missing]  # validator
        return {"inputs": self._inputs,
                "buffers": [b for b in self._buffers if b["name"] not in self._outputs],
                "steps": self._steps, "outputs": outs}


# -- validation ------------------------------------------------------------------------------

def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not valid JSON")


# A JSON string, or a NaN / Infinity literal outside one.
_CONSTANT_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|(-?Infinity|NaN)')


def _located(message: str, raw: bytes) -> str:
    """json's own errors say where; the parse_constant hook's cannot: find its literal."""
    if not message.endswith("is not valid JSON"):
        return message
    for match in _CONSTANT_TOKEN.finditer(raw):
        if match.group(1):
            line = raw.count(b"\n", 0, match.start()) + 1
            column = match.start() - (raw.rfind(b"\n", 0, match.start()) + 1) + 1
            return f"{message}: line {line} column {column} (char {match.start()})"
    return message


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object with a key twice is ambiguous (parsers keep the first, the last, or refuse):
    refused, as NaN is."""
    doc: dict[str, Any] = {}
    for key, value in pairs:
        if key in doc:
            raise ValueError(f"the key {key!r} appears twice in one object; keys must be unique")
        doc[key] = value
    return doc


def _same_array(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal dtype, shape and bytes: a NaN constant is its own (``np.array_equal`` said a
    program holding one was not equal to itself, nor to itself saved and loaded)."""
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()  # C order


def _write_npz(f: Any, arrays: Mapping[str, np.ndarray]) -> None:
    """The file ``np.savez(f, **arrays)`` writes (a zip of ``NAME.npy`` members, stored, no
    pickles), without savez's own keyword arguments: a constant named ``file`` or
    ``allow_pickle`` was taken for one of them (a ``TypeError``, or an empty file that
    ``load`` then refused)."""
    with zipfile.ZipFile(f, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
        for name, value in arrays.items():
            with z.open(f"{name}.npy", "w", force_zip64=True) as member:
                npy_format.write_array(member, np.asanyarray(value), allow_pickle=False)


def _npz_safe(v: np.ndarray) -> np.ndarray:
    """npz (without pickle) has no bfloat16: store its bits as uint16; the manifest's
    ``constant_tensors`` keeps the real dtype."""
    return v.view(np.uint16) if dtype_name(v.dtype) == "bfloat16" else v


def _constants_path(manifest: Path) -> Path:
    """Where ``Program.save(manifest)`` writes the constants: ``encoder.json`` →
    ``encoder.npz``; any other name gets ``.npz`` appended (``model.v1`` → ``model.v1.npz``),
    so that manifests differing only after their last dot never share one constants file."""
    if manifest.suffix == ".json":
        return manifest.with_suffix(".npz")
    return manifest.with_name(manifest.name + ".npz")


def _save_path(path: Any) -> Path:
    """``save``'s manifest path, checked before anything is written (a symlink: its target)."""
    text = path_text(path, "Program.save")
    if "\0" in text:
        raise InvalidArgument(f"save({text!r}): a path cannot hold a NUL character")
    if _names_folder(text):  # Path() would drop the "/" and write a file of the folder's name
        raise InvalidArgument(f"save({text!r}): a path ending in a separator names a folder; "
                              f"name a file to write the manifest to (e.g. "
                              f"{os.path.join(text, 'program.json')!r})")
    target = Path(text)
    try:
        target = _manifest_file(target)
        folder_ok = target.parent.is_dir()
        exists, regular = target.exists(), target.is_file()
    except (OSError, RuntimeError, InvalidProgram) as exc:  # a loop, a name too long
        raise InvalidArgument(f"save({text!r}): {exc}") from None
    if exists and not regular:
        raise InvalidArgument(f"save({text!r}): that is not a regular file (a folder, a device, "
                              f"a pipe); name a file to write the manifest to")
    if not folder_ok:
        there = os.path.lexists(target.parent)
        raise InvalidArgument(f"save({text!r}): {str(target.parent)!r} "
                              f"{'is not a folder' if there else 'does not exist'}; "
                              f"{'name a path in a folder' if there else 'create it first'}")
    if regular and zipfile.is_zipfile(target):
        raise InvalidArgument(f"save({text!r}): that file is a zip archive (another program's "
                              f"constants, say), which a manifest would overwrite; choose "
                              f"another manifest name")
    return target


def path_text(path: object, what: str) -> str:
    """A file path as text, as ``open()`` takes it: str, bytes (in the file system's encoding)
    or os.PathLike giving either; anything else is an ``InvalidArgument``."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        raise InvalidArgument(f"{what} takes a file path, got {type(path).__name__}: a path "
                              f"is a str, bytes or an os.PathLike")
    try:
        text = os.fsdecode(os.fspath(path))
        os.fsencode(text)  # a lone surrogate ("\ud800") names no file: open() would raise
    except TypeError as exc:  # a PathLike whose __fspath__ returns something else
        raise InvalidArgument(f"{what} takes a file path: {exc}") from None
    except UnicodeEncodeError:
        raise InvalidArgument(f"{what}: the path {text!r} cannot be encoded for the file "
                              f"system (a lone surrogate?)") from None
    return text


def _names_folder(text: str) -> bool:
    """Whether a path as given ends in a separator (``models/``): a folder, whatever it holds."""
    return text.endswith(("/", os.sep) + ((os.altsep,) if os.altsep else ()))


def _manifest_file(path: Path) -> Path:
    """The file a manifest path names: a symlink's target (its constants lie beside that)."""
    if not path.is_symlink():
        return path
    loop = f"a manifest path, not a symlink loop at {path}"
    try:  # resolve() does not tell a loop on Python 3.13 (it gives the path back as it is)
        os.stat(path)
    except OSError as exc:  # a dangling link is fine: the save makes its target
        if exc.errno == errno.ELOOP:
            raise InvalidProgram("", loop, exc.strerror) from None
    try:
        return path.resolve(strict=False)
    except RuntimeError as exc:  # a loop made since the stat, Python 3.11-3.12
        raise InvalidProgram("", loop, str(exc)) from None


def make_folders(folder: Path, named: str | os.PathLike[str]) -> None:
    """``folder`` and the folders above it, made where missing; where one cannot be made
    because a name on the way is not a folder (a file, a dangling link, a link loop), the
    error ``open()`` of a file in it would raise (``NotADirectoryError``,
    ``FileNotFoundError``, ``OSError`` ELOOP), naming ``named``, not ``mkdir``'s "File
    exists", which reads as "the file exists". (The timeline's exports, the demo's ``--out``
    and ``python -m streamlane.runtime.examples``.)"""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        try:  # the trailing separator makes the lookup walk into it as a folder
            os.stat(os.path.join(folder, ""))
        except OSError as why:
            raise OSError(why.errno, why.strerror, os.fspath(named)) from None
        raise  # a folder after all (made meanwhile): mkdir's own error


def new_hidden_file(folder: Path, written: list[Path], like: Path) -> Any:
    """A new file of a unique hidden name in ``folder``, open for binary writing, its path
    appended to ``written`` first (the caller removes what it does not rename). Its mode is
    that of ``like`` where ``like`` exists (the file it will replace), else 0o666 less the
    umask, as a plain ``open()`` would leave it either way. A failure to create it raises
    the ``OSError`` subclass ``open()`` would, naming ``like``. (``Program.save`` and the
    scheduler's timeline exports: written whole, then renamed into place.)"""
    temp = folder / f".streamlane-save-{uuid.uuid4().hex}.tmp"
    written.append(temp)
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:  # named by the file asked for, not by a name the caller never gave
        raise OSError(exc.errno, exc.strerror, str(like)) from None
    try:
        if like.is_file():
            os.chmod(fd, like.stat().st_mode & 0o7777)
        return os.fdopen(fd, "wb")
    except BaseException:
        os.close(fd)
        raise


def _free_constants_path(manifest: Path) -> Path:
    """Where ``save(manifest)`` writes its constants: ``_constants_path``, unless a file there
    is not the one the manifest now at ``manifest`` reads; then the first free
    ``<stem>-<n>.npz``. A save never replaces a file that may be another program's."""
    first = _constants_path(manifest)
    own = _constants_named(manifest)  # what the manifest there now reads, if any
    for n in range(10_000):
        npz = first if n == 0 else first.with_name(f"{first.stem}-{n}.npz")
        if not _plain_file_name(npz.name):
            raise InvalidArgument(f"save({str(manifest)!r}): its constants file would be "
                                  f"{npz.name!r}, which load() refuses (at most 255 bytes, no "
                                  f"path separator, control character, line separator, "
                                  f"bidirectional control or leading dot); choose another "
                                  f"manifest name")
        if not os.path.lexists(npz) or (npz.name == own and npz.is_file()
                                        and not npz.is_symlink()):
            return npz
    raise InvalidArgument(f"save({str(manifest)!r}): no free constants file name beside it "
                          f"({first.name} and 10,000 more are taken)")


def _constants_named(manifest: Path) -> Any:
    """The ``constants`` field of the manifest at ``manifest``, or None (no such file, or not
    a manifest: whatever reading it raises)."""
    try:
        with manifest.open("rb") as f:
            return json.loads(f.read(MAX_MANIFEST_BYTES)).get("constants")
    except Exception:  # OSError, a JSON error, RecursionError, a list instead of an object...
        return None


def _plain_file_name(name: str) -> bool:
    """A file name beside the manifest: not empty, at most 255 bytes of UTF-8, no path
    separator, no control character (NUL, newline, ...), line or paragraph separator or
    bidirectional control (a name shown in a message must read as what it is: U+202E turns
    the rest of a line around), no leading dot (nothing hidden, no ``..``)."""
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return (0 < size <= 255 and not name.startswith(".") and "/" not in name
            and "\\" not in name
            and not any(c in _BIDI_CONTROLS or unicodedata.category(c) in ("Cc", "Zl", "Zp")
                        for c in name))


_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e"
                           "\u2066\u2067\u2068\u2069")
# Members as numpy writes them (savez: stored; savez_compressed: deflate). zipfile inflates a
# bzip2 or LZMA member a whole compressed block at a time before cutting it to the declared
# size: 3 KB of bzip2 declaring 192 bytes took 8 GiB and 45 s to open.
_COMPRESSIONS = {zipfile.ZIP_STORED: "stored", zipfile.ZIP_DEFLATED: "deflate"}


def _read_npz(folder: Path, name: str, headers_only: bool = False) -> dict[str, np.ndarray]:
    """The arrays of the constants file: every member a plain ``.npy`` whose header agrees with
    its size, checked before anything is allocated (a 16-byte member may claim 10**12
    elements). Whatever the archive does wrong is an ``InvalidProgram``. ``headers_only``:
    read-only stand-ins of each member's dtype and shape (one element of memory each)."""
    if not _plain_file_name(name):
        raise InvalidProgram("constants", "a plain file name beside the manifest", name)
    path = folder / name
    try:
        # Opened without waiting (a FIFO would wait for a writer forever) and read only if it
        # is a regular file: a device such as /dev/zero reports no size and never ends.
        with _open_without_waiting(path, lambda fd: _check_regular(fd, name)) as f:
            return _read_members(f, name, headers_only)
    except InvalidProgram:
        raise
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile, zlib.error,
            lzma.LZMAError, NotImplementedError, RuntimeError, SyntaxError,
            tokenize.TokenError) as exc:
        # NotImplemented: compression method; RuntimeError: an encrypted member; SyntaxError,
        # TokenError: a damaged .npy header (numpy reads it with ast.literal_eval)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else \
            f"{type(exc).__name__}: {exc}"  # strerror: without a file descriptor's number
        raise InvalidProgram("constants", f"a readable .npz file {name!r} (at "
                             f"{os.path.abspath(path)!r})",
                             why) from None


def _open_without_waiting(path: Path, check: Callable[[int], None] | None = None) -> Any:
    """``open(path, "rb")``, except that a FIFO nobody writes to reads as empty instead of
    blocking the open forever (its reads then block as usual while a writer is there).
    ``check(fd)`` may refuse the file first (it raises; the file is closed)."""
    nonblock = getattr(os, "O_NONBLOCK", 0)
    fd = os.open(path, os.O_RDONLY | nonblock)
    try:
        if check is not None:
            check(fd)
        if nonblock:
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _check_regular(fd: int, name: str) -> None:
    """Raise unless ``fd`` is a regular file within the size limit."""
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        raise InvalidProgram("constants", f"a regular .npz file ({name!r})",
                             "a directory" if stat.S_ISDIR(info.st_mode) else
                             "a device, pipe or socket")
    if info.st_size > MAX_CONSTANTS_BYTES:
        raise InvalidProgram("constants", f"at most {MAX_CONSTANTS_BYTES} bytes of constants",
                             info.st_size)


def _read_members(f: Any, name: str, headers_only: bool) -> dict[str, np.ndarray]:
    """``_read_npz`` of the open, regular file ``f``."""
    arrays: dict[str, np.ndarray] = {}
    with zipfile.ZipFile(f) as zf:
        members = zf.infolist()
        total = sum(i.file_size for i in members)
        if total > MAX_CONSTANTS_BYTES:
            raise InvalidProgram("constants", "constants that fit the size limit", total)
        for info in members:
            key = info.filename[:-4] if info.filename.endswith(".npy") else ""
            if not key or key in arrays:
                raise InvalidProgram("constants", f"an .npz of distinct .npy members ({name!r})",
                                     info.filename)
            if info.compress_type not in _COMPRESSIONS:
                raise InvalidProgram(f"constants[{_key(key)!r}]", f"a readable .npz file "
                                     f"{name!r}: its members stored or deflated (as numpy's "
                                     f"savez and savez_compressed write them)",
                                     f"compression method {info.compress_type}")
            with zf.open(info) as member:
                arrays[key] = _read_npy(member, info.file_size, key, name, headers_only)
    return arrays


def _read_npy(member: Any, size: int, key: str, name: str, headers_only: bool) -> np.ndarray:
    where = f"constants[{_key(key)!r}]"
    version = npy_format.read_magic(member)
    if version == (1, 0):
        shape, _, dtype = npy_format.read_array_header_1_0(member)
    elif version == (2, 0):
        shape, _, dtype = npy_format.read_array_header_2_0(member)
    else:
        raise InvalidProgram(where, "an .npy member of format 1.0 or 2.0", f"format {version}")
    if dtype.hasobject:
        raise InvalidProgram(where, "a numeric array", str(dtype))
    if dtype.subdtype is not None:  # ('<f4', (2,)): numpy itself cannot read it back
        raise InvalidProgram(where, "an array of a plain dtype", str(dtype))
    if any(type(n) is not int for n in shape):  # numpy's header reader takes (4, True)
        raise InvalidProgram(where, f"a shape of ints in {name!r}", repr(shape))
    data = size - member.tell()
    if math.prod(shape) * dtype.itemsize != data:
        raise InvalidProgram(where, f"as many data bytes as its header's {dtype}{list(shape)} "
                             f"in {name!r}", data)
    if headers_only:  # in the byte order the data will have once loaded (native)
        return np.broadcast_to(np.zeros((), dtype.newbyteorder("=")), shape)
    member.seek(0)
    return npy_format.read_array(member, allow_pickle=False)


class _Names(dict):
    """A method's tensors by name (dtype, shape, group), over the program's constants: looked
    up as one dict (both tables are plain dicts: a lookup stays C-speed on wide steps)."""

    __slots__ = ("consts",)

    def __init__(self, consts: dict[str, tuple[str, tuple[int, ...], str]]):
        super().__init__()
        self.consts = consts

    def __missing__(self, name: str) -> tuple[str, tuple[int, ...], str]:
        return self.consts[name]

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or name in self.consts


class _Validator:
    def __init__(self, doc: Any, constants: dict[str, np.ndarray], callables: dict[str, StepFn],
                 folder: Path | None = None, owned: bool = False):
        self.doc = doc
        self.constants = constants
        self.callables = callables
        self.folder = folder  # where the constants file lies (Program.load)
        # The constants are copies no caller holds (a file's, just read; a builder's): kept as
        # they are once native and C-ordered, where a caller's arrays are copied.
        self.owned = owned or folder is not None
        self.stand_ins = False  # self.constants hold the file's headers, not its data

    def program(self) -> Program:
        doc = self._obj(self.doc, "", required=("format", "name", "methods"),
                        optional=("constants", "constant_tensors", "device_index"))
        fmt = doc["format"]
        if not _is_int(fmt) or fmt != FORMAT:
            raise InvalidProgram("format", f"format version {FORMAT}", fmt)
        name = self._name(doc["name"], "name")
        device_index = doc.get("device_index")
        if device_index is not None and (not _is_int(device_index)
                                         or not 0 <= device_index <= MAX_DEVICE_INDEX):
            raise InvalidProgram("device_index", f"an int in 0..{MAX_DEVICE_INDEX}", device_index)
        constants_file = doc.get("constants")
        if constants_file is not None and not isinstance(constants_file, str):
            raise InvalidProgram("constants", "the file name of the constants .npz",
                                 constants_file)
        if constants_file is not None and self.folder is not None:
            self.constants = _read_npz(self.folder, constants_file, headers_only=True)
            self.stand_ins = True
        consts = self._constants(doc.get("constant_tensors"))
        methods = doc["methods"]
        if not isinstance(methods, dict) or not methods:
            raise InvalidProgram("methods", "a non-empty object of methods", methods)
        defs = {}
        # Each method's names are looked up over the constants' table, built once: a program
        # may have thousands of methods and of constants.
        const_tensors = {k: (dtype_name(v.dtype), tuple(v.shape), "constant")
                         for k, v in consts.items()}
        for mname, mdoc in methods.items():
            self._name(mname, member_path("methods", mname))
            defs[mname] = self._method(mname, mdoc, const_tensors)
        used = {n for m in defs.values() for s in m.steps if s.kind == "callable"
                for n in [s.target]}
        callables = {k: v for k, v in self.callables.items() if k in used}
        if self.stand_ins:  # all valid: now the data, which the headers already described
            stand_ins = consts
            self.constants = _read_npz(self.folder, constants_file)
            self.stand_ins = False
            consts = self._constants(doc.get("constant_tensors"))
            changed = [k for k in stand_ins.keys() | consts.keys() if k not in stand_ins
                       or k not in consts or stand_ins[k].shape != consts[k].shape
                       or stand_ins[k].dtype != consts[k].dtype]
            if changed:
                raise InvalidProgram(f"constants[{_key(sorted(changed)[0])!r}]",
                                     f"the constants file {constants_file} unchanged while it "
                                     f"was read", "another dtype, shape or member")
        return Program(name, defs, consts, callables, device_index, constants_file)

    # -- pieces -------------------------------------------------------------------------------
    def _constants(self, decls: Any) -> dict[str, np.ndarray]:
        consts: dict[str, np.ndarray] = {}
        for k, v in self.constants.items():
            where = f"constants[{_key(k)!r}]"
            self._name(k, where)
            _check_constant(v, where)
            # Uploads copy bytes: a big-endian or Fortran-ordered constant (another machine's
            # np.save) becomes the native, C-ordered array of the same values first. A program
            # is immutable: the caller's arrays are copied (a file's were just read: no copy),
            # and the program's are read-only.
            if self.stand_ins:
                consts[k] = v
                continue
            native = v.dtype.newbyteorder("=")
            # (np.asarray, not np.ascontiguousarray: that one makes a 0-d array 1-d)
            array = np.asarray(v, dtype=native, order="C") if self.owned \
                else np.array(v, dtype=native, order="C", copy=True)
            array.flags.writeable = False
            consts[k] = array
        if decls is None:
            return consts
        if not isinstance(decls, list):
            raise InvalidProgram("constant_tensors", "a list of tensor declarations", decls)
        declared: set[str] = set()
        for i, d in enumerate(decls):
            t = self._tensor(d, f"constant_tensors[{i}]")
            if t.name in declared:
                raise InvalidProgram(f"constant_tensors[{i}].name",
                                     "a constant declared once", t.name)
            declared.add(t.name)
            have = consts.get(t.name)
            if have is not None and t.dtype == "bfloat16" and have.dtype == np.uint16:
                have = consts[t.name] = have.view(DTYPES["bfloat16"])
            if have is None:
                raise InvalidProgram(f"constant_tensors[{i}].name",
                                     "a constant present in the constants .npz", t.name)
            if dtype_name(have.dtype) != t.dtype or tuple(have.shape) != t.shape:
                # The field is the manifest's declaration: it should say what the .npz holds.
                raise InvalidProgram(f"constant_tensors[{i}]",
                                     f"{dtype_name(have.dtype)}{list(have.shape)}, as the "
                                     f"constants .npz holds", f"{t.dtype}{list(t.shape)}")
        undeclared = [k for k in consts if k not in declared]
        if undeclared:  # the table describes what the program reads, all of it
            raise InvalidProgram("constant_tensors", f"a declaration of every constant in the "
                                 f"constants .npz ({len(consts)})",
                                 f"none for {undeclared[0]!r}")
        return consts

    def _method(self, mname: str, mdoc: Any,
                const_tensors: dict[str, tuple[str, tuple[int, ...], str]]) -> MethodDef:
        base = member_path("methods", mname)
        m = self._obj(mdoc, base, required=("inputs", "steps", "outputs"),
                      optional=("buffers",))
        # The method's own names beside the constants' table (shared by every method, never
        # copied: a program may have thousands of each); _Names looks in both.
        tensors = _Names(const_tensors)
        groups = {}
        total = 0
        for group in ("inputs", "buffers", "outputs"):
            items = m.get(group, [])
            if not isinstance(items, list):
                raise InvalidProgram(f"{base}.{group}", "a list of tensor declarations", items)
            decls = []
            for i, d in enumerate(items):
                where = f"{base}.{group}[{i}]"
                t = self._tensor(d, where)
                if t.name in tensors:
                    raise InvalidProgram(f"{where}.name", "a name not already used by an input, "
                                         "buffer, output or constant", t.name)
                tensors[t.name] = (t.dtype, t.shape, group)
                total += t.nbytes
                decls.append(t)
            groups[group] = tuple(decls)
        if total > MAX_METHOD_BYTES:
            raise InvalidProgram(base, f"at most {MAX_METHOD_BYTES} bytes of planned memory", total)
        steps_doc = m["steps"]
        if not isinstance(steps_doc, list) or not steps_doc:
            raise InvalidProgram(f"{base}.steps", "a non-empty list of steps", steps_doc)
        written = {t.name for t in groups["inputs"]}  # and the constants (_step)
        steps = []
        for i, sdoc in enumerate(steps_doc):
            steps.append(self._step(f"{base}.steps[{i}]", sdoc, tensors, written))
        for group in ("buffers", "outputs"):  # a buffer nothing writes is never read either
            for i, t in enumerate(groups[group]):  # (_step): memory it would hold for nothing
                if t.name not in written:
                    raise InvalidProgram(f"{base}.{group}[{i}].name",
                                         f"{'a buffer' if group == 'buffers' else 'an output'} "
                                         f"that some step writes", t.name)
        return MethodDef(mname, groups["inputs"], groups["buffers"], tuple(steps),
                         groups["outputs"])

    def _step(self, where: str, sdoc: Any, tensors: Mapping, written: set[str]) -> StepDef:
        s = self._obj(sdoc, where, required=("in", "out"),
                      optional=("kernel", "callable", "params"))
        kinds = [k for k in ("kernel", "callable") if k in s]
        if len(kinds) != 1:
            raise InvalidProgram(where, 'exactly one of "kernel" or "callable"', sorted(s))
        kind = kinds[0]
        target = s[kind]
        ins, outs = s["in"], s["out"]
        for key, names in (("in", ins), ("out", outs)):
            if not isinstance(names, list):
                raise InvalidProgram(f"{where}.{key}", "a list of tensor names", names)
            for j, n in enumerate(names):
                if not isinstance(n, str) or n not in tensors:
                    raise InvalidProgram(f"{where}.{key}[{j}]", "the name of an input, buffer, "
                                         "output or constant of this method", n)
        for j, n in enumerate(ins):
            if n not in written and tensors[n][2] != "constant":
                raise InvalidProgram(f"{where}.in[{j}]", "a tensor written by an earlier step "
                                     "(or an input or constant)", n)
        read, seen = set(ins), set()  # sets: a step may name a million tensors
        for j, n in enumerate(outs):
            if tensors[n][2] in ("constant", "inputs"):
                raise InvalidProgram(f"{where}.out[{j}]", "a buffer or output (inputs and "
                                     "constants are read-only)", n)
            if n in read or n in seen:
                raise InvalidProgram(f"{where}.out[{j}]", "an output distinct from the step's "
                                     "other inputs and outputs", n)
            seen.add(n)
        params = s.get("params", {})
        if not isinstance(params, dict):
            raise InvalidProgram(f"{where}.params", "an object of scalar params", params)
        if kind == "callable":
            if not isinstance(target, str) or target not in self.callables:
                raise InvalidProgram(f"{where}.callable", "the name of a callable given to the "
                                     "program (callables exist only in Python-built programs)",
                                     target)
            if not callable(self.callables[target]):
                kind = type(self.callables[target]).__name__
                raise InvalidProgram(f"{where}.callable", f"the name of a callable fn(stream, "
                                     f"ins, outs); callables[{target!r}] is not callable: "
                                     f"{kind}", target)
            if params:
                raise InvalidProgram(f"{where}.params", "no params for a callable step", params)
        else:
            # The params as the kernel takes them (50.0 for an int: 50), so that to_manifest()
            # writes what runs; only those given: defaults stay implicit.
            resolved = self._kernel_step(where, target, ins, outs, params, tensors)
            params = {key: resolved[key] for key in params}
        written.update(outs)
        return StepDef(kind, target, tuple(ins), tuple(outs), MappingProxyType(dict(params)))

    def _kernel_step(self, where: str, target: Any, ins: list[str], outs: list[str],
                     params: dict, tensors: Mapping) -> dict[str, Any]:
        """Check a kernel step against its kernel's spec; returns its resolved params."""
        spec = _program_kernel(target, where)
        if len(ins) != spec.n_in:
            raise InvalidProgram(f"{where}.in", f"{spec.n_in} inputs for {spec.name}", len(ins))
        if len(outs) != spec.n_out:
            raise InvalidProgram(f"{where}.out", f"{spec.n_out} outputs for {spec.name}",
                                 len(outs))
        for key, names in (("in", ins), ("out", outs)):
            for j, n in enumerate(names):
                if tensors[n][0] not in spec.dtypes:
                    raise InvalidProgram(f"{where}.{key}[{j}]", f"dtype {'/'.join(spec.dtypes)} "
                                         f"for {spec.name}", f"{n}: {tensors[n][0]}")
        try:
            resolved = spec.resolve_params(params)
            inferred = spec.infer([tensors[n][1] for n in ins], resolved)
        except KernelSpecError as exc:
            raise InvalidProgram(f"{where}.{exc.where}", exc.expected, exc.got) from None
        for j, (want, n) in enumerate(zip(inferred, outs, strict=True)):
            if want is not None and tuple(want) != tensors[n][1]:
                raise InvalidProgram(f"{where}.out[{j}]", f"a tensor of shape {list(want)} "
                                     f"({spec.name} of its inputs)",
                                     f"{n}: {list(tensors[n][1])}")
        return resolved

    def _obj(self, value: Any, where: str, required: Sequence[str],
             optional: Sequence[str]) -> dict:
        if not isinstance(value, dict):
            raise InvalidProgram(where, "an object", type(value).__name__)
        for key in required:
            if key not in value:
                raise InvalidProgram(member_path(where, key), "a value (required field)")
        extra = set(value) - set(required) - set(optional)
        if extra:
            raise InvalidProgram(member_path(where, sorted(extra)[0]),
                                 f"one of the fields {', '.join((*required, *optional))}",
                                 sorted(extra)[0])
        return value

    def _tensor(self, d: Any, where: str) -> TensorDecl:
        d = self._obj(d, where, required=("name", "dtype", "shape"), optional=())
        name = self._name(d["name"], f"{where}.name")
        dtype = d["dtype"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise InvalidProgram(f"{where}.dtype", f"one of {', '.join(DTYPES)}", dtype)
        shape = d["shape"]
        if not isinstance(shape, list):
            raise InvalidProgram(f"{where}.shape", f"a list of at most {MAX_RANK} dimensions",
                                 shape)
        _check_dims(shape, where)
        t = TensorDecl(name, dtype, tuple(shape))
        if t.nbytes > MAX_TENSOR_BYTES:
            raise InvalidProgram(f"{where}.shape", f"at most {MAX_TENSOR_BYTES} bytes per tensor",
                                 f"{t.nbytes} bytes")
        return t

    def _name(self, value: Any, where: str) -> str:
        return _check_name(value, where)


def _program_kernel(name: Any, where: str) -> KernelSpec:
    """The kernel a program step names, if programs may use it (not ``latch``, which needs a
    host-side object); else ``InvalidProgram`` at ``where.kernel`` listing those they may."""
    try:
        spec = get_kernel(name) if isinstance(name, str) else None
    except UnknownKernel:
        spec = None
    if spec is None or not spec.in_programs:
        from streamlane.kernels import kernel_names

        raise InvalidProgram(f"{where}.kernel", "a kernel of the library (" +
                             ", ".join(kernel_names(in_programs_only=True)) + ")", name)
    return spec


def _check_name(value: Any, where: str) -> str:
    """A name of the manifest (program, method, tensor) at ``where``, or ``InvalidProgram``."""
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise InvalidProgram(where, "a name of letters, digits, '_', '.', '-' (at most 128, "
                             "starting with a letter or '_')", value)
    return value


def _check_constant(v: Any, where: str) -> None:
    """A constant's array at ``where``: numeric, of a dtype programs take, non-empty, within
    the limits; else ``InvalidProgram`` (the builder checks each as it is added)."""
    if not isinstance(v, np.ndarray) or v.dtype.hasobject:
        raise InvalidProgram(where, "a numeric array", f"dtype {v.dtype}" if isinstance(
            v, np.ndarray) else type(v).__name__)
    try:
        dtype_name(v.dtype)
    except Exception:
        raise InvalidProgram(where, f"a dtype of {', '.join(DTYPES)}", str(v.dtype)) from None
    if v.ndim > MAX_RANK or v.size == 0 or v.nbytes > MAX_TENSOR_BYTES:
        raise InvalidProgram(where, "a non-empty array within the size limits", list(v.shape))


def _check_dims(shape: Sequence[Any], where: str) -> None:
    """A shape's rank and dimensions (``where.shape``, ``where.shape[j]``), as a file's."""
    if len(shape) > MAX_RANK:
        raise InvalidProgram(f"{where}.shape", f"a list of at most {MAX_RANK} dimensions",
                             list(shape))
    for j, dim in enumerate(shape):
        if not _is_int(dim) or not 1 <= dim <= MAX_DIM:
            raise InvalidProgram(f"{where}.shape[{j}]", f"an int in 1..{MAX_DIM}", dim)


def _tensor_given(name: Any, dtype: Any, shape: Any, where: str) -> dict[str, Any]:
    """A tensor the builder was given in Python, ``(name, dtype, shape)`` with numpy dtypes
    and integers allowed, as a manifest holds it, checked as a manifest's would be."""
    given = _shape_given(shape)
    item = {"name": name, "dtype": _dtype_given(dtype),
            "shape": list(given) if given is not None else
            list(shape) if isinstance(shape, (list, tuple)) else shape}
    _Validator({}, {}, {})._tensor(item, where)
    return item


def _dtype_given(dtype: Any) -> Any:
    """A builder's dtype as its name: ``np.float32``, ``np.dtype("float32")`` and
    ``ml_dtypes.bfloat16`` as ``"float32"`` / ``"bfloat16"``; anything else as given, for the
    validator to report."""
    if isinstance(dtype, str):
        return dtype
    try:
        return dtype_name(dtype)
    except (InvalidArgument, TypeError, ValueError):
        return dtype


def _shape_given(shape: Any) -> tuple[int, ...] | None:
    """A builder's ``shape=`` as a tuple of ints: a list or tuple of ints (numpy integers
    too), or a 1-d numpy integer array; None if it is not one. The validator then checks its
    values as a file's."""
    if isinstance(shape, np.ndarray):
        if shape.ndim != 1 or shape.dtype.kind not in "iu":
            return None
    elif not isinstance(shape, (list, tuple)):
        return None
    dims = []
    for d in shape:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)):
            return None
        dims.append(int(d))
    return tuple(dims)


def _read_at_most(f: Any, limit: int) -> bytes:
    """Up to ``limit`` bytes of ``f``, in chunks: never a buffer of ``limit`` made up front."""
    chunks, got = [], 0
    while got < limit:
        chunk = f.read(min(1 << 20, limit - got))
        if not chunk:
            break
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _key(key: Any) -> Any:
    """A manifest key as it appears in an error's JSON path: an untrusted file may use a
    megabyte-long one. Valid names (at most 128 characters) are never cut; a key that is not a
    str (a constant named in Python) is shown as it is."""
    return key if not isinstance(key, str) or len(key) <= 128 else key[:125] + "..."

"""A float64 interpreter for programs: runs a method's kernel steps through the kernel library's
float64 references on the host. The yardstick for correctness checks (tests, the demo)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from streamlane.kernels import get_kernel

from .errors import InvalidArgument, InvalidInput, NotSupported
from .program import Program, TensorDecl

__all__ = ["run_reference"]


def run_reference(program: Program, method: str, inputs: Sequence[Any]) -> list[np.ndarray]:
    """The outputs of ``program.method`` on ``inputs``, computed in float64. Inputs (numpy
    arrays, Results, Python numbers for scalars) are checked for their count, shape and a
    real numeric kind, as ``set_inputs`` checks them (any real dtype: the reference computes
    in float64); a mismatch raises ``InvalidInput``."""
    if not isinstance(program, Program):
        raise InvalidArgument(f"run_reference takes a Program, got {type(program).__name__}")
    mdef = program.methods.get(method) if isinstance(method, str) else None
    if mdef is None:
        raise InvalidArgument(f"program {program.name!r} has no method {method!r}; methods: "
                              f"{', '.join(program.methods)}")
    label = f"{program.name}.{method}"
    if not isinstance(inputs, Sequence) or isinstance(inputs, (str, bytes)):
        raise InvalidInput(label, None, "a list of inputs", type(inputs).__name__)
    if len(inputs) != len(mdef.inputs):
        raise InvalidInput(label, None, f"{len(mdef.inputs)} inputs", len(inputs))
    env = {k: np.asarray(v, np.float64) for k, v in program.constants.items()}
    for i, (decl, value) in enumerate(zip(mdef.inputs, inputs, strict=True)):
        env[decl.name] = _input(label, i, decl, value)
    # fill's reference is a 0-d value (it has no input to take a shape from): a step reading
    # it must see the shape the program declares, as the device's kernel does.
    shapes = {t.name: t.shape for t in (*mdef.buffers, *mdef.outputs)}
    with np.errstate(all="ignore"):  # IEEE results (NaN, inf) as the device gives, not
        return _run(mdef, env, shapes)  # warnings (errors under -W error)


def _run(mdef: Any, env: dict[str, np.ndarray], shapes: dict[str, Any]) -> list[np.ndarray]:
    """The method's kernel steps on ``env`` (its inputs and constants, in float64)."""
    for step in mdef.steps:
        if step.kind != "kernel":
            raise NotSupported(f"run_reference: step {step.target!r} is a callable; only kernel "
                               f"steps have a float64 reference")
        spec = get_kernel(step.target)
        outs = spec.reference([env[n] for n in step.ins], spec.resolve_params(step.params))
        for name, value in zip(step.outs, outs, strict=True):
            shape = shapes.get(name)
            if value.ndim == 0 and shape:
                value = np.full(shape, value, np.float64)
            env[name] = value
    return [env[t.name] for t in mdef.outputs]


def _input(label: str, index: int, decl: TensorDecl, value: Any) -> np.ndarray:
    expected = f"{decl.dtype}{list(decl.shape)} (any real dtype)"
    if hasattr(value, "to_host"):  # a Result (its errors, a device fault, are its own)
        host = value.to_host()
    else:
        try:
            host = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as exc:  # ragged lists, say
            raise InvalidInput(label, index, expected,
                               f"{type(value).__name__} ({exc})") from None
    if not isinstance(host, np.ndarray) or not (host.dtype.kind in "biuf"
                                                or host.dtype.name == "bfloat16"):
        raise InvalidInput(label, index, expected,
                           f"{type(value).__name__} of dtype {getattr(host, 'dtype', '?')}")
    if host.shape != tuple(decl.shape):
        raise InvalidInput(label, index, expected, f"shape {list(host.shape)}")
    return host.astype(np.float64)

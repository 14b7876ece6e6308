"""A float64 interpreter for programs: runs a method's kernel steps through the kernel library's
float64 references on the host. The yardstick for correctness checks (tests, the demo)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from streamlane.kernels import get_kernel

from .errors import InvalidArgument, NotSupported
from .program import Program

__all__ = ["run_reference"]


def run_reference(program: Program, method: str, inputs: Sequence[Any]) -> list[np.ndarray]:
    """The outputs of ``program.method`` on ``inputs``, computed in float64."""
    mdef = program.methods.get(method)
    if mdef is None:
        raise InvalidArgument(f"program {program.name!r} has no method {method!r}")
    if len(inputs) != len(mdef.inputs):
        raise InvalidArgument(f"{len(mdef.inputs)} inputs expected, got {len(inputs)}")
    env = {k: np.asarray(v, np.float64) for k, v in program.constants.items()}
    for decl, value in zip(mdef.inputs, inputs, strict=True):
        host = value.to_host() if hasattr(value, "to_host") else np.asarray(value)
        env[decl.name] = host.astype(np.float64)
    for step in mdef.steps:
        if step.kind != "kernel":
            raise NotSupported(f"run_reference: step {step.target!r} is a callable; only kernel "
                               f"steps have a float64 reference")
        spec = get_kernel(step.target)
        outs = spec.reference([env[n] for n in step.ins], spec.resolve_params(step.params))
        for name, value in zip(step.outs, outs, strict=True):
            env[name] = value
    return [env[t.name] for t in mdef.outputs]

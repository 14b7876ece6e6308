"""What a kernel is: the contract every entry of the kernel library fills in.

The kernel library knows nothing of devices, programs or scheduling. A ``KernelSpec`` says
everything a device needs to run the kernel (CUDA C source and entry point, launch rule,
argument marshalling) and everything a host device or a test needs (the numpy twin and the
float64 reference). Kernel parameter order on the device is fixed: input pointers, then output
pointers, then the scalars that ``configure`` returns.
"""

from __future__ import annotations

import ctypes
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Shape = tuple[int, ...]

_PLAIN_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")


def member_path(where: str, key: str) -> str:
    """The JSON path of ``key`` under ``where``: ``where.key`` for a plain key, else
    ``where['key']``, so that a name holding a dot ("a.b") is never read as two levels.
    Keys come from untrusted files: one longer than 128 characters is cut."""
    key = key if isinstance(key, str) else repr(key)  # a dict built in Python: any key
    plain = _PLAIN_KEY.fullmatch(key)
    key = key if len(key) <= 128 else key[:125] + "..."
    if plain:
        return f"{where}.{key}" if where else key
    return f"{where}[{key!r}]"


class KernelSpecError(ValueError):
    """A kernel was given shapes, dtypes or params it cannot run on.

    ``where`` names the offending part ("in[1]", "out[0]", "params.alpha"); the runtime turns
    this into its own typed errors (``InvalidProgram`` / ``InvalidArgument``).
    """

    def __init__(self, where: str, expected: str, got: Any):
        self.where = where
        self.expected = expected
        self.got = got
        super().__init__(f"{where}: expected {expected}, got {got!r}")


def plain_number(value: Any) -> Any:
    """A numpy integer or floating scalar as the Python number it holds; anything else (a
    numpy bool included: no number) as it is."""
    return value.item() if isinstance(value, (np.integer, np.floating)) else value


@dataclass(frozen=True)
class Param:
    """A scalar setting of a kernel (under ``params`` in a program step)."""

    kind: type  # float or int
    default: Any = None  # None: required
    minimum: float | None = None
    maximum: float | None = None
    doc: str = ""


@dataclass(frozen=True)
class LaunchConfig:
    """Grid, block and dynamic shared memory of one launch, plus the trailing scalar arguments
    as ``(value, ctypes type)`` pairs. ``entry`` picks another ``extern "C"`` kernel of the
    same source, with the same parameters (None: the spec's ``entry``): a kernel whose launch
    rule has variants that need different register budgets."""

    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_mem: int = 0
    scalars: tuple[tuple[Any, type], ...] = ()
    entry: str | None = None


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of the library.

    - ``infer(in_shapes, params)`` returns the shape each output must have (``None`` where any
      shape is allowed, as for ``fill``) or raises ``KernelSpecError``.
    - ``configure(in_shapes, out_shapes, params)`` returns the ``LaunchConfig``.
    - ``host(ins, outs, params)`` is the numpy twin: it writes every element of ``outs``.
    - ``reference(ins, params)`` computes the outputs in float64 from float64 inputs.
    """

    name: str
    n_in: int
    n_out: int
    source: str
    entry: str
    infer: Callable[[Sequence[Shape], Mapping[str, Any]], list[Shape | None]]
    configure: Callable[[Sequence[Shape], Sequence[Shape], Mapping[str, Any]], LaunchConfig]
    host: Callable[[Sequence[np.ndarray], Sequence[np.ndarray], Mapping[str, Any]], None]
    reference: Callable[[Sequence[np.ndarray], Mapping[str, Any]], list[np.ndarray]]
    params: Mapping[str, Param] = field(default_factory=dict)
    dtypes: tuple[str, ...] = ("float32",)
    in_programs: bool = True  # False for kernels that need a host-side object (latch)
    # Launched only by the runtime, with arguments it derives itself: a caller naming it could
    # make it read anywhere (strided_copy's byte strides, latch's flag address: data, not
    # checked against memory). ``instead`` says what a caller uses in its place.
    internal: bool = False
    instead: str = ""
    # Whether an output may be exactly one of the inputs (same memory): every element is
    # written only by the thread that read what it needs of it, after reading it.
    in_place: bool = False
    doc: str = ""
    # Params the numpy twin needs beyond the CUDA kernel's (a host-side object): the host
    # device runs this when it prepares a launch, so a launch it could not run is refused
    # there (KernelSpecError), not on its stream's worker, which would fault the device.
    host_check: Callable[[Mapping[str, Any]], None] | None = None

    def resolve_params(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        """Validate ``given`` against the declared params and fill in defaults."""
        given = dict(given or {})
        out: dict[str, Any] = {}
        for key in given:
            if key not in self.params:
                known = ", ".join(sorted(self.params)) or "none"
                raise KernelSpecError(member_path("params", key),  # an untrusted key
                                      f"one of the params of {self.name} ({known})", key)
        for key, p in self.params.items():
            if key not in given:
                if p.default is None:
                    article = "an" if p.kind is int else "a"
                    raise KernelSpecError(f"params.{key}", f"{article} {p.kind.__name__} "
                                          f"(required by {self.name})", None)
                out[key] = p.default
                continue
            given_value = given[key]
            value = plain_number(given_value)  # np.float32(2): as 2.0 is
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            # math, not np.isfinite: numpy raises TypeError on ints beyond 64 bits (2**64),
            # and float() overflows on huge ints; both are bad params, not crashes.
            try:
                if ok and isinstance(value, float):
                    ok = math.isfinite(value) and (p.kind is not int or value.is_integer())
                if ok:
                    value = p.kind(value)
                    ok = p.kind is not float or math.isfinite(value)
            except OverflowError:
                ok = False
            if not ok:
                raise KernelSpecError(f"params.{key}", f"a finite {p.kind.__name__}",
                                      given_value)
            if (p.minimum is not None and value < p.minimum) or (
                p.maximum is not None and value > p.maximum
            ):
                raise KernelSpecError(
                    f"params.{key}", f"a value in [{p.minimum}, {p.maximum}]", value)
            out[key] = value
        return out


# ctypes aliases the specs use for their scalar arguments
c_int = ctypes.c_int
c_longlong = ctypes.c_longlong
c_ulonglong = ctypes.c_ulonglong
c_float = ctypes.c_float
c_double = ctypes.c_double

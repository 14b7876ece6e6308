"""The dtypes streamlane understands, by name. bfloat16 is ml_dtypes' numpy-compatible bfloat16."""

from __future__ import annotations

import numbers
import operator
from typing import Any

import ml_dtypes
import numpy as np

from .errors import InvalidArgument

__all__ = ["DTYPES", "as_host_array", "dtype_from_name", "dtype_name", "int_in", "real_in"]

DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "float64": np.dtype(np.float64),
    "float16": np.dtype(np.float16),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "int8": np.dtype(np.int8),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
    "uint8": np.dtype(np.uint8),
    "uint16": np.dtype(np.uint16),
    "bool": np.dtype(np.bool_),
}
_NAMES = {dt: name for name, dt in DTYPES.items()}


def dtype_from_name(name: str) -> np.dtype:
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidArgument(f"unknown dtype {name!r}; known: {', '.join(DTYPES)}") from None


def dtype_name(dtype: np.dtype) -> str:
    """The streamlane name of ``dtype`` (native byte order), e.g. ``"bfloat16"``."""
    name = _NAMES.get(np.dtype(dtype).newbyteorder("="))
    if name is None:
        raise InvalidArgument(f"dtype {dtype} is not supported; supported: {', '.join(DTYPES)}")
    return name


def as_host_array(value: object, what: str, order: str | None = None) -> np.ndarray:
    """``np.asarray(value, order=order)``, with what numpy cannot read (a ragged sequence, an
    ``__array__`` that raises) reported as ``InvalidArgument`` naming ``what``. Running out of
    memory stays a ``MemoryError``."""
    try:
        return np.asarray(value, order=order)
    except MemoryError:
        raise
    except Exception as exc:
        raise InvalidArgument(f"{what}: {type(value).__name__} is not array-like: "
                              f"{exc}") from exc


def int_in(value: Any, low: int, high: int | None = None) -> int | None:
    """``value`` as an int if it is an integer in [low, high] (numpy's included, anything with
    ``__index__``; not a bool), else None: a lane picked with ``np.argmin`` is an int64."""
    if isinstance(value, (bool, np.bool_)):
        return None
    try:
        number = operator.index(value)
    except Exception:  # not an integer; or its own __index__ failed (ValueError, ...)
        return None
    return number if low <= number and (high is None or number <= high) else None


def real_in(value: Any, low: float, high: float) -> float | None:
    """``value`` as a float if it is a real number in [low, high] (numpy's included; not a
    bool, NaN or a complex), else None. The range is checked on the float: in float16, 1e6
    is infinity, so ``np.float16('inf') <= 1e6`` held."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int (or Fraction) past float's range: 10**400
        return None
    return number if low <= number <= high else None

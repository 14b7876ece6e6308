"""DLPack export of device memory (the producer side of ``__dlpack__``).

numpy exports host memory itself; CUDA memory needs a ``DLManagedTensor`` built here. The
structures are plain data described with ctypes (no driver calls). Each export keeps its owner
(the Result's holder) alive in ``_LIVE`` until the consumer calls the deleter, or until the
capsule is dropped unconsumed.

A consumer may hold an export until the interpreter ends (a tensor in a module global, an
unconsumed capsule in a reference cycle), and its deleter then runs during or after the
teardown that wipes this module's globals: the two callbacks, their C thunks and ``_LIVE``
(which holds each export's ``DLManagedTensor``) are kept alive for the process's life, and
the callbacks reach nothing through the module's globals (their defaults hold what they
use). Freed with the module, they were a jump to freed memory: exit status 139.
"""

from __future__ import annotations

import ctypes
import itertools
import sys
from collections.abc import Callable
from typing import Any

import numpy as np

from .dtypes import dtype_name
from .errors import InvalidArgument

__all__ = ["KDL_CPU", "KDL_CUDA", "export", "live_exports", "read_host_bfloat16"]

KDL_CPU = 1
KDL_CUDA = 2
_CODES = {"int8": (0, 8), "int32": (0, 32), "int64": (0, 64), "uint8": (1, 8), "uint16": (1, 16),
          "float16": (2, 16), "float32": (2, 32), "float64": (2, 64), "bfloat16": (4, 16),
          "bool": (6, 8)}


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(DLManagedTensor))
DLManagedTensor._fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p),
                            ("deleter", _DELETER)]

_LIVE: dict[int, tuple[Any, ...]] = {}
_KEYS = itertools.count(1)


def _delete(managed: Any, _live: dict[int, tuple[Any, ...]] = _LIVE,
            _finalizing: Callable[[], bool] = sys.is_finalizing) -> None:
    # No lock (dict get and pop are atomic under the GIL): a garbage collection inside a
    # locked region may run a deleter on the same thread. The let-go is told first and the
    # export dropped after it, so an interrupt (Ctrl-C) between the two leaves the export
    # held, its memory pinned (a leak), rather than released without the consumer's mark.
    # While the interpreter ends nothing is told (the runtime's modules may be gone).
    key = managed.contents.manager_ctx
    entry = _live.get(key)
    if entry is not None and entry[3] is not None and not _finalizing():
        entry[3]()  # the consumer let go: told while the owner still holds the memory
    _live.pop(key, None)


_DELETE = _DELETER(_delete)
_MANAGED_POINTER = ctypes.POINTER(DLManagedTensor)
_CAPSULE_DESTRUCTOR = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
_NAME = b"dltensor"
# Our own prototypes of the C API: setting argtypes on ctypes.pythonapi's shared function
# objects would change them for every other library in the process.
_capsule_new = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p,
                                 _CAPSULE_DESTRUCTOR)(("PyCapsule_New", ctypes.pythonapi))
_capsule_is_valid = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_IsValid", ctypes.pythonapi))
_capsule_get_pointer = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))
_err_occurred = ctypes.PYFUNCTYPE(ctypes.c_void_p)(("PyErr_Occurred", ctypes.pythonapi))
_capsule_get_pointer_obj = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.py_object,
                                             ctypes.c_char_p)(
    ("PyCapsule_GetPointer", ctypes.pythonapi))


def _capsule_gone(capsule: int, _err_occurred: Any = _err_occurred,
                  _capsule_is_valid: Any = _capsule_is_valid,
                  _capsule_get_pointer: Any = _capsule_get_pointer, _name: bytes = _NAME,
                  _cast: Any = ctypes.cast, _managed: Any = _MANAGED_POINTER,
                  _delete: Callable[[Any], None] = _delete) -> None:
    # A consumer that refuses the tensor (numpy and bfloat16) drops the capsule with its error
    # already set, and ctypes then fails every call that takes arguments, which left the export
    # (and its buffer) held for good. A call without arguments raises that pending error here,
    # which clears it; the consumer then reports a SystemError instead of its own error, which
    # ctypes cannot set back.
    try:
        _err_occurred()
    except BaseException:  # the consumer's error, nothing of ours
        pass
    # Unconsumed capsules still carry the name "dltensor": then the producer frees.
    if _capsule_is_valid(capsule, _name):
        ptr = _capsule_get_pointer(capsule, _name)
        _delete(_cast(ptr, _managed))


def capsule_pointer(capsule: Any) -> int:
    """The DLManagedTensor address inside an unconsumed capsule (tests)."""
    return int(_capsule_get_pointer_obj(capsule, _NAME))


_DESTRUCTOR = _CAPSULE_DESTRUCTOR(_capsule_gone)
# One reference never given back (see the module's docstring): none of these is ever freed.
_IMMORTAL = (_DELETE, _DESTRUCTOR, _LIVE, _MANAGED_POINTER, _capsule_new, _capsule_is_valid,
             _capsule_get_pointer, _err_occurred)
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_IMMORTAL))


def export(ptr: int, shape: tuple[int, ...], dtype: np.dtype, device_type: int, device_id: int,
           owner: Any, on_release: Callable[[], None] | None = None) -> Any:
    """A ``dltensor`` capsule over C-contiguous memory at ``ptr`` on a DLPack device;
    ``owner`` lives until the consumer releases it (or the capsule dies unconsumed), and
    ``on_release()`` (which must not raise) is called then, just before ``owner`` goes."""
    name = dtype_name(dtype)
    if name not in _CODES:
        raise InvalidArgument(f"dtype {name} has no DLPack code")
    code, bits = _CODES[name]
    key = next(_KEYS)
    shape_arr = (ctypes.c_int64 * max(1, len(shape)))(*shape)
    managed = DLManagedTensor()
    managed.dl_tensor = DLTensor(ptr, DLDevice(device_type, device_id), len(shape),
                                 DLDataType(code, bits, 1), shape_arr, None, 0)
    managed.manager_ctx = key
    managed.deleter = _DELETE
    _LIVE[key] = (managed, shape_arr, owner, on_release)
    return _capsule_new(ctypes.addressof(managed), _NAME, _DESTRUCTOR)


_capsule_set_name = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.py_object, ctypes.c_char_p)(
    ("PyCapsule_SetName", ctypes.pythonapi))
_USED = b"used_dltensor"


def read_host_bfloat16(obj: Any, check: Callable[[tuple[int, ...]], None] | None = None
                       ) -> np.ndarray:
    """A C-ordered copy of the host (kDLCPU) bfloat16 tensor ``obj`` exports over DLPack:
    numpy has no DLPack code for bfloat16, so ``np.from_dlpack`` refuses it (torch's, ours).
    The capsule is consumed as the protocol says (renamed, then its deleter called once the
    copy is made); anything else (another device or dtype) raises ``ValueError`` and leaves
    the capsule to its producer. ``check(shape)`` may refuse the tensor (it raises) before
    anything is allocated or copied."""
    import ml_dtypes

    where = obj.__dlpack_device__()  # asked first: a GPU producer's export may synchronize
    if int(where[0]) != KDL_CPU:
        raise ValueError(f"not a host tensor (DLPack device {tuple(where)})")
    capsule = obj.__dlpack__()
    managed = ctypes.cast(_capsule_get_pointer_obj(capsule, _NAME), _MANAGED_POINTER)
    tensor = managed.contents.dl_tensor
    kind = (tensor.device.device_type, tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes)
    if kind != (KDL_CPU, *_CODES["bfloat16"], 1):
        raise ValueError(f"not a host bfloat16 tensor (device type, code, bits, lanes: {kind})")
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    if check is not None:
        check(shape)
    itemsize = 2
    out = np.empty(shape, ml_dtypes.bfloat16)
    strides = tuple(tensor.strides[i] * itemsize for i in range(tensor.ndim)) \
        if tensor.strides else out.strides  # NULL strides: C order, as ``out`` has
    if out.size:
        low = sum(min(0, (n - 1) * st) for n, st in zip(shape, strides, strict=True))
        high = sum(max(0, (n - 1) * st) for n, st in zip(shape, strides, strict=True))
        start = tensor.data + tensor.byte_offset + low
        memory = (ctypes.c_uint8 * (high - low + itemsize)).from_address(start)
        out[...] = np.ndarray(shape, ml_dtypes.bfloat16, memory, -low, strides)
    _capsule_set_name(capsule, _USED)  # ours now: its destructor leaves it alone
    deleter = managed.contents.deleter
    if deleter:
        deleter(managed)
    return out


def live_exports() -> int:
    """How many CUDA exports are still held by consumers (for leak tests)."""
    return len(_LIVE)

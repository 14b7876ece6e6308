"""Device memory: owned allocations (``Buffer``) and typed contiguous views of them
(``DeviceArray``), the unit kernels and copies work on."""

from __future__ import annotations

import math
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidArgument

if TYPE_CHECKING:
    from .device import Device
    from .stream import Stream

__all__ = ["Buffer", "DeviceArray"]


class Buffer:
    """``nbytes`` of device memory at ``ptr``, owned: ``free()`` (stream-ordered where the device
    supports it) returns it once; a finalizer holding only the handle frees it if forgotten.

    ``uses`` maps a stream's key to the event recorded after the latest work there that touched
    the buffer (several buffers of one method may share one dict). Freeing waits for all of them
    on the device, so memory is never handed back while another stream still reads it (rule 8).
    """

    __slots__ = ("__weakref__", "_finalizer", "_impl", "device", "nbytes", "ptr", "uses")

    def __init__(self, device: Device, ptr: int, nbytes: int, impl: Any,
                 uses: dict[Any, Any] | None = None):
        self.device = device
        self.ptr = ptr
        self.nbytes = nbytes
        self._impl = impl
        self.uses: dict[Any, Any] = {} if uses is None else uses
        self._finalizer: weakref.finalize | None = weakref.finalize(
            self, device._free_quiet, ptr, impl, self.uses)

    @classmethod
    def borrowed(cls, device: Device, ptr: int, nbytes: int) -> Buffer:
        """A view of memory another library owns (``__cuda_array_interface__``): never freed
        by us; its owner keeps it alive."""
        buffer = cls.__new__(cls)
        buffer.device, buffer.ptr, buffer.nbytes, buffer._impl = device, ptr, nbytes, None
        buffer.uses = {}
        buffer._finalizer = None
        return buffer

    def free(self, stream: Stream | None = None) -> None:
        """Return the memory, ordered after the work queued on ``stream`` (idempotent; a no-op
        for borrowed memory)."""
        if self._finalizer is None or not self._finalizer.alive:
            return
        self._finalizer.detach()
        self.device._free(self.ptr, self._impl, None if stream is None else stream._usable(),
                          self.uses)

    @property
    def freed(self) -> bool:
        return self._finalizer is not None and not self._finalizer.alive

    def view(self, dtype: np.dtype | str, shape: tuple[int, ...], offset: int = 0) -> DeviceArray:
        return DeviceArray(self, np.dtype(dtype), tuple(shape), offset)

    def __repr__(self) -> str:
        return f"<Buffer {self.nbytes} B at {self.ptr:#x} on {self.device.name}>"


class DeviceArray:
    """A C-contiguous typed view of a ``Buffer``: what kernels read and write."""

    __slots__ = ("buffer", "dtype", "nbytes", "offset", "ptr", "shape", "size")

    def __init__(self, buffer: Buffer, dtype: np.dtype, shape: tuple[int, ...], offset: int = 0):
        size = math.prod(shape)
        nbytes = size * dtype.itemsize
        if offset < 0 or offset + nbytes > buffer.nbytes:
            raise InvalidArgument(f"a view of {nbytes} B at offset {offset} does not fit in "
                                  f"{buffer!r}")
        self.buffer = buffer
        self.dtype = dtype
        self.shape = shape
        self.offset = offset
        self.size = size
        self.nbytes = nbytes
        self.ptr = buffer.ptr + offset

    @property
    def device(self) -> Device:
        return self.buffer.device

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA array interface v3 (CUDA devices only), so torch/CuPy can wrap callable-step
        arrays zero-copy. No stream: the callable is handed the stream to order on."""
        if self.buffer.device.kind != "cuda":
            raise AttributeError("__cuda_array_interface__ exists only for CUDA memory")
        return {"shape": self.shape, "typestr": self.dtype.str, "data": (self.ptr, False),
                "version": 3, "strides": None, "stream": None}

    def __repr__(self) -> str:
        return f"<DeviceArray {self.dtype.name}{list(self.shape)} on {self.buffer.device.name}>"

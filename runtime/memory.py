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

# A buffer's ``uses`` with this many streams (and twice, four times as many...) is pruned:
# one entry per stream ever used would grow without bound (a long-lived input read under a
# new caller stream per request).
PRUNE_USES_AT = 64


def prune_uses(uses: dict[Any, Any], key: Any) -> None:
    """Called once ``uses`` (just given ``key``'s latest use) holds ``PRUNE_USES_AT`` entries or
    more; at that many and at each doubling, it drops the entries a rewrite or free no longer
    needs to wait for, so a few streams never pay for this and many pay little per use:

    - an entry of another stream holding the very event just noted for ``key``: a method's
      pooled output event, which each execute of that method re-records on its own stream,
      and rule 4 orders each execute after the one before, so its record on ``key`` now
      comes after every earlier use it marked (a rewrite on ``key`` is ordered after it by
      the stream, any other waits for it);
    - an entry whose event the device has reached (its work, or later work, has finished).

    An event other entries share is kept under each of their keys: only its latest record is
    waited for, and a rewrite skips the entry of its own stream, so dropping any of them
    could let a rewrite overtake a use it no longer sees."""
    n = len(uses)
    if n & (n - 1):
        return
    newest = uses.get(key)
    # A copy: another thread may note a use meanwhile, and so may a garbage collection on
    # this one (a DLPack deleter: mark_release), even inside list(uses.items()) (dict.copy
    # allocates nothing a collection follows while it copies).
    for other, event in uses.copy().items():
        if other == key:
            continue
        queried = event is not newest  # the event just noted needs no query
        if queried and not _reached(event):
            continue
        # No other thread records the event just noted (its method is ours until the execute
        # ends), but one may note a later use of a stream meanwhile, with another event or a
        # reached one re-recorded (a method's pooled event): the pop takes it, and it goes
        # back unless it is that event, still reached (a note comes after its record), or a
        # still later note came in between.
        taken = uses.pop(other, None)
        if taken is not None and (taken is not event or (queried and not _reached(taken))):
            uses.setdefault(other, taken)


def note_use(uses: dict[Any, Any], key: Any, event: Any) -> None:
    """``event`` marks the end of the latest use on stream ``key`` (rule 8): noted, the entries
    bounded (``prune_uses``) for a reader with a stream per request."""
    uses[key] = event
    if len(uses) >= PRUNE_USES_AT:
        prune_uses(uses, key)


def _reached(event: Any) -> bool:
    try:
        return bool(event.query())
    except Exception:  # a device error: keep what orders what (the next wait reports it)
        return False


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

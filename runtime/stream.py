"""Streams and the thread-local caller-stream selection (ordering rules 1-3).

A ``Stream`` is one ordered queue of device work. Its kind says who owns it:

- ``per-thread``: the calling thread's per-thread default stream (``CU_STREAM_PER_THREAD``);
  bound to that thread — only that thread may enqueue on it, since the same handle means another
  stream on any other thread.
- ``legacy``: the legacy default stream, selected explicitly (``CallerStream(None)``).
- ``owned``: created by ``Device.create_stream()``; ``close()`` destroys it, once.
- ``foreign``: borrowed from another library through ``__cuda_stream__``; never destroyed by us.

Guarantees: every operation on a stream checks, before touching the device, that the stream is
open, that it belongs to the device of the event or buffer it is given, and (per-thread streams)
that it is used from its own thread.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from .errors import InvalidArgument, InvalidState, StreamClosed
from .event import Event, ProcessLocal

if TYPE_CHECKING:
    from .device import Device

__all__ = ["CallerStream", "Stream", "current_stream"]

_SERIALS = itertools.count(1)

PER_THREAD = "per-thread"
LEGACY = "legacy"
OWNED = "owned"
FOREIGN = "foreign"
# The handles CUDA (and DLPack's stream= argument) gives the two default streams: the calling
# thread's per-thread stream, a different one on each thread, and the legacy stream.
PER_THREAD_HANDLE = 0x2  # CU_STREAM_PER_THREAD
LEGACY_HANDLE = 0x1  # CU_STREAM_LEGACY


class Stream(ProcessLocal):
    """A device stream. Obtain one from a ``Device`` (``create_stream()``, ``per_thread_stream()``,
    ``legacy_stream()``, ``wrap_stream(obj)``), never by calling this class."""

    __slots__ = ("__weakref__", "_close_pending", "_closed", "_finalizer", "_impl",
                 "_keepalive", "_pins", "device", "handle", "key", "kind", "owner_thread")
    _WHAT = "a queue of this process's device"
    _INSTEAD = ("share the Stream object itself (copy.copy gives it back), or create a stream "
                "where it is needed")

    def __init__(self, device: Device, kind: str, handle: int, impl: Any,
                 owner_thread: int | None = None, keepalive: Any = None):
        self.device = device
        self.kind = kind
        self.handle = handle
        self.owner_thread = owner_thread
        self._impl = impl
        self._keepalive = keepalive  # the foreign object we borrow from, kept alive while used
        self._closed = False
        self._pins: list[object] = []  # one token per promise of work not yet enqueued (pin)
        self._close_pending = False  # close() came while pinned: it happens at the last unpin
        # Identity of the device queue. A per-thread stream is its thread's own queue, and a
        # thread's id is reused once the thread ends; an owned stream's handle may be handed out
        # again by the next create_stream() while the destroyed stream's work still runs. So
        # each of those is a queue of its own, named by a serial. A foreign stream is known by
        # its handle alone (another library's wrapper of the same handle is the same queue).
        serial = next(_SERIALS) if kind in (PER_THREAD, OWNED) else 0
        self.key = (device.name, kind if kind == PER_THREAD else "stream", handle, serial)
        self._finalizer = (weakref.finalize(self, device._destroy_stream, impl)
                           if kind == OWNED else None)

    # -- checks shared by every operation ---------------------------------------------------
    def _usable(self) -> Any:
        if self._closed:
            if self.kind == PER_THREAD:
                raise StreamClosed(f"{self!r} is the per-thread stream of a thread that has "
                                   f"ended (another thread may now have its id); use this "
                                   f"thread's own (device.per_thread_stream()) or share a "
                                   f"created stream (device.create_stream()) between threads")
            raise StreamClosed(f"{self!r} is closed; create a new stream with "
                               f"device.create_stream()")
        if self.owner_thread is not None and self.owner_thread != threading.get_ident():
            raise InvalidState(
                f"{self!r} is the per-thread stream of another thread; on this thread the same "
                f"handle names a different stream. Share a created stream "
                f"(device.create_stream()) between threads instead")
        return self._impl

    # -- operations ---------------------------------------------------------------------------
    def record(self, event: Event | None = None) -> Event:
        """Record ``event`` (or a new one) at the current end of this stream and return it."""
        impl = self._usable()
        if event is None:
            event = self.device.create_event()
        elif not isinstance(event, Event):
            raise _not_an_event("record", event)
        elif event.device is not self.device:
            raise InvalidArgument(f"{event!r} belongs to {event.device.name}, this stream to "
                                  f"{self.device.name}; record an event of the stream's device")
        self.device._record(event, impl)
        return event

    def wait(self, event: Event) -> None:
        """Make later work on this stream wait, on the device, until ``event`` has completed.
        No host round trip."""
        impl = self._usable()
        if not isinstance(event, Event):
            raise _not_an_event("wait", event)
        if event.device is not self.device:
            raise InvalidArgument(f"{event!r} belongs to {event.device.name} but this stream to "
                                  f"{self.device.name}; a stream can only wait on events of its "
                                  f"own device (synchronize the other event from the host)")
        self.device._stream_wait(impl, event)

    def synchronize(self) -> None:
        """Block the calling thread until all work queued so far on this stream is done."""
        self.device._stream_synchronize(self._usable())

    def close(self) -> None:
        """Destroy an owned stream (after its queued work). Safe to call twice. A borrowed
        (foreign) stream is only marked closed for this wrapper. The per-thread and legacy
        streams belong to the driver and are shared by everything in the process: closing one
        raises ``InvalidState``."""
        if self.kind in (PER_THREAD, LEGACY):
            raise InvalidState(f"{self!r} belongs to the driver and is shared by every user of "
                               f"the device; it cannot be closed. Close only streams from "
                               f"device.create_stream() (or wrappers of borrowed ones)")
        if self._closed or self._close_pending:
            return
        # Announce, then look (pin() does the same the other way round), so that a pin and a
        # close racing on two threads never both miss each other; whoever sees the other last
        # closes (the last unpin, or here).
        self._close_pending = True
        if not self._pins:
            self._close_now()

    def _close_now(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._finalizer is not None:
            self._finalizer()  # runs once, whoever calls it

    def _thread_ended(self) -> None:
        """A per-thread stream's thread is ending (its thread-local holder is dropped): the
        stream is gone with it, and a new thread that gets the same id must not take this
        object for its own (``_usable``'s owner check compares ids)."""
        self._closed = True

    @property
    def closed(self) -> bool:
        """True once ``close()`` was called (a pinned stream is destroyed at its last unpin),
        or, for a per-thread stream, once its thread has ended."""
        return self._closed or self._close_pending

    def pin(self, token: object = None) -> None:
        """Promise work to this stream that is enqueued later (a scheduler job submitted with
        ``stream=``): a ``close()`` before the matching ``unpin()`` takes effect then, so the
        promised work still runs. Raises ``StreamClosed`` if it is already closed. ``token``
        (any object) names this promise for ``unpin(token)``; without one it is anonymous."""
        self._pins.append(token)  # list operations are atomic: no lock on a job's path
        closed = self._closed or self._close_pending
        if closed:
            self.unpin(token)
            raise StreamClosed(f"{self!r} is closed; create a new stream with "
                               f"device.create_stream()")

    def unpin(self, token: object = None) -> None:
        """The promised work is enqueued (or will never be): see ``pin()``, with its token."""
        try:
            self._pins.remove(token)
        except ValueError:
            raise InvalidState(f"{self!r}: unpin() without a matching pin()") from None
        if self._close_pending and not self._pins:
            self._close_now()

    def _release_pin(self, token: object) -> None:
        """``unpin(token)`` if that promise is still held: for a caller whose ``pin(token)`` an
        exception (a Ctrl-C) may have cut short before or after it took the pin."""
        if token in self._pins:
            self.unpin(token)

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        """Leaving ``with stream:`` closes an owned stream (a borrowed one: this wrapper); the
        shared per-thread and legacy streams stay open."""
        if self.kind not in (PER_THREAD, LEGACY):
            self.close()

    def __cuda_stream__(self) -> tuple[int, int]:
        """The CUDA stream protocol: (version 0, handle)."""
        self._usable()
        return (0, self.handle)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stream) and other.key == self.key

    def __hash__(self) -> int:
        return hash(self.key)

    def __repr__(self) -> str:
        state = " closed" if self.closed else ""
        owner = f" thread={self.owner_thread}" if self.owner_thread is not None else ""
        return f"<Stream {self.kind} {self.device.name} handle={self.handle:#x}{owner}{state}>"


# -- caller stream selection (rule 2) ---------------------------------------------------------

class _Legacy:
    def __repr__(self) -> str:
        return "LEGACY_DEFAULT_STREAM"


_LEGACY = _Legacy()
_selection = threading.local()


def _stack() -> list[Any]:
    try:
        return _selection.stack
    except AttributeError:
        _selection.stack = []
        return _selection.stack


class CallerStream:
    """Select the stream that executes on this thread use, for the extent of a ``with`` block.

    ``CallerStream(s)`` with a streamlane ``Stream`` or any object exposing ``__cuda_stream__``
    selects that stream; ``CallerStream(None)`` explicitly selects the legacy default stream,
    which is distinct from having no guard (the per-thread default stream). Guards nest and are
    thread-local: a guard on one thread is invisible to every other thread.
    """

    __slots__ = ("stream",)

    def __init__(self, stream: Any):
        if not (stream is None or isinstance(stream, Stream) or offers_stream_protocol(stream)):
            raise InvalidArgument(
                f"CallerStream expects a streamlane Stream, an object with __cuda_stream__, or "
                f"None (legacy default stream); got {type(stream).__name__}")
        self.stream = _LEGACY if stream is None else stream

    def __repr__(self) -> str:
        return f"CallerStream({None if self.stream is _LEGACY else self.stream!r})"

    # The thread's stack holds the guards themselves (not a depth kept on the guard), so one
    # guard object may be entered again, nested or on several threads at once.
    def __enter__(self) -> CallerStream:
        _stack().append(self)
        return self

    def _leave(self) -> None:
        """Leave the guard if it is still entered (no error otherwise): for a caller whose
        ``__exit__`` an exception (a Ctrl-C) may have cut short before or after it left."""
        stack = _stack()
        if self in stack:
            stack.remove(self)

    def __exit__(self, *exc: object) -> None:
        stack = _stack()
        if stack and stack[-1] is self:
            stack.pop()
            return
        for i in range(len(stack) - 1, -1, -1):  # out of order: still leave, then say so
            if stack[i] is self:
                del stack[i]
                break
        raise InvalidState("CallerStream guards must be exited in reverse order of entry on "
                           "the thread that entered them")


def selected_stream() -> Any:
    """The innermost caller stream selected on this thread: a Stream, a foreign object, the legacy
    marker, or None when no guard is active."""
    stack = getattr(_selection, "stack", None)
    return stack[-1].stream if stack else None


def current_stream(device: Device) -> Stream:
    """The stream an execute on this thread would use on ``device`` (rule 2)."""
    stack = getattr(_selection, "stack", None)
    if not stack:
        return device.per_thread_stream()
    sel = stack[-1].stream
    if sel is _LEGACY:
        return device.legacy_stream()
    if isinstance(sel, Stream):
        if sel.device is not device:
            raise InvalidArgument(f"the caller stream {sel!r} belongs to {sel.device.name}, but "
                                  f"the work runs on {device.name}; select a stream of "
                                  f"{device.name}")
        return sel
    return device.wrap_stream(sel)


@contextmanager
def no_caller_stream() -> Iterator[None]:
    """Hide any caller stream for the extent of the block (used by lanes)."""
    saved = getattr(_selection, "stack", None)
    _selection.stack = []
    try:
        yield
    finally:
        _selection.stack = saved if saved is not None else []


def offers_stream_protocol(obj: Any) -> bool:
    """Whether ``obj`` has ``__cuda_stream__`` (a property of its class that raises
    ``AttributeError`` counts: reading it later says what it raised). A property raising
    anything else is an ``InvalidArgument`` saying so."""
    try:
        return hasattr(obj, "__cuda_stream__") or hasattr(type(obj), "__cuda_stream__")
    except Exception as exc:  # hasattr runs a property, which may raise anything
        raise InvalidArgument(f"reading {type(obj).__name__}.__cuda_stream__ raised "
                              f"{exc!r}") from None


def foreign_stream_handle(obj: Any) -> int:
    """The CUDA stream handle ``obj`` names through the stream protocol (``__cuda_stream__``,
    an attribute or a method giving ``(0, handle)``). Whatever is wrong with it, a property
    that raises included, is an ``InvalidArgument``."""
    try:
        proto = obj.__cuda_stream__
    except Exception as exc:  # a property may raise anything
        if isinstance(exc, AttributeError) and not hasattr(type(obj), "__cuda_stream__"):
            proto = None
        else:
            raise InvalidArgument(f"reading {type(obj).__name__}.__cuda_stream__ raised "
                                  f"{exc!r}") from None
    if proto is None:
        raise InvalidArgument(f"{type(obj).__name__} has no __cuda_stream__; pass a Stream or "
                              f"an object implementing the CUDA stream protocol")
    try:
        value = proto() if callable(proto) else proto
    except Exception as exc:
        raise InvalidArgument(f"{type(obj).__name__}.__cuda_stream__() raised {exc!r}") from exc
    if (not isinstance(value, tuple) or len(value) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) for v in value)):
        raise InvalidArgument(f"{type(obj).__name__}.__cuda_stream__() must return a tuple "
                              f"(version, handle) of two ints, got {value!r}")
    version, handle = value
    if version != 0:
        raise InvalidArgument(f"__cuda_stream__ protocol version {version} is not supported "
                              f"(only version 0)")
    if handle < 0 or handle >= 1 << 64:
        raise InvalidArgument(f"__cuda_stream__ returned an invalid handle {handle}")
    return handle


def _not_an_event(what: str, value: Any) -> InvalidArgument:
    return InvalidArgument(f"Stream.{what}() takes an Event (device.create_event() or "
                           f"stream.record()), got {type(value).__name__}")

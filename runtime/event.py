"""Events: markers recorded on a stream (ordering across streams, timing, host waits)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import InvalidArgument

if TYPE_CHECKING:
    from .device import Device

__all__ = ["Event"]


class ProcessLocal:
    """Something of this process's device (a queue, a marker): ``copy.copy`` gives the object
    itself (a second object over it would not know what the first did to it, a close), and
    pickle or ``deepcopy`` raise a ``TypeError`` saying what to do (``_INSTEAD``), where they
    failed on a lock inside."""

    __slots__ = ()
    _WHAT = "an object of this process's device"
    _INSTEAD = ""

    def __copy__(self) -> Any:
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError(f"{self!r} is {self._WHAT} and does not pickle or deep-copy: "
                        f"{self._INSTEAD}")

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__reduce_ex__(4)


class Event(ProcessLocal):
    """A marker in a stream. Obtain one from ``Device.create_event()`` or ``Stream.record()``.

    Semantics follow CUDA: an event never recorded counts as complete; re-recording moves the
    marker, and a wait always refers to the latest record made before the wait was issued.
    """

    __slots__ = ("__weakref__", "_impl", "device", "recorded", "timing")
    _WHAT = "a marker in this process's device queues"
    _INSTEAD = ("share the Event object itself (copy.copy gives it back), or record a new one "
                "(stream.record())")

    def __init__(self, device: Device, impl: Any, timing: bool):
        self.device = device
        self.timing = timing
        self.recorded = False
        self._impl = impl

    def query(self) -> bool:
        """True when the work before the marker has completed (never blocks)."""
        return self.device._event_query(self)

    def synchronize(self) -> None:
        """Block this thread until the marker is reached (a host wait; counted in
        ``device.stats.host_waits``). Raises ``DeviceError`` if the device failed."""
        self.device._event_synchronize(self)

    def elapsed_ms(self, end: Event) -> float:
        """Milliseconds from this event to ``end``; both must be timing events, recorded and
        complete."""
        if not isinstance(end, Event):
            raise InvalidArgument(f"elapsed_ms() takes the end Event, got {type(end).__name__}")
        if end.device is not self.device:
            raise InvalidArgument(f"{end!r} is on {end.device.name}, {self!r} on "
                                  f"{self.device.name}; time events of one device")
        if not (self.timing and end.timing):
            raise InvalidArgument("both events must be created with timing enabled: "
                                  "device.create_event(timing=True)")
        if not (self.recorded and end.recorded):
            raise InvalidArgument("both events must be recorded before elapsed_ms()")
        return self.device._elapsed_ms(self, end)

    def __repr__(self) -> str:
        return (f"<Event {self.device.name}{' timing' if self.timing else ''}"
                f"{'' if self.recorded else ' unrecorded'}>")

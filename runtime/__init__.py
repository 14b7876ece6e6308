"""streamlane.runtime: synchronous, thread-bound execution of programs on a device.

No ``async def`` in this layer. The async scheduler (``streamlane.sched``) sits on it.
"""

from .device import Device, Latch, get_device
from .errors import (
    DeviceError,
    InvalidArgument,
    InvalidInput,
    InvalidProgram,
    InvalidState,
    NotSupported,
    StreamClosed,
    StreamlaneError,
)
from .event import Event
from .host import HostDevice
from .memory import Buffer, DeviceArray
from .method import Method
from .program import MethodBuilder, Program, ProgramBuilder
from .result import Result
from .stream import CallerStream, Stream, current_stream

__all__ = [
    "Buffer",
    "CallerStream",
    "Device",
    "DeviceArray",
    "DeviceError",
    "Event",
    "HostDevice",
    "InvalidArgument",
    "InvalidInput",
    "InvalidProgram",
    "InvalidState",
    "Latch",
    "Method",
    "MethodBuilder",
    "NotSupported",
    "Program",
    "ProgramBuilder",
    "Result",
    "Stream",
    "StreamClosed",
    "StreamlaneError",
    "current_stream",
    "get_device",
]

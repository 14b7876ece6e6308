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
from .memory import Buffer, DeviceArray
from .method import Method
from .program import Program, ProgramBuilder
from .result import Result
from .stream import CallerStream, Stream, current_stream

__all__ = [
    "Buffer",
    "CallerStream",
    "Device",
    "DeviceArray",
    "DeviceError",
    "Event",
    "InvalidArgument",
    "InvalidInput",
    "InvalidProgram",
    "InvalidState",
    "Latch",
    "Method",
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

"""The error hierarchy of streamlane.

Each error has one meaning, carries the structured fields that produced it and formats its own
message: what was wrong, the value, and what to do. They are importable from
``streamlane.runtime.errors`` by every layer.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "DLPackUnsupported",
    "DeviceError",
    "InvalidArgument",
    "InvalidInput",
    "InvalidProgram",
    "InvalidState",
    "KernelCompileError",
    "MethodBusy",
    "NotSupported",
    "StreamClosed",
    "StreamlaneError",
]


class StreamlaneError(Exception):
    """Base class of every error streamlane raises on purpose.

    Errors pickle and copy whole (a process pool hands them back): the message as it was and
    the structured fields, without calling the subclass's ``__init__`` again (its arguments
    are not the message)."""

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (type(self), self.args), self.__dict__


def _rebuild(cls: type[StreamlaneError], args: tuple[Any, ...]) -> StreamlaneError:
    error = cls.__new__(cls)
    error.args = args
    return error


class InvalidArgument(StreamlaneError, ValueError):
    """A value passed to streamlane is of the wrong kind, type, dtype, shape or range."""


class DLPackUnsupported(InvalidArgument, BufferError):
    """``__dlpack__`` cannot give what the consumer asked (another device, a copy where none
    can be made): also a ``BufferError``, which the array API standard has a producer raise
    there, so a consumer that falls back on it does."""


def shown(value: Any, how: Any = repr, limit: int = 200) -> str:
    """``how(value)`` (``repr`` or ``str``) for an error message, cut to ``limit`` characters: a
    4000-digit int given for a float32 is reported, not repeated, and one past Python's digit
    limit, or an object whose text raises, is described instead of raising from the error."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 2048:
        return f"an int of {value.bit_length()} bits"
    try:
        text = how(value)
        if not isinstance(text, str):
            raise TypeError(f"{how.__name__}() returned {type(text).__name__}")
    except Exception as exc:
        return f"a {type(value).__name__} whose {how.__name__}() raised {type(exc).__name__}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


class InvalidInput(InvalidArgument):
    """An input passed to a method does not match its declaration.

    Fields: ``method`` (name), ``index`` (input position), ``expected`` and ``got``.
    """

    def __init__(self, method: str, index: int | None, expected: str, got: Any, hint: str = ""):
        self.method = method
        self.index = index
        self.expected = expected
        self.got = got
        self.hint = hint
        where = f"method {method!r}" if index is None else f"input {index} of method {method!r}"
        msg = f"{where}: expected {expected}, got {shown(got, str)}"
        super().__init__(msg + (f"; {hint}" if hint else ""))


class NotSupported(StreamlaneError):
    """A request that streamlane refuses on purpose, with the alternative in the message."""


class InvalidProgram(StreamlaneError):
    """A program definition (file or builder) is invalid.

    Fields: ``path`` (JSON path of the bad field, e.g. ``methods.forward.steps[2].in[0]``; a key
    that is not a plain name, such as one holding a dot, is quoted: ``methods['enc.v2']``; a
    member of the constants ``.npz`` always is: ``constants['w1']``), ``expected`` and ``got``.
    """

    def __init__(self, path: str, expected: str, got: Any = None):
        self.path = path
        self.expected = expected
        self.got = got
        msg = f"{path or '<manifest>'}: expected {expected}"
        if got is not None:
            text = repr(got)
            msg += f", got {text if len(text) <= 80 else text[:77] + '...'}"
        super().__init__(msg)


class InvalidState(StreamlaneError):
    """An operation was called in a state that does not allow it (the message says which call
    makes it valid)."""


class MethodBusy(InvalidState):
    """A method was called from one thread while another thread was using it (rule 4:
    refused, never run unordered)."""


class StreamClosed(InvalidState):
    """Work was given to a stream that this program closed."""


class DeviceError(StreamlaneError):
    """The device (driver, NVRTC, or the host device's emulation) failed or is unusable.

    ``code`` holds the driver's error name (``CUDA_ERROR_X``) where there is one.
    """

    def __init__(self, message: str, code: str | None = None):
        self.code = code
        super().__init__(f"{code}: {message}" if code else message)


class KernelCompileError(DeviceError):
    """NVRTC rejected a kernel source; ``log`` holds the compiler's log."""

    def __init__(self, kernel: str, code: str, log: str):
        self.kernel = kernel
        self.log = log
        super().__init__(f"compiling kernel {kernel!r} failed; NVRTC log:\n{log}", code)

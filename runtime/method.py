"""Methods: a program method bound to a device, with its buffers, input slots, outputs and the
input/output state machine (seed 004) and ordering rules 1, 4, 5 and 6.

Guarantees:
- every step of one ``execute()`` runs on one stream, the one ``current_stream`` resolves on the
  calling thread (rule 1); no step owns a stream;
- an execute that resolves to another stream than the method's previous execute first makes that
  stream wait, on the device, for the previous execute (rule 4);
- ``execute()`` never waits on the host for the device's own work (rule 6); it may wait where
  memory someone else may use is reused: an output buffer another library took on an unknown
  stream (``may_wait_on_host``), or pinned staging for large host inputs (CUDA); and once
  after an execute that failed partway where nothing could mark the end of its part (its
  stream closed meanwhile, a second Ctrl-C): the next one first waits for the whole device;
- two threads executing one method at the same time get ``InvalidState`` (``MethodBusy``),
  never unordered work.
"""

from __future__ import annotations

import array
import math
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from streamlane.kernels import get_kernel

from .dlpack import read_host_bfloat16
from .dtypes import DTYPES
from .errors import InvalidArgument, InvalidInput, InvalidState, MethodBusy, NotSupported, shown
from .event import Event
from .memory import PRUNE_USES_AT, Buffer, DeviceArray, prune_uses
from .result import OutputPool, PooledBuffer, Result, _Holder
from .stream import current_stream

if TYPE_CHECKING:
    from .device import Device
    from .program import MethodDef, Program
    from .stream import Stream

__all__ = ["Method"]

_BFLOAT16 = DTYPES["bfloat16"]
OPTIONS = {"clone_outputs": True, "use_shared_stream": False}

# Test-only switch: give every step a private stream with nothing ordering them (the bug of
# seed 000). Never part of the public API; tests flip it to prove the determinism test has teeth.
_PRIVATE_STREAM_PER_STEP = False


class _Foreign:
    """An input borrowed from another library (``__cuda_array_interface__``). In another layout
    it is gathered on the device into the input's slot (``gather``: the prepared
    ``strided_copy`` and the shape + byte strides it reads)."""

    __slots__ = ("array", "gather", "meta", "obj", "stream_handle")

    def __init__(self, array: DeviceArray, obj: Any, stream_handle: int | None,
                 gather: Any = None, meta: np.ndarray | None = None):
        self.array = array
        self.obj = obj
        self.stream_handle = stream_handle
        self.gather = gather
        self.meta = meta


class Method:
    """A program method bound to a device. Get one from ``Program.method(name, device=...)``.

    ``m(values)`` is ``set_inputs(values); execute(); return get_outputs()``.
    """

    def __init__(self, program: Program, mdef: MethodDef, device: Device,
                 options: dict[str, Any]):
        self.program = program
        self.definition = mdef
        self.device = device
        self.name = f"{program.name}.{mdef.name}"
        self.options = _check_options(options, self.name)
        self.clone_outputs: bool = self.options["clone_outputs"]
        # One caller at a time (rule 4). An RLock for its owner check: taken inside the `try`
        # that gives it back, so that a Ctrl-C landing as the take returns still gives it back
        # (see _busy's callers); a re-entry is refused before, by that check.
        self._guard = threading.RLock()
        self._inputs: list[Any] | None = None  # host arrays, Results or _Foreign
        self._inputs_valid = False
        self._outputs: list[Result] | None = None
        self.last_event: Event | None = None
        self._last_stream_key: Any = None
        # A failed execute left work on the device that nothing marks the end of
        # (_order_after_failure): the next execute first waits for the whole device.
        self._unordered = False
        self.executions = 0

        # Planned memory, allocated once: constants, internal buffers, input slots, outputs.
        stream = current_stream(device)
        # One record of stream uses for all memory the method owns (freed when it dies).
        self._uses: dict[Any, Event] = {}
        owned: dict[str, DeviceArray] = {}
        for name, value in program.constants.items():
            array = owned[name] = device.empty(value.shape, value.dtype, stream, self._uses)
            device.copy_from_host(array, value, stream)
        for t in mdef.buffers:
            owned[t.name] = device.empty(t.shape, DTYPES[t.dtype], stream, self._uses)
        self._input_decls = mdef.inputs
        self._n_inputs = len(mdef.inputs)
        self._wants = [(DTYPES[t.dtype], t.shape) for t in mdef.inputs]  # _accept's fast path
        self._slots: list[DeviceArray | None] = [None] * len(mdef.inputs)
        self._metas: dict[int, DeviceArray] = {}  # layouts of gathered inputs, by input index
        # Every tensor of an execute by index: inputs, outputs, then constants and buffers.
        names = [t.name for t in (*mdef.inputs, *mdef.outputs)] + list(owned)
        self._index = {n: i for i, n in enumerate(names)}
        self._arrays: list[Any] = [None] * (len(mdef.inputs) + len(mdef.outputs)) + list(
            owned.values())
        self._pools = [OutputPool(self._buffer_maker(t)) for t in mdef.outputs]
        self._views = [device.empty(t.shape, DTYPES[t.dtype], stream, self._uses)
                       for t in mdef.outputs] if not self.clone_outputs else []
        shapes = {t.name: t.shape for t in (*mdef.inputs, *mdef.buffers, *mdef.outputs)}
        shapes.update((name, value.shape) for name, value in program.constants.items())
        self._steps = [self._plan_step(s, shapes) for s in mdef.steps]
        self._private_streams: list[Stream] = []
        if program.constants:
            self.last_event = stream.record()  # the constants' upload orders the first execute
            self._last_stream_key = stream.key
            self._uses[stream.key] = self.last_event

    # -- inputs ---------------------------------------------------------------------------
    def set_inputs(self, values: Sequence[Any]) -> None:
        """Check and install the inputs (numpy arrays in any layout, Results, objects with
        ``__cuda_array_interface__`` or DLPack, Python numbers for scalar inputs).

        A wrong count raises and leaves the previous inputs intact; any other bad input raises
        and makes ``execute()`` refuse until every input is passed again."""
        guard = self._guard
        if guard._is_owned():  # a re-entry on this thread: an input's __array__, a handler
            raise _busy(self, "set_inputs")
        try:  # the take inside the try: a Ctrl-C as it returns still gives it back
            if not guard.acquire(blocking=False):
                raise _busy(self, "set_inputs")
            self._set_inputs(values)
        finally:
            try:
                guard.release()
            except RuntimeError:  # not ours: another thread holds it
                pass

    def _set_inputs(self, values: Sequence[Any]) -> None:
        """``set_inputs`` with the guard held."""
        if type(values) is not list and type(values) is not tuple:
            values = self._listed(values)
        if len(values) != len(self._input_decls):
            raise InvalidInput(self.name, None, f"{len(self._input_decls)} inputs",
                               len(values))
        self._inputs_valid = False
        self._outputs = None  # an output may share memory with an input
        accepted = [self._accept(i, v) for i, v in enumerate(values)]
        self._inputs = accepted
        self._inputs_valid = True

    def _listed(self, values: Any) -> list[Any]:
        """The inputs given as another sequence than a list or a tuple, as a list (a str, bytes
        or an array is not a sequence of inputs: bytes, memoryview and array.array are
        sequences of numbers)."""
        if not isinstance(values, Sequence) or \
                isinstance(values, (str, bytes, bytearray, memoryview, array.array)):
            raise InvalidInput(self.name, None, "a list of inputs", type(values).__name__)
        return list(values)

    def check_inputs(self, values: Sequence[Any], *,
                     unchecked: type | tuple[type, ...] = ()) -> list[Any]:
        """Check ``values`` as ``set_inputs`` would, without installing them, for code that
        passes them to a later ``set_inputs`` (the scheduler's ``submit``): the count, then
        every input that can be read now: Results, numpy arrays, Python numbers, and objects
        no input can be. Raises what ``set_inputs`` raises (``InvalidInput``).

        Returns the values to pass later: numpy arrays and numbers as checked copies (C
        order) that the caller's later changes do not reach, the rest as given. An object
        read only when the work runs (``__array__``, DLPack, ``__cuda_array_interface__``)
        is returned unchecked: ``set_inputs`` checks it then, as is an instance of
        ``unchecked`` (a type or a tuple of types: the caller checks those). Reads nothing an
        execute changes, so it may run on any thread."""
        if not isinstance(unchecked, type):
            unchecked = _types(unchecked)
        if type(values) is not list and type(values) is not tuple:
            values = self._listed(values)
        if len(values) != len(self._input_decls):
            raise InvalidInput(self.name, None, f"{len(self._input_decls)} inputs",
                               len(values))
        checked = list(values)
        for i, v in enumerate(values):
            if type(v) is Result:  # the common case: set_inputs' own check, returns it
                self._accept(i, v)
            elif not isinstance(v, unchecked):
                checked[i] = self._check_now(i, v)
        return checked

    def _check_now(self, index: int, value: Any) -> Any:
        if isinstance(value, Result):
            return self._accept(index, value)
        if isinstance(value, np.ndarray):
            array = self._accept(index, value)
            return array.copy() if np.may_share_memory(array, value) else array
        if isinstance(value, (bool, int, float, np.generic)):
            return self._accept(index, value)  # a new 0-d array (numpy scalars are immutable)
        try:
            later = any(hasattr(value, name) for name in (
                "__cuda_array_interface__", "__array_interface__", "__array__", "__dlpack__"))
        except Exception:  # a broken protocol property: _accept reports it
            later = False
        return value if later else self._accept(index, value)

    def _accept(self, index: int, value: Any) -> Any:
        want, shape = self._wants[index]
        if type(value) is Result:  # the common case, checked without building messages
            array = value.array
            if array.dtype == want and array.shape == shape and \
                    array.buffer.device is self.device and not value.view_only:
                return value
        decl = self._input_decls[index]
        expected = f"{decl.dtype}{list(decl.shape)}"
        if isinstance(value, Result):
            if value.device is not self.device:
                raise InvalidInput(self.name, index, f"a Result on {self.device.name}",
                                   f"a Result on {value.device.name}",
                                   "copy it with Result.from_host(result.to_host(), device)")
            if value.view_only and any(value.array.buffer is view.buffer
                                       for view in self._views):
                raise InvalidInput(
                    self.name, index, "a Result the execute does not overwrite",
                    "an output of this same method made with clone_outputs=False",
                    "every execute writes those outputs in place, so the execute would read "
                    "and overwrite the same memory; copy it first "
                    "(Result.from_host(r.to_host(), device)) or make the method with "
                    "clone_outputs=True")
            self._check_meta(index, value.dtype, value.shape, want, decl.shape, expected,
                             result=True)
            return value
        if isinstance(value, (bool, int, float, np.number, np.bool_)) and not isinstance(
                value, np.ndarray):
            return self._scalar(index, value, decl, want)
        try:  # the array protocols are properties: a broken one raises anything
            cai = getattr(value, "__cuda_array_interface__", None)
            host_readable = isinstance(value, np.ndarray) or hasattr(
                value, "__array_interface__") or hasattr(value, "__array__")
            dlpack = hasattr(value, "__dlpack__")
        except Exception as exc:
            raise InvalidInput(self.name, index, expected, type(value).__name__,
                               f"reading its array interface raised {exc!r}") from None
        if cai is not None and self.device.kind == "cuda":
            return self._accept_cai(index, value, cai, want, decl.shape, expected)
        if dlpack and want == _BFLOAT16 and not isinstance(value, np.ndarray):
            def check(shape: tuple[int, ...]) -> None:  # before the copy is allocated
                self._check_meta(index, want, shape, want, decl.shape, expected)

            try:  # numpy reads no bfloat16 over DLPack (nor through torch's __array__)
                array = read_host_bfloat16(value, check)
            except (InvalidInput, MemoryError):
                raise
            except Exception:  # not a host bfloat16 tensor: the readers below say what it is
                pass
            else:
                return array
        if host_readable:
            try:
                array = np.asarray(value)
            except Exception as exc:  # e.g. a GPU array given to a host-device method
                raise InvalidInput(self.name, index, f"{expected} readable on the host or a "
                                   f"Result", type(value).__name__, str(exc)) from None
        elif dlpack:
            try:
                array = np.from_dlpack(value)
            except Exception as exc:
                raise InvalidInput(self.name, index, f"{expected} readable on the host or a "
                                   f"Result", type(value).__name__, str(exc)) from None
        elif cai is not None:  # CUDA memory given to the host device
            raise InvalidInput(self.name, index, f"{expected} readable on the host or a Result",
                               type(value).__name__, "it is CUDA memory "
                               "(__cuda_array_interface__), which the host device cannot read; "
                               "copy it to the host first")
        else:
            raise InvalidInput(self.name, index, f"{expected} (numpy array, Result, DLPack or "
                               f"__cuda_array_interface__ object)", type(value).__name__)
        self._check_meta(index, array.dtype, array.shape, want, decl.shape, expected)
        return np.asarray(array, order="C")  # another layout is copied into the exported one

    def _scalar(self, index: int, value: Any, decl: Any, want: np.dtype) -> np.ndarray:
        if decl.shape != ():
            raise InvalidInput(self.name, index, f"{decl.dtype}{list(decl.shape)}",
                               f"a {'Python' if type(value).__module__ == 'builtins' else 'scalar'}"
                               f" number {shown(value)}")
        kind = want.kind
        ok = (kind == "b" and isinstance(value, (bool, np.bool_))) or \
             (kind in "iu" and isinstance(value, (int, np.integer))
              and not isinstance(value, (bool, np.bool_))) or \
             (kind in "fV" and isinstance(value, (int, float, np.integer, np.floating))
              and not isinstance(value, (bool, np.bool_)))
        if not ok:
            raise InvalidInput(self.name, index, f"a {decl.dtype} scalar",
                               f"{type(value).__name__} {shown(value)}")
        try:
            array, fits = _convert_scalar(value, kind, want)
        except Exception as exc:  # a number type of the caller's whose int() or float() raises
            raise InvalidInput(self.name, index, f"a {decl.dtype} scalar",
                               f"{type(value).__name__} {shown(value)}",
                               f"converting it raised {exc!r}") from None
        if array is None:
            raise InvalidInput(self.name, index, f"a {decl.dtype} scalar {fits}", value)
        return array

    def _check_meta(self, index: int, dtype: np.dtype, shape: tuple[int, ...], want: np.dtype,
                    want_shape: tuple[int, ...], expected: str, result: bool = False) -> None:
        if dtype != want:
            how = (f"a Result has no astype: produce it as {want.name}, or copy it with "
                   f"Result.from_host(r.to_host().astype({want.name!r}), device)") if result \
                else f"convert it with .astype({want.name!r}) first"
            raise InvalidInput(self.name, index, expected, f"dtype {dtype}", how)
        if tuple(shape) != tuple(want_shape):
            raise InvalidInput(self.name, index, expected, f"shape {list(shape)}")

    def _accept_cai(self, index: int, obj: Any, cai: dict, want: np.dtype,
                    shape: tuple[int, ...], expected: str) -> Any:
        try:
            dtype = np.dtype(cai["typestr"])
            got_shape = tuple(int(d) for d in cai["shape"])
            ptr = int(cai["data"][0])
        except Exception as exc:
            raise InvalidInput(self.name, index, expected, "a malformed "
                               "__cuda_array_interface__", str(exc)) from None
        if dtype.kind == "V" and want.itemsize == dtype.itemsize:
            dtype = want  # bfloat16 arrives as raw bytes (typestr "<V2")
        self._check_meta(index, dtype, got_shape, want, shape, expected)
        strides = cai.get("strides")
        if strides is not None:
            try:
                strides = tuple(int(s) for s in strides)
            except (TypeError, ValueError):
                raise InvalidInput(self.name, index, expected, "malformed strides in "
                                   "__cuda_array_interface__", repr(strides)) from None
            if len(strides) != len(got_shape):
                raise InvalidInput(self.name, index, expected,
                                   f"{len(strides)} strides for {len(got_shape)} dimensions")
        # A load of a misaligned element is a CUDA fault that ends the context (and with it
        # every other library's work in this process): refused before anything is enqueued.
        if ptr % dtype.itemsize or any(s % dtype.itemsize for s in strides or ()):
            raise InvalidInput(self.name, index, expected,
                               f"memory not aligned to its {dtype.itemsize}-byte elements "
                               f"(pointer {ptr:#x}, strides {strides})",
                               "copy it into a freshly allocated array first")
        if strides is not None and strides == _contiguous_strides(got_shape, dtype):
            strides = None
        if strides is None:
            nbytes = max(1, int(np.prod(got_shape)) * dtype.itemsize)
            array = DeviceArray(Buffer.borrowed(self.device, ptr, nbytes), want, got_shape)
            return _Foreign(array, obj, cai.get("stream"))
        # Another layout: gather it into the exported layout on the device (strided_copy).
        if not 1 <= len(got_shape) <= 8:
            raise InvalidInput(self.name, index, f"{expected} of rank 1..8 when not "
                               f"C-contiguous", f"rank {len(got_shape)}")
        span = sum((d - 1) * abs(s) for d, s in zip(got_shape, strides, strict=True)) + \
            dtype.itemsize
        meta = np.array([*got_shape, *strides], np.int64)
        size = int(np.prod(got_shape))
        gather = self.device._prepare(
            get_kernel("strided_copy"), [(span,), meta.shape], [(size * dtype.itemsize,)],
            {"n": size, "rank": len(got_shape), "itemsize": dtype.itemsize}, dtype="uint8")
        source = DeviceArray(Buffer.borrowed(self.device, ptr, span), np.dtype(np.uint8), (span,))
        return _Foreign(source, obj, cai.get("stream"), gather, meta)

    # -- execution -----------------------------------------------------------------------
    def execute(self, *, start: Event | None = None) -> None:
        """Enqueue every step on this thread's resolved stream. Never waits on the host for
        the device's own work (rule 6: see the module's guarantees for the two exceptions).

        ``start``: an event to record on that stream once this execute's device waits (the
        rule-4 handoff, inputs produced on other streams, output buffers still being read) are
        enqueued, just before its first step: where its own work starts (the scheduler's
        timing events)."""
        if start is not None:
            _check_start(self, start, "execute")
        guard = self._guard
        if guard._is_owned():  # a re-entry on this thread: an input's __array__, a handler
            raise _busy(self, "execute")
        try:  # the take inside the try: a Ctrl-C as it returns still gives it back
            if not guard.acquire(blocking=False):
                raise _busy(self, "execute")
            self._execute(start)
        finally:
            try:
                guard.release()
            except RuntimeError:  # not ours: another thread holds it
                pass

    def _execute(self, start: Event | None) -> None:
        """``execute`` with the guard held."""
        if self._inputs is None or not self._inputs_valid:
            raise InvalidState(
                f"{self.name}: execute() needs inputs; call set_inputs() with all "
                f"{len(self._input_decls)} inputs first"
                + (" (the last set_inputs() failed)" if self._inputs is not None else ""))
        device = self.device
        stream = current_stream(device)
        # A closed stream, or another thread's per-thread one, is refused before anything is
        # touched: a refusal partway would leave readied buffers with no event to order by.
        try:
            impl = stream._usable()
        except InvalidState as exc:  # StreamClosed too: say whose execute it refused
            raise type(exc)(f"{self.name}: execute() refused: {exc}") from None
        key = stream.key
        used: list[Buffer] = []  # memory of others this execute touches, and its outputs' (rule 8)
        pooled: list[PooledBuffer] = []  # the output buffers taken, in output order
        previous = self._outputs
        try:  # an interrupt (Ctrl-C) may land anywhere up to the end: ordered as a failure
            event = self._enqueue(stream, impl, key, start, used, pooled)
            self._note(key, event, used)
            self._outputs = [Result(p.array, event, key, _Holder(p)) for p in pooled] \
                if pooled else [Result(view, event, key, view_only=True) for view in self._views]
            self.executions += 1
        except BaseException:
            # Unordered until _order_after_failure has marked where the part enqueued ends: a
            # second Ctrl-C before it gets there leaves the next execute to wait for the
            # whole device (may_wait_on_host), not to run unordered after that part.
            unordered_before, self._unordered = self._unordered, True
            # The last execute's outputs stand, in buffers of their own; views it may have
            # half rewritten do not (clone_outputs=False): none until an execute succeeds.
            self._outputs = previous if self.clone_outputs else None
            for pool in self._pools:  # a buffer it took (or grew) is free with no let-go
                pool.all_held = None  # counted: the next execute searches
            if self._order_after_failure(stream, key, used):
                self._unordered = unordered_before
            raise

    def _enqueue(self, stream: Stream, impl: Any, key: Any, start: Event | None,
                 used: list[Buffer], pooled: list[PooledBuffer]) -> Event:
        """Enqueue one execute on ``stream``: the handoff, the inputs, the steps; returns the
        event recorded after them. ``used`` and ``pooled`` fill as it goes, so that a failure
        partway knows what it touched (``_order_after_failure``)."""
        device = self.device
        if self._unordered:  # see _order_after_failure
            device.synchronize()
            self._unordered = False
        if self.last_event is not None and self._last_stream_key != key:
            stream.wait(self.last_event)  # rule 4: hand the method over in device order
        arrays = self._arrays  # one list, reused: the guard makes this execute the only one
        for i, value in enumerate(self._inputs):
            if isinstance(value, Result):
                value.wait_on(stream)
                arrays[i] = value.array
                used.append(value.array.buffer)
            elif isinstance(value, _Foreign):
                if value.stream_handle:  # the producer's stream (CAI v3): order after it
                    stream.wait(device.stream_from_handle(value.stream_handle).record())
                arrays[i] = value.array if value.gather is None else \
                    self._gather_input(i, value, stream)
            else:
                slot = self._slots[i]
                if slot is None:
                    slot = self._slots[i] = device.empty(value.shape, value.dtype, stream,
                                                         self._uses)
                device.copy_from_host(slot, value, stream)
                arrays[i] = slot
        if self.clone_outputs:  # for each output, a buffer no live Result holds (OutputPool)
            for pool in self._pools:
                taken = pool.take(stream)
                pooled.append(taken)
                used.append(taken.array.buffer)
        uses = self._uses  # of our own memory: input slots, internal buffers, views
        if len(uses) > 1 or key not in uses:
            readers = list(uses.copy().items())  # another thread, or a GC here, may add
            if not pooled:
                # clone_outputs=False: the outputs are our own buffers, and a consumer on
                # another stream (or on the stream we last ran on, after us) may still have to
                # read the last ones (rule 8): wait for every stream that used our memory.
                for other, used_by in readers:
                    if other != key:
                        stream.wait(used_by)
            # Every entry is now ordered before this execute: rule 4's handoff orders our own
            # executes on other streams, the waits above the readers of our views. One entry
            # per stream ever used would grow without bound (a thread per call). A reader
            # that came since the copy above stays.
            for other, used_by in readers:
                if uses.get(other) is used_by:
                    uses.pop(other, None)
        first = self._n_inputs
        for j, out in enumerate(pooled):
            arrays[first + j] = out.array
        if not pooled:
            for j, view in enumerate(self._views):
                arrays[first + j] = view
        if start is not None:
            stream.record(start)
        if _PRIVATE_STREAM_PER_STEP:
            for index, (run, ins, outs) in enumerate(self._steps):
                run(self._private_stream(index), [arrays[k] for k in ins],
                    [arrays[k] for k in outs])
        else:
            for run, ins, outs in self._steps:
                run(stream, [arrays[k] for k in ins], [arrays[k] for k in outs])
        # A single output's buffer lends its event: no Result holds that buffer now, so no
        # live Result's event moves (see PooledBuffer). Several outputs, or a Result read
        # (``used`` holds more than our outputs), a new event: the read Result's buffer keeps
        # this event as the end of the read (rule 8), and a lent one is re-recorded by a
        # later execute of ours, on any stream, which the buffer's next writer would then
        # wait for (behind a latch there: for ever). CUDA takes a new one from its spares.
        lend = len(pooled) == 1 and len(used) == 1
        event = pooled[0].event if lend else device.create_event()
        # stream.record without its re-checks; the stream was checked before the first step,
        # but another thread may have closed it since (a created stream a CallerStream holds
        # is not pinned): a record there would fail, so it is refused here, before the event
        device._record(event, impl if not stream._closed else stream._usable())
        return event

    def _order_after_failure(self, stream: Stream, key: Any, used: list[Buffer]) -> bool:
        """An execute raised partway (an allocation that failed, a user step that raised, a
        Ctrl-C) after enqueuing part of its work on ``stream``: the handoff, uploads into the
        input slots, output buffers readied for rewriting (their readers' waits enqueued, the
        readers forgotten), some steps. Order whatever runs next after that part, as after a
        whole execute: the method's next execute on another stream (rule 4) and the next
        writer of the memory it touched (rule 8). Its own outputs are never given."""
        try:
            event = self.device.create_event()
            self.device._record(event, stream._usable())
        except BaseException:  # the stream was closed meanwhile (another thread), the device
            # failed, or a second Ctrl-C: nothing marks where that part ends, and the buffers
            # it readied have forgotten their readers. The next execute waits for the whole
            # device first (may_wait_on_host says so); the original error says what happened.
            self._unordered = True
            return False
        self._note(key, event, used)
        return True

    def _note(self, key: Any, event: Event, used: list[Buffer]) -> None:
        """``event`` marks the end of this execute's work on stream ``key``: the memory it
        touched is in use there until then (rule 8), and the method's next execute on another
        stream waits for it (rule 4)."""
        for buffer in used:  # memory.note_use, inlined: this is the execute's path
            uses = buffer.uses
            uses[key] = event
            if len(uses) >= PRUNE_USES_AT:  # a stream per request: bounded (prune_uses)
                prune_uses(uses, key)
        self._uses[key] = event
        self.last_event = event
        self._last_stream_key = key

    def get_outputs(self) -> list[Result]:
        """The outputs of the last execute (Results; no copy, no host wait)."""
        guard = self._guard
        if guard._is_owned():  # a re-entry on this thread: an input's __array__, a handler
            raise _busy(self, "get_outputs")
        try:  # the take inside the try: a Ctrl-C as it returns still gives it back
            if not guard.acquire(blocking=False):  # mid-call on another thread, they change
                raise _busy(self, "get_outputs")
            return self._get_outputs()
        finally:
            try:
                guard.release()
            except RuntimeError:  # not ours: another thread holds it
                pass

    def _get_outputs(self) -> list[Result]:
        """``get_outputs`` with the guard held."""
        if self._outputs is None:
            raise InvalidState(f"{self.name}: no outputs to get; call execute() after "
                               f"set_inputs() first")
        return list(self._outputs)

    def may_wait_on_host(self) -> bool:
        """Whether the next ``execute()`` may wait on the host: it may reuse an output buffer
        that another library took on a stream nobody could mark (an unknown one:
        ``__cuda_array_interface__``, DLPack with ``stream=-1``; or one that could not be
        marked when that library let go: another thread's per-thread stream, DLPack
        ``stream=2`` let go elsewhere), which only a device-wide synchronize makes safe to
        rewrite (rule 8), or follow an execute that failed partway with nothing to mark where
        its part ends (``_order_after_failure``). The scheduler's event loop thread never
        runs such an execute."""
        if self._unordered:
            return True
        if not PooledBuffer.blind_exports_seen:
            return False
        return any(p.needs_device_wait for pool in self._pools for p in pool.buffers)

    def __call__(self, values: Sequence[Any], *, start: Event | None = None) -> list[Result]:
        """``set_inputs(values); execute(start=start); return get_outputs()`` as one call:
        another thread cannot run the method between the three (rule 4 refuses it with
        ``InvalidState`` instead), so the outputs are always those of ``values``."""
        if start is not None:
            _check_start(self, start, "__call__")
        guard = self._guard
        if guard._is_owned():  # a re-entry on this thread: an input's __array__, a handler
            raise _busy(self, "__call__")
        try:  # the take inside the try: a Ctrl-C as it returns still gives it back
            if not guard.acquire(blocking=False):
                raise _busy(self, "__call__")
            self._set_inputs(values)
            self._execute(start)
            return self._get_outputs()
        finally:
            try:
                guard.release()
            except RuntimeError:  # not ours: another thread holds it
                pass

    # -- internals ------------------------------------------------------------------------
    def _buffer_maker(self, t: Any) -> Any:
        device, shape, dtype = self.device, t.shape, DTYPES[t.dtype]

        def make(stream: Stream) -> PooledBuffer:
            return PooledBuffer(device.empty(shape, dtype, stream), device.create_event())
        return make

    def _plan_step(self, step: Any, shapes: dict[str, tuple[int, ...]]
                   ) -> tuple[Any, tuple[int, ...], tuple[int, ...]]:
        ins = tuple(self._index[n] for n in step.ins)
        outs = tuple(self._index[n] for n in step.outs)
        if step.kind == "kernel":
            prepared = self.device.prepare(step.target, [shapes[n] for n in step.ins],
                                           [shapes[n] for n in step.outs], step.params)
            return prepared.bind(), ins, outs
        fn = self.program.callables[step.target]
        device = self.device

        def run_callable(stream: Stream, ins: list[DeviceArray], outs: list[DeviceArray]) -> None:
            device.enqueue_callable(stream, fn, ins, outs)

        return run_callable, ins, outs

    def _gather_input(self, index: int, value: _Foreign, stream: Stream) -> DeviceArray:
        """Copy a device input in another layout into the input's slot, on ``stream``."""
        decl = self._input_decls[index]
        slot = self._slots[index]
        if slot is None:
            slot = self._slots[index] = self.device.empty(decl.shape, DTYPES[decl.dtype], stream,
                                                          self._uses)
        meta = self._metas.get(index)
        if meta is None or meta.shape != value.meta.shape:
            meta = self._metas[index] = self.device.empty(value.meta.shape, "int64", stream,
                                                          self._uses)
        self.device.copy_from_host(meta, value.meta, stream)
        value.gather.run(stream, (value.array, meta),
                         (slot.buffer.view(np.uint8, (slot.nbytes,), slot.offset),))
        return slot

    def _private_stream(self, index: int) -> Stream:
        """Test-only: the step's own stream, ordered with nothing (the bug rule 1 forbids)."""
        if not self._private_streams:
            self._private_streams = [self.device.create_stream() for _ in self._steps]
        return self._private_streams[index]

    def __repr__(self) -> str:
        state = ("outputs ready" if self._outputs is not None else
                 "inputs set" if self._inputs_valid else "no inputs")
        return f"<Method {self.name} on {self.device.name}, {state}>"


def _check_start(method: Method, start: object, what: str) -> None:
    if not isinstance(start, Event):
        raise InvalidArgument(f"{method.name}: {what}(start=) takes an Event of "
                              f"{method.device.name} or None, got {type(start).__name__}")


def _busy(method: Method, what: str) -> MethodBusy:
    """Refuse a second thread instead of running unordered (rule 4)."""
    return MethodBusy(
        f"{method.name}: {what}() called while the method is in use: by another thread, or by "
        f"a call of it this one comes from (an input's __array__ or a callable step calling "
        f"back into it); drive one method from one thread at a time (hold a lock around "
        f"set_inputs/execute/get_outputs, or give each thread its own method)")


def _contiguous_strides(shape: tuple[int, ...], dtype: np.dtype) -> tuple[int, ...]:
    strides, acc = [], dtype.itemsize
    for d in reversed(shape):
        strides.append(acc)
        acc *= d
    return tuple(reversed(strides))


def _types(given: Any) -> tuple[type, ...]:
    """``check_inputs``' ``unchecked=``, checked: a tuple (or another iterable) of types."""
    try:
        types = tuple(given)
    except TypeError:
        types = (given,)
    if not all(isinstance(t, type) for t in types):
        raise InvalidArgument(f"check_inputs(unchecked=...) takes a type or a tuple of types, "
                              f"got {shown(given)}")
    return types


def _convert_scalar(value: Any, kind: str, want: np.dtype) -> tuple[np.ndarray | None, str]:
    """A number as a 0-d array of ``want`` (of kind ``kind``), or None and the range it missed.

    Checked on the value, not left to numpy's casts: those wrap numpy integers around
    (np.int64(2**31) as int32 is -2**31) and overflow finite floats to inf."""
    if kind in "iu":
        info = np.iinfo(want)
        if not info.min <= int(value) <= info.max:
            return None, f"in {info.min}..{info.max}"
        return np.asarray(int(value), dtype=want), ""
    if kind == "b":
        return np.asarray(bool(value), dtype=want), ""
    try:
        number = float(value)  # a long double beyond float64 becomes inf here: not finite
        finite = bool(np.isfinite(value)) if isinstance(value, np.floating) else \
            math.isfinite(number)
    except OverflowError:  # an int beyond any float
        number = None
    with np.errstate(over="ignore"):
        array = np.asarray(number if number is not None else 0.0, dtype=want)
    if number is None or finite != bool(np.isfinite(array)):
        return None, "within its range (finite numbers stay finite)"
    return array, ""


def _check_options(options: dict[str, Any], name: str) -> dict[str, Any]:
    out = dict(OPTIONS)
    for key, value in options.items():
        if key not in OPTIONS:
            raise InvalidArgument(f"{name}: unknown option {key!r}; options: "
                                  f"{', '.join(OPTIONS)}")
        if not isinstance(value, bool):
            raise InvalidArgument(f"{name}: option {key!r} must be a Python bool (True or "
                                  f"False), got {type(value).__module__}.{type(value).__name__} "
                                  f"{shown(value)}; pass bool(value)")
        out[key] = value
    if out["use_shared_stream"]:
        raise NotSupported(
            f"{name}: use_shared_stream=True is not supported: every execute runs on the calling "
            f"thread's stream, so a shared stream would not order work across threads. Run "
            f"dependent programs on one lane (thread), pass a caller stream with "
            f"CallerStream(stream), or order them with Scheduler.submit(..., after=[job])")
    return out

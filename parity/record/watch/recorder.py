"""Recording the calls of watched functions: what a wrapper does around each call.

Before the call: the arguments are bound by name, the target's reverse adapter maps them to an op's
inputs (``adapters``), the budget decides whether this call's tensors are kept, and a kept call's
inputs are copied to the host (a kernel may write its inputs: the state pool of a decode step).
Then the function runs on the caller's own arguments, untouched; its result is returned as it is.
After: a kept call's outputs are copied. Nothing the recorder does changes what the engine computes.

Nothing in a call waits for the device: a CUDA tensor is copied into pinned host memory
asynchronously on its own stream (ordered before the kernel for an input, after it for an output),
and an event recorded after the copies is waited on only when the part that holds them is written,
by the flusher thread (or, past ``BACKLOG_BYTES`` held, by the engine's thread). Shapes, dtypes and
the budget are host metadata: a call whose tensors are not kept costs no device work at all.

Budget (``max_bytes``, per process): a call's tensors are kept while the kept bytes stay under it,
sampled more sparsely as they fill it (every call until half of it, then every second call of the
op, every fourth past three quarters, ...), so later steps are kept too; the first call of each op
and each call larger than any before it of that op are kept whatever the budget (the file says so).
``max_bytes=0`` keeps shapes only. A call not kept is still listed with its shapes and the reason.

Steps: a step is one pass of the engine over its layers. Two successive calls of one pass come from
frames that part a few frames above the call (the next layer's forward); the first pair of calls
sets that height, and a call whose stack parts from the previous call's higher up starts a new step
(a new forward pass). An engine whose first two watched calls are already two passes (one watched
layer) cannot be told this way: ``next_step()`` marks a step explicitly.
"""
from __future__ import annotations

import inspect
import os
import sys
import threading
import time
import traceback
from collections import defaultdict
from dataclasses import dataclass, field

import torch

from . import adapters, callfile, uncalled

FLUSH_BYTES = 64 << 20       # kept bytes held in memory before the flusher is woken
BACKLOG_BYTES = 8 * FLUSH_BYTES   # held past this (the flusher behind): the engine's thread writes
FLUSH_SECONDS = 2.0          # at most this long between a call and the part that holds it


def parse_bytes(text) -> int:
    """``"2G"``, ``"512M"``, ``"64k"``, ``"0"`` -> bytes (powers of 1024); ValueError otherwise."""
    s = str(text).strip()
    units = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    num, unit = s.rstrip("kKmMgGtTbB"), s[len(s.rstrip("kKmMgGtTbB")):].upper().rstrip("B") or ""
    if unit.endswith("I"):
        unit = unit[:-1]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"{text!r}: expected a size such as 0, 512M or 2G") from None
    if unit not in units or value < 0 or value != value:
        raise ValueError(f"{text!r}: expected a size such as 0, 512M or 2G")
    return int(value * units[unit])


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


class Budget:
    """Which calls keep their tensors (module docstring)."""

    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.kept = 0
        self.calls = defaultdict(int)
        self.largest = {}

    def decide(self, op: str, nbytes: int) -> str | None:
        """None: keep; else the reason the call is not kept."""
        n = self.calls[op]
        self.calls[op] += 1
        if self.max_bytes == 0:
            return "shapes only (max bytes 0)"
        first = n == 0
        largest = nbytes > self.largest.get(op, -1)
        if largest:
            self.largest[op] = nbytes
        if not (first or largest):
            if self.kept + nbytes > self.max_bytes:
                return "over the byte budget"
            level = 0
            while self.kept > self.max_bytes * (1 - 2.0 ** -(level + 1)) and level < 60:
                level += 1
            if n % (1 << level):
                return f"sampled (1 call in {1 << level})"
        self.kept += nbytes
        return None


@dataclass
class Target:
    """One watched function: ``name`` (what the user called it: an op or family), ``spec``
    (``module:function``), the original function, its signature and reverse adapter."""

    name: str
    spec: str
    fn: object
    signature: inspect.Signature
    reverse: object
    known: str


@dataclass
class Pending:
    entry: dict
    mapping: adapters.Mapping | None
    arguments: dict | None
    tensors: dict = field(default_factory=dict)
    t0: float = 0.0
    devices: set = field(default_factory=set)     # CUDA devices whose copies are still in flight


def host_copy(t: torch.Tensor, devices: set) -> torch.Tensor:
    """A host copy of ``t`` that the caller may not read before the device's current stream has
    passed this point: a CUDA tensor is copied asynchronously into pinned memory (torch pins the
    host side of a non-blocking device-to-host copy) and its device is added to ``devices``; any
    other tensor is copied at once."""
    t = t.detach()
    if t.is_cuda:
        devices.add(t.device)
        return t.to("cpu", non_blocking=True)
    return t.to("cpu", copy=True)


def copies_done(devices) -> list:
    """An event per device in ``devices``, recorded on its current stream after the copies queued
    there (waited on when the copies are written)."""
    events = []
    for d in devices:
        ev = torch.cuda.Event(blocking=True)
        ev.record(torch.cuda.current_stream(d))
        events.append(ev)
    return events


class Recorder:
    """The calls of one process (module docstring); flushed as parts of ``out``."""

    def __init__(self, out, *, max_bytes: int, run: dict, quiet: bool = False):
        self.out = out
        self.budget = Budget(max_bytes)
        self.run = dict(run, max_bytes=max_bytes)
        self.pid = os.getpid()
        self.index = 0
        self.step = 0
        self._stack: list = []         # the previous call's frames, outermost first
        self._highest = -1             # how far above the call two calls of one step part
        self._entries: list = []
        self._tensors: dict = {}
        self._events: list = []        # CUDA events after the held tensors' copies
        self._bytes = 0
        self._seq = 0
        self.called: dict = defaultdict(int)    # target spec -> calls made in this process
        self.never_called: dict = {}   # target spec -> why it was never called (set by close)
        self._lock = threading.RLock()
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._flusher = None
        self._flush_failed = False
        self._start_flusher()
        self._warned: set = set()
        self.quiet = quiet
        self.closed = False
        self.spent = 0.0               # seconds the engine's threads spent in the recorder (bench_watch)

    # -- steps ---------------------------------------------------------------------------------
    def next_step(self) -> None:
        with self._lock:
            self.step += 1
            self._stack = []

    def _advance(self, frame) -> None:
        stack = []
        while frame is not None:
            stack.append(frame)
            frame = frame.f_back
        stack.reverse()
        prev = self._stack
        d = 0
        while d < len(stack) and d < len(prev) and stack[d] is prev[d]:
            d += 1
        if prev:
            # how far above the call the two stacks part: the next layer of one pass parts lower
            # than the next pass does (measured from the call, as a prefill and a decode step may
            # enter the model through stacks of different depths)
            height = len(stack) - d
            if height > self._highest:
                if self._highest >= 0:
                    self.step += 1
                else:
                    self._highest = height
        # the frames are kept until the next call (so that a dead frame's id is never taken for a
        # live one's); the last call's frames are released when the watch ends
        self._stack = stack

    # -- one call ------------------------------------------------------------------------------
    def before(self, target: Target, args, kwargs) -> Pending:
        t_in = time.perf_counter()
        try:
            return self._before(target, args, kwargs)
        finally:
            self.spent += time.perf_counter() - t_in

    def _before(self, target: Target, args, kwargs) -> Pending:
        frame = sys._getframe(3)     # the caller of the wrapper
        with self._lock:
            self._advance(frame)
            index = self.index
            self.index += 1
            step = self.step
            self.called[target.spec] += 1
        code = frame.f_code
        entry = {"id": f"p{self.pid}c{index}", "pid": self.pid, "index": index, "step": step,
                 "watched": target.name, "target": target.spec, "adapter_of": target.known,
                 "call_site": f"{code.co_filename}:{frame.f_lineno} ({getattr(code, 'co_qualname', code.co_name)})",
                 "op": None, "error": None, "device": None, "kept": False, "dropped": None, "contract": None, "note": "",
                 "kwargs": {}, "inputs": {}, "outputs": {}, "seconds": 0.0}
        try:
            bound = target.signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            for name, p in target.signature.parameters.items():
                if p.kind is p.VAR_KEYWORD:
                    arguments.update(arguments.pop(name, {}) or {})
            mapping = target.reverse(arguments)
        except adapters.Mismatch as exc:
            return self._unmapped(entry, target, str(exc))
        except TypeError as exc:
            return self._unmapped(entry, target, f"the call does not bind to {target.spec}{target.signature}: {exc}")
        except Exception as exc:  # an adapter that fails must not stop the engine: recorded, one line
            return self._unmapped(entry, target, f"adapter error: {type(exc).__name__}: {exc}")
        first = next((t for t in mapping.inputs.values() if isinstance(t, torch.Tensor)), None)
        entry["device"] = None if first is None else first.device.type
        entry.update(op=mapping.op, contract=mapping.contract, note=mapping.note,
                     kwargs={k: v for k, v in mapping.kwargs.items()},
                     inputs={n: _spec(t) for n, t in mapping.inputs.items()})
        nbytes = _nbytes(mapping.inputs.values())
        with self._lock:
            why = self.budget.decide(mapping.op, 2 * nbytes)   # outputs about as large as the inputs
        pend = Pending(entry, mapping, arguments)
        if why is None:
            entry["kept"] = True
            for n, t in mapping.inputs.items():
                if isinstance(t, torch.Tensor):
                    pend.tensors[f"{entry['id']}.in.{n}"] = host_copy(t, pend.devices)
        else:
            entry["dropped"] = why
        pend.t0 = time.perf_counter()
        return pend

    def _unmapped(self, entry, target, why: str) -> Pending:
        entry["error"] = why
        entry["dropped"] = "no op maps this call"
        key = (target.spec, why)
        if key not in self._warned and not self.quiet:
            self._warned.add(key)
            print(f"parity watch: {target.spec} at {entry['call_site']}: {why}", file=sys.stderr)
        return Pending(entry, None, None)

    def after(self, pend: Pending, result) -> None:
        t_in = time.perf_counter()
        try:
            self._after(pend, result)
        finally:
            self.spent += time.perf_counter() - t_in

    def _after(self, pend: Pending, result) -> None:
        entry = pend.entry
        entry["seconds"] = round(time.perf_counter() - pend.t0, 6) if pend.t0 else 0.0
        if pend.mapping is not None:
            try:
                outs = pend.mapping.outputs(result, pend.arguments)
            except Exception as exc:
                entry["error"] = f"adapter error reading the outputs: {type(exc).__name__}: {exc}"
                entry["kept"], entry["dropped"] = False, "no op maps this call"
                pend.tensors.clear()
                outs = {}
            entry["outputs"] = {n: _spec(t) for n, t in outs.items()}
            if entry["kept"]:
                for n, t in outs.items():
                    pend.tensors[f"{entry['id']}.out.{n}"] = host_copy(t, pend.devices)
        events = copies_done(pend.devices) if pend.devices else []
        with self._lock:
            self._entries.append(entry)
            self._tensors.update(pend.tensors)
            self._events += events
            self._bytes += _nbytes(pend.tensors.values())
            held = self._bytes
        if held >= BACKLOG_BYTES:    # the flusher is behind: bound the host memory held
            self.flush()
        elif held >= FLUSH_BYTES:
            self._wake.set()

    # -- writing -------------------------------------------------------------------------------
    def _start_flusher(self) -> None:
        """A daemon thread writes the pending calls every FLUSH_SECONDS, off the engine's thread
        (a part is written whole and synced to disk: milliseconds the engine need not wait)."""
        self._flusher = threading.Thread(target=self._flush_every, name="parity-watch-flush", daemon=True)
        self._flusher.start()

    def _flush_every(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(FLUSH_SECONDS)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.flush()
            except Exception:  # a full disk: said once, the engine goes on
                if not self._flush_failed:
                    self._flush_failed = True
                    traceback.print_exc()

    def _take(self) -> tuple[list, dict]:
        """The calls held so far and their tensors, their copies complete (waits for the device
        here, off the engine's thread unless the engine flushes)."""
        with self._lock:
            entries, tensors, events = self._entries, self._tensors, self._events
            self._entries, self._tensors, self._events, self._bytes = [], {}, [], 0
        for ev in events:
            ev.synchronize()
        return entries, tensors

    def flush(self, *, last: bool = False) -> None:
        """Write the calls held so far as the next part (parts are written in order); ``last``:
        the process's final part, written with the targets never called even without calls."""
        with self._write_lock:
            entries, tensors = self._take()
            if not entries and not (last and self.never_called):
                return
            seq, self._seq = self._seq, self._seq + 1
            callfile.write_part(self.out, self.pid, seq, self.run, entries, tensors,
                                never_called=self.never_called if last else None)

    def _finish(self) -> bool:
        """Stop recording; False when closed already. Names the targets this process never called
        (while they are still wrapped: ``uncalled``)."""
        with self._lock:
            if self.closed:
                return False
            self.closed = True
        self._stop.set()
        self._wake.set()
        try:
            self.never_called = uncalled.reasons(self.run.get("targets") or {}, self.called)
        except Exception as exc:  # naming them is a courtesy: never mask the calls themselves
            self.never_called = {}
            print(f"parity watch: cannot tell why a target was never called: {type(exc).__name__}: {exc}",
                  file=sys.stderr)
        self._stack = []
        return True

    def close(self) -> None:
        """Stop recording and write what is held as this process's last part (``parity watch``:
        the command merges the parts when the program ends)."""
        if not self._finish():
            return
        try:
            self.flush(last=True)
        except Exception:  # at exit: say it, never mask the program's own exit
            traceback.print_exc()

    def never_called_report(self) -> list:
        """``[{"watched", "target", "why"}]``: the targets this process never called (after close)."""
        targets = self.run.get("targets") or {}
        return [{"watched": name, "target": spec, "why": self.never_called[spec]}
                for name, spec in targets.items() if spec in self.never_called]

    def close_into_file(self):
        """Stop recording and write the calls file ``out`` whole (``parity.watch``): the parts
        flushed while the block ran and the calls still held, in one write."""
        if not self._finish():
            return None
        with self._write_lock:
            entries, tensors = self._take()
            return callfile.merge(self.out, run=self.run, empty=True,
                                  held=callfile.Held(self.pid, entries, tensors, self.never_called))


def _spec(t) -> dict | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor, got {type(t).__name__}")
    return {"dtype": callfile.dtype_name(t), "shape": list(t.shape)}

"""Where certify calls user code: in this process (parity.certify.check.InProcess), or in a worker process
(:class:`Worker`, the multiprocessing ``spawn`` context) that owns the device, so that a candidate
that kills its process (``os._exit``, a segfault) or poisons its CUDA context (a misaligned or
illegal address) fails only the call that did it.

The parent draws the inputs (hypothesis), rounds them and runs the float64 reference on the CPU,
and judges what comes back; a worker receives the rounded input tensors, moves them to its device,
runs the calls of one input (the candidate, its repeat, its mutants: :class:`parity.certify.check.Call`)
and sends each result back, outputs on the CPU. A worker whose call faulted reports the fault and
exits; its :class:`Worker` starts a fresh process for the remaining calls and the next input.
Messages are pickled with the standard pickler (tensors travel by value, no shared memory).

Workers are pinned one device each: ``CUDA_VISIBLE_DEVICES`` names one of the devices visible to
the parent (an outer ``CUDA_VISIBLE_DEVICES`` respected), so ``cuda`` in a worker is its own GPU.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import signal
import threading
from dataclasses import replace

import torch

import optimized

from .. import ops
from . import candidate
from .check import CANDIDATE, CallResult, InProcess, Job, first_line, raise_out_of_memory, run_call

_START = threading.Lock()   # os.environ is process-wide: one worker starts at a time
CALL_TIMEOUT = 600.0        # seconds one call may take (the interpreter's largest take tens)
START_TIMEOUT = 600.0       # seconds a worker may take to import torch and kimi-parity
READY = b"ready"


def visible_devices() -> list[str]:
    """The CUDA devices this process may use: an outer ``CUDA_VISIBLE_DEVICES`` (its entries, as
    given), else every device torch counts; empty without CUDA."""
    outer = os.environ.get("CUDA_VISIBLE_DEVICES")
    if outer is not None:
        return [d.strip() for d in outer.split(",") if d.strip() and d.strip() != "-1"]
    return [str(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


class Worker:
    """One worker process on ``device`` (``cuda``: pinned to ``gpu``, one entry of
    :func:`visible_devices`), started on first use and again after a fault. ``faults``: how many
    times its process died; ``timeout``: seconds a call may take before it is a fault (the process
    killed: a kernel that hangs)."""

    isolated = True

    def __init__(self, device: str, gpu: str | None = None, timeout: float = CALL_TIMEOUT):
        self.device = device
        self.timeout = timeout
        self.prep_device = "cpu"   # the parent never touches the GPU: inputs are prepared on the CPU
        self.gpu = gpu
        self.faults = 0
        self._proc = self._conn = None

    def run(self, record, cand, job: Job, ref=None) -> list:
        """Results of ``job.calls`` in order. A call that kills the process (or its CUDA context) is
        a ``fault`` result; the calls after it run in a fresh process, except after the candidate's
        own call (the calls after it are about an input it cannot take)."""
        blob = portable(record, cand)
        pending, results = list(job.calls), []
        while pending:
            self._start()
            try:
                self._conn.send_bytes(pickle.dumps((replace(job, calls=pending), blob, self.device)))
                while pending:
                    if not self._conn.poll(self.timeout):   # a hung kernel: the call is a fault
                        self._proc.kill()
                        self._reap()
                        results.append(CallResult(pending.pop(0), fault=f"the call did not return within "
                                                  f"{self.timeout:g} s (the worker was killed)"))
                        break
                    res = pickle.loads(self._conn.recv_bytes())
                    results.append(res)
                    pending.pop(0)
                    if res.fault:
                        self._reap()
                        break
            except (EOFError, OSError):   # the process died inside pending[0]
                results.append(CallResult(pending.pop(0), fault=self._reap()))
            if results and results[-1].fault and results[-1].call.kind == CANDIDATE:
                break
        return raise_out_of_memory(results)

    def _start(self) -> None:
        if self._proc is not None:
            return
        ctx = multiprocessing.get_context("spawn")   # never fork: the parent may hold CUDA state
        parent, child = ctx.Pipe()
        with _START:
            old = os.environ.get("CUDA_VISIBLE_DEVICES")
            if self.gpu is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.gpu
            try:
                proc = ctx.Process(target=_main, args=(child,), daemon=True, name="parity-worker")
                proc.start()
            finally:
                if self.gpu is not None:
                    if old is None:
                        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
                    else:
                        os.environ["CUDA_VISIBLE_DEVICES"] = old
        child.close()
        self._proc, self._conn = proc, parent
        try:   # imports done: the call timeout starts with the first call
            ready = parent.poll(START_TIMEOUT) and parent.recv_bytes() == READY
        except (EOFError, OSError):
            ready = False
        if not ready:
            why = self._reap()
            raise RuntimeError(f"a certify worker process did not start ({why})")

    def _reap(self) -> str:
        """Wait for the dead (or dying) process; how it ended, in words."""
        proc, self._proc = self._proc, None
        self._conn.close()
        proc.join(timeout=60)
        if proc.is_alive():
            proc.kill()
            proc.join()
        self.faults += 1
        code = proc.exitcode
        if code is not None and code < 0:
            return f"the worker process was killed by {signal.Signals(-code).name}"
        if code == FAULT_EXIT:
            return "the worker process exited after a CUDA fault"
        return f"the worker process exited with status {code}"

    def close(self) -> None:
        if self._proc is None:
            return
        try:
            self._conn.send_bytes(pickle.dumps(None))
        except OSError:
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
        self._conn.close()
        self._proc = None


FAULT_EXIT = 70


def portable(record, cand) -> bytes:
    """The candidate as a worker rebuilds it: the repository's named candidates by name, one
    loaded from a ``module:function`` or ``file.py:function`` spec by its spec, any other by
    pickling its callable (a module-level function). ValueError for one that cannot travel."""
    if not cand.outside and cand.name in ("optimized", "reference-f32"):
        what = ("named", cand.name, cand.contract)
    elif cand.spec is not None:
        what = ("spec", cand.spec, cand.contract)
    else:
        what = ("pickled", replace(cand), None)
    try:
        return pickle.dumps(what)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise ValueError(f"{cand.name}: a worker process cannot rebuild this candidate ({exc}); "
                         "give a module-level function or a module:function spec") from None


def _rebuild(op: str, blob: bytes):
    record = ops.get(op)
    kind, what, contract = pickle.loads(blob)
    if kind == "named":
        cand = candidate.named(record, what, contract)
    elif kind == "spec":
        cand = replace(candidate.of(candidate.load(what), contract=contract), spec=what)
    else:
        cand = what
    return record, cand, cand.normalized(record)


def _main(conn) -> None:
    """A worker: receive jobs, run their calls, send each result (outputs moved to the CPU); after a
    fault, report it and exit."""
    conn.send_bytes(READY)
    built: dict = {}
    while True:
        try:
            msg = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        if msg is None:
            return
        job, blob, device = msg
        optimized.use(device)   # this process's entry point: the kernels' backend, as the parent chose it
        if device == "cpu":
            torch.set_num_threads(1)   # tiny shapes on a shared machine, as certify.cpu_threads
        key = (job.op, blob)
        if key not in built:
            try:
                built[key] = _rebuild(job.op, blob)
            except Exception as exc:  # the user's module failed to import here: every call says why
                why = f"the worker could not load the candidate: {first_line(exc)}"
                for call in job.calls:
                    conn.send_bytes(pickle.dumps(CallResult(call, error=why)))
                continue
        record, cand, fn = built[key]
        inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in job.inputs.items()}
        aux = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in job.aux.items()}
        for call in job.calls:
            res = run_call(record, fn, call, inputs, job.kwargs, aux, counter=cand.counter, device=device)
            # after a fault the outputs cannot be read (the context is gone): only the error travels
            res.outputs = None if res.fault else _to_cpu(res.outputs)
            conn.send_bytes(pickle.dumps(res))
            if res.fault:
                conn.close()
                os._exit(FAULT_EXIT)


def _to_cpu(outputs):
    if not isinstance(outputs, dict):
        return outputs
    return {k: (v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in outputs.items()}

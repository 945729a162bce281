"""Running one op on one input: round the inputs to the candidate's dtype, evaluate the float64
reference on the SAME rounded values, call a candidate (:func:`run_call`: the only place user code
runs, in this process or in a worker of parity.certify.pool), and judge every output against the bound.

This is the one place where dtype and device conversion happens (the parity boundary).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from optimized import _counters

from .. import metrics
from ..bounds.core import dtype_name, precision_for
from ..emulate import torch_dtype
from ..errors import OutOfMemory, Unsupported, is_out_of_memory, memory_line
from ..platform import default_device
from ..registry import Case, Mutant, OpRecord, OutputsError


def strength_of(dtype: str) -> str:
    """lifted for float32/float64 runs, production for bfloat16/float16 runs."""
    return "production" if dtype_name(dtype) in ("bfloat16", "float16") else "lifted"


def _policy_dtype(policy: str, dtype: str) -> str:
    if policy == "fp32" and dtype in ("bfloat16", "float16"):
        return "float32"
    return dtype


def _to_torch(arr, policy, dtype, device):
    if arr is None:
        return None, None
    if isinstance(arr, (int, float)):
        return arr, arr
    arr = np.asarray(arr)
    if policy == "int" or arr.dtype.kind in "iub":
        t = torch.from_numpy(np.ascontiguousarray(arr)).to(device)
        return t, arr
    t = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float64)).to(
        device=device, dtype=torch_dtype(_policy_dtype(policy, dtype)))
    return t, t.detach().to("cpu", torch.float64).numpy()


@dataclass
class Prepared:
    """A case at one dtype: the candidate's tensors, the float64 values the reference saw, and the
    reference outputs on them. ``aux``: the case's arrays the op does not take (for mutants)."""

    record: OpRecord
    case: Case
    dtype: str
    device: str
    tensors: dict
    f64: dict
    ref: dict
    contract: str = "ieee"        # the arithmetic the candidate claims (parity.bounds.core.CONTRACTS)
    aux: dict = field(default_factory=dict)
    _bounds: dict = field(default_factory=dict)

    def inputs(self) -> dict:
        """Fresh copies of the input tensors (a candidate may write its inputs)."""
        return fresh(self.tensors)

    def bound(self, out_dtypes: dict, contract: str | None = None) -> dict:
        """Per-output bounds for outputs of ``out_dtypes`` under ``contract`` (default: the claimed one)."""
        contract = contract or self.contract
        key = (contract, *sorted(out_dtypes.items()))
        if key not in self._bounds:
            p = precision_for(self.dtype, out_dtypes, contract=contract)
            b = self.record.bound(self.f64, self.case.kwargs, self.ref, p)
            for name in self.record.exact:
                b[name] = np.zeros(np.shape(self.ref[name]))
            self._bounds[key] = b
        return self._bounds[key]


def fresh(tensors: dict) -> dict:
    """Copies of ``tensors`` (values without ``clone`` as they are)."""
    return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in tensors.items()}


def _rounded(record: OpRecord, arrays: dict, dtype: str, device: str):
    tensors, f64 = {}, {}
    for name, arr in arrays.items():
        tensors[name], f64[name] = _to_torch(arr, record.policy.get(name, "io"), dtype, device)
    return tensors, f64


def tensors(record: OpRecord, case: Case, dtype: str, device: str | None = None) -> dict:
    """The case's arrays as the tensors a candidate at ``dtype`` gets (rounded by the record's
    input policy), without running the reference: for kernel tests that call the op themselves."""
    return _rounded(record, case.arrays, dtype_name(dtype), default_device(device))[0]


def prepare(record: OpRecord, case: Case, dtype: str, device: str | None = None, *,
            contract: str = "ieee") -> Prepared:
    """The case's inputs rounded to ``dtype`` on ``device`` (None: cuda if available, else cpu), and
    the float64 reference of the rounded values; bounds under ``contract``. The rounding is IEEE
    round to nearest (torch's conversion, on any device)."""
    dtype = dtype_name(dtype)
    device = default_device(device)
    cand_inputs, f64 = _rounded(record, case.arrays, dtype, device)
    aux, _ = _rounded(record, case.aux, dtype, device)
    ref = {k: np.asarray(v) for k, v in record.call(record.reference, f64, case.kwargs).items()}
    return Prepared(record, case, dtype, device, cand_inputs, f64, ref, contract, aux)


@dataclass
class Judgement:
    """The verdict of one candidate on one prepared case."""

    passed: bool
    ratio: float                              # worst error in bound units over all outputs
    outputs: dict = field(default_factory=dict)   # name -> metrics.Comparison
    values: dict = field(default_factory=dict)    # name -> what the candidate returned
    error: str | None = None                  # the candidate raised
    seconds: float = 0.0
    kernel_ran: bool | None = None
    witness: str | None = None                # an outside candidate: why its outputs are not its own

    def report(self) -> str:
        if self.error:
            return f"candidate raised: {self.error}"
        return "\n".join(c.report() for c in self.outputs.values())


# -- calling user code -------------------------------------------------------------------------------
CANDIDATE, REPEAT, BATCH, MUTANT = "candidate", "repeat", "batch", "mutant"


@dataclass(frozen=True)
class Call:
    """One call of user code on a prepared input: the candidate, the candidate again (bytes:
    run-to-run), the candidate on the first half of the batch (bytes: batch composition), or a
    mutant built around it (``name``)."""

    kind: str
    name: str = ""


@dataclass
class CallResult:
    """What one :class:`Call` gave: its outputs, or the one-line error it raised, or the fault that
    killed its process or CUDA context (parity.certify.pool), or the adapter's refusal of the input."""

    call: Call
    outputs: dict | None = None
    error: str | None = None         # the call raised: type and first line
    fault: str | None = None         # the call killed its process or its CUDA context
    unsupported: str | None = None   # an adapter refused the input (parity.errors.Unsupported)
    seconds: float = 0.0
    launched: bool | None = None     # a counted candidate: its launch counter moved
    called: bool | None = None       # a witnessed candidate: the user's callable was called
    aliased: str | None = None       # a witnessed candidate: an output is memory it did not own
    outputs_error: bool = False      # it returned another number of outputs (registry.OutputsError)
    out_of_memory: str | None = None  # the call ran out of memory: no finding, the run cannot go on


def raise_out_of_memory(results: list) -> list:
    """``results``, unless a call ran out of memory: then ``OutOfMemory`` with its line (the CLI's
    exit 2; a candidate that cannot get memory for a small input is not judged, nor is the run)."""
    for res in results:
        if res.out_of_memory is not None:
            raise OutOfMemory(res.out_of_memory)
    return results


def first_line(exc: BaseException) -> str:
    """``Type: first line`` (CUDA errors append paragraphs of advice: the first line says it)."""
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0] if msg else ''}"


def context_fault(device) -> str | None:
    """Why ``device``'s CUDA context is unusable (a kernel faulted: every later CUDA call in the
    process fails), or None."""
    if not str(device).startswith("cuda"):
        return None
    try:
        torch.cuda.synchronize()
    except RuntimeError as exc:   # torch.AcceleratorError
        return first_line(exc)
    return None


def half_batch(record: OpRecord, inputs: dict):
    """(the inputs' first half along the record's batch axes, half, whole) when the record declares
    independent rows and the batch has at least two (and no ``cu_seqlens``); else None."""
    spec = record.batch
    if not spec or inputs.get("cu_seqlens") is not None:
        return None
    axes = spec["inputs"]
    n = next((inputs[k].shape[a] for k, a in axes.items() if inputs.get(k) is not None), None)
    if n is None or n < 2:
        return None
    m = n // 2
    sub = dict(inputs)
    for k, a in axes.items():
        if sub.get(k) is not None:
            sub[k] = sub[k].narrow(a, 0, m).contiguous()
    return sub, m, n


def run_call(record: OpRecord, fn, call: Call, inputs: dict, kwargs: dict, aux: dict | None = None, *,
             counter: str | None = None, ref: dict | None = None, device: str = "cpu") -> CallResult:
    """Call user code once: ``fn`` (a normalized candidate ``fn(inputs, kwargs) -> {output: tensor}``)
    or the mutant ``call.name`` built around it, on fresh copies of ``inputs``. Exceptions are
    caught here and only here: an exception raised by the call fails the check, with its first line;
    one that leaves ``device``'s CUDA context unusable is a ``fault``. ``counter``: the launch counter
    that must move (this repository's kernels); a witnessed candidate (``calls``) is checked for
    having been called and for outputs that alias its inputs (or ``ref``'s arrays)."""
    inp = fresh(inputs)
    if call.kind == BATCH:
        inp = half_batch(record, inp)[0]
    if counter is not None:
        before = _counters.launches[counter]
    calls = getattr(fn, "calls", None)
    kw = dict(kwargs)
    poison_free_memory(device)   # an output it never writes reads as NaN, never as our own last result
    t0 = time.perf_counter()
    try:
        if call.kind == MUTANT:
            out = _mutant(record, call.name).run(fn, record, inp, kw, aux or {})
        else:
            out = fn(inp, kw)
        fault = context_fault(device)   # an asynchronous fault surfaces here, inside the call
    except Unsupported as exc:   # an input the implementation does not take: skipped, counted
        if call.kind == CANDIDATE:
            return CallResult(call, unsupported=str(exc), seconds=time.perf_counter() - t0)
        return CallResult(call, error=first_line(exc), seconds=time.perf_counter() - t0)
    except OutputsError as exc:  # the candidate's result is not the record's outputs
        return CallResult(call, error=first_line(exc), outputs_error=True, seconds=time.perf_counter() - t0)
    except Exception as exc:  # user code raised (or a mutant around it): the check fails, with why
        if is_out_of_memory(exc):  # not a finding: the machine, not the candidate
            return CallResult(call, error=first_line(exc), seconds=time.perf_counter() - t0,
                              out_of_memory=f"{record.name}: {memory_line(exc, gpu=str(device))}")
        return CallResult(call, error=first_line(exc), fault=context_fault(device),
                          seconds=time.perf_counter() - t0)
    res = CallResult(call, out, seconds=time.perf_counter() - t0, fault=fault)
    if counter is not None and call.kind != MUTANT:
        res.launched = _counters.launches[counter] > before
    elif calls is not None and call.kind != MUTANT:
        res.called = fn.calls > calls
        res.aliased = aliased(record, inp, out, ref)
    return res


@dataclass
class Job:
    """The calls of one input: the op, the rounded input tensors, the scalar keyword arguments, the
    case's aux arrays (for mutants) and the calls in order."""

    op: str
    inputs: dict
    kwargs: dict
    aux: dict
    calls: list


class InProcess:
    """Calls user code in this process: cheap, but a candidate that kills its process kills certify,
    and a CUDA fault poisons every later CUDA call here."""

    isolated = False

    def __init__(self, device: str):
        self.device = device
        self.prep_device = device
        self._fns: dict = {}

    def run(self, record, cand, job: Job, ref=None) -> list:
        fn = self._normalized(record, cand)
        return raise_out_of_memory([run_call(record, fn, c, job.inputs, job.kwargs, job.aux, counter=cand.counter,
                                             ref=ref, device=self.device) for c in job.calls])

    def _normalized(self, record, cand):
        key = (record.name, id(cand))
        if key not in self._fns:   # one normalized candidate per op: a witnessed one counts its calls
            self._fns[key] = (cand, cand.normalized(record))
        return self._fns[key][1]

    def close(self) -> None:
        pass


def _mutant(record: OpRecord, name: str) -> Mutant:
    return next(m for m in record.mutants if m.name == name)


def poison_free_memory(device) -> None:
    """Fill every block that the CUDA caching allocator holds free on ``device`` with 0xFF bytes (NaN
    in every float format, -1 in every signed integer) before a candidate runs.

    Why: an output the candidate never writes (``torch.empty`` on a path that forgets it) is whatever
    the allocator hands back, and that is the most recently freed block of its size: on CUDA, the
    outputs certify itself just computed on the same input (a mutant, the stand-in, the previous
    call). Such an output would pass as correct, or be named as the mutant it copies. Poisoned, it
    reads NaN. Each free block is taken by allocations of exactly its size (best fit: that block; a
    small segment's free run in pieces of the small pool's largest request), filled, and given back.
    Nothing on the CPU (its allocator offers no such view)."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_initialized():
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    small = 1 << 20                       # the allocator's small-pool limit: larger requests go elsewhere
    sizes = []
    for seg in torch.cuda.memory_snapshot():
        if seg["device"] != index:
            continue
        for blk in seg["blocks"]:
            n = blk["size"]
            if blk["state"] != "inactive" or (seg["segment_type"] == "large" and n <= small):
                continue
            if seg["segment_type"] == "large":
                sizes.append(n)
            else:                         # a free run of a small segment: taken in pieces of at most 1 MiB
                sizes += [small] * (n // small) + ([n % small] if n % small else [])
    sizes.sort(reverse=True)
    held = [torch.empty(n, dtype=torch.uint8, device=dev) for n in sizes]
    for t in held:
        t.fill_(0xFF)
    del held


def _span(x):
    """(device, first byte, end) of the memory behind a tensor's storage or a NumPy array; None
    for anything else."""
    if isinstance(x, torch.Tensor):
        st = x.untyped_storage()
        return (str(x.device), st.data_ptr(), st.data_ptr() + st.nbytes())
    if isinstance(x, np.ndarray) and x.size:
        base = x.__array_interface__["data"][0]
        lo = base + sum(s * (n - 1) for s, n in zip(x.strides, x.shape) if s < 0)
        hi = base + sum(s * (n - 1) for s, n in zip(x.strides, x.shape) if s > 0) + x.itemsize
        return ("cpu", lo, hi)
    return None


def _overlap(a, b) -> bool:
    return a is not None and b is not None and a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


def aliased(record: OpRecord, inputs: dict, outputs, ref: dict | None = None) -> str | None:
    """Why ``outputs`` are not an implementation's own memory (None when they are): an output that
    is not a tensor, or shares memory with an input it was handed (an in-place record's output may
    be the buffer of the same name), with the reference's arrays ``ref`` or with another output."""
    if not isinstance(outputs, dict):
        return f"outputs are a {type(outputs).__name__}"
    spans = {}
    for name in record.outputs:
        t = outputs.get(name)
        if not isinstance(t, torch.Tensor):
            return f"output {name} is a {type(t).__name__}, not a tensor"
        spans[name] = _span(t)
    for name, s in spans.items():
        for k, x in inputs.items():
            if record.in_place and k == name:
                continue
            if _overlap(s, _span(x)):
                return f"output {name} is the memory of input {k}"
        for k, r in (ref or {}).items():
            if _overlap(s, _span(np.asarray(r))):
                return f"output {name} is the memory of the reference's {k}"
        for k, s2 in spans.items():
            if k != name and _overlap(s, s2):
                return f"outputs {name} and {k} share memory"
    return None


def dishonest(prepared: Prepared, outputs: dict) -> str | None:
    """Why ``outputs`` are not honest (None when they are): a float output non-finite where the
    reference is finite, or finite where it is not."""
    for name in prepared.record.outputs:
        t, ref = outputs[name], np.asarray(prepared.ref[name])
        if not t.is_floating_point() or tuple(t.shape) != ref.shape:
            continue  # integer outputs are compared exactly; shapes are the comparison's to refuse
        bad = ~torch.isfinite(t).cpu().numpy()
        if not np.array_equal(bad, ~np.isfinite(ref)):
            n = int(np.sum(bad & np.isfinite(ref)))
            return (f"output {name} is non-finite at {n} element(s) where the reference is finite" if n
                    else f"output {name} is finite where the reference is not")
    return None


def own_outputs(prepared: Prepared, inputs: dict, outputs: dict) -> str | None:
    """Why ``outputs`` are not an outside implementation's own work (None when they are):
    :func:`aliased` (against the inputs it was handed and the reference's arrays), then
    :func:`dishonest`."""
    return aliased(prepared.record, inputs, outputs, prepared.ref) or dishonest(prepared, outputs)


def witness(prepared: Prepared, res: CallResult) -> tuple[bool | None, str | None]:
    """(kernel_ran, why not) of a candidate's call: the launch counter moved (counted), or the
    user's callable was called and returned its own, honest outputs (witnessed); None for others."""
    if res.launched is not None:
        return res.launched, None
    if res.called is None:
        return None, None
    if not res.called:
        return False, "the implementation was not called"
    if res.outputs is None:
        return True, None
    why = res.aliased or dishonest(prepared, res.outputs)
    return why is None, why


def judge(prepared: Prepared, outputs: dict | None, *, error: str | None = None, seconds: float = 0.0,
          kernel_ran: bool | None = None, contract: str | None = None) -> Judgement:
    """Every output against its bound (under ``contract``, default the prepared one)."""
    if error is not None or outputs is None:
        return Judgement(False, float("inf"), error=error or "no outputs", seconds=seconds, kernel_ran=kernel_ran)
    rec = prepared.record
    missing = [n for n in rec.outputs if n not in outputs]
    if missing:
        return Judgement(False, float("inf"), error=f"missing outputs {missing}", seconds=seconds,
                         kernel_ran=kernel_ran)
    out_dtypes = {n: metrics.dtype_of(outputs[n]) for n in rec.outputs if metrics.dtype_of(outputs[n])}
    bounds = prepared.bound(out_dtypes, contract)
    comps = {}
    for n in rec.outputs:
        comps[n] = metrics.compare(n, prepared.ref[n], outputs[n], bounds[n])
    ratio = max((c.ratio for c in comps.values()), default=0.0)
    passed = all(c.passed for c in comps.values())
    return Judgement(passed, ratio, comps, dict(outputs), seconds=seconds, kernel_ran=kernel_ran)


def check(prepared: Prepared, cand, *, counter: str | None = None) -> Judgement:
    """Call the normalized candidate ``cand`` once on ``prepared`` (in this process) and judge it."""
    res = run_call(prepared.record, cand, Call(CANDIDATE), prepared.tensors, prepared.case.kwargs,
                   prepared.aux, counter=counter, ref=prepared.ref, device=prepared.device)
    raise_out_of_memory([res])
    if res.unsupported is not None:
        raise Unsupported(res.unsupported)
    ran, why = witness(prepared, res)
    j = judge(prepared, res.outputs, error=res.error, seconds=res.seconds, kernel_ran=ran)
    j.witness = why
    return j


# -- bytes ------------------------------------------------------------------------------------
def bitwise_equal(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))
    return bool(torch.equal(a, b))


def differing(record: OpRecord, a: dict, b: dict, axes: dict | None = None, m: int | None = None) -> list:
    """The outputs whose bytes differ between two runs (``axes``/``m``: ``a``'s first ``m`` rows
    along each output's batch axis against ``b`` whole)."""
    if axes is None:
        return [n for n in record.outputs if not bitwise_equal(a[n], b[n])]
    return [o for o, ax in axes.items() if not bitwise_equal(b[o], a[o].narrow(ax, 0, m).contiguous())]

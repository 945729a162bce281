"""Running one op on one input: round the inputs to the candidate's dtype, evaluate the float64
reference on the SAME rounded values, run a candidate, and judge every output against the bound.

This is the one place where dtype and device conversion happens (the parity boundary).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from . import metrics
from .bounds.core import dtype_name, precision_for
from .errors import Unsupported
from .platform import default_device
from .registry import Case, OpRecord

_TORCH = {}


def torch_dtype(name: str):
    import torch

    if not _TORCH:
        _TORCH.update({"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
                       "float64": torch.float64})
    return _TORCH[dtype_name(name)]


def strength_of(dtype: str) -> str:
    """lifted for float32/float64 runs, production for bfloat16/float16 runs."""
    return "production" if dtype_name(dtype) in ("bfloat16", "float16") else "lifted"


def _policy_dtype(policy: str, dtype: str) -> str:
    if policy == "fp32" and dtype in ("bfloat16", "float16"):
        return "float32"
    return dtype


def _to_torch(arr, policy, dtype, device):
    import torch

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
    reference outputs on them."""

    record: OpRecord
    case: Case
    dtype: str
    device: str
    tensors: dict
    f64: dict
    ref: dict
    rounding: str = "nearest"     # the platform's float32 -> dtype conversion (parity.platform)
    contract: str = "ieee"        # the arithmetic the candidate claims (parity.bounds.core.CONTRACTS)
    _bounds: dict = field(default_factory=dict)

    def inputs(self) -> dict:
        """Fresh copies of the input tensors (a candidate may write its inputs)."""
        return {k: (v.clone() if hasattr(v, "clone") else v) for k, v in self.tensors.items()}

    def bound(self, out_dtypes: dict, contract: str | None = None) -> dict:
        """Per-output bounds for outputs of ``out_dtypes`` under ``contract`` (default: the claimed one)."""
        contract = contract or self.contract
        key = (contract, *sorted(out_dtypes.items()))
        if key not in self._bounds:
            p = precision_for(self.dtype, out_dtypes, self.rounding, contract)
            inputs = {k: v for k, v in self.f64.items() if not k.startswith("_")}
            b = self.record.bound(inputs, self.case.kwargs, self.ref, p)
            for name in self.record.exact:
                b[name] = np.zeros(np.shape(self.ref[name]))
            self._bounds[key] = b
        return self._bounds[key]


def _rounded(record: OpRecord, case: Case, dtype: str, device: str):
    tensors, f64 = {}, {}
    for name, arr in case.arrays.items():
        tensors[name], f64[name] = _to_torch(arr, record.policy.get(name, "io"), dtype, device)
    for name, arr in case.aux.items():
        tensors["_" + name], f64["_" + name] = _to_torch(arr, record.policy.get(name, "io"), dtype, device)
    return tensors, f64


def tensors(record: OpRecord, case: Case, dtype: str, device: str | None = None) -> dict:
    """The case's arrays as the tensors a candidate at ``dtype`` gets (rounded by the record's
    input policy), without running the reference: for kernel tests that call the op themselves."""
    t, _ = _rounded(record, case, dtype_name(dtype), default_device(device))
    return {k: v for k, v in t.items() if not k.startswith("_")}


def prepare(record: OpRecord, case: Case, dtype: str, device: str | None = None,
            rounding: str = "nearest", contract: str = "ieee") -> Prepared:
    """The case's inputs rounded to ``dtype`` on ``device`` (None: cuda if available, else cpu), and
    the float64 reference of the rounded values; bounds under ``contract``."""
    dtype = dtype_name(dtype)
    device = default_device(device)
    cand_inputs, f64 = _rounded(record, case, dtype, device)
    ref_inputs = {k: v for k, v in f64.items() if not k.startswith("_")}
    ref = {k: np.asarray(v) for k, v in record.call(record.reference, ref_inputs, case.kwargs).items()}
    return Prepared(record, case, dtype, device, cand_inputs, f64, ref, rounding, contract)


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


def run_candidate(prepared: Prepared, cand, *, counter: str | None = None):
    """Call a normalized candidate; returns (outputs, error string or None, kernel_ran, seconds,
    why_not_ran). ``kernel_ran``: the launch counter moved (a counted candidate), or, for a witnessed
    one (``parity.candidate.Witnessed``), it was called and returned its own outputs
    (:func:`own_outputs`; ``why_not_ran`` says what was wrong); None for any other. An adapter's
    ``parity.candidate.Unsupported`` passes through."""
    from_counters = None
    if counter is not None:
        from optimized import _counters  # only for a counted kernel: importing optimized picks the backend

        before = _counters.launches[counter]
    calls = getattr(cand, "calls", None)
    inputs = prepared.inputs()
    poison_free_memory(prepared.device)
    t0 = time.perf_counter()
    try:
        out = cand(inputs, dict(prepared.case.kwargs))
        err = None
    except Unsupported:
        raise  # an input the implementation does not take: the caller skips it
    except Exception as exc:  # a crashing candidate fails the check; the message says why
        msg = str(exc).strip().splitlines()   # CUDA errors append paragraphs of advice: the first line says it
        out, err = None, f"{type(exc).__name__}: {msg[0] if msg else ''}"
    dt = time.perf_counter() - t0
    why = None
    if counter is not None:
        from_counters = _counters.launches[counter] > before
    elif calls is not None:
        why = "the implementation was not called" if cand.calls == calls else \
            (own_outputs(prepared, inputs, out) if out is not None else None)
        from_counters = why is None
    return out, err, from_counters, dt, why


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
    import torch

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
    import torch

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


def own_outputs(prepared: Prepared, inputs: dict, outputs: dict) -> str | None:
    """Why ``outputs`` are not an outside implementation's own work (None when they are): an output
    that is not a tensor, shares memory with an input it was handed (an in-place record's output
    may be the buffer of the same name), with the reference's arrays or with another output, or is
    non-finite where the reference is finite or finite where it is not ("honest")."""
    import torch

    rec = prepared.record
    spans = {}
    for name in rec.outputs:
        t = outputs.get(name)
        if not isinstance(t, torch.Tensor):
            return f"output {name} is a {type(t).__name__}, not a tensor"
        spans[name] = _span(t)
    for name, s in spans.items():
        for k, x in inputs.items():
            if rec.in_place and k == name:
                continue
            if _overlap(s, _span(x)):
                return f"output {name} is the memory of input {k}"
        for k, r in prepared.ref.items():
            if _overlap(s, _span(np.asarray(r))):
                return f"output {name} is the memory of the reference's {k}"
        for k, s2 in spans.items():
            if k != name and _overlap(s, s2):
                return f"outputs {name} and {k} share memory"
    for name in rec.outputs:
        t, ref = outputs[name], np.asarray(prepared.ref[name])
        if not t.is_floating_point() or tuple(t.shape) != ref.shape:
            continue  # integer outputs are compared exactly; shapes are the comparison's to refuse
        bad = ~torch.isfinite(t).cpu().numpy()
        if not np.array_equal(bad, ~np.isfinite(ref)):
            n = int(np.sum(bad & np.isfinite(ref)))
            return (f"output {name} is non-finite at {n} element(s) where the reference is finite" if n
                    else f"output {name} is finite where the reference is not")
    return None


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
    out, err, ran, dt, why = run_candidate(prepared, cand, counter=counter)
    j = judge(prepared, out, error=err, seconds=dt, kernel_ran=ran)
    j.witness = why
    return j


# -- bytes ------------------------------------------------------------------------------------
def bitwise_equal(a, b) -> bool:
    import torch

    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_floating_point():
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return bool(torch.equal(a.contiguous().view(view), b.contiguous().view(view)))
    return bool(torch.equal(a, b))


def bytes_checks(prepared: Prepared, cand, first: dict | None = None) -> dict:
    """Run-to-run identity and, where the record declares independent batch rows, batch-composition
    invariance (the first half of the batch alone gives bit-identical rows). Returns
    ``{"run_to_run": bool, "batch": bool | None, "detail": str}``."""
    rec = prepared.record
    if first is None:
        first = cand(prepared.inputs(), dict(prepared.case.kwargs))
    again = cand(prepared.inputs(), dict(prepared.case.kwargs))
    bad = [n for n in rec.outputs if not bitwise_equal(first[n], again[n])]
    out = {"run_to_run": not bad, "batch": None,
           "detail": f"run-to-run differs in {bad}" if bad else ""}
    spec = rec.batch
    if spec and prepared.tensors.get("cu_seqlens") is None:
        axes = spec["inputs"]
        n = None
        for name, ax in axes.items():
            t = prepared.tensors.get(name)
            if t is not None:
                n = t.shape[ax]
                break
        if n is not None and n >= 2:
            m = n // 2
            sub = prepared.inputs()
            for name, ax in axes.items():
                if sub.get(name) is not None:
                    sub[name] = sub[name].narrow(ax, 0, m).contiguous()
            part = cand(sub, dict(prepared.case.kwargs))
            bad = [o for o, ax in spec["outputs"].items()
                   if not bitwise_equal(part[o], first[o].narrow(ax, 0, m).contiguous())]
            out["batch"] = not bad
            if bad:
                out["detail"] += f"{'; ' if out['detail'] else ''}batch of {m} of {n} differs in {bad}"
    return out

"""Comparing a candidate's output with the float64 reference, in units of an error bound.

``compare(ref, cand, bound)`` measures max abs, max rel, RMS ratio ``rms(a-b)/rms(b)``, cosine, ULP
distance (when the candidate has a float dtype, against the reference rounded to that dtype) and
the error in units of the bound; it fails on any element past its bound and, in their own right, on
a NaN/Inf pattern that differs from the reference's, on a degenerate output (all zeros or constant
where the reference is not) and on a shape mismatch. Reports name the worst few elements with
their index, both values and the bound; never whole tensors.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

WORST = 5


@dataclass
class Element:
    index: tuple
    ref: float
    cand: float
    bound: float
    ratio: float

    def describe(self) -> str:
        return (f"at {self.index}: candidate {self.cand:.9g}, reference {self.ref:.9g}, "
                f"|diff| {abs(self.cand - self.ref):.3g}, bound {self.bound:.3g} ({_r(self.ratio)} x bound)")


def _r(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


@dataclass
class Comparison:
    name: str
    shape: tuple
    passed: bool
    ratio: float                # max |diff| / bound over elements (0/0 = 0, x/0 = inf)
    max_abs: float = 0.0
    max_rel: float = 0.0
    rms_ratio: float = 0.0
    cosine: float = 1.0
    ulp: float | None = None    # max ULP distance in the candidate's dtype
    n_bad: int = 0
    failures: list = field(default_factory=list)   # reasons (strings)
    worst: list = field(default_factory=list)      # Element, worst first

    def report(self) -> str:
        lines = [f"{self.name} {self.shape}: {'ok' if self.passed else 'FAIL'}, worst {_r(self.ratio)} x bound, "
                 f"max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g}, rms ratio {self.rms_ratio:.3g}, "
                 f"cosine {self.cosine:.9f}" + (f", ulp {self.ulp:.0f}" if self.ulp is not None else "")]
        lines += [f"  {f}" for f in self.failures]
        if self.worst and not self.passed:
            lines.append(f"  {self.n_bad} element(s) past the bound; worst:")
            lines += [f"    {e.describe()}" for e in self.worst]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        f = _finite
        return {"name": self.name, "shape": list(self.shape), "passed": self.passed, "ratio": f(self.ratio),
                "max_abs": f(self.max_abs), "max_rel": f(self.max_rel), "rms_ratio": f(self.rms_ratio),
                "cosine": f(self.cosine), "ulp": f(self.ulp), "n_bad": self.n_bad, "failures": list(self.failures),
                "worst": [{"index": list(e.index), "ref": f(e.ref), "cand": f(e.cand), "bound": f(e.bound),
                           "ratio": f(e.ratio)} for e in self.worst[:3]]}


def _finite(x):
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def to_numpy(x) -> np.ndarray:
    """float64 (or int64) NumPy copy of an array or torch tensor: the parity boundary's conversion."""
    if hasattr(x, "detach"):
        t = x.detach().cpu()
        if t.is_floating_point():
            return t.to(torch.float64).numpy()
        return t.to(torch.int64).numpy()
    a = np.asarray(x)
    return a.astype(np.float64) if a.dtype.kind == "f" else a.astype(np.int64)


class HostCopy(np.ndarray):
    """A float64 (int64) host copy of a device tensor that remembers the dtype the tensor was
    stored in, ``stored`` (``dtype_of`` reads it): a bf16 trace entry copied for reading is still
    a bf16 entry, whose storage rounding is part of its bound. Slices keep it; ``to_numpy`` gives
    a plain array."""
    stored: str | None = None

    def __array_finalize__(self, obj):
        self.stored = getattr(obj, "stored", None)

    def __array_wrap__(self, array, context=None, return_scalar=False):
        # what is computed from a copy is no longer stored in its dtype: a plain array
        array = array.view(np.ndarray)
        return array[()] if return_scalar else array


def to_host(arrays: dict) -> dict:
    """``arrays`` (a trace: name -> array or tensor) with every device tensor replaced by its
    ``HostCopy``, all of one device and dtype converted and copied in one transfer: a call's many
    entries are read one by one, by every prompt of a batch, and would otherwise each cross from
    the device (and be widened) at every read. Host arrays and tensors are passed through."""
    out, groups = dict(arrays), {}
    for key, x in arrays.items():
        if hasattr(x, "detach") and x.device.type != "cpu":
            groups.setdefault((x.device, x.dtype), []).append(key)
    for keys in groups.values():
        out.update(zip(keys, host_copies([arrays[k] for k in keys])))
    return out


def host_copies(tensors: list) -> list[HostCopy]:
    """The ``HostCopy`` of each of ``tensors`` (torch, of one device and dtype), widened on their
    device and copied to the host together."""
    xs = [x.detach() for x in tensors]
    flat = torch.cat([x.reshape(-1) for x in xs])
    flat = flat.to(torch.float64 if flat.is_floating_point() else torch.int64).cpu().numpy()
    flat.setflags(write=False)  # one buffer under every copy: read, never written
    stored = dtype_of(xs[0])
    out, start = [], 0
    for x in xs:
        c = flat[start:start + x.numel()].reshape(tuple(x.shape)).view(HostCopy)
        c.stored = stored
        out.append(c)
        start += x.numel()
    return out


def dtype_of(x) -> str | None:
    """Float dtype name of a tensor/array ('bfloat16', ...; a ``HostCopy``'s stored dtype) or None
    for integer data."""
    s = getattr(x, "stored", None) or str(getattr(x, "dtype", "")).replace("torch.", "")
    return s if s in ("bfloat16", "float16", "float32", "float64") else None


def _ordered_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """Map floats of ``dtype`` (given as float64 values exactly representable in it) to integers
    whose difference is the ULP distance."""
    if dtype == "bfloat16":
        bits = (a.astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
        sign, mag = bits >> 15, bits & 0x7FFF
    elif dtype == "float16":
        bits = a.astype(np.float16).view(np.uint16).astype(np.int64)
        sign, mag = bits >> 15, bits & 0x7FFF
    elif dtype == "float32":
        bits = a.astype(np.float32).view(np.uint32).astype(np.int64)
        sign, mag = bits >> 31, bits & 0x7FFFFFFF
    else:
        bits = a.view(np.uint64)
        sign = (bits >> np.uint64(63)).astype(np.int64)
        mag = (bits & np.uint64(0x7FFFFFFFFFFFFFFF)).astype(np.int64)
    return np.where(sign == 1, -mag, mag)


def round_to(a: np.ndarray, dtype: str) -> np.ndarray:
    """float64 values rounded (to nearest even) to ``dtype`` and returned as float64."""
    if dtype == "float64":
        return a.astype(np.float64)
    tdt = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[dtype]
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(tdt).to(torch.float64).numpy()


def ulp_distance(a: np.ndarray, b: np.ndarray, dtype: str) -> np.ndarray:
    """Elementwise ULP distance of two arrays of values representable in ``dtype``."""
    return np.abs(_ordered_bits(np.asarray(a, np.float64), dtype) - _ordered_bits(np.asarray(b, np.float64), dtype))


def compare(name: str, ref, cand, bound, *, cand_dtype: str | None = None) -> Comparison:
    """Compare ``cand`` with ``ref`` element by element against ``bound`` (same shape, >= 0)."""
    ref = to_numpy(ref)
    cand_dtype = cand_dtype or dtype_of(cand)
    cand = to_numpy(cand)
    if cand.shape != ref.shape:
        return Comparison(name, tuple(ref.shape), False, math.inf,
                          failures=[f"shape mismatch: candidate {tuple(cand.shape)}, reference {tuple(ref.shape)}"])
    bound = np.broadcast_to(np.asarray(bound, dtype=np.float64), ref.shape)
    failures = []
    ref_f, cand_f = ref.astype(np.float64), cand.astype(np.float64)
    fin_r, fin_c = np.isfinite(ref_f), np.isfinite(cand_f)
    pattern = (np.isnan(ref_f) != np.isnan(cand_f)) | (np.isinf(ref_f) != np.isinf(cand_f)) | \
        (np.isinf(ref_f) & np.isinf(cand_f) & (np.sign(ref_f) != np.sign(cand_f)))
    if pattern.any():
        idx = tuple(int(i) for i in np.argwhere(pattern)[0])
        failures.append(f"NaN/Inf pattern mismatch in {int(pattern.sum())} element(s), first at {idx}: "
                        f"candidate {cand_f[idx]}, reference {ref_f[idx]}")
    both = fin_r & fin_c
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        diff = np.where(both, np.abs(cand_f - ref_f), 0.0)
        ratio = np.where(diff == 0, 0.0, diff / bound)
        rel = np.where(diff == 0, 0.0, diff / np.abs(ref_f))
    ratio = np.where(pattern, np.inf, ratio)
    n = ref.size
    if n and both.any():
        rr, cc = ref_f[both], cand_f[both]
        if not np.any(rr):
            pass
        elif not np.any(cc):
            failures.append("degenerate output: all zeros where the reference is not")
        elif rr.size > 1 and np.ptp(cc) == 0 and np.ptp(rr) != 0:
            failures.append(f"degenerate output: constant {cc.flat[0]:.6g} where the reference is not")
    bad = ratio > 1.0
    worst_ratio = float(np.max(ratio)) if n else 0.0
    if bad.any():
        failures.insert(0, f"{int(bad.sum())} of {n} element(s) past the bound")
    order = np.argsort(-ratio, axis=None, kind="stable")[:WORST] if n else []
    worst = [Element(tuple(int(i) for i in np.unravel_index(j, ref.shape)), float(ref_f.flat[j]),
                     float(cand_f.flat[j]), float(bound.flat[j]), float(ratio.flat[j])) for j in order
             if ratio.flat[j] > 0]
    with np.errstate(invalid="ignore", over="ignore"):
        rms_r = _rms(np.where(both, cand_f - ref_f, 0.0)) / max(_rms(np.where(both, ref_f, 0.0)), np.finfo(float).tiny)
    cosine = _cosine(np.where(both, ref_f, 0.0), np.where(both, cand_f, 0.0))
    ulp = None
    if cand_dtype and n and both.any():
        ulp = float(np.max(ulp_distance(round_to(ref_f[both], cand_dtype), cand_f[both], cand_dtype)))
    return Comparison(name, tuple(ref.shape), not failures, worst_ratio,
                      max_abs=float(np.max(diff)) if n else 0.0, max_rel=float(np.max(rel)) if n else 0.0,
                      rms_ratio=float(rms_r), cosine=float(cosine), ulp=ulp, n_bad=int(bad.sum()),
                      failures=failures, worst=worst)


def _rms(a):
    return float(np.sqrt(np.mean(np.square(a)))) if a.size else 0.0


def _cosine(a, b):
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    if na == 0 and nb == 0:
        return 1.0
    if na == 0 or nb == 0:
        return 0.0
    return float(np.dot(a.ravel(), b.ravel()) / (na * nb))


def nearer_truth(truth, a, b) -> dict:
    """Which of two candidates is nearer the float64 truth: ``{"nearer": "a" | "b" | "tie",
    "err_a", "err_b"}`` with the errors as RMS distances to ``truth`` (max abs as a tie breaker)."""
    t, x, y = to_numpy(truth), to_numpy(a), to_numpy(b)
    ea, eb = _rms(x - t), _rms(y - t)
    if ea == eb:
        ma, mb = float(np.max(np.abs(x - t), initial=0)), float(np.max(np.abs(y - t), initial=0))
        nearer = "tie" if ma == mb else ("a" if ma < mb else "b")
    else:
        nearer = "a" if ea < eb else "b"
    return {"nearer": nearer, "err_a": ea, "err_b": eb}

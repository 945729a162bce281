"""Searching for a correct implementation past its bound (docs/certificates.md, "Bound search").

A bound must hold for every correct implementation on every input. The registered input builders
draw a few shape buckets chosen to make the mutants visible; this module draws KDA configurations
widely and lets ``hypothesis.target`` climb toward the worst error in bound units: head dims 16 to
128 (K and V apart), 1 to 8 heads, GVA (``HV`` a multiple of ``H``), odd and even ``T``, chunk sizes
16/32/64, carried states, varlen batches, decays from ~1 (long memory) to ~e^-12 per step, beta near
1, values over four decades, and inputs that make the read-out cancel (a repeated token, keys from a
low-rank subspace).

Each drawn input is judged exactly as certification judges it (``parity.check.prepare`` rounds the
inputs, runs the float64 reference on the rounded values and holds every output to the record's
bound; ``parity.check.judge`` gives the ratio). Implementations:

- ``ours``: the registered optimized kernels (Triton; the interpreter on CPU);
- ``standin``: the float32 stand-in (``parity.emulate``, the record's ``emulated``);
- ``fla``: fla-core 0.6.0 through adapters to the record signatures (``parity.peers``): on CUDA its
  Triton ``fused_recurrent_kda`` / ``chunk_kda``, on CPU its torch recurrences
  (``fla.ops.kda.naive``; core ops only).

``python -m parity.bound_search --device cuda --json OUT.json`` runs the whole search (the GPU
command of docs/certificates.md); the suite runs a few examples of it (tests/parity/test_bound_search.py).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings, target
from hypothesis import strategies as st

from .check import judge, prepare
from .errors import Unsupported
from .registry import Case

KDA_OPS = ("kda.recurrent", "kda.chunked", "kda.fused_recurrent", "kda.fused_chunked")
IMPLS = ("ours", "standin", "fla")
DIMS = (16, 32, 64, 128)
HEADS = (1, 2, 4, 8)
CHUNKS = (16, 32, 64)
DECAYS = ("mixed", "moderate", "slow")
PATTERNS = ("random", "repeat", "lowrank")
RATIO_CAP = 1e6   # hypothesis.target needs a finite score: an infinite ratio counts as this


def get_record(name: str):
    """The registered record of ``name`` (the registry's public ``get``, wherever it lives)."""
    try:
        from .ops import get
    except ImportError:
        from .registry import get
    return get(name)


# -- inputs ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Space:
    """What the search draws from. ``elements`` caps ``B T HV K V`` (the interpreter's cost)."""

    dims: tuple = DIMS
    heads: tuple = HEADS
    chunks: tuple = CHUNKS
    max_T: int = 160
    elements: int = 1 << 22
    shapes: tuple | None = None   # (H, HV, K, V) drawn from these only (None: any of the above)

    @classmethod
    def cheap(cls) -> "Space":
        """A few seconds per example under the Triton interpreter (the suite's search)."""
        return cls(dims=(16, 32, 64), heads=(1, 2, 4), max_T=48, elements=1 << 17)

    @classmethod
    def buckets(cls) -> "Space":
        """Head shapes from a fixed list that still spans 1..8 heads, GVA and K, V from 16 to 128
        (apart and equal): on a GPU every new (H, HV, K, V) compiles and autotunes the kernels
        (seconds each), so a five-minute search draws its data widely over a few shapes."""
        return cls(max_T=512, elements=1 << 26,
                   shapes=((1, 1, 16, 16), (2, 4, 32, 64), (4, 8, 128, 128), (8, 8, 64, 16),
                           (1, 4, 128, 32), (4, 4, 16, 128), (2, 2, 128, 128)))


def _unit(x):
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def _tokens(r, B, T, H, K, pattern):
    """q or k rows ``[B, T, H, K]`` (not normalized): i.i.d. normal, a few vectors repeated like the
    tokens of a prompt that repeats itself, or rows from a two-dimensional subspace."""
    if pattern == "random":
        return r.standard_normal((B, T, H, K))
    if pattern == "repeat":
        vocab = r.standard_normal((3, H, K))
        return vocab[r.integers(0, 3, size=(B, T))]
    basis = r.standard_normal((H, 2, K))
    return np.einsum("bthc,hck->bthk", r.standard_normal((B, T, H, 2)), basis)


def _log_decays(r, shape, regime):
    """g <= 0: ``mixed`` e^-0.01 .. e^-12 per step, ``moderate`` e^-0.05 .. e^-1, ``slow`` decays of
    1 - 1e-4 .. 1 - 1e-2 (long memory: the state carries every step's rounding for many steps)."""
    sp = np.log1p(np.exp(r.standard_normal(shape)))
    if regime == "slow":
        return -np.exp(r.uniform(-9.0, -4.5, size=shape[:-1] + (1,))) * sp
    lo, hi = (-2.5, -0.5) if regime == "moderate" else (-4.0, 1.5)
    return -np.exp(r.uniform(lo, hi, size=shape[:-1] + (1,))) * sp


@dataclass(frozen=True)
class Config:
    """One drawn configuration of a KDA op's input (``make_case`` builds the arrays from it)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    seed: int
    C: int | None = None              # chunk size (chunked ops)
    cuts: tuple = ()                  # varlen: the inner sequence boundaries (B == 1)
    h0: bool = False                  # a carried initial state
    decay: str = "mixed"              # DECAYS
    pattern: str = "random"           # PATTERNS
    beta: str = "sigmoid"             # "sigmoid" or "near_one" (logits shifted by +6)
    v_scale: float = 1.0
    qk_scale: float = 2.0             # fused ops: the raw q, k rows' scale (1e-3: l2norm's eps matters)

    def label(self, fused: bool) -> str:
        return (f"B={self.B} T={self.T} H={self.H} HV={self.HV} K={self.K} V={self.V}"
                + (f" C={self.C}" if self.C else "") + (f" varlen{len(self.cuts) + 1}" if self.cuts else "")
                + (" h0" if self.h0 else "") + f" {self.decay} {self.pattern} beta={self.beta} v*{self.v_scale:g}"
                + (f" qk*{self.qk_scale:g}" if fused else "") + f" seed={self.seed}")


def make_case(record, cfg: Config) -> Case:
    """The input of ``record`` (core: ``q, k, v, g, beta``; fused: ``q, k, v, g_raw, beta_logits,
    A_log, dt_bias``) that ``cfg`` describes, as a ``Case`` with the record's argument names."""
    fused = "g_raw" in record.args
    B, T, H, HV, K, V = cfg.B, cfg.T, cfg.H, cfg.HV, cfg.K, cfg.V
    r = np.random.default_rng(cfg.seed)
    a = {}
    q, k = _tokens(r, B, T, H, K, cfg.pattern), _tokens(r, B, T, H, K, cfg.pattern)
    a["q"], a["k"] = (cfg.qk_scale * q, cfg.qk_scale * k) if fused else (_unit(q), _unit(k))
    a["v"] = r.standard_normal((B, T, HV, V)) * cfg.v_scale
    logits = r.standard_normal((B, T, HV)) + (6.0 if cfg.beta == "near_one" else 0.0)
    if fused:
        a["g_raw"] = r.standard_normal((B, T, HV, K)) * 1.5
        a["beta_logits"] = logits
        a["A_log"] = {"mixed": r.uniform(-2.0, 1.0, HV), "moderate": r.uniform(-2.5, -0.5, HV),
                      "slow": r.uniform(-9.0, -5.0, HV)}[cfg.decay]
        a["dt_bias"] = r.standard_normal(HV * K) * 0.5
    else:
        a["g"] = _log_decays(r, (B, T, HV, K), cfg.decay)
        a["beta"] = 1.0 / (1.0 + np.exp(-logits))
    a["cu_seqlens"] = np.array([0, *cfg.cuts, T], dtype=np.int64) if cfg.cuts else None
    n_seq = len(cfg.cuts) + 1 if cfg.cuts else B
    a["initial_state"] = r.standard_normal((n_seq, HV, K, V)) * 0.5 * cfg.v_scale if cfg.h0 else None
    kw = {"chunk_size": cfg.C} if cfg.C else {}
    return Case({n: a[n] for n in (*record.args, *record.kwarg_arrays)}, kw, label=cfg.label(fused))


@st.composite
def configs(draw, record, space: Space = Space(), chunks=None):
    """A drawn ``Config`` of a KDA op record within ``space`` (``chunks``: the chunk sizes the
    implementation takes)."""
    fused = "g_raw" in record.args
    if space.shapes:
        H, HV, K, V = draw(st.sampled_from(space.shapes))
    else:
        H = draw(st.sampled_from(space.heads))
        HV = H * draw(st.sampled_from([g for g in (1, 2, 4) if H * g <= 8]))
        K, V = draw(st.sampled_from(space.dims)), draw(st.sampled_from(space.dims))
    varlen = draw(st.booleans())
    B = 1 if varlen else draw(st.sampled_from([1, 2]))
    cap = max(2, min(space.max_T, space.elements // (B * HV * K * V)))
    T = draw(st.integers(2 if varlen else 1, cap))
    cuts = tuple(sorted(set(draw(st.lists(st.integers(1, T - 1), min_size=1, max_size=2))))) if varlen else ()
    return Config(
        B=B, T=T, H=H, HV=HV, K=K, V=V, seed=draw(st.integers(0, 2**32 - 1)),
        C=draw(st.sampled_from(chunks or space.chunks)) if "chunked" in record.name else None,
        cuts=cuts, h0=draw(st.booleans()), decay=draw(st.sampled_from(DECAYS)),
        pattern=draw(st.sampled_from(PATTERNS)), beta=draw(st.sampled_from(["sigmoid", "near_one"])),
        v_scale=draw(st.sampled_from([1.0, 1e-2, 30.0])),
        qk_scale=draw(st.sampled_from([2.0, 1e-3])) if fused else 2.0)


def kda_cases(record, space: Space = Space(), chunks=None):
    """A strategy of drawn inputs (``Case``) of a KDA op record."""
    return configs(record, space, chunks).map(lambda cfg: make_case(record, cfg))


# -- implementations -------------------------------------------------------------------------------
def implementation(record, impl: str, device: str):
    """``impl`` of ``record`` as a normalized candidate ``cand(inputs, kwargs) -> {output: tensor}``."""
    if impl == "ours":
        import optimized  # noqa: F401  (importing it selects and sets up the backend)

        return record.candidate(record.optimized_callable())
    if impl == "standin":
        return record.candidate(record.emulated)
    if impl == "fla":
        fn = _fla(record.name, device)
        return record.candidate(fn)
    raise ValueError(f"impl: expected one of {IMPLS}, got {impl!r}")


def supported_chunks(impl: str, device: str) -> tuple | None:
    """Chunk sizes ``impl`` takes (None: any)."""
    if impl == "fla" and device == "cuda":
        from .peers import fla

        return fla.CHUNK_SIZES
    return None


def contract_of(impl: str, op: str, device: str) -> str:
    """The arithmetic contract ``impl`` declares for ``op`` (docs/certificates.md): fla's adapters
    say theirs (``tf32`` for chunk_kda's products), ours and the stand-in claim ``ieee``."""
    return getattr(_fla(op, device), "parity_contract", "ieee") if impl == "fla" else "ieee"


def _fla(op: str, device: str):
    from .peers import fla

    table = fla.implementations(device)
    if op not in table:
        raise Unsupported(f"fla-core on {device}: no implementation of {op}")
    return table[op]


# -- the search ------------------------------------------------------------------------------------
@dataclass
class Result:
    """The worst an implementation reached on one op and dtype."""

    op: str
    impl: str
    dtype: str
    device: str
    contract: str = "ieee"       # the arithmetic it is judged under (parity.bounds.core.CONTRACTS)
    worst_ratio: float = 0.0
    worst_label: str = ""
    worst_output: str = ""
    examples: int = 0
    past_bound: int = 0          # examples past their bound
    unsupported: int = 0         # configurations the implementation refused
    errors: list = field(default_factory=list)   # what raised, other than Unsupported (first few)
    seconds: float = 0.0
    worst_case: Case | None = field(default=None, repr=False)   # the input that reached worst_ratio

    def to_dict(self) -> dict:
        d = {k: v for k, v in asdict(self).items() if k != "worst_case"}
        d["worst_ratio"] = self.worst_ratio if math.isfinite(self.worst_ratio) else None  # null: inf or not run
        return d


def judge_case(record, case: Case, cand, dtype: str, device: str, rounding: str, contract: str = "ieee"):
    """(ratio, output name, Judgement) of ``cand`` on ``case`` at ``dtype``, judged as certification
    does under ``contract``. Raises ``Unsupported`` when the implementation refuses the configuration."""
    prepared = prepare(record, case, dtype, device, rounding, contract)
    try:
        out = cand(prepared.inputs(), dict(case.kwargs))
        err = None
    except Unsupported:
        raise
    except Exception as exc:  # a crashing candidate is past its bound (infinitely)
        out, err = None, f"{type(exc).__name__}: {exc}"
    j = judge(prepared, out, error=err)
    worst = max(j.outputs, key=lambda n: j.outputs[n].ratio) if j.outputs else ""
    return j.ratio, worst, j


def search(op: str, impl, dtype: str, *, device: str = "cpu", examples: int = 10,
           seconds: float = math.inf, space: Space = Space(), derandomize: bool = True,
           fail: bool = False) -> Result:
    """Draw up to ``examples`` inputs of ``op`` (stopping after ``seconds``), climbing toward the
    worst ratio of ``impl`` (a name of ``IMPLS``, or a normalized candidate ``cand(inputs, kwargs)``)
    at ``dtype``. ``fail``: assert every ratio <= 1 (hypothesis then shrinks a failure to a small
    configuration); else report the worst."""
    from .platform import store_rounding

    record = get_record(op)
    name = impl if isinstance(impl, str) else getattr(impl, "__name__", "candidate")
    cand = implementation(record, impl, device) if isinstance(impl, str) else impl
    rounding = store_rounding(dtype, device) if impl == "ours" else "nearest"
    contract = contract_of(impl, op, device) if isinstance(impl, str) else "ieee"
    res = Result(op, name, dtype, device, contract=contract)
    t0 = time.monotonic()

    @settings(max_examples=examples, deadline=None, database=None, derandomize=derandomize,
              suppress_health_check=list(HealthCheck), print_blob=True)
    @given(kda_cases(record, space, supported_chunks(name, device)))
    def body(case):
        if time.monotonic() - t0 > seconds:
            raise _OutOfTime  # not an Exception: hypothesis stops at once instead of shrinking
        try:
            ratio, name, j = judge_case(record, case, cand, dtype, device, rounding, contract)
        except Unsupported:
            res.unsupported += 1
            return
        res.examples += 1
        if j.error and len(res.errors) < 3:
            res.errors.append(f"{case.label}: {j.error}")
        res.past_bound += ratio > 1.0
        if ratio >= res.worst_ratio:
            res.worst_ratio, res.worst_label, res.worst_output, res.worst_case = ratio, case.label, name, case
        target(min(ratio, RATIO_CAP), label=f"{op} {name} {dtype}")
        if fail:
            assert ratio <= 1.0, f"{name} {op} {dtype} {case.label}: {ratio:.3g}x its bound\n{j.report()}"

    from hypothesis.reporting import with_reporter

    try:
        if fail:
            body()
        else:  # a search that reports its worst has no failure to print (not even the time-out's seed)
            with with_reporter(lambda *a, **k: None):
                body()
    except _OutOfTime:
        pass
    res.seconds = time.monotonic() - t0
    return res


class _OutOfTime(BaseException):
    """Raised inside a search's hypothesis test when its time is up (see ``search``)."""


# -- command line ----------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m parity.bound_search", description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", default=list(KDA_OPS), choices=KDA_OPS)
    p.add_argument("--impls", nargs="+", default=["ours", "fla"], choices=IMPLS)
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--device", default=None, choices=["cpu", "cuda"], help="default: cuda if present")
    p.add_argument("--examples", type=int, default=60, help="drawn inputs per op, impl and dtype")
    p.add_argument("--seconds", type=float, default=270.0, help="wall-clock budget of the whole search")
    p.add_argument("--space", choices=["full", "cheap", "buckets"], default=None,
                   help="what to draw: any head shape (full), the suite's small ones (cheap), or a few "
                        "fixed head shapes with long sequences (buckets); default buckets on cuda, else full")
    p.add_argument("--random", action="store_true", help="random draws (default: derandomized)")
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--keep", metavar="DIR", help="save each run's worst input past its bound here (.npz)")
    return p


def save_case(case: Case, path) -> None:
    """``case`` as an .npz (arrays; ``kwargs`` and ``label`` as JSON): ``load_case`` reads it back."""
    arrays = {f"a_{k}": v for k, v in case.arrays.items() if v is not None}
    meta = json.dumps({"kwargs": case.kwargs, "label": case.label})

    def write(f):
        np.savez(f, meta=np.array(meta), **arrays)

    from .atomic import atomic_write

    atomic_write(path, writer=write)


def load_case(path, record) -> Case:
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        arrays = {n: (z[f"a_{n}"] if f"a_{n}" in z else None) for n in (*record.args, *record.kwarg_arrays)}
    return Case(arrays, meta["kwargs"], label=meta["label"])


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    from .platform import default_device

    device = default_device(args.device)
    runs = [(op, impl, dt) for impl in args.impls for op in args.ops for dt in args.dtypes
            if not (impl == "fla" and device == "cpu" and "fused" in op)]
    space = {"full": Space, "cheap": Space.cheap, "buckets": Space.buckets}[
        args.space or ("buckets" if device == "cuda" else "full")]()
    results, t0 = [], time.monotonic()
    for i, (op, impl, dt) in enumerate(runs):
        share = max(0.0, args.seconds - (time.monotonic() - t0)) / (len(runs) - i)  # what is left, shared
        try:
            r = search(op, impl, dt, device=device, examples=args.examples, seconds=share, space=space,
                       derandomize=not args.random)
        except Exception as exc:  # an implementation that cannot be imported or set up: say so, go on
            r = Result(op, impl, dt, device, worst_ratio=math.nan, errors=[f"{type(exc).__name__}: {exc}"])
        results.append(r.to_dict())
        if args.keep and r.worst_case is not None and r.worst_ratio > 1:
            save_case(r.worst_case, f"{args.keep}/{op}-{impl}-{dt}.npz")
        print(f"{op:20s} {impl:8s} {dt:9s} worst {r.worst_ratio:9.3g} over {r.examples:3d} "
              f"({r.past_bound} past, {r.unsupported} unsupported, {r.seconds:.0f}s)  {r.worst_label}",
              flush=True)
    from .atomic import atomic_write
    from .environment import environment

    out = {"format": "kimi-parity/bound-search", "version": 1, "device": device,
           "environment": environment(device), "space": asdict(space), "results": results}
    atomic_write(args.json, json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

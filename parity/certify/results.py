"""What certification finds, as typed results: :class:`CaseResult` (one input), :class:`MutantResult`,
:class:`DtypeRun` (one dtype of one op) and :class:`OpCertificate` (one op: verdict, reasons,
strengths, faults, nondeterminism), each with ``to_dict`` (the certificate's JSON,
parity/schemas/certificate.schema.json) and ``from_dict`` (back, for :func:`merge` of shard
certificates). Filled by parity.certify."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .. import ops
from ..bounds.core import weaker_contracts
from ..registry import OpRecord
from . import fingerprint


def _fin(x):
    return None if x is None or not math.isfinite(x) else float(x)


def _r(x) -> str:
    return "inf" if x is None or not math.isfinite(x) else f"{x:.3g}"


def _inf(x):
    """A certificate's number back: null (an infinite ratio) is inf."""
    return math.inf if x is None else x


@dataclass
class CaseResult:
    """The candidate on one input at one dtype. ``ratio``: its worst error in bound units (inf for a
    raise, a fault, a shape or NaN-pattern failure); ``outputs``: each output's comparison (as
    metrics.Comparison.to_dict); ``fault``: the call killed its process or CUDA context (with the
    input's ``shapes``); ``dirty``: the fill of the memory the op leaves unused (FILLS), for a
    dirty-memory input derived from a drawn one; ``source``: a replayed case's origin."""

    label: str
    passed: bool
    ratio: float
    seconds: float = 0.0
    kernel_ran: bool | None = None
    summary: str = ""
    outputs: dict = field(default_factory=dict)
    witness: str | None = None
    source: dict | None = None
    contracts: dict | None = None          # failing with outputs: its ratio under each weaker contract
    bug_similarity: dict | None = None     # failing: its similarity to each mutant (parity.certify.fingerprint)
    fault: str | None = None
    shapes: dict | None = None             # a fault: input name -> shape
    dirty: str | None = None

    def to_dict(self) -> dict:
        d = {"label": self.label, "passed": self.passed, "ratio": _fin(self.ratio), "seconds": self.seconds,
             "kernel_ran": self.kernel_ran, "summary": self.summary, "outputs": self.outputs}
        for k in ("witness", "source", "fault", "shapes", "dirty", "bug_similarity"):
            if getattr(self, k) is not None:
                d[k] = getattr(self, k)
        if self.contracts is not None:
            d["contracts"] = {k: _fin(v) for k, v in self.contracts.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CaseResult":
        c = cls(**{k: v for k, v in d.items() if k != "ratio"}, ratio=_inf(d["ratio"]))
        if c.contracts is not None:
            c.contracts = {k: _inf(v) for k, v in c.contracts.items()}
        return c


@dataclass
class MutantResult:
    name: str
    kind: str
    doc: str
    detected: int = 0
    cases: int = 0                # inputs it ran on: until the first that kills it
    teeth: float = 0.0            # worst ratio over those inputs (inf: shape/NaN/degenerate/raised)
    first_failure: str = ""

    @property
    def killed(self) -> bool:
        return self.detected > 0

    def to_dict(self) -> dict:
        return {"name": self.name, "kind": self.kind, "doc": self.doc, "killed": self.killed,
                "teeth": _fin(self.teeth), "teeth_infinite": math.isinf(self.teeth),
                "detected": self.detected, "cases": self.cases, "first_failure": self.first_failure}

    @classmethod
    def from_dict(cls, d: dict) -> "MutantResult":
        teeth = math.inf if d["teeth_infinite"] else d["teeth"]
        return cls(d["name"], d["kind"], d["doc"], d["detected"], d["cases"], teeth, d["first_failure"])


@dataclass
class DtypeRun:
    dtype: str
    strength: str
    cases: list = field(default_factory=list)            # CaseResult, in the order run
    mutants: dict = field(default_factory=dict)          # name -> MutantResult
    controls: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    seconds: float = 0.0
    contract: str = "ieee"
    unsupported: dict = field(default_factory=dict)   # why -> inputs the implementation refused
    nondeterminism: list = field(default_factory=list)  # {"label", "outputs", "detail"}: repeats differed

    @property
    def worst_ratio(self) -> float:
        return max((c.ratio for c in self.cases), default=math.inf)

    @property
    def passed(self) -> bool:
        return bool(self.cases) and all(c.passed for c in self.cases)

    @property
    def kernel_ran(self):
        flags = [c.kernel_ran for c in self.cases if c.fault is None]
        if not flags or any(f is None for f in flags):
            return None
        return bool(flags) and all(flags)

    def bytes_ok(self):
        if not self.bytes:
            return None
        vals = [v for k, v in self.bytes.items() if k in ("run_to_run", "batch") and v is not None]
        return all(vals) if vals else None

    def contract_verdict(self) -> dict:
        """The claimed contract at this dtype: ``holds`` (every input within its bounds), the worst
        ratio, and on a failure the worst ratio of the failing inputs under each weaker contract
        and the strongest weaker one they all fit (``consistent_with``; None if none does, or if
        an input failed without outputs to judge). Inputs that passed the claimed contract pass
        every weaker one: bounds grow with every unit roundoff."""
        out = {"name": self.contract, "holds": self.passed, "worst_ratio": _fin(self.worst_ratio),
               "weaker": {}, "consistent_with": None}
        failing = [c for c in self.cases if not c.passed]
        if not failing:
            return out
        weaker = {}
        for c in failing:
            for k, r in (c.contracts or {}).items():
                weaker[k] = max(weaker.get(k, 0.0), r)
        out["weaker"] = {k: _fin(v) for k, v in weaker.items()}
        if all(c.contracts is not None for c in failing):
            fits = [k for k, v in weaker.items() if v <= 1.0]
            if fits:
                out["consistent_with"] = {"contract": fits[0], "ratio": _fin(weaker[fits[0]])}
        return out

    def to_dict(self) -> dict:
        return {"dtype": self.dtype, "strength": self.strength, "passed": self.passed,
                "contract": self.contract_verdict(), "unsupported": dict(self.unsupported),
                "worst_ratio": _fin(self.worst_ratio), "kernel_ran": self.kernel_ran,
                "bytes": dict(self.bytes), "controls": dict(self.controls), "seconds": round(self.seconds, 3),
                "nondeterminism": list(self.nondeterminism),
                "cases": [c.to_dict() for c in self.cases],
                "mutants": [m.to_dict() for m in self.mutants.values()]}

    @classmethod
    def from_dict(cls, d: dict) -> "DtypeRun":
        return cls(d["dtype"], d["strength"], [CaseResult.from_dict(c) for c in d["cases"]],
                   {m["name"]: MutantResult.from_dict(m) for m in d["mutants"]}, dict(d["controls"]),
                   dict(d["bytes"]), d["seconds"], d.get("contract", {}).get("name", "ieee"),
                   dict(d.get("unsupported", {})), list(d.get("nondeterminism", [])))


@dataclass
class OpCertificate:
    record: OpRecord
    candidate: str                                  # the candidate's name
    runs: dict = field(default_factory=dict)        # dtype -> DtypeRun
    error: str | None = None
    counter: str | None = None                      # the launch counter that had to move
    contract: str = "ieee"                          # the arithmetic the candidate claims
    implementation: dict | None = None              # an outside candidate: who it is
    outside: bool = False

    @property
    def op(self) -> str:
        return self.record.name

    @property
    def label(self) -> str:
        """The candidate as tables name it: ``optimized``, ``reference-f32``, or the implementation
        (``fla:chunk_kda`` for an adapter around fla's ``chunk_kda``; else ``module:function``)."""
        impl = self.implementation
        if impl and impl.get("adapter"):
            return f"{impl['module'].split('.')[0]}:{impl['function']}"
        return self.candidate

    def nearest_bug(self) -> tuple[dict | None, dict]:
        """(``{"mutant", "similarity"}`` or None, mutant -> mean score) over the fingerprinted
        failing inputs of every dtype (parity.certify.fingerprint)."""
        return fingerprint.nearest([c.bug_similarity for r in self.runs.values() for c in r.cases
                                    if c.bug_similarity])

    def faults(self) -> list:
        """Each input whose call killed its process or CUDA context: dtype, label, shapes, error."""
        return [{"dtype": d, "label": c.label, "shapes": c.shapes or {}, "error": c.fault}
                for d, r in self.runs.items() for c in r.cases if c.fault is not None]

    def nondeterminism(self) -> list:
        """Each input on which two runs of the candidate gave different bytes."""
        return [{"dtype": d, **n} for d, r in self.runs.items() for n in r.nondeterminism]

    def contract_summary(self) -> str:
        """One line per dtype: ``fails ieee at float32 by 86x; consistent with tf32 at 0.4 units``."""
        parts = []
        for d, r in self.runs.items():
            v = r.contract_verdict()
            w = r.worst_ratio
            if not r.cases:
                parts.append(f"{v['name']} at {d}: no input judged")
            elif v["holds"]:
                parts.append(f"holds {v['name']} at {d} ({_r(w)} units)")
            elif all(c.fault is not None for c in r.cases if not c.passed):
                n = sum(c.fault is not None for c in r.cases)
                parts.append(f"{v['name']} at {d}: {n} input(s) faulted, the rest within it")
            else:
                line = f"fails {v['name']} at {d} by {_r(w)}x"
                if v["consistent_with"]:
                    c = v["consistent_with"]
                    line += f"; consistent with {c['contract']} at {_r(c['ratio'])} units"
                elif weaker_contracts(v["name"]):
                    line += "; consistent with no weaker contract"
                parts.append(line)
        return "; ".join(parts)

    def reached(self) -> list:
        out = []
        if any(r.passed and r.strength == "lifted" for r in self.runs.values()):
            out.append("lifted")
        if any(r.passed and r.strength == "production" for r in self.runs.values()):
            out.append("production")
        b = [r.bytes_ok() for r in self.runs.values()]
        if b and all(x is True for x in b):
            out.insert(0, "bytes")
        return out

    def _judged(self) -> list:
        """The record's mutants the runs judged (all of them in certify; judging recorded calls
        leaves out those only dirty memory shows)."""
        if not self.runs:
            return list(self.record.mutants)
        return [m for m in self.record.mutants if any(m.name in r.mutants for r in self.runs.values())]

    def mutants_killed(self) -> tuple[int, int]:
        """(killed at every dtype run, total)."""
        judged = self._judged()
        killed = sum(all(r.mutants[m.name].killed for r in self.runs.values()) for m in judged) \
            if self.runs else 0
        return killed, len(judged)

    def teeth(self) -> dict:
        """mutant -> its weakest teeth ratio over the dtypes run."""
        return {m.name: min((r.mutants[m.name].teeth for r in self.runs.values()), default=0.0)
                for m in self._judged()}

    def reasons(self) -> list:
        why = []
        if self.error:
            why.append(self.error)
        for d, r in self.runs.items():
            if not r.cases:
                why.append(f"{d}: no input was drawn")
            faults = [c for c in r.cases if c.fault is not None]
            for c in faults:
                why.append(f"{d}: fault on {c.label}: {c.fault}")
            bad = [c for c in r.cases if not c.passed and c.fault is None]
            if bad:
                c = bad[0]
                why.append(f"{d}: {len(bad)}/{len(r.cases)} input(s) failed, first {c.label}: {c.summary}")
            if self.counter is not None and r.kernel_ran is False:
                why.append(f"{d}: the optimized kernel did not record a launch (counter {self.counter})")
            if self.outside and r.kernel_ran is False:
                c = next(c for c in r.cases if c.kernel_ran is False)
                why.append(f"{d}: the implementation did not return its own, honest outputs on every input, "
                           f"first {c.label}: {c.witness}")
            for m in r.mutants.values():
                if not m.killed:
                    # a mutant runs only on the inputs the candidate ran: those that faulted may be
                    # the ones that would have shown it
                    where = f" on the {len(r.cases) - len(faults)} input(s) that did not fault" if faults else ""
                    why.append(f"{d}: mutant {m.name} survived{where} (teeth {m.teeth:.3g})")
            for name, rejected in r.controls.items():
                if not rejected:
                    why.append(f"{d}: the {name} control candidate passed")
            if "bytes" in self.record.strengths and r.bytes_ok() is False:
                why.append(f"{d}: bytes: {r.bytes.get('detail')}")
        return why

    @property
    def certified(self) -> bool:
        return bool(self.runs) and not self.reasons()

    @property
    def verdict(self) -> str:
        return "certified" if self.certified else "not certified"

    def shapes(self) -> list:
        seen = []
        for r in self.runs.values():
            for c in r.cases:
                if c.label not in seen:
                    seen.append(c.label)
        return seen

    def replayed(self) -> list:
        """The replayed cases (``certify_op(cases=)``), once each: their source, label, whether they
        passed at every dtype and their worst ratio."""
        out: dict = {}
        for r in self.runs.values():
            for c in r.cases:
                if c.source is not None:
                    e = out.setdefault(c.source["case"], {**c.source, "label": c.label, "passed": True,
                                                          "ratio": 0.0})
                    e["passed"] = e["passed"] and c.passed
                    e["ratio"] = max(e["ratio"], c.ratio)
        return list(out.values())

    def to_dict(self) -> dict:
        k, n = self.mutants_killed()
        bug, scores = self.nearest_bug()
        replayed = [{**e, "ratio": _fin(e["ratio"])} for e in self.replayed()]
        return {"op": self.op, "verdict": self.verdict, "candidate": self.candidate,
                "claimed": list(self.record.strengths), "reached": self.reached(),
                "worst_ratio": {d: _fin(r.worst_ratio) for d, r in self.runs.items()},
                "mutants_killed": k, "mutants_total": n,
                "teeth": {m: _fin(t) for m, t in self.teeth().items()},
                "shapes": self.shapes(), "reasons": self.reasons(),
                "bound_model": self.record.bound_doc, "reductions": self.record.reductions,
                "counter": self.counter, "contract": self.contract, "contract_verdict": self.contract_summary(),
                "implementation": self.implementation, "nearest_bug": bug, "bug_similarity": scores,
                "faults": self.faults(), "nondeterminism": self.nondeterminism(),
                **({"error": self.error} if self.error else {}),
                **({"gate": self.record.gate} if self.record.gate else {}),
                **({"replayed": replayed} if replayed else {}),
                "runs": {d: r.to_dict() for d, r in self.runs.items()}}

    @classmethod
    def from_dict(cls, d: dict, record: OpRecord | None = None) -> "OpCertificate":
        """The certificate of one op back from its JSON (``parity certify merge``); ``record``:
        default the registered one of that name."""
        record = record or ops.get(d["op"])
        return cls(record, d["candidate"], {k: DtypeRun.from_dict(r) for k, r in d["runs"].items()},
                   d.get("error"), d["counter"], d.get("contract", "ieee"), d.get("implementation"),
                   outside=d.get("implementation") is not None)


def merge(docs) -> list:
    """The op certificates of shard certificates (``parity certify --shard i/n``, each a parsed
    JSON document), combined into those of the unsharded run: every shard of one run (same
    device, dtypes, candidate, implementations, contract, examples and profile), each once.
    ValueError, one line, otherwise."""
    if not docs:
        raise ValueError("merge: no certificates given")
    keys = ("device", "dtypes", "candidate", "impls", "contract", "examples", "hypothesis_profile")
    first = docs[0]
    shards = []
    for i, d in enumerate(docs):
        for k in keys:
            if d.get(k) != first.get(k):
                raise ValueError(f"merge: certificate {i + 1} differs in {k} ({d.get(k)!r}, first {first.get(k)!r})")
        sh = d.get("shard")
        if sh is None:
            raise ValueError(f"merge: certificate {i + 1} is not a shard (no shard entry)")
        shards.append((sh["index"], sh["count"]))
    counts = {n for _, n in shards}
    if len(counts) != 1 or sorted(i for i, _ in shards) != list(range(1, counts.pop() + 1)):
        raise ValueError(f"merge: expected shards 1..n of one run once each, got {sorted(f'{i}/{n}' for i, n in shards)}")
    by_op: dict = {}
    for d in docs:
        for o in d["ops"]:
            cert = OpCertificate.from_dict(o)
            if o["op"] in by_op:
                by_op[o["op"]].runs.update(cert.runs)
            else:
                by_op[o["op"]] = cert
    order = [n for n in first["shard"]["ops"] if n in by_op]
    for cert in by_op.values():
        cert.runs = {dt: cert.runs[dt] for dt in first["dtypes"] if dt in cert.runs}
    return [by_op[n] for n in order]

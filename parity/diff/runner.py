"""The decode loop of ``parity diff``: both paths, step by step, with verdicts.

Step 0 compares the logits of the last prompt position after ``prefill``; every later step feeds
one token to both paths' ``decode`` and compares the new logits. ``steps`` steps generate
``steps`` tokens. Each step records the reference and optimized greedy tokens, the verdict of
``parity.classify_step`` against the step's noise (``noise.py``: the certified twin's where the
twin is sane there, else the ops' model-level bound), max |logit difference|, KL(ref || opt), the
reference margin between the two tokens, the flip bound and every router decision that differed
in that call (for step 0: at every prompt position).

Modes:

* ``forced``: both paths consume the reference's greedy token at every step.
* ``free``: each path consumes its own greedy token. While they agree this is the same run; at a
  split the optimized path is re-anchored to the reference token (it consumes ``ref_token``, not
  its own; without this every later step would compare logits of two different contexts) and the
  run goes on. Each split reports whether the paths re-converged: the first later step whose tokens
  agree again, or ``None`` when every step after it split too.

What is judged at every step (docs/concepts.md, "What is judged"):

* with traces, every call is replayed (``replay.py``, ``localize.py``): each layer's mixer, router
  and FFN on the engine's own inputs, its residual stream, the final norm, and the step's logits
  through lm_head from the engine's own final_norm row at the position the step reads
  (``head.py``), matches included;
* where the twin runs (every step of an engine without traces; with traces, each step whose tokens
  differ) the engine's whole logit vector is held to the step's noise (``noise.LogitsNoise``).

A step past the noise (tokens flipped past the flip bound, or logits past ``||e||``) is judged on
the replay of every position feeding it: a check past its bound, or NaN/Inf, makes it
``diverged`` and names it; with every check within its bound, a router flip excuses it only where a
counterfactual replay shows it (``excuse.py``), else it stays ``diverged`` (a matched step whose
logits are past the noise keeps its token verdict; the run is then ``past-bound``). There is no
excuse without traces.

After the last step the run is localized once more (``DiffResult.final``), so a bug that never
flipped a token is still reported: numbers past their bound are not a clean run (the run's verdict
is then ``past-bound``, the CLI exits 1), even when every token agrees. Every engine's logits are
also held to lm_head's span (``logits.py``).

``tokens`` (a dump's own tokens, ``tokens[0]`` the last prompt token) makes both paths consume
them instead of the reference's: an engine that already ran (free mode) cannot be re-anchored, so
the reference follows it, every step compares the same context, and a split is a step where the
engine's greedy token left the reference's.

``PromptRun`` is one prompt's diff between its calls (it judges each step); ``diff_prompt`` drives
one through ``prefill`` and ``decode`` (``run_diff``: the same, its ``Decode`` given as keywords),
``parity.diff.batch`` several through ``decode_batch``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from parity.bounds.core import precision_for
from parity.bounds.model import logit_rel_bound
from parity.metrics import dtype_of, to_host, to_numpy

from .excuse import Routes, candidates, replay_flip, replay_routing
from .head import LmHead
from .job import Decode
from .localize import Localization, ReplayStats, first_nonfinite
from .logits import LmHeadSpan, output_roundoff
from .numerics import finite_or_none
from .replay import HostWeights, OpError, Replay, ReplayCall, riders, trace_roundoff
from .step import StepLogits, StepRecord, coarser
from .twin import twin_for

__all__ = ["MODES", "VERDICTS", "RUN_VERDICTS", "Decode", "DiffResult", "PromptRun", "StepLogits", "StepRecord",
           "diff_prompt", "run_diff", "summary_line"]

MODES = ("forced", "free")
VERDICTS = ("match", "near-tie", "diverged")
RUN_VERDICTS = ("match", "near-tie", "past-bound", "diverged")  # past-bound: no step diverged, but
                                                               # numbers are past their bound
HERE = object()  # ``PromptRun.judge``: a part the batch did not take beforehand is taken here
NO_TRACES = ("no traces: every step's logits held to the certified twin's noise; no op replayed and no router "
             "flip shown, so a bug that moves no logit past that noise is not seen")


@dataclass
class DiffResult:
    mode: str
    dtype: str
    prompt_ids: list[int]
    steps: list[StepRecord]
    splits: list[dict]  # free mode: {"step", "verdict", "reconverged_at"}
    final: Localization | None = None  # every position of the run, after the last step
    rounding: str = "nearest"          # the platform's conversion to ``dtype``
    traced: bool = True                # the optimized path filled its traces
    follow: str = "reference"          # whose tokens both paths consumed: "reference" | "engine"
    twin: str = "no twin"              # where the flip noise came from (``parity.diff.twin``)
    logits_lossy: str | None = None    # the engine's logits came back coarser than its run dtype
    drift: dict | None = None          # per layer, how far the engine's stream drifted from the
                                       # reference's own run (a picture, not a judge)

    @property
    def counts(self) -> dict:
        return {v: sum(s.verdict == v for s in self.steps) for v in VERDICTS}

    @property
    def past_bound(self) -> str | None:
        """What is past its bound although no step diverged (a check of the replay, else the
        logits against their noise or lm_head's span), or None."""
        if self.counts["diverged"]:
            return None
        f = self.final
        if f is not None and f.localized:
            return f.describe()
        s = next((s for s in self.steps if s.past_noise), None)
        if s is not None:
            return f"step {s.step}: {s.noise.describe()}"
        s = next((s for s in self.steps if s.logits is not None and s.logits.units > 1), None)
        return f"step {s.step}: {s.logits.describe()}" if s is not None else None

    @property
    def verdict(self) -> str:
        """``diverged`` (a step diverged), ``past-bound`` (none did, but numbers are past their
        bound), ``near-tie`` or ``match``."""
        c = self.counts
        if c["diverged"]:
            return "diverged"
        if self.past_bound is not None:
            return "past-bound"
        return "near-tie" if c["near-tie"] else "match"

    @property
    def localization(self) -> Localization | None:
        """What the report explains: the localization of the first diverged step, else of the first
        step a counterfactual explained, else of the whole run when a check is past its bound
        although no step diverged; None when there is nothing to explain (plain near-ties need no
        localization)."""
        for want in ("op", "router"):
            for s in self.steps:
                if s.localization is not None and (s.cause == want or want == "op" and s.verdict == "diverged"):
                    return s.localization
        f = self.final
        return f if f is not None and f.localized else None

    @property
    def twin_set_aside(self) -> list[dict]:
        """The steps where the twin ran but its noise was not used, and why."""
        return [{"step": s.step, "why": s.twin_note} for s in self.steps if s.twin_note is not None]

    def summary(self) -> dict:
        c = self.counts
        return {"steps": len(self.steps), "match": c["match"], "near_tie": c["near-tie"],
                "diverged": c["diverged"], "verdict": self.verdict, "past_bound": self.past_bound,
                "traces": self.traced, "twin": self.twin, "twin_set_aside": self.twin_set_aside,
                "logits_lossy": self.logits_lossy, "drift": self.drift, "line": summary_line(self)}


def _fmt(x: float) -> str:
    return f"{x:.3g}" if x is not None and np.isfinite(x) else str(x)


def summary_line(result: DiffResult) -> str:
    """``122/128 tokens match, 1 near-tie (step 7, margin 0.004 < bound 0.011), 0 diverged``."""
    c, n = result.counts, len(result.steps)
    parts = [f"{c['match']}/{n} tokens match"]
    ties = [s for s in result.steps if s.verdict == "near-tie"]
    word = "near-tie" if len(ties) == 1 else "near-ties"
    if ties:
        s = max(ties, key=lambda s: s.ratio if np.isfinite(s.ratio) else np.inf)
        where = f"step {s.step}" if len(ties) == 1 else "steps " + ", ".join(str(t.step) for t in ties[:6]) \
            + (", ..." if len(ties) > 6 else "") + f"; worst step {s.step}"
        if s.cause == "router":
            parts.append(f"{len(ties)} {word} ({where}, router flip shown: {s.explanation})")
        else:
            parts.append(f"{len(ties)} {word} ({where}, margin {_fmt(s.ref_margin)} <= bound {_fmt(s.bound)})")
    else:
        parts.append(f"0 {word}")
    bad = [s for s in result.steps if s.verdict == "diverged"]
    if bad:
        s = bad[0]
        rel = "<=" if s.classified == "near-tie" else ">"
        text = f"{len(bad)} diverged (first: step {s.step}, margin {_fmt(s.ref_margin)} {rel} bound {_fmt(s.bound)}"
        if s.cause == "nonfinite" or s.explanation is not None:
            text += f"; {s.explanation}"
        parts.append(text + ")")
    else:
        parts.append("0 diverged")
    line = ", ".join(parts)
    if result.past_bound is not None:
        line += f"; not clean: past its bound although no step diverged: {result.past_bound}"
    if result.mode == "free" and result.splits:
        conv = sum(sp["reconverged_at"] is not None for sp in result.splits)
        line += f"; free mode: {len(result.splits)} split(s), {conv} re-converged"
    aside = result.twin_set_aside
    if aside:
        line += (f"; the twin's noise set aside at {len(aside)} step(s) (step {aside[0]['step']}: "
                 f"{aside[0]['why']})")
    if result.logits_lossy is not None:
        line += (f"; logits stored as {result.logits_lossy}, coarser than the {result.dtype} run: their "
                 "rounding joins the flip bound")
    if not result.traced:
        line += f"; {NO_TRACES}"
    return line


class Drift:
    """End to end: the median over positions of ``||h_engine - h_reference|| / ||h_reference||`` of
    each layer's stream, both paths running on their own (how far the paths drift; replay judges)."""

    def __init__(self, config):
        self.config = config
        self.err: dict[str, list[np.ndarray]] = {}

    def add(self, ref_trace: dict, opt_trace: dict) -> None:
        for i in range(self.config.num_hidden_layers):
            k = f"layers.{i}.hidden"
            if k in ref_trace and k in opt_trace:
                r = to_numpy(ref_trace[k]).astype(np.float64)
                o = to_numpy(opt_trace[k]).astype(np.float64).reshape(r.shape)
                with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
                    e = np.linalg.norm(o - r, axis=-1) / np.linalg.norm(r, axis=-1)
                self.err.setdefault(k, []).append(np.where(np.isfinite(e), e, np.inf))

    def summary(self) -> dict:
        return {k: finite_or_none(float(np.median(np.concatenate(v)))) for k, v in self.err.items()}


def run_diff(ref_model, opt_model, prompt_ids: list[int], *, config, steps: int, mode: str = "forced",
             dtype: str = "bfloat16", rounding: str = "nearest",
             on_step: Callable[[StepRecord], None] | None = None,
             on_logits: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
             localize: bool = True, tokens: list[int] | None = None,
             lm_head: LmHeadSpan | None = None, twin="auto", twin_every_step: bool = False) -> DiffResult:
    """Decode ``steps`` tokens on both paths and compare them step by step (module docstring).

    ``ref_model``: the reference; ``opt_model``: the optimized model or any engine
    (``parity.diff.engines``), wrapped in ``CheckedEngine`` by callers that take outside engines;
    ``prompt_ids``: at least one token id below ``config.vocab_size``; ``dtype``: the engine's
    compute dtype and ``rounding`` how its platform converts to it ("nearest" on a GPU,
    "toward-zero" under the Triton interpreter: ``parity.platform.store_rounding``); together they
    set ``u`` of the bounds. ``tokens``: ``[steps]`` tokens both paths consume instead of the
    reference's (``tokens[0]`` the last prompt token; a free-mode dump's own). ``lm_head``: the
    checkpoint's ``LmHeadSpan``, to hold the logits to their own bound (None: not checked).
    ``twin``: where the noise that may excuse a flip comes from (``parity.diff.twin``): "auto"
    (``twin_for``: never the engine under test), a ``Twin``, or None (no twin: flips and logits are
    held to the ops' model-level bound only); ``twin_every_step``: run the twin at every step, not only
    where the engine has no traces or the tokens differ (a golden keeps every step's noise bound).
    ``on_step(record)`` is called after each step, ``on_logits(step, ref, opt)`` with both float64
    logit vectors (golden files keep digests of them).
    """
    decode = Decode(config, steps, mode=mode, dtype=dtype, rounding=rounding, localize=localize, tokens=tokens,
                    lm_head=lm_head, twin=twin, twin_every_step=twin_every_step)
    return diff_prompt(ref_model, opt_model, prompt_ids, decode, on_step=on_step, on_logits=on_logits)


def diff_prompt(ref_model, opt_model, prompt_ids: list[int], decode: Decode, *,
                on_step: Callable[[StepRecord], None] | None = None,
                on_logits: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> DiffResult:
    """``run_diff`` with its settings as one ``Decode``: ``decode.steps`` steps of one prompt
    through ``prefill`` and ``decode``, each judged by a ``PromptRun``."""
    run = PromptRun(ref_model, opt_model, prompt_ids, decode, on_step=on_step, on_logits=on_logits)
    ref_cache = opt_cache = None
    for step in range(decode.steps):
        rt, ot, call = {}, {}, None
        if step == 0:
            opt_logits, opt_cache = opt_model.prefill(list(run.seq), trace=ot)
            opt_logits, ot = on_host(opt_logits, ot)
            ref_logits, ref_cache, call = prefill_riding(run, ot, rt)
        else:
            ref_logits, ref_cache = ref_model.decode(run.seq[-1], ref_cache, trace=rt)
            opt_logits, opt_cache = opt_model.decode(run.seq[-1], opt_cache, trace=ot)
            opt_logits, ot = on_host(opt_logits, ot)
        ref_logits, rt = on_host(ref_logits, rt)
        run.judge(run.logits(step, ref_logits, opt_logits, rt, ot), rt, ot, call=call)
    return run.result()


def prefill_riding(run: "PromptRun", ot: dict, rt: dict) -> tuple:
    """The reference's prefill of ``run``'s prompt (its trace into ``rt``) with the replay of the
    engine's prefill (trace ``ot``, on the host) riding along with its FFNs (``replay.riders``):
    ``(logits, cache, the replay's ReplayCall)``; the call is None (replayed by ``judge``, or not at
    all) where the engine filled no trace or the run does not localize."""
    ids = list(run.seq)
    if not (ot and run.localize):
        logits, cache = run.ref_model.prefill(ids, trace=rt)
        return logits, cache, None
    riding = riders([run.replay], [ids], [ot])
    logits, cache = run.ref_model.prefill(ids, trace=rt, riders=riding)
    return logits, cache, run.replay.add(ids, ot, riders=riding)


def on_host(logits, trace: dict) -> tuple:
    """``(logits, trace)`` of one call on the host, in one transfer a dtype (``to_host``): a call's
    many trace entries are read one by one, by every prompt of a batch, and would otherwise cross
    from the device at each read."""
    trace = to_host({**trace, "": logits})
    return trace.pop(""), trace


class PromptRun:
    """One prompt's diff between its calls: what both paths consumed, the records so far, the
    replay of the engine's calls and the statistics the localization reads. ``judge`` takes one
    step's logits and traces (a prefill at step 0, else one decode of ``seq[-1]``) and records the
    step; ``result`` gives the ``DiffResult``. ``run_diff`` drives one run a step at a time;
    ``parity.diff.batch`` drives several in lockstep through both paths' ``decode_batch``: the
    judging is this one code either way, so a prompt's result does not depend on its batch.
    Arguments: the models and the prompt as ``run_diff``'s, its settings as one ``Decode``;
    ``on_step``, ``on_logits`` as ``run_diff``'s; ``host_weights``: the reference's router weights
    on the host, shared by the runs of a batch (None: the run's own); ``head``: the checkpoint's
    ``LmHead``, shared likewise (None: the run's own, read when first needed)."""

    def __init__(self, ref_model, opt_model, prompt_ids: list[int], decode: Decode, *,
                 on_step: Callable[[StepRecord], None] | None = None,
                 on_logits: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
                 host_weights: HostWeights | None = None, head: LmHead | None = None):
        d = decode
        self.prompt = _check_args(d.mode, d.steps, prompt_ids, d.config, d.tokens)
        self.ref_model, self.opt_model, self.config = ref_model, opt_model, d.config
        self.steps, self.mode, self.dtype, self.rounding = d.steps, d.mode, d.dtype, d.rounding
        self.on_step, self.on_logits, self.localize, self.tokens, self.lm_head = (
            on_step, on_logits, d.localize, d.tokens, d.lm_head)
        self.precision = precision_for(d.dtype, rounding=d.rounding)
        self.twin = twin_for(opt_model, ref_model, dtype=d.dtype) if d.twin == "auto" else d.twin
        self._head, self.twin_every_step = head, d.twin_every_step
        # what both paths have consumed (the optimized path is always re-anchored)
        self.seq = list(self.prompt)
        self.records: list[StepRecord] = []
        self.splits: list[dict] = []
        self.replay = Replay(ref_model, d.config, u=self.precision.u, ua=self.precision.ua, host=host_weights)
        self.stats = ReplayStats(d.config)    # every check of every engine call, on its own inputs
        self.drift = Drift(d.config)
        self.routes = Routes(d.config)        # both paths' own expert choices, position by position
        self.traced = True
        self.lossy = None

    @property
    def localizes(self) -> bool:
        """Whether the engine's calls are replayed and localized (known after step 0: an engine
        that filled no trace at its prefill is judged on its logits alone)."""
        return self.traced and self.localize

    @property
    def head(self) -> LmHead:
        """The checkpoint's lm_head (``head.py``), read on first use (the span's copy where the
        run has one)."""
        if self._head is None:
            self._head = LmHead.of(self.ref_model.source, self.config, span=self.lm_head)
        return self._head

    def stored_dtype(self, opt_logits) -> str | None:
        """The dtype the engine returned ``opt_logits`` in (its own word for it, else theirs)."""
        return getattr(self.opt_model, "stored_logits_dtype", None) or dtype_of(opt_logits)

    def logits_roundoff(self, opt_logits) -> float:
        """``u_out`` of the logits' own bound for logits returned as ``opt_logits``."""
        return output_roundoff(self.precision, self.stored_dtype(opt_logits))

    def logits(self, step: int, ref_logits, opt_logits, rt: dict, ot: dict) -> StepLogits:
        """Step ``step``'s logits on the host, as ``judge`` reads them (``rt``, ``ot``: both paths'
        traces of the call): the twin's too where it runs (every step of an engine without traces,
        else where the greedy tokens differ: with traces each step's logits are replayed through
        lm_head instead), the ops' model-level bound from the reference's own final-norm row, and
        ``on_logits`` called. The calls of one run are made in step order."""
        config, seq, twin = self.config, self.seq, self.twin
        if step == 0:
            self.traced = bool(ot)
        r = to_numpy(ref_logits).reshape(-1, config.vocab_size)[-1]
        o = to_numpy(opt_logits).reshape(-1, config.vocab_size)[-1]
        if self.on_logits is not None:
            self.on_logits(step, r, o)
        self.lossy = self.lossy or coarser(self.stored_dtype(opt_logits), self.dtype)
        out = StepLogits(step=step, position=len(seq) - 1, input_token=None if step == 0 else seq[-1], r=r, o=o,
                         t=None, dtype=self.dtype, lossy=self.lossy, stored=self.stored_dtype(opt_logits),
                         scale=getattr(twin, "arith_scale", 1.0))
        if out.flipped or not self.localizes or self.twin_every_step:
            out.t = None if twin is None else twin.logits(seq, len(self.prompt))
            out.certified = self.certified(rt, len(seq))
        return out

    def certified(self, rt: dict, S: int) -> np.ndarray | None:
        """The ops' model-level bound ``[vocab]`` of the logits at position ``S - 1``
        (``parity.bounds.model``) from the reference's own final-norm row in ``rt``; None where the
        reference traced none."""
        h = rt.get("final_norm")
        if h is None or getattr(self.ref_model, "source", None) is None:
            return None
        row = to_numpy(h).reshape(-1, self.config.hidden_size)[-1].astype(np.float64)
        return logit_rel_bound(self.config, S, self.dtype) * self.head.magnitude(row)

    def judge(self, logits: StepLogits, rt: dict, ot: dict, *, call: ReplayCall | None = None,
              logits_check=HERE, nonfinite=HERE, record: StepRecord | None = None) -> StepRecord:
        """Step ``logits.step`` from both paths' logits of this call (``PromptRun.logits``) and their
        traces ``rt``, ``ot``; the token both paths consume next is appended to ``seq``. Taken
        beforehand (a batch's decode steps take them for their prompts together), else here:
        ``call``: this call's replay (``replay.replay_batch``; None: ``Replay.add`` here);
        ``logits_check``: the logits' own check (``LmHeadSpan.check_rows``) or ``HERE``;
        ``nonfinite``: the first NaN/Inf of ``ot`` (``first_nonfinite``; None: a batch whose whole
        trace is finite) or ``HERE``; ``record``: ``logits.record()`` (None: taken here)."""
        config, seq, precision = self.config, self.seq, self.precision
        step, o = logits.step, logits.o
        call_ids = list(seq) if step == 0 else [seq[-1]]
        rec = logits.record() if record is None else record
        localize = self.localizes
        nonfinite = first_nonfinite(ot, config) if nonfinite is HERE else nonfinite
        if localize:
            call = self.replay.add(call_ids, ot) if call is None else call
            rec.head = self._replay_head(call, ot, logits)
            self.stats.add(call, nonfinite)
            rec.router = call.flips
            self.drift.add(rt, ot)
            self.routes.add(rt, ot)
        if nonfinite is not None:
            rec.nonfinite = {**nonfinite, "position": nonfinite["position"] + len(seq) - len(call_ids)}
        elif not np.all(np.isfinite(o)):
            rec.nonfinite = {"name": "logits", "layer": None, "position": rec.position,
                             "nan": int(np.isnan(o).sum()), "inf": int(np.isinf(o).sum())}
        if logits_check is not HERE:
            rec.logits = logits_check
        elif self.lm_head is not None:
            rec.logits = self.lm_head.check(o, u_out=output_roundoff(precision, logits.stored), ua=precision.ua)
        if rec.nonfinite is not None:  # NaN/Inf is never clean, whatever the tokens did
            rec.verdict, rec.cause = "diverged", "nonfinite"
            rec.explanation = (f"first NaN/Inf at {rec.nonfinite['name']} "
                               f"(position {rec.nonfinite['position']})")
        else:
            self._settle(rec, logits)
            if rec.verdict != "match" and rec.cause != "op" and rec.logits is not None and rec.logits.units > 1:
                rec.verdict, rec.cause, rec.explanation = "diverged", "op", rec.logits.describe()
        tokens = self.tokens
        _track_split(rec, self.splits, free=self.mode == "free", anchor=tokens is None)
        self.records.append(rec)
        if self.on_step is not None:
            self.on_step(rec)
        seq.append(rec.ref_token if tokens is None or step + 1 >= self.steps else int(tokens[step + 1]))
        return rec

    def _replay_head(self, call: ReplayCall, ot: dict, logits: StepLogits):
        """The step's logits replayed through lm_head from the engine's final_norm row at the
        position the step reads (``head.py``), added to ``call`` as its ``lm_head`` check (units at
        that position, 0 at the call's others); None where the trace holds no final_norm."""
        x = ot.get("final_norm")
        if x is None:
            return None
        rows = to_numpy(x).reshape(-1, self.config.hidden_size)
        p = self.precision
        check = self.head.check(rows[-1].astype(np.float64), logits.o, position=logits.position,
                                u_out=output_roundoff(p, logits.stored), ua=p.ua,
                                u_w=self.head.weight_roundoff(self.dtype), l_x=trace_roundoff(x, p.u))
        T = rows.shape[0]
        err = np.zeros(T)
        err[-1] = check.units
        call.ops.append(OpError("lm_head", None, "lm_head", err, np.zeros(T), np.ones(T)))
        return check

    def _settle(self, rec: StepRecord, logits: StepLogits) -> None:
        """The verdict of a step past its noise (its margin past the flip bound, or its logits past
        ``||e||``), from the replay of every position feeding it: a check past its bound names it;
        else a router flip excuses it only where a counterfactual shows it (``excuse.py``)."""
        past = rec.verdict == "diverged" or (rec.noise is not None and rec.noise.units > 1)
        if rec.verdict == "match" and not past:
            return
        if not self.localizes:  # nothing to replay, no flip to show (the summary line says so)
            return
        loc = self.stats.localize(rec.step, self.stats.positions, precision=self.precision)
        rec.localization = loc
        if loc.localized:
            if rec.verdict != "match":
                rec.verdict, rec.cause, rec.explanation = "diverged", "op", loc.describe()
            return
        if not past:
            return  # a near-tie: its margin within the flip bound, every check within its bound
        tokens_differ = rec.ref_token != rec.opt_token
        cf = self._show(rec, logits, loc)
        rec.counterfactual = cf
        if cf is not None and cf.shown:
            loc.shown, loc.first_kind = cf, "router"
            loc.explained_by_router = [cf.flip] if cf.flip is not None else []
            loc.first_position = cf.flip.position if cf.flip is not None else cf.first[1]
            rec.cause, rec.explanation = "router", cf.describe()
            if tokens_differ:
                rec.verdict = "near-tie"
            return
        if tokens_differ:
            rec.verdict = "diverged"
        tried = f"; replayed: {cf.describe()}" if cf is not None else "; no router flip or routing split to replay"
        rec.explanation = (f"past the noise although every check is within its bound ({loc.describe()}){tried}: "
                           "a bug below the checks' bounds, or one that accumulates")

    def _show(self, rec: StepRecord, logits: StepLogits, loc: Localization):
        """The counterfactual that shows a router decision explains the step (``excuse.py``): the
        latest replayed flips one at a time, then the whole routing split; the first that shows it,
        else the last tried (None: nothing to try)."""
        e = logits.noise().e
        seq, o, last = list(self.seq), logits.o, None
        engine = self.routes.engine()
        for flip in candidates(loc.router_flips, rec.position):
            if flip.layer not in engine:
                continue
            last = replay_flip(self.ref_model, seq, flip, engine[flip.layer][flip.position], o, e, self.dtype)
            if last.shown:
                return last
        split = self.routes.split()
        if split is not None:
            last = replay_routing(self.ref_model, seq, engine, split, o, e, self.dtype)
        return last

    def result(self) -> DiffResult:
        """The run after its last step (localized once more over every position)."""
        localize = self.localizes
        final = self.stats.localize(self.steps - 1, self.stats.positions, precision=self.precision) \
            if localize else None
        twin = self.twin
        return DiffResult(mode=self.mode, dtype=self.dtype, prompt_ids=self.prompt, steps=self.records,
                          splits=self.splits, final=final, rounding=self.rounding, traced=self.traced,
                          follow="reference" if self.tokens is None else "engine",
                          twin="no twin" if twin is None else twin.describe(), logits_lossy=self.lossy,
                          drift=self.drift.summary() if localize else None)


def _check_args(mode, steps, prompt_ids, config, tokens) -> list[int]:
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    if steps < 1:
        raise ValueError(f"steps: expected a positive number, got {steps}")
    prompt = [int(t) for t in prompt_ids]
    if not prompt:
        raise ValueError("prompt: no tokens")
    bad = [t for t in prompt + list(tokens or []) if not 0 <= int(t) < config.vocab_size]
    if bad:
        raise ValueError(f"token ids outside the vocabulary [0, {config.vocab_size}): {bad[:5]}")
    if tokens is not None and (len(tokens) < steps or int(tokens[0]) != prompt[-1]):
        raise ValueError(f"tokens: expected {steps} or more, the first being the last prompt token")
    return prompt


def _track_split(rec: StepRecord, splits: list[dict], *, free: bool, anchor: bool) -> None:
    """Free mode: a split where the tokens differ (the optimized path re-anchored when ``anchor``;
    a dump followed by the reference is not), and the step where the paths agree again."""
    if rec.ref_token != rec.opt_token:
        if free:
            rec.anchored = anchor
            splits.append({"step": rec.step, "verdict": rec.verdict, "reconverged_at": None})
    elif splits and splits[-1]["reconverged_at"] is None:
        for sp in splits:
            if sp["reconverged_at"] is None:
                sp["reconverged_at"] = rec.step

"""The decode loop of ``parity diff``: both paths, step by step, with verdicts.

Step 0 compares the logits of the last prompt position after ``prefill``; every later step feeds
one token to both paths' ``decode`` and compares the new logits. ``steps`` steps generate
``steps`` tokens. Each step records the reference and optimized greedy tokens, the verdict of
``parity.classify_step`` (refined by localization, below), max |logit difference|,
KL(ref || opt), the reference margin between the two tokens, the step's noise bound and every router
decision that differed in that call (for step 0: at every prompt position).

Modes:

* ``forced``: both paths consume the reference's greedy token at every step.
* ``free``: each path consumes its own greedy token. While they agree this is the same run; at a
  split the optimized path is re-anchored to the reference token (it consumes ``ref_token``, not
  its own; without this every later step would compare logits of two different contexts) and the
  run goes on. Each split reports whether the paths re-converged: the first later step whose tokens
  agree again, or ``None`` when every step after it split too.

Every step whose tokens differ is localized (``localize.py``) from the traces both paths wrote so
far (every prompt and decode position, the decode kernels included), and the verdict of
``classify_step`` is refined by it:

* an op past its bound (other than a router flip in noise) makes the step ``diverged``, even one
  that ``classify_step`` called a near-tie: the noise that excused the flip is itself a bug;
* otherwise ``diverged`` becomes ``near-tie`` when the first thing past its bound is a router flip
  within its noise bound (the MoE FFN spikes exactly where the router swapped an expert), or when
  no op is past its bound and the router flipped within noise: the flip explains the logit jump.

After the last step the run is localized once more (``DiffResult.final``), so a bug that never
flipped a token is still reported: numbers past their bound are not a clean run (the run's verdict
is then ``past-bound``, the CLI exits 1), even when every token agrees.

The optimized path may be any engine (``parity.engines``). One that fills no trace is not localized:
its steps are judged on their logits alone, and the summary line says so. Every engine's logits are
also held to their own bound (``logits.py``: the part outside lm_head's span); past it, a step whose
tokens differ is ``diverged`` and a run whose tokens agree is ``past-bound``.

``tokens`` (a dump's own tokens, ``tokens[0]`` the last prompt token) makes both paths consume
them instead of the reference's: an engine that already ran (free mode) cannot be re-anchored, so
the reference follows it, every step compares the same context, and a split is a step where the
engine's greedy token left the reference's.

``PromptRun`` is one prompt's diff between its calls (it judges each step); ``run_diff`` drives one
through ``prefill`` and ``decode``, ``parity.diff.batch`` several through ``decode_batch``.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from parity.bounds.core import UNIT_ROUNDOFF, precision_for
from parity.metrics import dtype_of, to_host, to_numpy
from parity.neartie import classify_step, twin_bound

from .localize import Localization, ReplayStats, first_nonfinite
from .logits import LmHeadSpan, LogitsCheck, output_roundoff
from .numerics import finite_or_none, kl_divergence, max_abs_diff
from .replay import HostWeights, Replay, ReplayCall, riders
from .router import RouterFlip
from .twin import twin_for

MODES = ("forced", "free")
VERDICTS = ("match", "near-tie", "diverged")
RUN_VERDICTS = ("match", "near-tie", "past-bound", "diverged")  # past-bound: no step diverged, but
                                                               # numbers are past their bound
HERE = object()  # ``PromptRun.judge``: a part the batch did not take beforehand is taken here
NO_TRACES = ("no traces: verdicts from the logits against the certified twin's noise; no op replayed, "
             "a bug that moves no token past that noise is not seen")


@dataclass
class StepRecord:
    step: int
    position: int            # sequence index whose logits are compared
    input_token: int | None  # token both paths consumed before this step (None: step 0, the prompt)
    ref_token: int
    opt_token: int
    verdict: str             # match | near-tie | diverged (after router explanation)
    classified: str          # classify_step's own verdict
    max_abs_diff: float
    kl: float
    ref_margin: float        # r[ref_token] - r[opt_token] (0 for a match)
    bound: float | None  # the flip bound (None: the tokens agree and the twin did not run)
    ratio: float
    ref_gap: float = 0.0     # r[ref_token] - the reference's runner-up: how far from any flip
    router: list[RouterFlip] = field(default_factory=list)
    explanation: str | None = None  # why the verdict differs from ``classified``, or what localized it
    cause: str | None = None        # "router": a router flip in noise; "op": an op past its bound
    nonfinite: dict | None = None
    anchored: bool = False   # free mode: the optimized path was re-anchored after this step
    logits: LogitsCheck | None = None  # the logits' own bound (None: the check did not apply)
    localization: Localization | None = None  # steps whose tokens differ (not in to_dict: the
                                              # report carries the one that matters)

    def to_dict(self) -> dict:
        return {
            "step": self.step, "position": self.position, "input_token": self.input_token,
            "ref_token": self.ref_token, "opt_token": self.opt_token, "verdict": self.verdict,
            "classified": self.classified, "max_abs_diff": finite_or_none(self.max_abs_diff),
            "kl": finite_or_none(self.kl), "ref_margin": finite_or_none(self.ref_margin),
            "bound": finite_or_none(self.bound), "ratio": finite_or_none(self.ratio),
            "ref_gap": finite_or_none(self.ref_gap),
            "router": [f.to_dict() for f in self.router], "explanation": self.explanation,
            "cause": self.cause,
            "nonfinite": self.nonfinite, "anchored": self.anchored,
            "logits": self.logits.to_dict() if self.logits is not None else None,
        }


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
    twin: str = "the engine itself"    # where the flip noise came from (``parity.diff.twin``)
    logits_lossy: str | None = None    # the engine's logits came back coarser than its run dtype
    drift: dict | None = None          # per layer, how far the engine's stream drifted from the
                                       # reference's own run (a picture, not a judge)

    @property
    def counts(self) -> dict:
        return {v: sum(s.verdict == v for s in self.steps) for v in VERDICTS}

    @property
    def past_bound(self) -> str | None:
        """What is past its bound although no step diverged (an op, else the logits), or None."""
        if self.counts["diverged"]:
            return None
        f = self.final
        if f is not None and (f.first is not None or f.nonfinite is not None):
            return f.describe()
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
        step a router flip explains, else of the whole run when an op is past its bound although no
        token flipped; None when there is nothing to explain (plain near-ties need no localization)."""
        for want in ("op", "router"):
            for s in self.steps:
                if s.localization is not None and (s.cause == want or want == "op" and s.verdict == "diverged"):
                    return s.localization
        f = self.final
        return f if f is not None and (f.first is not None or f.nonfinite is not None) else None

    def summary(self) -> dict:
        c = self.counts
        return {"steps": len(self.steps), "match": c["match"], "near_tie": c["near-tie"],
                "diverged": c["diverged"], "verdict": self.verdict, "past_bound": self.past_bound,
                "traces": self.traced, "twin": self.twin, "logits_lossy": self.logits_lossy,
                "drift": self.drift, "line": summary_line(self)}


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
            parts.append(f"{len(ties)} {word} ({where}, {s.explanation})")
        else:
            parts.append(f"{len(ties)} {word} ({where}, margin {_fmt(s.ref_margin)} <= bound {_fmt(s.bound)})")
    else:
        parts.append(f"0 {word}")
    bad = [s for s in result.steps if s.verdict == "diverged"]
    if bad:
        s = bad[0]
        if s.classified == "near-tie":  # within the logit noise, but the noise itself is past its bound
            text = (f"{len(bad)} diverged (first: step {s.step}, margin {_fmt(s.ref_margin)} <= bound "
                    f"{_fmt(s.bound)} of a noise that is itself past its bound")
        else:
            text = f"{len(bad)} diverged (first: step {s.step}, margin {_fmt(s.ref_margin)} > bound {_fmt(s.bound)}"
        loc = result.localization
        if loc is not None and not loc.explained_by_router:
            text += f"; {loc.describe()}"
        parts.append(text + ")")
    else:
        parts.append("0 diverged")
    line = ", ".join(parts)
    if result.past_bound is not None:
        line += f"; not clean: past its bound although no step diverged: {result.past_bound}"
    if result.mode == "free" and result.splits:
        conv = sum(sp["reconverged_at"] is not None for sp in result.splits)
        line += f"; free mode: {len(result.splits)} split(s), {conv} re-converged"
    if result.logits_lossy is not None:
        line += (f"; logits stored as {result.logits_lossy}, coarser than the {result.dtype} run: their "
                 "rounding joins the flip bound")
    if not result.traced:
        line += f"; {NO_TRACES}"
    return line


class Routes:
    """Both paths' own expert choices (``layers.i.router.ids``) over the calls of one run: where the
    engine's stream drifted (every op within its bound), its router may choose otherwise than the
    reference's own run, a whole expert apart although each choice is right for its own input."""

    def __init__(self, config):
        self.layers = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
        self.ref: dict[int, list[np.ndarray]] = {i: [] for i in self.layers}
        self.eng: dict[int, list[np.ndarray]] = {i: [] for i in self.layers}

    def add(self, ref_trace: dict, opt_trace: dict) -> None:
        for i in self.layers:
            k = f"layers.{i}.router.ids"
            if k in ref_trace and k in opt_trace:
                self.ref[i].append(np.sort(to_numpy(ref_trace[k]).astype(np.int64), axis=-1))
                self.eng[i].append(to_numpy(opt_trace[k]).astype(np.int64))

    def engine(self) -> dict:
        """``{layer: ids [T, k_e]}``: the engine's choices at every position so far."""
        return {i: np.concatenate(v) for i, v in self.eng.items() if v}

    def split(self) -> tuple[int, int, int] | None:
        """``(count, first layer, first position)`` of the choices the two runs made differently."""
        first, n = None, 0
        for i, v in self.engine().items():
            diff = np.flatnonzero(np.any(np.sort(v, axis=-1) != np.concatenate(self.ref[i]), axis=-1))
            n += diff.size
            if diff.size and (first is None or (diff[0], i) < (first[1], first[0])):
                first = (i, int(diff[0]))
        return None if first is None else (n, *first)


def _rerouted(rec: StepRecord, ref_model, seq: list[int], routes: Routes, split: tuple[int, int, int],
              r, o, t, dtype: str) -> None:
    """A flip past the twin's noise while every op is within its bound, the two runs having routed
    differently upstream: the reference re-run with the engine's own expert choices (each judged
    within its noise by the replay) says whether the routing split is what moved the logits. If
    the margin is then within the twin's noise, the step is a near-tie one level down."""
    n, layer, pos = split
    r2 = to_numpy(ref_model.forward(list(seq), routing=routes.engine(), logits="last")).reshape(-1)
    v = classify_step(r2, o, bound=twin_bound(r, t, dtype=dtype), dtype=dtype)
    if v.verdict != "diverged":
        rec.verdict, rec.cause = "near-tie", "router"
        rec.explanation = (f"the two runs routed differently upstream ({n} choice(s), first layers.{layer} pos {pos}; "
                           f"each the engine's router's own, within its noise); with the engine's routing the "
                           f"reference's margin is {v.margin:.3g} <= the twin's bound {v.bound:.3g}")


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
             lm_head: LmHeadSpan | None = None, twin="auto") -> DiffResult:
    """Decode ``steps`` tokens on both paths and compare them step by step (module docstring).

    ``ref_model``: the reference; ``opt_model``: the optimized model or any engine
    (``parity.engines``), wrapped in ``CheckedEngine`` by callers that take outside engines;
    ``prompt_ids``: at least one token id below ``config.vocab_size``; ``dtype``: the engine's
    compute dtype and ``rounding`` how its platform converts to it ("nearest" on a GPU,
    "toward-zero" under the Triton interpreter: ``parity.platform.store_rounding``); together they
    set ``u`` of the bounds. ``tokens``: ``[steps]`` tokens both paths consume instead of the
    reference's (``tokens[0]`` the last prompt token; a free-mode dump's own). ``lm_head``: the
    checkpoint's ``LmHeadSpan``, to hold the logits to their own bound (None: not checked).
    ``twin``: where the noise that may excuse a flip comes from (``parity.diff.twin``): "auto" (our
    optimized model on the reference's weights at ``dtype``; the engine itself when it is that
    model), or a ``Twin``. ``on_step(record)`` is called after each step, ``on_logits(step, ref,
    opt)`` with both float64 logit vectors (golden files keep digests of them).
    """
    run = PromptRun(ref_model, opt_model, prompt_ids, config=config, steps=steps, mode=mode, dtype=dtype,
                    rounding=rounding, on_step=on_step, on_logits=on_logits, localize=localize, tokens=tokens,
                    lm_head=lm_head, twin=twin)
    ref_cache = opt_cache = None
    for step in range(steps):
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
        run.judge(run.logits(step, ref_logits, opt_logits), rt, ot, call=call)
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
    Arguments: as ``run_diff``; ``host_weights``: the reference's router weights on the host,
    shared by the runs of a batch (None: the run's own)."""

    def __init__(self, ref_model, opt_model, prompt_ids: list[int], *, config, steps: int, mode: str = "forced",
                 dtype: str = "bfloat16", rounding: str = "nearest",
                 on_step: Callable[[StepRecord], None] | None = None,
                 on_logits: Callable[[int, np.ndarray, np.ndarray], None] | None = None,
                 localize: bool = True, tokens: list[int] | None = None,
                 lm_head: LmHeadSpan | None = None, twin="auto", host_weights: HostWeights | None = None):
        self.prompt = _check_args(mode, steps, prompt_ids, config, tokens)
        self.ref_model, self.opt_model, self.config = ref_model, opt_model, config
        self.steps, self.mode, self.dtype, self.rounding = steps, mode, dtype, rounding
        self.on_step, self.on_logits, self.localize, self.tokens, self.lm_head = (
            on_step, on_logits, localize, tokens, lm_head)
        self.precision = precision_for(dtype, rounding=rounding)
        self.twin = twin_for(opt_model, ref_model, dtype=dtype) if twin == "auto" else twin
        # what both paths have consumed (the optimized path is always re-anchored)
        self.seq = list(self.prompt)
        self.records: list[StepRecord] = []
        self.splits: list[dict] = []
        self.replay = Replay(ref_model, config, u=self.precision.u, ua=self.precision.ua, host=host_weights)
        self.stats = ReplayStats(config)    # every op of every engine call, judged on its own inputs
        self.drift = Drift(config)
        self.routes = Routes(config)        # both paths' own expert choices, position by position
        self.traced = True
        self.lossy = None

    @property
    def localizes(self) -> bool:
        """Whether the engine's calls are replayed and localized (known after step 0: an engine
        that filled no trace at its prefill is judged on its logits alone)."""
        return self.traced and self.localize

    def stored_dtype(self, opt_logits) -> str | None:
        """The dtype the engine returned ``opt_logits`` in (its own word for it, else theirs)."""
        return getattr(self.opt_model, "stored_logits_dtype", None) or dtype_of(opt_logits)

    def logits_roundoff(self, opt_logits) -> float:
        """``u_out`` of the logits' own bound for logits returned as ``opt_logits``."""
        return output_roundoff(self.precision, self.stored_dtype(opt_logits))

    def logits(self, step: int, ref_logits, opt_logits) -> "StepLogits":
        """Step ``step``'s logits on the host, as ``judge`` reads them: the twin's too where the
        greedy tokens differ (the twin runs here: a match needs no noise to be judged), and
        ``on_logits`` called. The calls of one run are made in step order."""
        config, seq, twin = self.config, self.seq, self.twin
        r = to_numpy(ref_logits).reshape(-1, config.vocab_size)[-1]
        o = to_numpy(opt_logits).reshape(-1, config.vocab_size)[-1]
        if self.on_logits is not None:
            self.on_logits(step, r, o)
        flipped = int(np.argmax(r)) != int(np.argmax(np.where(np.isnan(o), -np.inf, o))) or not np.all(np.isfinite(o))
        t = o if twin is None else twin.logits(seq, len(self.prompt)) if flipped else None
        self.lossy = self.lossy or _coarser(self.stored_dtype(opt_logits), self.dtype)
        return StepLogits(step=step, position=len(seq) - 1, input_token=None if step == 0 else seq[-1], r=r, o=o,
                          t=t, dtype=self.dtype, lossy=self.lossy, stored=self.stored_dtype(opt_logits))

    def judge(self, logits: "StepLogits", rt: dict, ot: dict, *, call: ReplayCall | None = None,
              logits_check=HERE, nonfinite=HERE, record: StepRecord | None = None) -> StepRecord:
        """Step ``logits.step`` from both paths' logits of this call (``PromptRun.logits``) and their
        traces ``rt``, ``ot``; the token both paths consume next is appended to ``seq``. Taken
        beforehand (a batch's decode steps take them for their prompts together), else here:
        ``call``: this call's replay (``replay.replay_batch``; None: ``Replay.add`` here);
        ``logits_check``: the logits' own check (``LmHeadSpan.check_rows``) or ``HERE``;
        ``nonfinite``: the first NaN/Inf of ``ot`` (``first_nonfinite``; None: a batch whose whole
        trace is finite) or ``HERE``; ``record``: ``logits.record()`` (None: taken here)."""
        config, seq, precision = self.config, self.seq, self.precision
        step, r, o, t = logits.step, logits.r, logits.o, logits.t
        if step == 0:
            call_ids = list(seq)
            self.traced = bool(ot)
        else:
            call_ids = [seq[-1]]
        rec = logits.record() if record is None else record
        localize = self.localizes
        nonfinite = first_nonfinite(ot, config) if nonfinite is HERE else nonfinite
        if localize:
            call = self.replay.add(call_ids, ot) if call is None else call
            self.stats.add(call, nonfinite)
            rec.router = call.flips
            self.drift.add(rt, ot)
        if nonfinite is not None:
            rec.nonfinite = {**nonfinite, "position": nonfinite["position"] + len(seq) - len(call_ids)}
        elif not np.all(np.isfinite(o)):
            rec.nonfinite = {"name": "logits", "layer": None, "position": rec.position,
                             "nan": int(np.isnan(o).sum()), "inf": int(np.isinf(o).sum())}
        if logits_check is not HERE:
            rec.logits = logits_check
        elif self.lm_head is not None:
            rec.logits = self.lm_head.check(o, u_out=output_roundoff(precision, logits.stored), ua=precision.ua)
        if localize:
            self.routes.add(rt, ot)
            if rec.verdict != "match":  # a match needs no localization (the run's final one sees all)
                _judge(rec, self.stats.localize(step, self.stats.positions, precision=precision))
            split = self.routes.split() if rec.verdict == "diverged" and rec.cause is None else None
            if split is not None:
                _rerouted(rec, self.ref_model, seq, self.routes, split, r, o, t, self.dtype)
        if rec.nonfinite is not None:  # NaN/Inf is never clean, whatever the tokens did
            rec.verdict, rec.cause = "diverged", "nonfinite"
            rec.explanation = (f"first NaN/Inf at {rec.nonfinite['name']} "
                               f"(position {rec.nonfinite['position']})")
        elif rec.verdict != "match" and rec.cause != "op" and rec.logits is not None and rec.logits.units > 1:
            rec.verdict, rec.cause, rec.explanation = "diverged", "op", rec.logits.describe()
        tokens = self.tokens
        _track_split(rec, self.splits, free=self.mode == "free", anchor=tokens is None)
        self.records.append(rec)
        if self.on_step is not None:
            self.on_step(rec)
        seq.append(rec.ref_token if tokens is None or step + 1 >= self.steps else int(tokens[step + 1]))
        return rec

    def result(self) -> DiffResult:
        """The run after its last step (localized once more over every position)."""
        localize = self.localizes
        final = self.stats.localize(self.steps - 1, self.stats.positions, precision=self.precision) \
            if localize else None
        twin = self.twin
        return DiffResult(mode=self.mode, dtype=self.dtype, prompt_ids=self.prompt, steps=self.records,
                          splits=self.splits, final=final, rounding=self.rounding, traced=self.traced,
                          follow="reference" if self.tokens is None else "engine",
                          twin="the engine itself" if twin is None else twin.describe(), logits_lossy=self.lossy,
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


@dataclass
class StepLogits:
    """One step's logits on the host (``PromptRun.logits``): the reference's ``r``, the engine's
    ``o`` (float64 ``[vocab]``) and the twin's ``t`` (None: the tokens agree, the twin did not run),
    with what ``record`` judges them by."""
    step: int
    position: int
    input_token: int | None
    r: np.ndarray
    o: np.ndarray
    t: np.ndarray | None
    dtype: str
    lossy: str | None      # the engine's logits came back coarser than the run (``_coarser``)
    stored: str | None     # the dtype the engine returned its logits in

    def record(self) -> StepRecord:
        """The step judged on its logits (``_record``): host arithmetic over the vocabulary only,
        so the records of a batch's prompts may be taken side by side in threads."""
        return _record(self.step, self.position, self.input_token, self.r, self.o, self.t, self.dtype, self.lossy)


def _record(step: int, position: int, input_token, r, o, t, dtype: str, lossy: str | None) -> StepRecord:
    """The step judged on its logits: the flip bound from the twin's logits ``t`` (plus the
    rounding of logits stored coarser than the run, ``lossy``); ``t`` None: the tokens agree and the
    twin did not run (the bound is reported as None)."""
    if t is None:  # the greedy tokens agree and every logit is finite: a match (classify_step's)
        token = int(np.argmax(r))
        return StepRecord(step=step, position=position, input_token=input_token, ref_token=token,
                          opt_token=token, verdict="match", classified="match",
                          max_abs_diff=max_abs_diff(r, o), kl=kl_divergence(r, o), ref_margin=0.0,
                          bound=None, ratio=0.0, ref_gap=_gap(r))
    bound = twin_bound(r, t, dtype=dtype)
    if lossy is not None:
        with np.errstate(invalid="ignore"):
            bound = bound + UNIT_ROUNDOFF[lossy] * np.where(np.isfinite(o), np.abs(o), 0.0)
    v = classify_step(r, o, bound=bound, dtype=dtype)
    return StepRecord(
        step=step, position=position, input_token=input_token,
        ref_token=int(v.ref_token), opt_token=int(v.opt_token), verdict=v.verdict,
        classified=v.verdict, max_abs_diff=max_abs_diff(r, o), kl=kl_divergence(r, o),
        ref_margin=float(v.margin), bound=float(v.bound), ratio=float(v.ratio), ref_gap=_gap(r))


def _gap(r: np.ndarray) -> float:
    """The reference's top-1 minus its top-2: how far the step was from any flip."""
    return float(np.diff(np.partition(r, -2)[-2:])[0]) if r.size > 1 else 0.0


def _coarser(stored: str | None, dtype: str) -> str | None:
    """``stored`` when logits came back in a dtype coarser than the run's ``dtype`` (their own
    rounding then joins the flip bound, and the report says so), else None."""
    if stored is None or stored not in UNIT_ROUNDOFF or dtype not in UNIT_ROUNDOFF:
        return None
    return stored if UNIT_ROUNDOFF[stored] > UNIT_ROUNDOFF[dtype] else None


def _judge(rec: StepRecord, loc: Localization) -> None:
    """A flip is a near-tie only if every replayed op at the positions feeding this step is within
    its bound; otherwise it is diverged, named by the first op past its bound."""
    if rec.verdict == "match":
        return
    rec.localization = loc
    if loc.first is not None:
        rec.verdict, rec.cause = "diverged", "op"
        rec.explanation = loc.describe()
    elif loc.explained_by_router and (rec.verdict == "diverged" or any(
            f.position == rec.position for f in loc.explained_by_router)):
        # every op within its bound: a router flip within its own noise swapped a whole expert,
        # which may move the logits past any smooth noise (a near-tie one level down). A near-tie
        # is attributed to a flip only when the router flipped in the very call of these logits
        rec.verdict, rec.cause = "near-tie", "router"
        rec.explanation = "router flip in noise: " + loc.explained_by_router[0].describe()
    elif rec.verdict == "diverged":
        rec.explanation = ("margin past the certified twin's noise although every replayed op is within "
                           "its bound: a bug below the ops' bounds, or one that accumulates")


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

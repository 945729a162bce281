"""Replay: the float64 reference recomputes every layer from the engine's own input to that layer.

Each call of the engine (a prefill, or one decode step) comes with its trace (``parity.diff.engines.
trace``): per layer ``i`` the mixer and FFN outputs and the stream after the layer. From it the
replay recovers what the engine handed each op:

* ``layers.i.mixer`` reads the stream before the layer: the engine's ``layers.{i-1}.hidden`` rows
  (layer 0: the embedding of the call's tokens, exact in any dtype), at this and every earlier
  position; the replay carries its own KDA/MLA cache, built from the engine's inputs, from call to
  call;
* ``layers.i.router`` and ``layers.i.ffn`` read ``mid``, that stream plus the engine's mixer
  output (as the engine added them, one rounding to its storage dtype at most); the replayed router is judged by ``router.judge_router``, and the replayed FFN runs the experts the
  engine chose (its router is judged on its own), so a benign router flip never fails an FFN;
* ``layers.i.residual``: the engine's stream after the layer against its stream before it plus its
  own mixer and FFN outputs, in float64, in units of a bound derived from their storage rounding
  (``_Batch.residual``): an add the engine got wrong (an output added twice, or not at all) is named
  here, never at a correct op;
* ``final_norm`` (where traced) replayed on the engine's own last stream, judged as the ops are.
  The step's logits are replayed through lm_head from that row by the runner (``head.py``).

Per op and position the replay's error is ``e[p] = ||engine - replay|| / max(||replay[p]||,
median_q ||replay[q]||)`` and its bound ``amp[p] * (A * e_in[p] + fresh)``: ``e_in`` only the
rounding between what the trace holds and what the engine held (a trace stored coarser than the
run's dtype: that dtype's ``u``; for the FFN also the engine's rounding of ``mid``: ``u``), never an
error propagated from upstream. ``fresh``, ``A`` and the KDA read-out amplification ``amp`` are those of
``localize.py``. So a wrong op is past its bound whatever happened before it, and a benign flip
upstream loosens nothing.

A batch's decode step is replayed once for its B sequences (``replay_batch``; the corpus's
``--batch``): each layer runs on the B rows gathered from each sequence's own trace, every product
row by row (``Model.row_by_row``), each sequence on its own replay cache, judged on its own rows and
its own KDA state; so each gets the ``ReplayCall`` its own replay gives (bit for bit on the CPU
executors). The router weights the judge reads cross to the host once per layer (``HostWeights``),
shared by the replays of a batch.
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field

import numpy as np

from kimi.tensors import layer_prefix
from parity.bounds.core import UNIT_ROUNDOFF
from parity.metrics import HostCopy, dtype_of, to_numpy
from parity.ops.kda.bounds import read_out_kappa, readout_condition
from reference import moe, norm
from reference.batch import Rider
from reference.executor import namespace

from .router import RouterFlip, RouterJudgement, judge_router, score_noise


def _rows(x) -> np.ndarray:
    x = to_numpy(x)
    return x.astype(np.float64).reshape(-1, x.shape[-1])


def trace_roundoff(x, u: float) -> float:
    """The relative rounding a trace entry's storage adds to what the engine held: its dtype's unit
    roundoff when coarser than the run's storage ``u`` (an engine that holds its stream at the run
    dtype traces it exactly), else 0."""
    ut = UNIT_ROUNDOFF.get(dtype_of(x) or "float64", UNIT_ROUNDOFF["float64"])
    return ut if ut > u else 0.0


@dataclass
class OpError:
    """One replayed op (or check) over one call's positions."""
    name: str              # "layers.2.mixer", "layers.2.router", "layers.2.ffn", "layers.2.residual",
                           # "final_norm", "lm_head"
    layer: int | None      # None: the head
    op: str                # kda | mla | router | mlp | moe | residual | norm | lm_head
    err: np.ndarray        # [T] relative error (router, residual, lm_head: units of their derived bound)
    err_in: np.ndarray     # [T] relative storage error of the input (router: 0)
    amp: np.ndarray        # [T] the op's own amplification (KDA read-out; 1 elsewhere)


@dataclass
class ReplayCall:
    ops: list[OpError]
    flips: list[RouterFlip] = field(default_factory=list)


@dataclass(frozen=True)
class RouterWeights:
    """One MoE layer's router as the replay's judge reads it, on the host, float64 (read-only): the
    gate ``W [E, D]`` and ``absW = |W|``, the correction ``bias [E]`` and the post-attention norm's
    weight ``norm [D]``."""
    W: np.ndarray
    absW: np.ndarray
    bias: np.ndarray
    norm: np.ndarray


class HostWeights:
    """The router weights of ``model`` (a ``reference.Model``) on the host, taken from its device
    once per layer and reused by every call of every replay sharing this object: at 48B a layer's
    gate is 4.7 MB of float64, 123 MB of device-to-host copies a step if copied per call."""

    def __init__(self, model):
        self.model = model
        self._layers: dict[int, RouterWeights] = {}

    def router(self, i: int) -> RouterWeights:
        """MoE layer ``i``'s ``RouterWeights``."""
        w = self._layers.get(i)
        if w is None:
            w = self._layers[i] = self._fetch(i)
        return w

    def _fetch(self, i: int) -> RouterWeights:
        p = layer_prefix(i)
        g = p + "block_sparse_moe.gate."
        W = to_numpy(self.model.weight(g + "weight"))
        arrays = (W, np.abs(W), to_numpy(self.model.weight(g + "e_score_correction_bias")).reshape(-1),
                  to_numpy(self.model.weight(p + "post_attention_layernorm.weight")))
        for a in arrays:
            a.setflags(write=False)  # shared by the replays of a batch
        return RouterWeights(*arrays)


class Replay:
    """Replays one sequence's calls on the float64 ``model`` (a ``reference.Model``): its prompt,
    then one decoded token a call. ``u``: the unit roundoff of the engine's storage dtype, ``ua`` of
    its arithmetic (``Precision``); ``host``: the model's router weights on the host, shared by the
    replays of one model (None: this replay's own)."""

    def __init__(self, model, config, *, u: float, ua: float, host: HostWeights | None = None):
        self.model, self.config, self.u, self.ua = model, config, u, ua
        self.host = HostWeights(model) if host is None else host
        self.caches = [None] * config.num_hidden_layers
        self.position = 0

    def add(self, ids, trace: dict, *, riders: dict[int, Rider] | None = None) -> ReplayCall:
        """Replay one call over ``ids`` (the tokens it consumed) from the engine's ``trace``;
        ``riders``: this call's ``riders(...)``, already run along with the reference's own call."""
        _check_ridden(riders)
        return _replay([self], [[int(t) for t in ids]], [trace], riders)[0]


def riders(replays: list[Replay], calls: list[list[int]], traces: list[dict]) -> dict[int, Rider]:
    """What each layer's FFN replay of a call runs on (a prompt, or one decode step of B sequences
    as ``replay_batch``: ``calls`` the tokens of each): ``{layer: Rider}`` of the engine's stream
    after the mixer (the stream before the layer plus the mixer's output, as the engine added them)
    and, in an MoE layer, its expert ids. Handed to the reference's own call over the same tokens
    (``prefill``, ``decode_batch``), they ride along with its FFNs (each weight read once for both);
    ``Replay.add`` / ``replay_batch(..., riders=)`` then take their outputs."""
    batch = _Batch(replays, [[int(t) for t in x] for x in calls], traces)
    c = batch.config
    return {i: Rider(mid=batch.mid(i), ids=batch.chosen(i) if c.is_moe_layer(i) else None)
            for i in range(c.num_hidden_layers)}


def replay_batch(replays: list[Replay], tokens: list[int], traces: list[dict], *,
                 riders: dict[int, Rider] | None = None) -> list[ReplayCall]:
    """One decode step of B sequences replayed together: ``replays[b]`` (all of one model, each past
    its prompt) consumes ``tokens[b]``, from ``traces[b]``, its engine's trace of that call (its part
    of a batch's trace: ``reference.batch.split_trace``). Each layer runs once on the B rows, inside
    ``Model.row_by_row`` (``Model.mixer_step`` on each sequence's own cache, ``Model.ffn`` with each
    one's expert ids); the router is judged per sequence. Returns the B ``ReplayCall``s, on the CPU
    executors bit for bit those of ``replays[b].add([tokens[b]], traces[b])``. ``riders``: this
    step's ``riders(...)``, already run along with the reference's ``decode_batch``: each layer's
    FFN is then read from them, not run again."""
    if any(r.position == 0 for r in replays):
        raise ValueError("replay_batch: decode steps only; replay each prompt first (Replay.add)")
    _check_ridden(riders)
    return _replay(replays, [[int(t)] for t in tokens], traces, riders)


def _check_ridden(riders: dict[int, Rider] | None) -> None:
    if riders is not None and any(r.out is None for r in riders.values()):
        raise ValueError("replay: riders that no reference call ran")


def _replay(replays: list[Replay], ids: list[list[int]], traces: list[dict],
            riders: dict[int, Rider] | None = None) -> list[ReplayCall]:
    """One call of each of B sequences (a prompt, B = 1; or one token each, the decode forms inside
    ``row_by_row``), every layer on the calls' rows together."""
    decode = _check_calls(replays, ids, traces)
    m = replays[0].model
    core, m.trace_kda_core = m.trace_kda_core, True  # the read-out's amplification
    try:
        with m.row_by_row() if decode else nullcontext():
            return _Batch(replays, ids, traces, riders).run()
    finally:
        m.trace_kda_core = core


def _check_calls(replays: list[Replay], ids: list[list[int]], traces: list[dict]) -> bool:
    """Whether the calls are decode steps (else one prompt); ``ValueError`` for calls that are
    neither."""
    if len(ids) != len(replays) or len(traces) != len(replays):
        raise ValueError(f"replay: {len(replays)} replays, {len(ids)} calls, {len(traces)} traces")
    if any(r.model is not replays[0].model for r in replays):
        raise ValueError("replay: the replays of a batch are of one model")
    decode = [r.position > 0 for r in replays]
    if any(decode) and not (all(decode) and all(len(x) == 1 for x in ids)):
        raise ValueError("replay: after its prompt a sequence's call is one token, and a batch holds decode "
                         "steps only")
    if not any(decode) and len(replays) > 1:
        raise ValueError("replay: prompts are replayed one at a time")
    return decode[0]


class _Batch:
    """One call of each of B sequences: their rows of the stream, stacked in order (``rows[b]``)."""

    def __init__(self, replays: list[Replay], ids: list[list[int]], traces: list[dict],
                 riders: dict[int, Rider] | None = None):
        self.replays, self.ids, self.traces, self.riders = replays, ids, traces, riders
        self.config, self.model = replays[0].config, replays[0].model
        ends = np.cumsum([len(x) for x in ids])
        self.rows = [slice(int(e) - len(x), int(e)) for e, x in zip(ends, ids)]
        self.calls = [ReplayCall(ops=[]) for _ in replays]

    def on(self, a):
        """A host array on the model's executor."""
        return self.model.executor.asarray(np.ascontiguousarray(a))

    def gather(self, key: str) -> list[np.ndarray]:
        """Each sequence's rows ``[T_b, D]`` of the trace entry ``key`` (float64)."""
        return [_rows(t[key]) for t in self.traces]

    def stream_before(self, i: int) -> np.ndarray:
        """The engine's stream before layer ``i`` ``[N, D]`` (layer 0: the embedding of the calls'
        tokens, exact in any dtype), on the host."""
        if i == 0:
            return to_numpy(self.model.embed(np.concatenate([np.asarray(x, dtype=np.int64) for x in self.ids])))
        return np.concatenate(self.gather(f"layers.{i - 1}.hidden"))

    def mid(self, i: int) -> np.ndarray:
        """Layer ``i``'s FFN input ``[N, D]``: the stream before the layer plus the mixer's output,
        as the engine added them (one rounding to its storage dtype at most)."""
        return self.stream_before(i) + np.concatenate(self.gather(f"layers.{i}.mixer"))

    def chosen(self, i: int) -> np.ndarray:
        """The engine's expert ids ``[N, k_e]`` of MoE layer ``i``."""
        key = f"layers.{i}.router.ids"
        return np.concatenate([to_numpy(t[key]).astype(np.int64).reshape(rows.stop - rows.start, -1)
                               for t, rows in zip(self.traces, self.rows)])

    def run(self) -> list[ReplayCall]:
        lossy = [0.0] * len(self.replays)
        for i in range(self.config.num_hidden_layers):
            p = f"layers.{i}."
            h = self.stream_before(i)
            a_e = np.concatenate(self.gather(p + "mixer"))
            self.mixer(i, self.on(h), a_e, lossy)
            e_mid = [r.u + max(lo, trace_roundoff(t[p + "mixer"], r.u)) for r, lo, t in zip(self.replays, lossy, self.traces)]
            self.ffn(i, h + a_e, e_mid)
            after = [trace_roundoff(t[p + "hidden"], r.u) for r, t in zip(self.replays, self.traces)]
            self.residual(i, h, a_e, lossy, after)
            lossy = after
        self.final_norm(lossy)
        for r, x in zip(self.replays, self.ids):
            r.position += len(x)
        return self.calls

    def residual(self, i: int, h: np.ndarray, a: np.ndarray, l_in: list[float], l_out: list[float]) -> None:
        """Layer ``i``'s residual stream: the engine's stream after the layer against its stream
        before it ``h [N, D]`` plus its own mixer output ``a`` and FFN output, in float64. Two
        roundings to the storage dtype (the sum after the mixer and after the FFN, each an fp32 add,
        ``u + 2 ua`` at most) and the traces' own storage (``l_in``, ``l_out`` and the mixer's and
        FFN's, each where coarser than the run) bound each element by ``(2 (u + 2 ua) + sum of the
        traces' roundings) (|h| + |a| + |f|)``, the (1 + 2u) the traced magnitudes' own rounding
        (docs/error-bounds.md, "The residual stream"). Per position the error's norm in units of
        that bound's norm: every element within its bound puts the norm within it."""
        p = f"layers.{i}."
        f = np.concatenate(self.gather(p + "ffn"))
        out = np.concatenate(self.gather(p + "hidden"))
        with np.errstate(invalid="ignore", over="ignore"):
            d = np.linalg.norm(out - (h + a + f), axis=-1)
            m = np.linalg.norm(np.abs(h) + np.abs(a) + np.abs(f), axis=-1)
        for b, (r, t, rows) in enumerate(zip(self.replays, self.traces, self.rows)):
            c = (2 * (r.u + 2 * r.ua) + l_in[b] + l_out[b] + trace_roundoff(t[p + "mixer"], r.u)
                 + trace_roundoff(t[p + "ffn"], r.u)) * (1 + 2 * r.u)
            T = rows.stop - rows.start
            self.calls[b].ops.append(OpError(p + "residual", i, "residual", _units(d[rows], c * m[rows]),
                                             np.zeros(T), np.ones(T)))

    def final_norm(self, lossy: list[float]) -> None:
        """The final norm replayed on the engine's own last stream (``layers.{L-1}.hidden``),
        judged as the ops are (``localize.py``), where every trace holds ``final_norm``."""
        if any("final_norm" not in t for t in self.traces):
            return
        last = f"layers.{self.config.num_hidden_layers - 1}.hidden"
        y_r = to_numpy(self.model.final_norm(self.on(np.concatenate(self.gather(last)))))
        errs = _rel(np.concatenate(self.gather("final_norm")), y_r, self.rows)
        for b, rows in enumerate(self.rows):
            T = rows.stop - rows.start
            self.calls[b].ops.append(OpError("final_norm", None, "norm", errs[b], np.full(T, lossy[b]), np.ones(T)))

    def mixer(self, i: int, h_in, a_e: np.ndarray, lossy: list[float]) -> None:
        """Layer ``i``'s mixer on the stream ``h_in [N, D]``, each sequence on its own cache;
        ``a_e [N, D]``: the engine's outputs, ``lossy``: the storage rounding of each one's input."""
        m, c = self.model, self.config
        rt: dict = {}
        prevs = [r.caches[i] for r in self.replays]
        if prevs[0] is None:  # a prompt: the prefill forms
            a_r, new = m.mixer(i, h_in, None, trace=rt)
            new = [new]
        else:
            a_r, new = m.mixer_step(i, h_in, prevs, trace=rt)
        kind = "kda" if c.is_kda_layer(i) else "mla"
        amps = [np.ones(rows.stop - rows.start) for rows in self.rows]
        if kind == "kda" and prevs[0] is not None:  # decode steps: from the new states, on the executor
            amps = list(readout_amplification_step(rt, i, [lc.state for lc in new])[:, None])
        elif kind == "kda":  # a prompt: its core's values, the recurrence replayed position by position
            amps = [readout_amplification(rt, i)]
        errs = _rel(a_e, to_numpy(a_r), self.rows)
        for b, (r, rows) in enumerate(zip(self.replays, self.rows)):
            r.caches[i] = new[b]
            T = rows.stop - rows.start
            self.calls[b].ops.append(OpError(f"layers.{i}.mixer", i, kind, errs[b], np.full(T, lossy[b]), amps[b]))

    def ffn(self, i: int, mid: np.ndarray, e_mid: list[float]) -> None:
        """Layer ``i``'s router (judged per sequence) and FFN on ``mid [N, D]``, the FFN on the
        engine's own expert choices; ``e_mid``: each sequence's relative rounding of ``mid``."""
        c, m, p = self.config, self.model, f"layers.{i}."
        routing = None
        if c.is_moe_layer(i):
            chosen = self.chosen(i)
            judged = self.router(i, mid, e_mid, chosen)
            for b, rows in enumerate(self.rows):
                T = rows.stop - rows.start
                self.calls[b].ops.append(OpError(p + "router", i, "router", judged.units[rows], np.zeros(T), np.ones(T)))
                self.calls[b].flips += [f for f, t in zip(judged.flips, judged.rows) if rows.start <= t < rows.stop]
            routing = m.executor.ints(chosen)
        rider = None if self.riders is None else self.riders[i]
        f_r = to_numpy(m.ffn(i, self.on(mid), routing=routing) if rider is None else rider.out)
        op = "moe" if c.is_moe_layer(i) else "mlp"
        errs = _rel(np.concatenate(self.gather(p + "ffn")), f_r, self.rows)
        for b, rows in enumerate(self.rows):
            T = rows.stop - rows.start
            self.calls[b].ops.append(OpError(p + "ffn", i, op, errs[b], np.full(T, e_mid[b]), np.ones(T)))

    def router(self, i: int, mid: np.ndarray, e_mid: list[float], chosen: np.ndarray) -> RouterJudgement:
        """MoE layer ``i``'s router replayed on ``mid [N, D]`` and judged against the engine's
        choices ``chosen [N, k_e]``, the B calls' rows together (where ``Model.bitwise_rows``,
        each call's rows with the bits of its own replay)."""
        c, r0, t = self.config, self.replays[0], f"layers.{i}.router."
        w = r0.host.router(i)
        x = norm.rms_norm(mid, w.norm, eps=c.rms_norm_eps)
        e_rows = np.concatenate([np.full(rows.stop - rows.start, e) for e, rows in zip(e_mid, self.rows)])
        # where the model's rows are bitwise (the CPU executors) each call's products are its own;
        # elsewhere one product for the batch (a row-at-a-time GEMV streams the gate once a row)
        calls = self.rows if self.model.bitwise_rows else None
        s, eps, logit = score_noise(x, w.W, u=r0.u, e_mid=e_rows, ua=r0.ua, absW=w.absW, calls=calls)
        _, ref_ids = moe.router(logit, w.bias, top_k=c.num_experts_per_token, num_groups=c.num_expert_group,
                                topk_groups=c.topk_group, renormalize=c.moe_renormalize,
                                scaling=c.routed_scaling_factor)
        positions = np.concatenate([r.position + np.arange(rows.stop - rows.start)
                                    for r, rows in zip(self.replays, self.rows)])
        return judge_router(i, positions, s=s, eps=eps, bias=w.bias, ref_ids=ref_ids, opt_ids=chosen,
                            opt_scores=self.joined(t + "scores"), opt_sel=self.joined(t + "selection"),
                            ua=r0.ua, num_groups=c.num_expert_group, topk_groups=c.topk_group)

    def joined(self, key: str):
        """The B traces' entry ``key`` as one ``[N, ...]`` array that keeps the dtype it was stored
        in (the bound reads it), or None when the traces do not hold it."""
        parts = [t.get(key) for t in self.traces]
        if any(x is None for x in parts):
            return None
        stored = {dtype_of(x) for x in parts}
        if len(stored) != 1:
            raise ValueError(f"replay: the calls of a batch hold {key} in different dtypes: {sorted(map(str, stored))}")
        if len(parts) == 1:
            return parts[0]
        out = np.concatenate([to_numpy(x) for x in parts]).view(HostCopy)
        out.stored = stored.pop()
        return out


def _units(err: np.ndarray, bound: np.ndarray) -> np.ndarray:
    """``err / bound`` per position: 0 where both are 0, inf where only the bound is (or NaN/Inf)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        u = np.where(bound > 0, err / bound, np.where(err == 0, 0.0, np.inf))
    return np.where(np.isfinite(u), u, np.inf)


def _rel(engine: np.ndarray, replay: np.ndarray, calls: list[slice]) -> list[np.ndarray]:
    """Per call (its ``rows`` of ``engine``, ``replay [N, D]``), per row ``||engine - replay|| /
    max(||replay[p]||, the median over the call's rows of ||replay||)`` (NaN/Inf: inf)."""
    replay = replay.reshape(engine.shape)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        d = np.linalg.norm(engine - replay, axis=-1)
        n = np.linalg.norm(replay, axis=-1)
        if all(c.stop - c.start == 1 for c in calls):  # decode steps: each row is its call's median
            e = d / np.maximum(n, np.where(n > 0, n, 1.0))
            return list(np.where(np.isfinite(e), e, np.inf)[:, None])
        out = []
        for c in calls:
            floor = np.median(n[c])
            e = d[c] / np.maximum(n[c], floor if floor > 0 else 1.0)
            out.append(np.where(np.isfinite(e), e, np.inf))
    return out


KDA_CORE = ("q", "k", "v", "g", "beta", "initial_state", "normed")


def readout_amplification_step(ref_trace: dict, i: int, states: list) -> np.ndarray:
    """``[B]``: ``readout_amplification`` of one decode token of each of B sequences, from the KDA
    layer's new states ``states`` (B ``[HV, K, V]``: the state each token's read-out reads, so no
    recurrence is replayed) and the trace's normalized ``q [B, H, K]`` and gated-norm output
    ``normed [B, HV, V]``, on the executor those live on (a state stays there: only ``[B]`` comes
    to the host)."""
    p = f"layers.{i}.kda."
    if p + "q" not in ref_trace or p + "normed" not in ref_trace:
        raise ValueError(f"the reference trace has no {p}q: the localization's bound needs the KDA core's "
                         "values (load the reference with trace_kda_core = True)")
    q, y = ref_trace[p + "q"], ref_trace[p + "normed"]
    xp = namespace(q, y)
    S = xp.stack(states, axis=0)                                   # [B, HV, K, V]
    if S.shape[1] != q.shape[1]:  # GVA: value head hv reads qk head hv // (HV // H)
        q = xp.repeat(q, S.shape[1] // q.shape[1], axis=1)
    return _amplification(read_out_kappa(q, S), y)


def _amplification(kappa, y) -> np.ndarray:
    """``[T]`` on the host: ``sqrt(sum_h |y_h|^2 max(1, kappa_h)^2 / sum_h |y_h|^2)`` of ``kappa
    [T, HV]`` and the gated-norm output ``y [T, HV, V]`` (1 where ``y`` is all zero)."""
    xp = namespace(kappa, y)
    ny2 = xp.sum(y * y, axis=-1)                                   # [T, HV]
    total = xp.sum(ny2, axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        amp = xp.sqrt(xp.sum(ny2 * xp.maximum(kappa, 1.0) ** 2, axis=-1) / total)
    return np.where(to_numpy(total) > 0, to_numpy(amp), 1.0)


def readout_amplification(ref_trace: dict, i: int) -> np.ndarray:
    """``[T]``: how much KDA layer ``i``'s read-out amplifies, at each position, the relative error
    its operands carry, seen at the mixer's output (docs/error-bounds.md, "Model level"): with
    ``kappa_h`` the read-out's condition number of value head ``h``
    (``parity.ops.kda.bounds.readout_condition``) and ``y_h`` the head's gated-norm output,
    ``sqrt(sum_h |y_h|^2 max(1, kappa_h)^2 / sum_h |y_h|^2)``. The gated RMSNorm is scale invariant:
    it hands on the relative error of each head's read-out, whatever that head's magnitude, so a
    read-out that cancels (``kappa >> 1``) reaches the output at full weight."""
    p = f"layers.{i}.kda."
    missing = [n for n in KDA_CORE if p + n not in ref_trace]
    if missing:
        raise ValueError(f"the reference trace has no {p}{missing[0]}: the localization's bound needs the "
                         "KDA core's values (load the reference with trace_kda_core = True)")
    q, k, v, g, beta, s0, y = (ref_trace[p + n] for n in KDA_CORE)
    kappa, _ = readout_condition(q, k, v, g, beta, s0)
    return _amplification(kappa, y)

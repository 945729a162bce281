"""A corpus's prompts diffed B at a time: each prompt prefilled on its own, then the B prompts'
decode steps taken together through both paths' ``decode_batch``.

Each prompt is judged by the one code that judges a single run (``runner.PromptRun``), on its own
rows of each batched call: its logits, and its own part of both traces
(``reference.batch.split_trace``), so its replay, localization, router analysis and twin are those
of its own run. Both models give a sequence's row the bits of decoding it alone (the reference row
by row, ``reference.Model.decode_batch``; the optimized model on a fixed tile, its ``decode_batch``),
so every prompt's report equals, number for number, the report ``run_diff`` writes for it.

The replay of the engine's decode calls (``replay.py``) is batched too: the float64 reference
re-runs each layer once for the B prompts (``replay.replay_batch``: each prompt's rows gathered from
its own trace, each on its own replay cache, row by row), not once per prompt, and the router
weights its judge reads are taken to the host once for the batch (``replay.HostWeights``). Each
layer's FFN replay rides along with the reference's own ``decode_batch`` of the step
(``replay.riders``: one experts call for both, each expert read once), as a prompt's rides along
with its prefill. Each prompt is then judged on its own ``ReplayCall``, the one its single run's
replay gives. A step's traces and logits cross to the host once (``runner.on_host``), and the
prompts' logits are judged side by side in threads (``StepLogits.record``).

The prompts of a batch have their own lengths (ragged); every prompt runs the same number of steps,
so a batch starts and ends together. An engine whose batched caches must share state (the optimized
model's state pool) is asked for it first (``CheckedEngine.batch_caches``).
"""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

from parity.metrics import to_numpy
from reference.batch import split_trace

from .localize import first_nonfinite
from .head import LmHead
from .job import Decode
from .logits import LmHeadSpan
from .replay import HostWeights, ReplayCall, replay_batch, riders
from .runner import HERE, DiffResult, PromptRun, StepLogits, StepRecord, on_host, prefill_riding

DEFAULT_BATCH = 8  # prompts decoded together when --batch is not given (docs/cli.md)
RECORD_THREADS = 8  # threads judging a batch step's logits


def run_diff_batch(ref_model, opt_model, prompts: list[list[int]], *, config, steps: int, mode: str = "forced",
                   dtype: str = "bfloat16", rounding: str = "nearest", localize: bool = True,
                   lm_head: LmHeadSpan | None = None, twin="auto") -> list[DiffResult]:
    """``run_diff`` of each of ``prompts`` (the arguments as ``run_diff``'s), the decode steps of
    all of them taken together: ``ref_model`` and ``opt_model`` need ``decode_batch``
    (``opt_model`` a ``CheckedEngine``). Returns the results in prompt order."""
    decode = Decode(config, steps, mode=mode, dtype=dtype, rounding=rounding, localize=localize, lm_head=lm_head,
                    twin=twin)
    return diff_batch(ref_model, opt_model, prompts, decode)


def diff_batch(ref_model, opt_model, prompts: list[list[int]], decode: Decode) -> list[DiffResult]:
    """``run_diff_batch`` with its settings as one ``Decode`` (the reference's tokens: its
    ``tokens`` None)."""
    if decode.tokens is not None:
        raise ValueError("tokens: a batch decodes the reference's tokens (diff a dump's own on its own)")
    config, steps = decode.config, decode.steps
    host = HostWeights(ref_model)  # the router weights on the host, once for the batch
    head = LmHead.of(ref_model.source, config, span=decode.lm_head)  # the lm_head, once for the batch
    runs = [PromptRun(ref_model, opt_model, p, decode, host_weights=host, head=head) for p in prompts]
    fresh = opt_model.batch_caches(len(runs))
    ref_caches, opt_caches = [], []
    for run in runs:
        rt, ot = {}, {}
        opt_logits, opt_cache = opt_model.prefill(list(run.seq), trace=ot, cache=fresh())
        opt_logits, ot = on_host(opt_logits, ot)
        ref_logits, ref_cache, call = prefill_riding(run, ot, rt)
        ref_logits, rt = on_host(ref_logits, rt)
        run.judge(run.logits(0, ref_logits, opt_logits, rt, ot), rt, ot, call=call)
        ref_caches.append(ref_cache)
        opt_caches.append(opt_cache)
    B = len(runs)
    for step in range(1, steps):
        tokens = [run.seq[-1] for run in runs]
        rt, ot = {}, {}
        opt_logits, opt_caches = opt_model.decode_batch(tokens, opt_caches, trace=ot)
        opt_logits, ot = on_host(opt_logits, ot)
        ots = split_trace(ot, B)
        # the replay's FFN inputs ride along with the reference's step: each expert read once for both
        replaying = [b for b, run in enumerate(runs) if run.localizes]
        riding = riders([runs[b].replay for b in replaying], [[tokens[b]] for b in replaying],
                        [ots[b] for b in replaying]) if replaying else None
        ref_logits, ref_caches = ref_model.decode_batch(tokens, ref_caches, trace=rt, riders=riding)
        ref_logits, rt = on_host(ref_logits, rt)
        rts = split_trace(rt, B)
        calls = _replayed(runs, replaying, tokens, ots, riding)
        checks = _logits_checks(runs[0], opt_logits)
        nonfinite = None if first_nonfinite(ot, config) is None else HERE  # a finite batch: every row
        logits = [run.logits(step, ref_logits[b], opt_logits[b], rts[b], ots[b]) for b, run in enumerate(runs)]
        records = _records(logits)
        for b, (run, r, o, call) in enumerate(zip(runs, rts, ots, calls)):
            run.judge(logits[b], r, o, call=call, logits_check=checks[b], nonfinite=nonfinite, record=records[b])
    return [run.result() for run in runs]


def _records(logits: list[StepLogits]) -> list[StepRecord]:
    """Each prompt's ``StepLogits.record()``, side by side on the host's cores (NumPy's loops over
    the vocabulary release the GIL: a prompt's quantiles and softmaxes are milliseconds)."""
    with ThreadPoolExecutor(max_workers=min(RECORD_THREADS, len(logits), os.cpu_count() or 1)) as pool:
        return list(pool.map(StepLogits.record, logits))


def _logits_checks(run: PromptRun, opt_logits) -> list:
    """The logits' own check of each row of a batch step (``LmHeadSpan.check_rows``); None for
    each when there is no span to check against."""
    rows = to_numpy(opt_logits).reshape(-1, run.config.vocab_size)
    if run.lm_head is None:
        return [None] * len(rows)
    return run.lm_head.check_rows(rows, u_out=run.logits_roundoff(opt_logits), ua=run.precision.ua)


def _replayed(runs: list[PromptRun], which: list[int], tokens: list[int], traces: list[dict],
              riding: dict | None) -> list[ReplayCall | None]:
    """The decode call of each run that localizes (``which``), replayed together (``replay_batch``,
    its FFNs from ``riding``, run along with the reference's step); None for the others (an engine
    that filled no trace)."""
    out: list[ReplayCall | None] = [None] * len(runs)
    if which:
        calls = replay_batch([runs[b].replay for b in which], [tokens[b] for b in which],
                             [traces[b] for b in which], riders=riding)
        for b, call in zip(which, calls):
            out[b] = call
    return out

"""A corpus's prompts diffed B at a time: each prompt prefilled on its own, then the B prompts'
decode steps taken together through both paths' ``decode_batch``.

Each prompt is judged by the one code that judges a single run (``runner.PromptRun``), on its own
rows of each batched call: its logits, and its own part of both traces
(``reference.batch.split_trace``), so its replay, localization, router analysis and twin are those
of its own run. Both models give a sequence's row the bits of decoding it alone (the reference row
by row, ``reference.Model.decode_batch``; the optimized model on a fixed tile, its ``decode_batch``),
so every prompt's report equals, number for number, the report ``run_diff`` writes for it.

The prompts of a batch have their own lengths (ragged); every prompt runs the same number of steps,
so a batch starts and ends together. An engine whose batched caches must share state (the optimized
model's state pool) is asked for it first (``CheckedEngine.batch_caches``).
"""
from __future__ import annotations

from reference.batch import split_trace

from .logits import LmHeadSpan
from .runner import DiffResult, PromptRun

DEFAULT_BATCH = 8  # prompts decoded together when --batch is not given (docs/cli.md)


def run_diff_batch(ref_model, opt_model, prompts: list[list[int]], *, config, steps: int, mode: str = "forced",
                   dtype: str = "bfloat16", rounding: str = "nearest", localize: bool = True,
                   lm_head: LmHeadSpan | None = None, twin="auto") -> list[DiffResult]:
    """``run_diff`` of each of ``prompts`` (the arguments as ``run_diff``'s), the decode steps of
    all of them taken together: ``ref_model`` and ``opt_model`` need ``decode_batch``
    (``opt_model`` a ``CheckedEngine``). Returns the results in prompt order."""
    runs = [PromptRun(ref_model, opt_model, p, config=config, steps=steps, mode=mode, dtype=dtype,
                      rounding=rounding, localize=localize, lm_head=lm_head, twin=twin) for p in prompts]
    fresh = opt_model.batch_caches(len(runs))
    ref_caches, opt_caches = [], []
    for run in runs:
        rt, ot = {}, {}
        ref_logits, ref_cache = ref_model.prefill(list(run.seq), trace=rt)
        opt_logits, opt_cache = opt_model.prefill(list(run.seq), trace=ot, cache=fresh())
        run.judge(0, ref_logits, opt_logits, rt, ot)
        ref_caches.append(ref_cache)
        opt_caches.append(opt_cache)
    B = len(runs)
    for step in range(1, steps):
        tokens = [run.seq[-1] for run in runs]
        rt, ot = {}, {}
        ref_logits, ref_caches = ref_model.decode_batch(tokens, ref_caches, trace=rt)
        opt_logits, opt_caches = opt_model.decode_batch(tokens, opt_caches, trace=ot)
        for b, (run, r, o) in enumerate(zip(runs, split_trace(rt, B), split_trace(ot, B))):
            run.judge(step, ref_logits[b], opt_logits[b], r, o)
    return [run.result() for run in runs]

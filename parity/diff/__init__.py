"""``parity diff`` as a library: decode on both paths and explain every difference.

    from parity.diff import run_diff
    result = run_diff(ref_model, opt_model, prompt_ids, config=config, steps=32)
    result.summary()["line"]   # '32/32 tokens match, 0 near-ties, 0 diverged'

Modules: ``runner`` (the decode loop, verdicts, summary), ``step`` (one step's logits and record),
``replay`` (every layer, its residual stream and the final norm on the engine's own values),
``router`` (router flips and their noise bound), ``localize`` (first check past its bound, first
NaN/Inf), ``head`` (the logits replayed through lm_head), ``logits`` (the logits' own bound: their
part outside lm_head's span), ``twin`` and ``noise`` (the certified twin, its sanity, the step's
noise), ``excuse`` (counterfactual replays of router flips), ``report`` (JSON report, atomic writes), ``render``
(rich table), ``plot`` (PNG), ``corpus`` (``--prompts``: one run per prompt, the corpus report,
shards and their merge), ``job`` (``DiffJob``: the ``parity diff`` command as one frozen record;
``Decode``: the decode loop's settings), ``command`` (``parity diff`` run from its ``DiffJob``),
``corpus_driver`` (a corpus decoded, printed and written; ``parity diff merge``). The optimized
side may be any engine (``parity.diff.engines``).
"""
from .localize import Localization, localize
from .report import atomic_write, build_report, write_json
from .router import RouterFlip
from .runner import MODES, RUN_VERDICTS, DiffResult, StepRecord, run_diff, summary_line

__all__ = ["MODES", "RUN_VERDICTS", "DiffResult", "Localization", "RouterFlip", "StepRecord", "atomic_write",
           "build_report", "localize", "run_diff", "summary_line", "write_json"]

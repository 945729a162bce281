"""Helpers of the ``parity diff`` / ``parity golden`` tests: run the real CLI in-process, and build
checkpoints with a planted difference (a perturbed ``A_log``, a constructed router near-tie)."""
from __future__ import annotations

import json

import numpy as np

from parity.cli import main
from reference.checkpoint import WeightSource, save_checkpoint

PROMPT_IDS = "75,107,104,117,35,108,104,111,104,100,117,35,115,100,117,104,35,102,114,106"


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    """``parity *argv`` in this process: (exit status, stdout, stderr). argparse errors exit too."""
    try:
        rc = main(list(argv))
    except SystemExit as exc:
        rc = exc.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def one_line_error(rc, out, err, message):
    """Exit 2 and one ``error:`` line, the last on stderr (an engine that breaks the protocol mid-run
    does so after the header lines that say what was loaded)."""
    assert rc == 2, out + err
    lines = err.strip().splitlines()
    assert lines[-1].startswith("error: ") and sum(x.startswith("error:") for x in lines) == 1, err
    assert message in lines[-1] and "Traceback" not in out + err, err


def load_report(path) -> dict:
    return json.loads(path.read_text())


class Override(WeightSource):
    """A source with some tensors replaced (float64 values, stored at the original storage dtype)."""

    def __init__(self, base, replaced: dict[str, np.ndarray]):
        self.base, self.config, self.replaced = base, base.config, replaced

    def names(self):
        return self.base.names()

    def shape(self, name):
        return self.base.shape(name)

    def storage_dtype(self, name):
        return self.base.storage_dtype(name)

    def describe(self):
        return f"{self.base.describe()} with {', '.join(self.replaced)} replaced"

    def get_raw(self, name):
        if name in self.replaced:
            from reference.checkpoint import to_storage

            return to_storage(np.asarray(self.replaced[name], dtype=np.float64), self.storage_dtype(name))
        return self.base.get_raw(name)


def write_checkpoint(source, path):
    """``source`` written as a hub-layout checkpoint directory (storage bits preserved)."""
    return save_checkpoint(path, source.config, {n: source.get_raw(n) for n in source.names()},
                           dtypes=source.storage_dtype)


def perturbed_a_log(source, layer: int, delta: float):
    name = f"model.layers.{layer}.self_attn.A_log"
    return Override(source, {name: source.get(name) + delta})


def router_near_tie(source, prompt: list[int], *, layer: int, amplify: float = 30.0):
    """A copy of ``source`` whose router at ``layer`` is a near-tie at the last prompt position.

    The reference and the optimized (bf16) path compute sigmoid scores ``s_ref``, ``s_opt`` for that
    token; bias does not change them (it only enters the selection). With ``d = (s_opt[y] - s_ref[y])
    - (s_opt[x] - s_ref[x]) > 0`` for a pair ``(x, y)``, the correction bias is set so that one
    expert is always chosen, ``x`` beats ``y`` in the reference by ``d / 4``, and everything else is
    far below: the optimized path's noise then picks ``y`` (by ``d / 4``). Expert ``y``'s down
    projection is scaled by ``amplify`` so that the swap moves the logits far past their noise.
    Returns ``(source, info)`` with ``info = {"layer", "position", "x", "y", "margin"}``."""
    import optimized
    import reference

    c = source.config
    rt, ot = {}, {}
    reference.load(source).prefill(prompt, trace=rt)
    optimized.load(source, dtype="bfloat16").prefill(prompt, trace=ot)  # the CLI's device
    key = f"layers.{layer}.router.scores"
    s_ref = np.asarray(rt[key], dtype=np.float64)[-1]
    s_opt = ot[key].double().cpu().numpy()[-1]
    delta = s_opt - s_ref
    E, k = c.num_experts, c.num_experts_per_token
    order = np.argsort(delta)
    # the pair with the middle-sized error difference (not the two extremes, whose d is the
    # largest the noise spread can cover), so that d / 4 sits well inside the flip's noise bound
    x, y = int(order[1]), int(order[-2])
    d = delta[y] - delta[x]
    assert d > 0
    margin = d / 4
    sure = [int(e) for e in np.argsort(-s_ref) if e not in (x, y)][: k - 1]
    bias = np.full(E, -2.0) - s_ref
    bias[sure] = 2.0 - s_ref[sure]
    bias[x] = 0.5 + margin / 2 - s_ref[x]
    bias[y] = 0.5 - margin / 2 - s_ref[y]
    prefix = f"model.layers.{layer}.block_sparse_moe."
    w2 = f"{prefix}experts.{y}.w2.weight"
    out = Override(source, {f"{prefix}gate.e_score_correction_bias": bias, w2: source.get(w2) * amplify})
    return out, {"layer": layer, "position": len(prompt) - 1, "x": x, "y": y, "margin": margin}

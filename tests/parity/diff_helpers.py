"""Helpers of the ``parity diff`` / ``parity golden`` tests: run the real CLI in-process, and build
checkpoints with a planted difference (a perturbed ``A_log``, a constructed router near-tie)."""
from __future__ import annotations

import json

import numpy as np

from kimi.checkpoint import WeightSource, save_checkpoint
from parity.cli import main

PROMPT_IDS = "75,107,104,117,35,108,104,111,104,100,117,35,115,100,117,104,35,102,114,106"


def run_cli(capsys, *argv, free_memory=None) -> tuple[int, str, str]:
    """``parity *argv`` in this process: (exit status, stdout, stderr). argparse errors exit too.
    ``free_memory``: ``main``'s (what each device has free, for the checks before allocating)."""
    try:
        rc = main(list(argv), free_memory=free_memory)
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
            from kimi.checkpoint import to_storage

            return to_storage(np.asarray(self.replaced[name], dtype=np.float64), self.storage_dtype(name))
        return self.base.get_raw(name)


def reference_rows_exact(report: dict) -> bool:
    """Whether the report's reference gives a batched row the bits of its run alone: its CPU
    executors do; on a GPU a row's last bits depend on its batch (docs/ARCHITECTURE.md)."""
    return report["environment"]["reference"]["device"] == "cpu"


def assert_same_numbers(got, want, *, exact: bool, where: str = "report") -> None:
    """``got == want``, number for number when ``exact``; else (a GPU reference: every float64 of
    the reference within 1e-12 of its run alone) every string, integer and verdict equal and every
    float within 1e-6 relative or 1e-9 absolute (a difference of two float64 paths moves by the
    reference's last bits, and an error in bound units with it)."""
    if exact:
        assert got == want, where
        return
    if isinstance(want, dict):
        assert isinstance(got, dict) and sorted(got) == sorted(want), where
        for k in want:
            assert_same_numbers(got[k], want[k], exact=False, where=f"{where}.{k}")
    elif isinstance(want, list):
        assert isinstance(got, list) and len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_numbers(a, b, exact=False, where=f"{where}[{i}]")
    elif isinstance(want, float) and not isinstance(got, bool):
        assert isinstance(got, (int, float)) and np.isclose(got, want, rtol=1e-6, atol=1e-9), (where, got, want)
    else:
        assert got == want, (where, got, want)


def write_checkpoint(source, path):
    """``source`` written as a hub-layout checkpoint directory (storage bits preserved)."""
    return save_checkpoint(path, source.config, {n: source.get_raw(n) for n in source.names()},
                           dtypes=source.storage_dtype)


def perturbed_a_log(source, layer: int, delta: float):
    name = f"model.layers.{layer}.self_attn.A_log"
    return Override(source, {name: source.get(name) + delta})


def router_near_tie(source, prompt: list[int], *, layer: int, amplify: float = 30.0):
    """A copy of ``source`` whose router at ``layer`` is a near-tie at the last prompt position.

    The float64 router on the optimized (bf16) path's own input and the optimized router compute
    sigmoid scores ``s_ref``, ``s_opt`` for that token; bias does not change them (it only enters the selection). With ``d = (s_opt[y] - s_ref[y])
    - (s_opt[x] - s_ref[x]) > 0`` for a pair ``(x, y)``, the correction bias is set so that one
    expert is always chosen, ``x`` beats ``y`` in the reference by ``d / 4``, and everything else is
    far below: the optimized path's noise then picks ``y`` (by ``d / 4``). Expert ``y``'s down
    projection is scaled by ``amplify`` so that the swap moves the logits far past their noise.
    Returns ``(source, info)`` with ``info = {"layer", "position", "x", "y", "margin"}``."""
    import optimized
    import reference

    from reference.norm import rms_norm

    c = source.config
    ot = {}
    optimized.load(source, dtype="bfloat16").prefill(prompt, trace=ot)  # the CLI's device
    # the float64 router on the optimized path's own input to it (what the diff's replay runs)
    p = f"model.layers.{layer}."
    mid = (ot[f"layers.{layer - 1}.hidden"].double() + ot[f"layers.{layer}.mixer"].double()).cpu().numpy()[-1]
    x = rms_norm(mid, source.get(p + "post_attention_layernorm.weight"), eps=c.rms_norm_eps)
    s_ref = 1.0 / (1.0 + np.exp(-(x @ source.get(p + "block_sparse_moe.gate.weight").T)))
    s_opt = ot[f"layers.{layer}.router.scores"].double().cpu().numpy()[-1]
    rt = {}
    reference.load(source).prefill(prompt, trace=rt)  # the reference's own run picks too
    s_own = np.asarray(rt[f"layers.{layer}.router.scores"], dtype=np.float64)[-1]
    E, k = c.num_experts, c.num_experts_per_token
    # the pair (x, y) and the bias gap c = b_x - b_y where the engine picks y (s_opt[x] - s_opt[y]
    # + c < 0) while the replayed router and the reference's own run pick x: the widest such window
    lo = np.maximum(s_ref[None, :] - s_ref[:, None], s_own[None, :] - s_own[:, None])  # [x, y]
    hi = s_opt[None, :] - s_opt[:, None]
    width = np.where(np.eye(E, dtype=bool), -np.inf, hi - lo)
    x, y = (int(i) for i in np.unravel_index(np.argmax(width), width.shape))
    assert width[x, y] > 0, "no pair of experts the engine's rounding orders the other way"
    gap = (lo[x, y] + hi[x, y]) / 2
    margin = s_ref[x] - s_ref[y] + gap   # the replayed router's preference for x
    sure = [int(e) for e in np.argsort(-s_ref) if e not in (x, y)][: k - 1]
    bias = np.full(E, -2.0) - s_ref
    bias[sure] = 2.0 - s_ref[sure]
    bias[x] = 0.5 + gap / 2
    bias[y] = 0.5 - gap / 2
    prefix = f"model.layers.{layer}.block_sparse_moe."
    w2 = f"{prefix}experts.{y}.w2.weight"
    out = Override(source, {f"{prefix}gate.e_score_correction_bias": bias, w2: source.get(w2) * amplify})
    return out, {"layer": layer, "position": len(prompt) - 1, "x": x, "y": y, "margin": margin}

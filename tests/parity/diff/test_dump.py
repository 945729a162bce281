"""Dumps and plans (docs/dump-format.md): an engine outside Python writes a safetensors file, the diff
reads it back. A plan from the reference, dumps written by engines run through it (NumPy engines:
seconds), a planted bug localized from the dump alone, NaN logits, free mode, golden files, and every
malformed dump refused with one line, exit 2, nothing written."""
import json

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import load_file

import reference
from kimi.checkpoint import open_source
from kimi.fixtures import default_checkpoint_path
from parity.cli import main
from parity.diff.engines.dump import record
from parity.diff.engines.dump_writer import write_dump
from parity.diff.engines.plan import load_plan
from parity.schema import errors

from ..diff_helpers import PROMPT_IDS, one_line_error, run_cli
from .engines_planted import fb_doubled_source
from .test_diff_cli import SCHEMA, check_consistent

STEPS = 4
PROMPT = [int(t) for t in PROMPT_IDS.split(",")]


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """A plan of the bundled checkpoint and three dumps: a correct engine's and the doubled-f_b
    engine's, both forced on the plan with traces, and the correct one without traces."""
    d = tmp_path_factory.mktemp("dumps")
    assert main(["diff", "--plan", str(d / "plan.json"), "--prompt-ids", PROMPT_IDS,
                 "--steps", str(STEPS)]) == 0
    plan = load_plan(d / "plan.json")
    source = open_source(default_checkpoint_path())
    c = source.config
    for name, model in (("good", reference.load(source)), ("fb", reference.load(fb_doubled_source(source)))):
        record(model, d / f"{name}.safetensors", config=c, dtype="float32", prompt_ids=plan["prompt_ids"],
               steps=plan["steps"], tokens=plan["tokens"], name=f"numpy {name}")
    t = load_file(str(d / "good.safetensors"))
    write_dump(d / "bare.safetensors", config=c.to_hub_dict(), prompt_ids=plan["prompt_ids"],
               tokens=t["tokens"], logits=t["logits"], dtype="float32", mode="forced")
    return d, plan, c


def _diff(capsys, path, *more):
    report = path.parent / "r.json"
    report.unlink(missing_ok=True)
    rc, out, err = run_cli(capsys, "diff", "--engine", f"dump:{path}", "--no-progress", "--json", str(report),
                           *more)
    return rc, out, err, (json.loads(report.read_text()) if report.exists() else None)


def test_the_plan_is_the_prompt_and_the_references_greedy_tokens(work):
    d, plan, c = work
    assert plan["prompt_ids"] == PROMPT and plan["steps"] == STEPS == len(plan["tokens"])
    assert plan["tokens"][0] == PROMPT[-1]
    ref = reference.load(open_source(default_checkpoint_path()))
    logits, cache = ref.prefill(PROMPT)
    for k in range(1, STEPS):
        assert plan["tokens"][k] == int(np.argmax(logits[-1] if logits.ndim == 2 else logits))
        logits, cache = ref.decode(plan["tokens"][k], cache)


def test_a_correct_engines_forced_dump_is_clean(work, capsys):
    d, plan, c = work
    rc, out, err, report = _diff(capsys, d / "good.safetensors")
    assert rc == 0, out + err
    assert errors(report, SCHEMA) == []
    check_consistent(report)
    assert report["summary"]["verdict"] == "match" and report["summary"]["steps"] == STEPS
    assert report["engine"] == {"name": f"dump:{d / 'good.safetensors'}", "traced": True, "follow": "reference"}
    assert report["mode"] == "forced" and report["prompt"]["ids"] == PROMPT
    assert "(numpy good, float32, forced mode, 4 steps, traces)" in err


def test_the_doubled_f_b_engines_dump_exits_1_localized_to_that_layers_mixer(work, capsys):
    d, plan, c = work
    rc, out, err, report = _diff(capsys, d / "fb.safetensors")
    assert rc == 1, out + err
    loc = report["localization"]
    assert loc["first"]["name"] == "layers.1.mixer" and loc["first"]["units"] > 100
    assert "layers.1.mixer (kda)" in out.strip().splitlines()[-1]


@pytest.mark.parametrize("k", [0, 2])
def test_nan_logits_at_step_k_are_reported_non_finite_at_step_k(work, capsys, k):
    d, plan, c = work
    t = load_file(str(d / "bare.safetensors"))
    t["logits"][k, 17] = np.nan
    bad = d / f"nan{k}.safetensors"
    write_dump(bad, config=c.to_hub_dict(), prompt_ids=PROMPT, tokens=t["tokens"], logits=t["logits"],
               dtype="float32", mode="forced")
    rc, out, err, report = _diff(capsys, bad)
    assert rc == 1, out + err
    steps = report["steps"]
    assert steps[k]["verdict"] == "diverged" and steps[k]["nonfinite"]["name"] == "logits"
    assert steps[k]["nonfinite"]["nan"] == 1 and steps[k]["nonfinite"]["position"] == len(PROMPT) - 1 + k
    assert [s["step"] for s in steps if s["nonfinite"]] == [k]
    assert report["summary"]["traces"] is False
    assert f"first NaN/Inf: step {k}, logits" in out


class _Steered:
    """A correct engine whose step-1 logits favour token 7 by a wide margin: its own tokens leave the
    reference's there."""

    def __init__(self, model):
        self.model, self.calls = model, 0

    def prefill(self, ids, *, trace=None):
        return self.model.prefill(ids, trace=trace)

    def decode(self, token, cache, *, trace=None):
        self.calls += 1
        logits, cache = self.model.decode(token, cache, trace=trace)
        if self.calls == 1:
            logits = logits.copy()
            logits[7] = logits.max() + 5.0
        return logits, cache


def test_a_free_mode_dump_is_followed_by_the_reference_and_says_where_it_left(work, capsys):
    d, plan, c = work
    path = d / "free.safetensors"
    record(_Steered(reference.load(open_source(default_checkpoint_path()))), path, config=c, dtype="float32",
           prompt_ids=PROMPT, steps=STEPS)
    rc, out, err, report = _diff(capsys, path)
    assert rc == 1, out + err
    assert report["mode"] == "free" and report["engine"]["follow"] == "engine"
    assert "the reference followed them" in out and "re-anchored" not in out
    assert [sp["step"] for sp in report["splits"]] == [1]
    s = report["steps"]
    assert s[1]["opt_token"] == 7 and s[1]["verdict"] == "diverged" and s[2]["input_token"] == 7
    assert s[2]["verdict"] == s[3]["verdict"] == "match"  # the same context again: comparable
    assert report["splits"][0]["reconverged_at"] == 2


def test_logits_stored_coarser_than_the_run_are_judged_at_the_run_dtype_and_said_lossy(work, capsys, tmp_path):
    d, plan, c = work
    from safetensors.torch import save_file

    with safe_open(str(d / "bare.safetensors"), "pt") as f:   # a float32 run, logits only
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    path = tmp_path / "bf16-logits.safetensors"
    tensors["logits"] = tensors["logits"].bfloat16()   # what another writer may store
    save_file(tensors, str(path), metadata=meta)
    rc, out, err, report = _diff(capsys, path)
    line = out.strip().splitlines()[-1]
    assert "logits stored as bfloat16, coarser than the float32 run" in line, line
    assert report["summary"]["logits_lossy"] == "bfloat16" and report["environment"]["dtype"] == "float32"


def test_golden_check_holds_a_dump_to_the_golden(work, capsys, tmp_path):
    d, plan, c = work
    g = json.loads((default_checkpoint_path().parent / "golden" / "default.json").read_text())
    tokens = [g["prompt"]["ids"][-1]] + [s["token"] for s in g["steps"][:2]]
    ref = reference.load(open_source(default_checkpoint_path()))
    path = tmp_path / "g.safetensors"
    record(ref, path, config=c, dtype=g["dtype"], prompt_ids=g["prompt"]["ids"], steps=3, tokens=tokens)
    rc, out, err = run_cli(capsys, "golden", "check", str(default_checkpoint_path().parent / "golden" / "default.json"),
                           "--engine", f"dump:{path}", "--steps", "3")
    assert rc == 0, out + err
    assert out.strip().splitlines()[-1] == "golden: 3/3 steps match, 0 near-tie, 0 diverged"


def _rewrite(work, name, *, header=None, tensors=None, drop=(), cut=None):
    """A copy of the good dump with its header fields, tensors or bytes changed."""
    d, plan, c = work
    src = d / "good.safetensors"
    with safe_open(str(src), framework="np") as f:
        head = json.loads(f.metadata()["kimi-parity"])
    t = {k: v for k, v in load_file(str(src)).items() if k not in drop}
    head.update(header or {})
    t.update(tensors or {})
    out = d / f"{name}.safetensors"
    from safetensors.numpy import save_file

    save_file(t, str(out), metadata={"kimi-parity": json.dumps(head)})
    if cut:
        out.write_bytes(out.read_bytes()[:-cut])
    return out


def _config(**changes):
    cfg = open_source(default_checkpoint_path()).config.to_hub_dict()
    cfg.update(changes)
    return cfg


BAD = {
    "another vocabulary": (lambda w: _rewrite(w, "vocab", header={"config": _config(vocab_size=1000)},
                                              tensors={"logits": np.zeros((STEPS, 1000), np.float32)}),
                           "the dump ran another vocabulary: vocab_size 1000, the checkpoint has 512"),
    "another config": (lambda w: _rewrite(w, "cfg", header={"config": _config(num_experts_per_token=3)}),
                       "the dump ran another config: num_experts_per_token 3"),
    "truncated": (lambda w: _rewrite(w, "cut", cut=100), "truncated"),
    "a missing step": (lambda w: _rewrite(w, "short", header={"steps": STEPS + 1}),
                       "logits: shape (4, 512), expected (5, 512) (a missing step?)"),
    "a plan it did not follow": (lambda w: _rewrite(w, "unplanned", tensors={
        "tokens": np.array([PROMPT[-1]] + [w[1]["tokens"][1], 3, w[1]["tokens"][3]], np.int64)}),
                                 "step 2 consumed token 3, but the plan has"),
    "half a trace": (lambda w: _rewrite(w, "half", drop=("layers.2.ffn",)),
                     "traces are all or nothing: layers.2.ffn is missing"),
    "unknown tensor": (lambda w: _rewrite(w, "extra", tensors={"layers.9.mixer": np.zeros((3, 64), np.float32)}),
                       "unknown tensor 'layers.9.mixer'"),
    "not a dump": (lambda w: _rewrite(w, "plain", header={"format": "something/else"}),
                   "format 'something/else', expected 'kimi-parity/dump'"),
    "another version": (lambda w: _rewrite(w, "v9", header={"version": 9}), "dump format version 9"),
    "a bad header field": (lambda w: _rewrite(w, "mode", header={"mode": "sideways"}), "header: $.mode"),
    "tokens[0] not the last prompt token": (
        lambda w: _rewrite(w, "t0", tensors={"tokens": np.array([1] + w[1]["tokens"][1:], np.int64)}),
        "tokens[0] is 1"),
    "no such file": (lambda w: w[0] / "nope.safetensors", "no such dump file"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_dump_is_one_line_exit_2_and_nothing_written(work, capsys, case):
    make, message = BAD[case]
    path = make(work)
    rc, out, err, report = _diff(capsys, path)
    one_line_error(rc, out, err, message)
    assert report is None


@pytest.mark.parametrize("argv, message", [
    (["--mode", "free"], "--mode free: "),
    (["--steps", "9"], "--steps 9: "),
    (["--dtype", "bfloat16"], "the dump ran float32, not bfloat16"),
    (["--prompt-ids", "1,2,3"], "the dump ran another prompt"),
])
def test_options_that_contradict_the_dump_are_refused(work, capsys, argv, message):
    rc, out, err, report = _diff(capsys, work[0] / "good.safetensors", *argv)
    one_line_error(rc, out, err, message)

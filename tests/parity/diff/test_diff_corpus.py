"""``parity diff --prompts``: a corpus of 8 short prompts on the bundled checkpoint, 3 steps each.

The engine is ``fb_doubled_on_trigger`` (float64 NumPy, cheap, with ``decode_batch``): llama.cpp's
doubled ``f_b`` at layer 1 for the prompts holding the token id ``TRIGGER``, the clean model for
the others. The corpus decodes in batches (8 by default, ragged prompt lengths); each prompt's
record equals the single-prompt run's, the bug is named in exactly the prompts that reach it, two
shards run with other batch sizes merge into the unsharded report number for number (on a GPU
reference, whose batched rows differ from their runs alone in the last bits: every verdict, token
and string, and every float to 1e-6), a folder of
dumps and an engine without ``decode_batch`` run one prompt at a time, and unusable input is one
line. Cost on a 2-core CPU: ~50 s (the corpus three times: whole, two shards, single prompts; the
optimized model only as the certified twin of the flipped steps, and for two prompts as the
engine, batched)."""
import contextlib
import io
import json
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from parity.cli import main
from parity.schema import errors, load

from ..diff_helpers import assert_same_numbers, load_report, one_line_error, reference_rows_exact, run_cli
from .engines_planted import TRIGGER

ENGINE = "tests.parity.diff.engines_planted:fb_doubled_on_trigger"
STEPS = "3"
# byte-level tokens: id = byte + 3, so 'W' (87) is TRIGGER (90): prompts 1, 4 and 7 reach the bug
PROMPTS = ["The cat sat.", "Water flows downhill.", "hello there", "A quick test of it", "What is it?",
           "Numbers: 1 2 3", "small prompt", "We go now."]
REACHED = [k for k, p in enumerate(PROMPTS) if "W" in p]
SCHEMA = load("diff-corpus")
DOCS_SCHEMA = json.loads((Path(__file__).resolve().parents[3] / "docs" / "diff-report-schema.json").read_text())


def _times_dropped(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "seconds"}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The corpus file and the unsharded run's (exit status, stdout, report)."""
    d = tmp_path_factory.mktemp("corpus")
    path = d / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    out, err = io.StringIO(), io.StringIO()  # capsys is per test; the CLI writes to sys.stdout/stderr
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["diff", "--prompts", str(path), "--engine", ENGINE, "--steps", STEPS,
                   "--json", str(d / "r.json"), "--plot", str(d / "r.png")])
    return path, rc, out.getvalue(), err.getvalue(), load_report(d / "r.json"), d


def test_a_bug_only_some_prompts_reach_is_named_in_exactly_those_prompts(corpus):
    path, rc, out, err, report, d = corpus
    assert rc == 1
    assert errors(report, SCHEMA) == []
    reached = [p["index"] for p in report["prompts"] if TRIGGER in p["ids"]]
    assert reached == REACHED
    for p in report["prompts"]:
        if p["index"] in REACHED:
            assert p["verdict"] in ("diverged", "past-bound"), p["summary"]["line"]
            assert "layers.1.mixer (kda)" in p["localization"]
        else:  # the clean float64 model: nothing past its bound, no localization
            assert p["verdict"] == "match" and p["localization"] is None, p["summary"]["line"]
    s = report["summary"]
    named = [x["index"] for x in s["diverged"]] + [x["index"] for x in s["past_bound"]]
    assert sorted(named) == REACHED
    for x in s["diverged"]:
        p = report["prompts"][x["index"]]
        assert x["first_step"] == next(st["step"] for st in p["steps"] if st["verdict"] == "diverged")
        assert "layers.1.mixer (kda)" in x["localization"]
    assert s["verdict"] == ("diverged" if s["diverged"] else "past-bound")
    # the op's units over the prompts: past 1 in the prompts that reach the bug, 0 (float64) elsewhere
    units = {p["index"]: p["units"]["layers.1.mixer"][1] for p in report["prompts"]}
    assert all(units[k] > 1 for k in REACHED) and all(units[k] < 1 for k in units if k not in REACHED)
    mixer = s["op_units"]["layers.1.mixer"]["units"]
    assert mixer["max"] == max(units.values()) and mixer["min"] == min(units.values())
    assert mixer["median"] == float(np.median(list(units.values())))
    # stdout: one line per prompt, the not-clean prompts (diverged first), the corpus line last
    lines = out.strip().splitlines()
    assert lines[-1] == s["line"] and len([x for x in lines if x.startswith("prompt ")]) == len(PROMPTS)
    bad = [x for x in lines if x.startswith(("diverged: prompt", "past its bound: prompt"))]
    assert len(bad) == len(REACHED)
    assert not any(x.lstrip().startswith("prompts ") for x in err.splitlines())   # no progress bar on a pipe
    assert "decoding: up to 8 prompts at a time through decode_batch" in err
    image = matplotlib.image.imread(d / "r.png")
    assert image.ndim == 3 and image.shape[0] > 400


def test_the_corpus_numbers_are_those_of_the_steps(corpus):
    report = corpus[4]
    steps = [st for p in report["prompts"] for st in p["steps"]]
    s = report["summary"]
    kl = np.array([st["kl"] for st in steps])
    assert s["steps"] == len(steps) == len(PROMPTS) * int(STEPS)
    assert s["kl"]["mean"] == pytest.approx(kl.mean(), rel=1e-12) and s["kl"]["max"] == kl.max()
    assert s["kl"]["p99"] == pytest.approx(np.percentile(kl, 99), rel=1e-12)
    agree = [st["ref_token"] == st["opt_token"] for st in steps]
    assert s["kl"]["top1_agreement"] == sum(agree) / len(steps) < 1  # the bug flipped tokens
    flipped = len(steps) - sum(agree)
    ties = sum(st["verdict"] == "near-tie" for st in steps)
    assert s["near_ties"] == {"near_ties": ties, "flipped_steps": flipped, "steps": len(steps),
                              "per_flipped_step": ties / flipped, "per_step": ties / len(steps)}
    flips = sum(len(st["router"]) for st in steps)
    positions = sum(len(p["ids"]) + int(STEPS) - 1 for p in report["prompts"])
    assert s["router_flips"]["flips"] == flips and s["router_flips"]["positions"] == positions
    assert s["verdicts"]["match"] == len(PROMPTS) - len(REACHED)


def test_each_prompt_of_the_corpus_is_reported_as_its_own_run_reports_it(corpus, tmp_path, capsys):
    path, _, _, _, report, _ = corpus
    for p in report["prompts"]:
        single = tmp_path / f"p{p['index']}.json"
        rc, out, err = run_cli(capsys, "diff", "--prompt", PROMPTS[p["index"]], "--engine", ENGINE,
                               "--steps", STEPS, "--json", str(single))
        one = load_report(single)
        assert rc == (1 if p["verdict"] in ("diverged", "past-bound") else 0), out + err
        exact = reference_rows_exact(report)
        assert one["prompt"]["ids"] == p["ids"]
        assert_same_numbers(one["steps"], p["steps"], exact=exact, where="steps")
        assert_same_numbers(one["summary"], p["summary"], exact=exact, where="summary")
        assert (one["localization"] is None) == (p["localization"] is None)


def test_the_optimized_engine_on_a_jsonl_corpus_reports_each_prompt_as_its_own_run(tmp_path, capsys):
    """Two prompts of two lengths decoded together through the optimized model's ``decode_batch``
    (one state pool), each reported as its own run reports it."""
    ids = [[75, 107, 104, 35, 102, 100, 119], [90, 100, 119, 104, 117]]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in ({"ids": ids[0]}, {"text": "Water"})))
    rc, out, err = run_cli(capsys, "diff", "--prompts", str(path), "--steps", "2", "--json", str(tmp_path / "c.json"))
    assert rc == 0, out + err
    assert "decoding: up to 8 prompts at a time through decode_batch" in err
    report = load_report(tmp_path / "c.json")
    assert [p["ids"] for p in report["prompts"]] == ids and report["prompts"][1]["text"] == "Water"
    for p in report["prompts"]:
        rc, out, err = run_cli(capsys, "diff", "--prompt-ids", ",".join(map(str, p["ids"])), "--steps", "2",
                               "--json", str(tmp_path / "one.json"))
        one = load_report(tmp_path / "one.json")
        exact = reference_rows_exact(report)
        assert_same_numbers(one["steps"], p["steps"], exact=exact, where="steps")
        assert_same_numbers(one["summary"], p["summary"], exact=exact, where="summary")


def test_an_engine_without_decode_batch_runs_one_prompt_at_a_time(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"ids": [75, 107, 104]}\n{"ids": [90, 100]}\n')
    rc, out, err = run_cli(capsys, "diff", "--prompts", str(path), "--engine", "tests.parity.diff.engines_planted:untraced",
                           "--steps", "2", "--batch", "4", "--json", str(tmp_path / "c.json"))
    assert rc == 0, out + err
    assert "decoding: one prompt at a time (tests.parity.diff.engines_planted:untraced has no decode_batch)" in err
    assert [p["verdict"] for p in load_report(tmp_path / "c.json")["prompts"]] == ["match", "match"]


def test_an_engine_whose_decode_batch_breaks_the_protocol_is_one_line_naming_the_prompts(tmp_path, capsys):
    path = tmp_path / "p.jsonl"
    path.write_text('{"ids": [75, 107, 104]}\n{"ids": [90, 100]}\n')
    one_line_error(*run_cli(capsys, "diff", "--prompts", str(path), "--engine",
                            "tests.parity.diff.engines_planted:one_row_batches", "--steps", "2"),
                   "prompts 0 (line 1), 1 (line 2): engine tests.parity.diff.engines_planted:one_row_batches: "
                   "decode_batch returned logits of shape (1, 512); expected (2, 512)")


def test_two_shards_merge_into_the_unsharded_report(corpus, tmp_path, capsys):
    """Shard 1 decoded one prompt at a time, shard 2 by 3 (batches of 3 and 1), the whole corpus by
    8: the merge equals the whole corpus's report number for number (each prompt's steps,
    localization and op units, and the aggregates), so the batch size changes no number."""
    path, _, _, _, report, _ = corpus
    shards = []
    for i, batch, how in ((1, "1", "one prompt at a time (--batch 1)"),
                          (2, "3", "up to 3 prompts at a time through decode_batch")):
        shards.append(tmp_path / f"s{i}.json")
        rc, out, err = run_cli(capsys, "diff", "--prompts", str(path), "--engine", ENGINE, "--steps", STEPS,
                               "--shard", f"{i}/2", "--batch", batch, "--json", str(shards[-1]))
        assert f"decoding: {how}" in err
        part = load_report(shards[-1])
        assert [p["index"] for p in part["prompts"]] == list(range(i - 1, len(PROMPTS), 2))
        assert part["shard"] == {"index": i, "count": 2} and errors(part, SCHEMA) == []
    merged = tmp_path / "m.json"
    rc, out, err = run_cli(capsys, "diff", "merge", str(shards[1]), str(shards[0]), "--json", str(merged))
    assert rc == 1, out + err  # the corpus's exit status: prompts diverged
    assert_same_numbers(_times_dropped(load_report(merged)), _times_dropped(report),
                        exact=reference_rows_exact(report))
    assert out.strip().splitlines()[-1] == report["summary"]["line"]
    _refused_merges(capsys, tmp_path, shards)


def _refused_merges(capsys, tmp_path, shards):
    s1, s2 = shards
    doc = load_report(s2)

    def variant(name, change):
        p = tmp_path / f"{name}.json"
        d = json.loads(json.dumps(doc))
        change(d)
        p.write_text(json.dumps(d))
        return str(p)

    other_corpus = variant("corpus", lambda d: d["corpus"].update(digest="0" * 64))
    other_steps = variant("steps", lambda d: d["settings"].update(steps=4))
    of_three = variant("three", lambda d: d["shard"].update(count=3))
    out = str(tmp_path / "x.json")
    cases = [
        ([str(s1), other_corpus], "is a shard of another corpus"),
        ([str(s1), other_steps], "ran other settings than"),
        ([str(s1), of_three], "one of 2"),
        ([str(s1)], "shard 2/2 is missing"),
        ([str(s1), str(s1)], "given twice"),
        ([str(s1), str(tmp_path / "nope.json")], "cannot read it"),
        ([str(s1), str(tmp_path / "m.json")], "not a shard report"),
    ]
    for files, message in cases:
        one_line_error(*run_cli(capsys, "diff", "merge", *files, "--json", out), message)
    one_line_error(*run_cli(capsys, "diff", "merge", str(s1), str(s2)), "--json PATH is required")
    assert not Path(out).exists()


def _jsonl(tmp_path, text, name="p.jsonl"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def _bytes(tmp_path, data):
    p = tmp_path / "b.txt"
    p.write_bytes(data)
    return str(p)


ERRORS = {
    "missing file": (lambda t: ["--prompts", str(t / "nope.txt")], "cannot read it"),
    "empty file": (lambda t: ["--prompts", _jsonl(t, "\n\n", "e.txt")], "no prompts in it"),
    "not UTF-8": (lambda t: ["--prompts", _bytes(t, b"\xff\xfe bad\n")], "cannot read it: UnicodeDecodeError"),
    "bad JSONL line": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1, 2]}\n{"text": "a"\n')], "line 2: not valid JSON"),
    "no text or ids": (lambda t: ["--prompts", _jsonl(t, '{"txt": "a"}\n')], "line 1: unknown key 'txt'"),
    "both text and ids": (lambda t: ["--prompts", _jsonl(t, '{"text": "a", "ids": [1]}\n')], "exactly one of"),
    "ids not integers": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1, "2"]}\n')], "list of integers"),
    "no tokens": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1]}\n\n{"ids": []}\n')], "line 3: the prompt has no tokens"),
    "empty text": (lambda t: ["--prompts", _jsonl(t, '{"text": ""}\n')], "line 1: the prompt has no tokens"),
    "out of vocabulary": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1, 512]}\n')], "line 1: token id 512 is outside"),
    "with --prompt": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1]}\n'), "--prompt", "x"], "--prompts and --prompt"),
    "with --prompt-ids": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1]}\n'), "--prompt-ids", "1"],
                          "--prompts and --prompt-ids"),
    "with a dump": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1]}\n'), "--engine", "dump:x.safetensors"],
                    "a dump carries its own prompt"),
    "--shard alone": (lambda t: ["--shard", "1/2"], "--shard splits a corpus"),
    "bad --shard": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1]}\n'), "--shard", "0/2"], "--shard 0/2: expected I/N"),
    "--batch 0": (lambda t: ["--prompts", _jsonl(t, '{"ids": [1]}\n'), "--batch", "0"],
                  "--batch 0: expected a positive number of prompts"),
    "--batch alone": (lambda t: ["--batch", "4"], "--batch decodes the prompts of a corpus together"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_unusable_corpus_input_is_one_line_and_exit_2(case, tmp_path, capsys):
    argv, message = ERRORS[case]
    out = tmp_path / "r.json"
    one_line_error(*run_cli(capsys, "diff", *argv(tmp_path), "--json", str(out)), message)
    assert not out.exists()


def test_the_corpus_schema_repeats_the_single_reports_step_definitions():
    for name in ("verdict", "run_verdict", "step", "router_flip", "nonfinite", "logits_check", "counterfactual"):
        assert SCHEMA["$defs"][name] == DOCS_SCHEMA["$defs"][name], name


def _dumps(folder, prompts, *, steps=3, mode_of=lambda k: None):
    """The planted engine's runs of ``prompts`` written as dumps (free mode: its own tokens), one a file."""
    from kimi.checkpoint import open_source
    from kimi.fixtures import default_checkpoint_path
    from parity.diff.engines.dump import record

    from .engines_planted import fb_doubled_on_trigger

    source = open_source(default_checkpoint_path())
    engine = fb_doubled_on_trigger(source, dtype="float32", device=None)
    folder.mkdir()
    for k, ids in enumerate(prompts):
        record(engine, folder / f"d{k}.safetensors", config=source.config, dtype="float32", prompt_ids=ids,
               steps=steps + k if mode_of(k) == "steps" else steps)
    return folder


def test_a_folder_of_dumps_is_a_corpus_and_each_dump_reports_as_its_own_diff(tmp_path, capsys):
    prompts = [[87, 107, 104, 35, 102], [TRIGGER, 100, 119, 104], [107, 104, 111, 111, 114]]
    folder = _dumps(tmp_path / "dumps", prompts)
    rc, out, err = run_cli(capsys, "diff", "--engine", f"dump:{folder}", "--json", str(tmp_path / "c.json"))
    assert rc == 1, out + err
    report = load_report(tmp_path / "c.json")
    assert errors(report, SCHEMA) == [] and report["corpus"]["file"] == str(folder)
    assert [p["source"] for p in report["prompts"]] == ["d0.safetensors", "d1.safetensors", "d2.safetensors"]
    assert [p["verdict"] in ("diverged", "past-bound") for p in report["prompts"]] == [False, True, False]
    bad = report["summary"]["diverged"] + report["summary"]["past_bound"]
    assert [b["source"] for b in bad] == ["d1.safetensors"]
    assert "layers.1.mixer (kda)" in (bad[0].get("localization") or bad[0].get("past_bound"))
    for p in report["prompts"]:
        rc, out, err = run_cli(capsys, "diff", "--engine", f"dump:{folder / p['source']}", "--json",
                               str(tmp_path / "one.json"))
        one = load_report(tmp_path / "one.json")
        exact = reference_rows_exact(report)
        assert_same_numbers(one["steps"], p["steps"], exact=exact, where="steps")
        assert_same_numbers(one["summary"], p["summary"], exact=exact, where="summary") and one["mode"] == "free"
    # dumps that ran different numbers of steps: refused without --steps, which takes the shortest
    uneven = _dumps(tmp_path / "uneven", prompts[:2], steps=2, mode_of=lambda k: "steps")
    one_line_error(*run_cli(capsys, "diff", "--engine", f"dump:{uneven}"), "d1.safetensors ran steps 3")
    one_line_error(*run_cli(capsys, "diff", "--engine", f"dump:{uneven}", "--steps", "3"), "holds 2 steps")
    one_line_error(*run_cli(capsys, "diff", "--engine", f"dump:{folder}", "--prompt-ids", "1,2"),
                   "each with its own prompt")
    (tmp_path / "empty").mkdir()
    one_line_error(*run_cli(capsys, "diff", "--engine", f"dump:{tmp_path / 'empty'}"), "no dump (*.safetensors)")


class _PathModel:
    """A model whose logits say how they were reached: ``prefill`` and ``decode`` differ, as the
    kernels' roundings do, so a twin that reuses another prompt's run is seen."""

    prefills = 0

    def prefill(self, ids):
        self.prefills += 1
        return np.array([[float(len(ids)), 0.0]] * len(ids)), list(ids)

    def decode(self, token, cache):
        return np.array([float(len(cache)), 1.0]), cache + [token]


def test_the_twin_gives_a_prompt_the_logits_of_its_own_run_whatever_ran_before():
    from parity.diff.twin import Twin

    twin = Twin(object(), dtype="bfloat16", device="cpu")
    twin._model = _PathModel()  # its loaded model: no kernel needed to check what it is asked
    seq = [5, 6, 7]
    decoded = twin.logits(seq, 2)      # prompt [5, 6], then 7 decoded
    prefilled = twin.logits(seq, 3)    # prompt [5, 6, 7]: another corpus prompt, its own prefill
    assert decoded.tolist() == [2.0, 1.0] and prefilled.tolist() == [3.0, 0.0]
    assert twin.logits([5, 6, 7, 8], 3).tolist() == [3.0, 1.0]  # continues the prompt's own run
    # a batched corpus asks for the prompts' steps in turn: each continues its own run (no second
    # prefill), the steps between decoded on the way
    assert twin._model.prefills == 2
    assert twin.logits([5, 6, 7, 9, 10], 2).tolist() == [4.0, 1.0]
    assert twin.logits([5, 6, 7, 8, 11, 12], 3).tolist() == [5.0, 1.0]
    assert twin._model.prefills == 2
    assert twin.logits([5, 6, 4], 2).tolist() == [2.0, 1.0]  # another run of the same prompt: prefilled anew
    assert twin._model.prefills == 3


def test_a_prompt_is_a_line_up_to_its_newline_and_keeps_its_line_number(tmp_path):
    from parity.diff.corpus import read_prompts

    text = tmp_path / "p.txt"
    text.write_bytes("ab\u2028cd\r\n\nef \n".encode())  # U+2028 is inside a prompt; CRLF ends a line
    got = read_prompts(text, vocab=512, encode=lambda t: [ord(c) % 512 for c in t])
    assert [(p.index, p.line, p.text) for p in got] == [(0, 1, "ab\u2028cd"), (1, 3, "ef ")]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"ids": [3, 4]}\n\n  \n{"text": "x"}')
    got = read_prompts(jsonl, vocab=512, encode=lambda t: [7])
    assert [(p.line, p.ids, p.text) for p in got] == [(1, (3, 4), None), (4, (7,), "x")]

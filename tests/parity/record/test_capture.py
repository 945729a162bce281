"""`parity capture` and `parity certify --cases`: the inputs the optimized model's ops receive, recorded
on the bundled checkpoint (a 3-token prefill and one decode step under the Triton interpreter),
validated on read, replayed through certify with teeth; tampered files refused with one line; the
regeneration used at real sizes exercised on small shapes with the store limit forced to 0."""
import json
import math
from contextlib import redirect_stdout
from io import StringIO

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import optimized
from kimi.fixtures import default_checkpoint_path
from parity import ops, schema
from parity.certify import certify_op
from parity.certify.candidate import named
from parity.certify.check import check, prepare
from parity.cli import main
from parity.record import capture
from parity.record.capture import casefile, sites, tensors

from ..diff_helpers import one_line_error, run_cli

PROMPT = "5,17,99"
MODEL_OPS = {"embed.embedding", "embed.lm_head", "norm.rms_norm", "norm.add_rms_norm", "norm.gated_rms_norm",
             "conv.short_conv", "conv.short_conv_step_", "kda.fused_chunked", "kda.fused_recurrent_decode",
             "mla.naive", "mla.paged_decode", "moe.router_logits", "moe.router", "moe.experts", "moe.swiglu"}


@pytest.fixture(scope="module")
def cases_file(tmp_path_factory, parity_device):
    """``parity capture`` on the bundled checkpoint, in this process: (path, stdout)."""
    path = tmp_path_factory.mktemp("capture") / "cases.safetensors"
    buf = StringIO()  # capsys is per test: the module's one capture prints here
    with redirect_stdout(buf):
        rc = main(["capture", "--prompt-ids", PROMPT, "--steps", "1", "--device", parity_device, "--out", str(path)])
    assert rc == 0, buf.getvalue()
    return path, buf.getvalue()


def test_capture_keeps_one_case_per_op_signature_and_call_site(cases_file):
    path, out = cases_file
    cf = casefile.read(path)
    head = cf.header
    assert head["prompt_ids"] == [5, 17, 99] and head["steps"] == 1 and head["dtype"] == "bfloat16"
    assert {c.op for c in cf.cases} == MODEL_OPS == {s.op for s in sites.SITES.values() if s.op}
    keys = [(c.op, c.entry["call_site"], json.dumps(c.entry["kwargs"], sort_keys=True),
             json.dumps({n: i and (i["dtype"], i["shape"]) for n, i in c.entry["inputs"].items()})) for c in cf.cases]
    assert len(keys) == len(set(keys))
    prefill = [c for c in cf.cases if c.op == "kda.fused_chunked"]
    assert len(prefill) == 1 and prefill[0].entry["calls"] == 3 and prefill[0].entry["first"] == "prefill"
    assert prefill[0].entry["kwargs"] == {"scale": None, "chunk_size": 64}      # the defaults the op applied
    assert prefill[0].entry["inputs"]["cu_seqlens"] is None
    decode = [c for c in cf.cases if c.op == "kda.fused_recurrent_decode"]
    assert [c.entry["first"] for c in decode] == ["decode 1"]
    eps = {c.entry["kwargs"]["eps"] for c in cf.cases if c.op == "norm.rms_norm"}
    assert eps == {1e-5, 1e-6}                                # the input norm and kv_a_layernorm
    assert all(c.kind == "captured" for c in cf.cases)      # the tiny model: every input stored
    assert head["uncaptured"] == {"mla_write": 2}
    assert f"{len(cf.cases)} case(s) ({len(cf.cases)} captured, 0 regenerated)" in out
    assert "not captured: ops.mla_write" in out and "not captured: the projections" in out


def test_every_captured_case_is_within_its_bound(cases_file, parity_device):
    cf = casefile.read(cases_file[0])
    by_op, skipped = capture.replay_cases(cf, ops.names())
    assert not skipped and sum(map(len, by_op.values())) == len(cf.cases)
    for op, cases in by_op.items():
        rec = ops.get(op)
        cand = named(rec, "optimized")
        for case in cases:
            assert case.source["kind"] == "captured" and case.source["file"] == str(cf.path)
            prep = prepare(rec, case, "bfloat16", parity_device)
            for name, spec in cf.cases[int(case.source["case"][1:])].entry["inputs"].items():
                if spec is not None and spec["dtype"] in ("bfloat16", "int64"):  # replayed bit for bit
                    assert tensors.digest(prep.tensors[name]) == spec["sha256"], (op, name)
            j = check(prep, cand.normalized(rec), counter=cand.counter)
            assert j.passed and j.kernel_ran, (op, case.label, j.report())


def test_certify_replays_the_cases_beside_the_draws_and_lists_them(cases_file, tmp_path, capsys, parity_device):
    path = cases_file[0]
    report = tmp_path / "c.json"
    chosen = ["norm.add_rms_norm", "moe.router", "embed.embedding"]
    rc, out, err = run_cli(capsys, "certify", "--device", parity_device, "--ops", *chosen, "--dtype", "bfloat16",
                           "--examples", "1", "--cases", str(path), "--json", str(report))
    assert rc == 0, out + err
    cf = casefile.read(path)
    mine = [c for c in cf.cases if c.op in chosen]
    assert f"cases: {len(mine)} replayed from {path} ({len(mine)} captured, 0 regenerated)" in out
    assert "skipped" in out and "kda.fused_chunked (1)" in out and "replayed: c" in out
    doc = json.loads(report.read_text())
    assert schema.errors(doc) == []
    assert doc["cases"]["sha256"] == cf.sha256 and doc["cases"]["replayed"] == len(mine)
    assert sum(doc["cases"]["skipped"].values()) == len(cf.cases) - len(mine)
    for op in doc["ops"]:
        listed = {e["case"]: e for e in op["replayed"]}
        assert set(listed) == {c.id for c in mine if c.op == op["op"]}
        for c in mine:
            if c.op == op["op"]:
                e = listed[c.id]
                assert (e["kind"], e["sha256"], e["file"], e["passed"]) == ("captured", c.entry["sha256"], str(path), True)
        run = op["runs"]["bfloat16"]
        assert [c["source"]["case"] for c in run["cases"] if "source" in c] == list(listed)
        assert len(run["cases"]) == len(listed) + 1            # and one drawn input


def test_a_mutant_is_killed_on_a_replayed_case(cases_file, parity_device):
    """The replayed cases have teeth: mutants die on them (by value, not by raising), before any draw."""
    cf = casefile.read(cases_file[0])
    for op, mutants in (("norm.add_rms_norm", ("residual_dropped", "h_not_written", "weight_plus_one")),
                        ("kda.fused_recurrent_decode", ("state_not_written_back", "A_log_plus_one", "l2norm_skipped"))):
        by_op, _ = capture.replay_cases(cf, [op])
        cert = certify_op(ops.get(op), dtypes=("bfloat16",), device=parity_device, examples=1, cases=by_op[op])
        assert cert.certified, cert.reasons()
        run = cert.runs["bfloat16"]
        for m in mutants:
            first = run.mutants[m].first_failure
            assert first.startswith("c") and " captured " in first and "Error" not in first, (op, m, first)
        # a decode step of the model has no padding row: that mutant cannot show there, and must not
        # be counted as killed by raising on it
        if op == "kda.fused_recurrent_decode":
            assert run.mutants["padding_row_computed"].first_failure.startswith("B=")


def test_recording_leaves_the_model_bitwise_unchanged(parity_device):
    """The recorder copies inputs before each op runs and writes nothing: the logits of a recorded
    run are the bits of an unrecorded one (the in-place decode pools included). The families on the
    reference math keep this cheap; the recorder sits in front of ``model.ops`` either way."""
    model = optimized.load(default_checkpoint_path(), device=parity_device, dtype="bfloat16", cuda_graphs=False,
                           backends={f: "reference" for f in ("embed", "norm", "conv", "kda", "mla", "moe")})
    prompt = [5, 17, 99, 3]
    rec = capture.run(model, prompt, steps=2)
    logits, cache = model.prefill(prompt)
    plain = [logits[-1]]
    for _ in range(2):
        logits, cache = model.decode(int(plain[-1].argmax()), cache)
        plain.append(logits)
    assert len(rec.logits) == 3 and all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(rec.logits, plain))
    assert model.ops.__class__.__name__ == "Ops"             # restored
    assert rec.uncaptured == {"mla_write": 3}
    by = {}
    for c in rec.cases.values():
        by.setdefault(c.op, []).append(c)
    assert [c.calls for c in by["kda.fused_recurrent_decode"]] == [6]       # 3 layers x 2 steps: one case
    assert [c.first for c in by["mla.paged_decode"]] == ["decode 1", "decode 2"]   # the context grew
    # a 4-token prefill and a decode step's tile share the norms' signature where the tile is 4 rows
    # (the CPU's): one case; the GPU's 64-row tile is a case of its own
    norms = sorted(c.calls for c in by["norm.rms_norm"] if c.call_site.startswith("Model._stack:"))
    assert norms == ([3] if model.decode_tile == len(prompt) else [1, 2]), norms


def _rewrite(src, dst, *, head=None, tensors_=None):
    """Copy a cases file with its header and/or tensors edited (as a tamperer would)."""
    t = load_file(str(src))
    from safetensors import safe_open

    with safe_open(str(src), framework="pt") as f:
        meta = dict(f.metadata())
    h = json.loads(meta["kimi-parity"])
    if head:
        head(h)
    if tensors_:
        tensors_(t)
    save_file(t, str(dst), metadata={"kimi-parity": json.dumps(h)})
    return dst


def _set_kwarg(h):
    next(c for c in h["cases"] if c["op"] == "norm.rms_norm")["kwargs"]["eps"] = 1e-3


def _flip_value(t):
    name = next(n for n in t if n.endswith(".x"))
    t[name] = t[name].clone()
    t[name].view(torch.int16)[0] ^= 1


@pytest.mark.parametrize("edit, needle", [
    ({"head": lambda h: h["cases"][0].update(op="kda.nosuch")}, "unknown op 'kda.nosuch'"),
    ({"head": _set_kwarg}, "sha256 does not match its op, kwargs and inputs"),
    ({"tensors_": _flip_value}, "do not match their sha256"),
    ({"head": lambda h: h.update(version=2)}, "version 2"),
    ({"head": lambda h: h["cases"][0]["inputs"].pop("ids")}, "'ids' is missing"),
    ({"tensors_": lambda t: t.update(extra=torch.zeros(2))}, "tensor 'extra' belongs to no case input"),
    ({"head": lambda h: h["cases"][1].update(kind="regenerated")}, "does not match its inputs"),
])
def test_a_tampered_file_is_one_line_error_exit_2(cases_file, tmp_path, capsys, edit, needle, parity_device):
    bad = _rewrite(cases_file[0], tmp_path / "bad.safetensors", **edit)
    with pytest.raises(casefile.CasesError, match=needle):
        casefile.read(bad)
    rc, out, err = run_cli(capsys, "certify", "--device", parity_device, "--ops", "norm.rms_norm", "--cases", str(bad))
    one_line_error(rc, out, err, needle)


def test_a_corrupt_or_foreign_file_is_one_line_error_exit_2(cases_file, tmp_path, capsys, parity_device):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(cases_file[0].read_bytes()[:-5])
    plain = tmp_path / "plain.safetensors"
    save_file({"x": torch.zeros(3)}, str(plain))
    for path, needle in ((cut, "truncated"), (plain, "not a kimi-parity cases file"),
                         (tmp_path / "none.safetensors", "no such cases file")):
        rc, out, err = run_cli(capsys, "certify", "--device", parity_device, "--cases", str(path))
        one_line_error(rc, out, err, needle)


@pytest.mark.parametrize("args, needle", [
    (["--steps", "-1"], "--steps -1"),
    (["--synthetic", "nosuch"], "unknown preset"),
    (["--prompt-ids", "5,9999"], "outside the vocabulary"),
    (["--store-limit", "-3"], "--store-limit"),
])
def test_capture_bad_arguments_are_one_line_errors_exit_2(tmp_path, capsys, args, needle, parity_device):
    out_file = tmp_path / "c.safetensors"
    rc, out, err = run_cli(capsys, "capture", "--device", parity_device, "--out", str(out_file), *args)
    one_line_error(rc, out, err, needle)
    assert not out_file.exists()


# -- the regenerated path (real sizes), forced on small shapes ----------------------------------------
def _torch_case(rec, case, dtype, device):
    """A drawn case's inputs as the model would hand them over (the record's policy at ``dtype``)."""
    from parity.certify.check import tensors as as_tensors

    return as_tensors(rec, case, dtype, device)


def test_real_size_inputs_are_regenerated_from_statistics_and_ids_stay_exact(tmp_path, parity_device):
    # at T=4096 with 32 heads of 128, one bf16 activation is 32 MiB: past the store limit
    assert 4096 * 32 * 128 * 2 > tensors.STORE_LIMIT
    assert tensors.channels_of((1, 4096, 32, 128)) == 2 and tensors.channels_of((256, 1024, 2304)) == 1
    from parity.ops.kda.inputs import decode_case

    rec = ops.get("kda.fused_recurrent_decode")
    drawn = decode_case(8, 2, 2, 32, 32, seed=3)
    given = _torch_case(rec, drawn, "bfloat16", parity_device)
    # the large path, forced: q, k, v, g_raw (1 KiB each) and the pool regenerated; the gate
    # parameters and beta logits stored, as at real sizes (A_log, dt_bias: 32 and 4096 floats)
    r = capture.Recorder(store_limit=512, seed=7)
    site = sites.SITES["kda_decode_"]
    r.add(site, "test:1", dict(given))
    path = casefile.write(tmp_path / "regen.safetensors", list(r.cases.values()),
                          run={"checkpoint": {}, "dtype": "bfloat16", "device": parity_device, "prompt_ids": [1],
                               "steps": 1, "store_limit": 512, "seed": 7, "uncaptured": {}})
    cf = casefile.read(path)
    (fc,) = cf.cases
    assert fc.kind == "regenerated"
    spec = fc.entry["inputs"]
    assert spec["slot_ids"]["stored"] and spec["A_log"]["stored"] and spec["dt_bias"]["stored"]
    assert not spec["q"]["stored"] and spec["q"]["channels"] == 2 and spec["state_pool"]["channels"] == 3
    lo, hi = spec["g_raw"]["log_decay"]
    a, b = fc.arrays(), fc.arrays()
    assert all(np.array_equal(a[n], b[n]) for n in a)                       # a pure function of the file
    assert np.array_equal(a["slot_ids"], drawn.arrays["slot_ids"])          # ids exactly
    for name in ("q", "g_raw", "state_pool"):
        x, orig = a[name], given[name].double().cpu().numpy()
        assert x.shape == orig.shape and not np.array_equal(x, orig)
        c = x.reshape(-1, *x.shape[-spec[name]["channels"]:])
        o = orig.reshape(c.shape)
        assert (c.min(0) >= o.min(0)).all() and (c.max(0) <= o.max(0)).all()   # each channel's range
        assert abs(c.std() / o.std() - 1) < 0.25                              # and scale
        stored_dtype = tensors.DTYPES[spec[name]["dtype"]]
        assert np.array_equal(torch.from_numpy(x).to(stored_dtype).double().numpy(), x)  # the captured dtype
    g_lo, g_hi = tensors.log_decay_range(a["g_raw"], a["A_log"], a["dt_bias"])
    assert lo <= g_lo <= g_hi <= hi and lo < -0.01
    # replayed: the certificate says "regenerated", and the case is within its bound with teeth
    by_op, _ = capture.replay_cases(cf, [rec.name])
    cert = certify_op(rec, dtypes=("bfloat16",), device=parity_device, examples=1, cases=by_op[rec.name])
    (entry,) = cert.to_dict()["replayed"]
    assert entry["kind"] == "regenerated" and entry["passed"] and cert.certified, cert.reasons()
    assert cert.runs["bfloat16"].mutants["A_log_plus_one"].first_failure.startswith("c0 regenerated")


def test_stored_values_round_trip_exactly_and_a_regenerated_case_keeps_its_digest(tmp_path, parity_device):
    x = torch.randn(5, 64).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(64)).to(torch.bfloat16)
    runinfo = {"checkpoint": {}, "dtype": "bfloat16", "device": parity_device, "prompt_ids": [1], "steps": 0,
               "store_limit": 0, "seed": 0, "uncaptured": {}}
    for limit in (tensors.STORE_LIMIT, 0):
        r = capture.Recorder(store_limit=limit)
        r.add(sites.SITES["rms_norm"], "test:1", {"x": x, "weight": w, "eps": 1e-5})
        cf = casefile.read(casefile.write(tmp_path / f"{limit}.safetensors", list(r.cases.values()), run=runinfo))
        (fc,) = cf.cases
        assert fc.entry["inputs"]["x"]["sha256"] == tensors.digest(x)
        if limit:
            assert np.array_equal(fc.arrays()["x"], x.double().numpy())
        else:
            assert fc.kind == "regenerated" and fc.label().startswith("c0 regenerated x=5x64")


def test_non_finite_inputs_are_refused_at_capture():
    r = capture.Recorder(store_limit=tensors.STORE_LIMIT)
    x = torch.ones(2, 8)
    x[1, 3] = math.nan
    with pytest.raises(ValueError, match="norm.rms_norm at test:1 .* input x: non-finite"):
        r.add(sites.SITES["rms_norm"], "test:1", {"x": x, "weight": torch.ones(8), "eps": 1e-5})


def test_every_model_op_call_has_a_site_and_each_site_fits_its_record():
    import inspect

    from optimized.backends import Ops

    public = {n for n, _ in inspect.getmembers(Ops, inspect.isfunction) if not n.startswith("_")}
    assert public == set(sites.SITES)
    for s in sites.SITES.values():
        if s.op is not None:
            assert s.op in ops.names()


@pytest.mark.parity_gpu
def test_real_size_capture_and_replay_on_cuda(tmp_path, capsys, parity_device):
    """T=4096 on the medium preset (heads of 128): the prefill's activations and the decode step's
    4097-position MLA context are regenerated, and those cases certify on the GPU."""
    path = tmp_path / "medium.safetensors"
    rc, out, err = run_cli(capsys, "capture", "--synthetic", "medium", "--device", parity_device, "--prompt-length",
                           "4096", "--steps", "1", "--out", str(path))
    assert rc == 0, out + err
    cf = casefile.read(path)
    kda = next(c for c in cf.cases if c.op == "kda.fused_chunked")
    assert kda.kind == "regenerated" and kda.entry["inputs"]["q"]["shape"] == [1, 4096, 4, 128]
    report = tmp_path / "c.json"
    rc, out, err = run_cli(capsys, "certify", "--device", parity_device, "--dtype", "bfloat16", "--examples", "1",
                           "--ops", "kda.fused_chunked", "mla.paged_decode", "--cases", str(path),
                           "--json", str(report))
    doc = json.loads(report.read_text())
    kinds = {e["kind"] for op in doc["ops"] for e in op["replayed"]}
    assert rc == 0 and kinds == {"regenerated"}, out[-3000:]

"""`parity.watch`, `parity watch` and `parity judge` (or `parity certify --calls`) on real programs: transformers'
KimiLinearForCausalLM generating on the bundled checkpoint (its own torch KDA functions), watched at
its two KDA entry points; the same with the vLLM state-layout bug planted in a copy of the watched
function; our optimized model at its KDA op entry points (the Triton interpreter); a program run by
``parity watch`` in a subprocess that crashes (with a child process of its own) or is interrupted."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import parity
from kimi.fixtures import default_checkpoint_path
from parity import schema
from parity.record.watch import callfile, judge, recorder
from parity.record.watch.adapters import Mismatch

from . import watch_programs as wp
from ..diff_helpers import one_line_error, run_cli
from ...subprocesses import sigint_default

PROMPT = [[5, 17, 99, 3, 8, 41]]


@pytest.fixture(scope="module")
def hf_model():
    """transformers' model on the bundled checkpoint, in bfloat16, its KDA names pointing at its torch
    functions (fla-core's kernels, which transformers picks when fla imports, need a GPU)."""
    transformers = pytest.importorskip("transformers")
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    mod = wp.modeling()
    saved = {n: getattr(mod, n) for n in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")}
    for n in saved:
        setattr(mod, n, wp.torch_function(n))
    model = transformers.KimiLinearForCausalLM.from_pretrained(str(default_checkpoint_path()), dtype=torch.bfloat16)
    yield model.eval()
    for n, fn in saved.items():
        setattr(mod, n, fn)


def _generate(model, steps=3):
    with torch.inference_mode():
        out = model.generate(torch.tensor(PROMPT), max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences, torch.stack(out.logits)


def test_a_watched_transformers_generate_computes_the_same_bits_and_every_call_is_judged_clean(hf_model, tmp_path,
                                                                                              capsys):
    plain = _generate(hf_model)
    path = tmp_path / "calls.safetensors"
    with parity.watch(wp.TARGETS, out=path):
        watched = _generate(hf_model)
    assert torch.equal(plain[0], watched[0]) and torch.equal(plain[1].view(torch.int16), watched[1].view(torch.int16))
    calls = callfile.read(path).calls
    assert [(c["op"], c["step"]) for c in calls] == [("kda.chunked+qk_l2norm", 0)] * 3 + \
        [("kda.recurrent+qk_l2norm", s) for s in (1, 1, 1, 2, 2, 2)]
    assert all(c["kept"] and "modeling_kimi_linear.py" in c["call_site"] for c in calls)
    assert calls[3]["inputs"]["initial_state"]["shape"] == [1, 2, 32, 32]
    rc, out, err = run_cli(capsys, "judge", str(path), "--json", str(tmp_path / "c.json"))
    assert rc == 0, out + err
    assert out.startswith(f"parity judge {path}: ")
    assert "every judged call is clean: 9 of 9" in out.splitlines()[1]
    doc = json.loads((tmp_path / "c.json").read_text())
    schema.validate(doc)
    assert doc["candidate"] == "recorded" and doc["summary"]["verdict"] == "certified"
    assert doc["calls"]["first_bad"] is None and doc["calls"]["verdicts"] == {"clean": 9}
    by = {o["op"]: o for o in doc["ops"]}
    assert by["kda.chunked+qk_l2norm"]["mutants_killed"] == 6 and by["kda.chunked+qk_l2norm"]["worst_ratio"]["bfloat16"] < 1


def test_a_planted_state_layout_bug_names_the_first_bad_call_and_state_stored_transposed(hf_model, tmp_path, capsys):
    mod = wp.modeling()
    plain = mod.chunk_kimi_delta_attention
    mod.chunk_kimi_delta_attention = wp.chunk_state_transposed     # the user's copy, in the model's place
    path = tmp_path / "calls.safetensors"
    try:
        with parity.watch(wp.TARGETS, out=path):
            _generate(hf_model, steps=2)
    finally:
        mod.chunk_kimi_delta_attention = plain
    v = judge.judge_file(path)
    assert not v.certified
    first = v.first_bad
    assert first.entry["index"] == 0 and first.entry["step"] == 0 and first.entry["op"] == "kda.chunked+qk_l2norm"
    assert first.entry["adapter_of"] == wp.CHUNK
    assert first.nearest_bug["mutant"] == "state_stored_transposed" and first.nearest_bug["similarity"] > 0.95
    # the decode steps read the corrupted state as their input: judged on it, they are clean
    assert [c.verdict for c in v.calls] == ["past its bound"] * 3 + ["clean"] * 3
    rc, out, err = run_cli(capsys, "certify", "--calls", str(path))
    assert rc == 1
    top = out.splitlines()[1]
    assert top.startswith(f"first bad call: {first.entry['id']} (kda.chunked+qk_l2norm) at step 0") \
        and "nearest known bug: state_stored_transposed" in top


@pytest.mark.parametrize("bounded", [False, True])
def test_our_optimized_model_watched_at_its_kda_op_entry_points_is_judged_clean(tmp_path, bounded):
    """Also on the bounded-gate fixture (fixtures/bounded): its calls pass lower_bound and are judged
    as the ``+lower_bound`` records."""
    import optimized

    ckpt = Path(default_checkpoint_path()).parent / "bounded" if bounded else default_checkpoint_path()
    model = optimized.load(ckpt, dtype="bfloat16", cuda_graphs=False,
                           backends={f: "reference" for f in ("embed", "norm", "conv", "mla", "moe")})
    path = tmp_path / "calls.safetensors"
    targets = {"kda.fused_chunked": "optimized.kda:fused_chunked",
               "kda.fused_recurrent_decode": "optimized.kda:fused_recurrent_decode"}
    prompt = [5, 17, 99, 3]
    plain, cache = model.prefill(prompt)
    with parity.watch(targets, out=path):
        logits, cache2 = model.prefill(prompt)
        model.decode(int(logits[-1].argmax()), cache2)
    assert torch.equal(plain, logits)
    v = judge.judge_file(path)
    assert v.certified, [c.summary for c in v.calls]
    gate = "+lower_bound" if bounded else ""
    assert [(c.entry["op"], c.entry["step"]) for c in v.calls] == [("kda.fused_chunked" + gate, 0)] * 3 + \
        [("kda.fused_recurrent_decode" + gate, 1)] * 3
    killed = {"kda.fused_chunked": (6, 6), "kda.fused_recurrent_decode": (5, 5)}
    if bounded:   # the gate's three mutants too (the decode step's one that dirty memory shows is not judged here)
        killed = {"kda.fused_chunked+lower_bound": (9, 9), "kda.fused_recurrent_decode+lower_bound": (8, 8)}
    assert {c.op: c.mutants_killed() for c in v.certs} == killed


def test_the_budget_keeps_the_first_and_the_largest_calls_and_samples_the_rest():
    b = recorder.Budget(1000)
    kept = [b.decide("op", n) is None for n in (100, 100, 100, 100, 100, 100, 100, 100, 100, 400, 100)]
    assert kept[0] and kept[9]                       # the first; the largest so far, past the budget
    assert kept[1:5] == [True] * 4 and not all(kept[5:9])      # half full: every second call
    assert b.decide("other", 10) is None              # each op's first call is kept
    zero = recorder.Budget(0)
    assert zero.decide("op", 8) == "shapes only (max bytes 0)"
    assert [recorder.parse_bytes(s) for s in ("0", "2G", "512M", "64k")] == [0, 2 << 30, 512 << 20, 64 << 10]


def test_past_the_budget_the_file_says_what_was_dropped(tmp_path):
    sys.path.insert(0, str(tmp_path))
    (tmp_path / "kern_budget.py").write_text(wp.NEVER)
    try:
        import kern_budget

        q = torch.nn.functional.normalize(torch.randn(1, 3, 1, 4), dim=-1)
        args = (q, q, torch.randn(1, 3, 1, 2), -torch.rand(1, 3, 1, 4), torch.rand(1, 3, 1))
        with parity.watch({"kda.recurrent": "kern_budget:recurrent", "kda.chunked": "kern_budget:chunked"},
                          out=tmp_path / "c.safetensors", max_bytes=0):
            for _ in range(3):
                kern_budget.recurrent(*args)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("kern_budget", None)
    cf = callfile.read(tmp_path / "c.safetensors")
    assert [c["kept"] for c in cf.calls] == [False] * 3 and cf.calls[0]["inputs"]["q"]["shape"] == [1, 3, 1, 4]
    assert cf.header["dropped"] == [{"op": "kda.recurrent", "reason": "shapes only (max bytes 0)", "calls": 3}]
    # the target not called beside one that was: both likely reasons, without naming its holders
    [never] = cf.header["run"]["never_called"]
    assert never["target"] == "kern_budget:chunked" and never["why"].startswith(
        "likely the program does not call it here (a prefill makes no decode call), or the program dispatches")
    v = judge.judge_file(tmp_path / "c.safetensors")
    assert not v.certified and {c.verdict for c in v.calls} == {"not kept"}


def test_a_call_no_record_fits_is_one_line_naming_the_argument():
    from parity.peers.fla import chunk_kda_reverse
    from parity.peers.transformers import recurrent_reverse

    x = torch.zeros(1, 2, 1, 4)
    base = dict(q=x, k=x, v=x, g=x, beta=x[..., 0], use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=torch.zeros(1), dt_bias=torch.zeros(4))
    with pytest.raises(Mismatch, match="argument use_beta_sigmoid_in_kernel: False with"):
        chunk_kda_reverse(base)
    with pytest.raises(Mismatch, match="^argument state_v_first: True given"):
        chunk_kda_reverse(dict(base, state_v_first=True, use_beta_sigmoid_in_kernel=True))
    assert chunk_kda_reverse(dict(base, use_beta_sigmoid_in_kernel=True)).op == "kda.fused_chunked"
    assert chunk_kda_reverse(dict(base, use_gate_in_kernel=False)).op == "kda.chunked+qk_l2norm"
    with pytest.raises(Mismatch, match="^argument value: 2 heads for 1 query heads"):
        recurrent_reverse(dict(query=x, key=x, value=torch.zeros(1, 2, 2, 4), g=x, beta=x[..., 0]))


def _watch(tmp_path, mode, *args, ops=(), **popen):
    (tmp_path / "kern.py").write_text(wp.KERNEL)
    (tmp_path / "prog.py").write_text(wp.PROGRAM)
    env = dict(os.environ, MODE=mode)
    cmd = [sys.executable, "-m", "parity", "watch", "--op", "kda.recurrent=kern:recurrent",
           *(a for op in ops for a in ("--op", op)),
           "--out", str(tmp_path / "calls.safetensors"), "--", sys.executable, "prog.py", *args]
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_default, **popen)


def test_a_crashing_program_and_its_subprocess_leave_a_valid_file(tmp_path):
    (tmp_path / "kern_unused.py").write_text(wp.NEVER)
    p = _watch(tmp_path, "child-crash", ops=("kda.chunked=kern_unused:chunked",))
    out, err = p.communicate(timeout=300)
    assert p.returncode == 1 and "RuntimeError: the program crashed" in err, err
    v = judge.judge_file(tmp_path / "calls.safetensors")
    assert v.certified, err
    pids = v.file.header["run"]["processes"]
    assert len(pids) == 2 and v.file.header["run"]["exit_code"] == 1      # the program and its child
    assert [(c.entry["pid"], c.entry["index"]) for c in v.calls] == [(pid, i) for pid in pids for i in (0, 1, 2)]
    # the target no process imported is named, once for both processes, by the command and the file
    said = "kern_unused:chunked (kda.chunked) was never called: its module kern_unused was never imported"
    assert [line for line in err.splitlines() if "never called" in line] == [
        f"parity watch: {said} in this process (the program does not use it here: a framework that picked "
        "another implementation, or a process that does not compute)"]
    assert v.never_called == [{"watched": "kda.chunked", "target": "kern_unused:chunked",
                               "why": err.split("was never called: ")[1].splitlines()[0]}]


def test_an_interrupted_program_leaves_a_valid_file(tmp_path):
    p = _watch(tmp_path, "wait", start_new_session=True)
    assert p.stdout.readline().strip() == "ready"
    os.killpg(p.pid, signal.SIGINT)                    # Ctrl-C: the whole process group
    out, err = p.communicate(timeout=120)
    assert p.returncode == 130, err
    assert not callfile.parts_dir(tmp_path / "calls.safetensors").exists()
    v = judge.judge_file(tmp_path / "calls.safetensors")
    assert v.certified and len(v.calls) == 3 and v.file.header["run"]["exit_code"] == 130


@pytest.mark.parametrize("argv, needle", [
    (["watch", "--op", "kda.nope=m:f", "--out", "{d}/c.safetensors", "--", "python", "x.py"], "'kda.nope' is no registered op"),
    (["watch", "--op", "kda.recurrent=nocolon", "--out", "{d}/c.safetensors", "--", "python", "x.py"], "expected module:function"),
    (["watch", "--op", "kda.recurrent=m:f", "--out", "{d}/c.safetensors", "--max-bytes", "lots", "--", "python"], "--max-bytes"),
    (["watch", "--op", "kda.recurrent=m:f", "--out", "{d}/c.safetensors"], "no program to run"),
    (["certify", "--calls", "{d}/missing.safetensors"], "no such calls file"),
    (["certify", "--calls", "{d}/foreign.safetensors"], "not a kimi-parity calls file"),
    (["certify", "--calls", "{d}/foreign.safetensors", "--impl", "fla"], "--impl does not apply"),
    (["judge", "{d}/missing.safetensors"], "no such calls file"),
    (["judge", "{d}/foreign.safetensors", "--json", "{d}/c.json"], "not a kimi-parity calls file"),
])
def test_unusable_arguments_are_one_line_errors_exit_2(tmp_path, capsys, argv, needle):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "foreign.safetensors"))
    rc, out, err = run_cli(capsys, *[a.format(d=tmp_path) for a in argv])
    one_line_error(rc, out, err, needle)
    assert not (tmp_path / "c.safetensors").exists()


def test_watching_a_function_no_adapter_knows_is_one_line(tmp_path):
    with pytest.raises(parity.watch.WatchError, match="no adapter maps this function's calls"):
        with parity.watch({"kda.chunked": "torch.nn.functional:normalize"}, out=tmp_path / "c.safetensors"):
            pass
    assert torch.nn.functional.normalize.__module__ == "torch.nn.functional"      # nothing left replaced


@pytest.mark.parity_gpu
def test_transformers_handing_its_kda_calls_to_fla_core_is_watched_at_fla_s_kernels_and_judged_clean(tmp_path):
    """The watch as benchmarks/run_watch_gpu.sh runs it: transformers hands its KDA calls to fla-core's
    kernels as its model module loads; the import hook has wrapped them by then."""
    pytest.importorskip("fla")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    out = tmp_path / "calls.safetensors"
    cmd = [sys.executable, "-m", "parity", "watch", "--op", "kda.chunked=fla.ops.kda:chunk_kda",
           "--op", "kda.recurrent=fla.ops.kda:fused_recurrent_kda", "--out", str(out), "--",
           sys.executable, os.path.join(root, "benchmarks", "watch_generate.py"), "--device", "cuda",
           "--prompt-tokens", "100", "--new-tokens", "3"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0 and "(watched)" in p.stdout, p.stdout + p.stderr
    v = judge.judge_file(out)
    assert v.certified, [c.summary for c in v.calls if c.bad]
    assert {c.entry["op"] for c in v.calls} == {"kda.chunked+qk_l2norm", "kda.recurrent+qk_l2norm"}


@pytest.mark.parametrize("op, fn", [("kda.chunked", "chunked"), ("kda.recurrent", "recurrent")])
def test_transformers_torch_kda_functions_fit_the_core_ops_through_their_forward_adapters(op, fn, parity_device):
    """The adapters whose reverse direction maps watched calls also certify the functions (--impl)."""
    pytest.importorskip("transformers")
    from parity.ops.kda.inputs import core_case
    from parity.peers import transformers as tf

    case = core_case(1, 20, 2, 2, 16, 8, 3, chunk=16 if op == "kda.chunked" else None)
    parity.assert_parity(op, case, candidate=getattr(tf, fn), dtype="float32", device=parity_device)


def test_a_watched_call_no_record_fits_is_unmapped_with_the_argument_named(tmp_path, capsys):
    path = tmp_path / "calls.safetensors"
    x = torch.zeros(1, 1, 2, 4)
    with parity.watch({"kda.recurrent": f"{wp.__name__}:recurrent_grouped"}, out=path):
        for _ in range(2):
            wp.recurrent_grouped(x, x, torch.zeros(1, 1, 4, 4), x, x[..., 0])
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "argument value: 4 heads for 2 query heads" in err[0]      # once per reason
    rc, out, err = run_cli(capsys, "certify", "--calls", str(path))
    assert rc == 1 and "first bad call: " in out.splitlines()[1] and "argument value: 4 heads" in out.splitlines()[1]


def _module(tmp_path, name, text):
    (tmp_path / f"{name}.py").write_text(text)
    sys.path.insert(0, str(tmp_path))
    try:
        return __import__(name)
    finally:
        sys.path.remove(str(tmp_path))


def test_a_target_never_called_is_named_with_the_likely_reason(tmp_path, capsys):
    """One target held by a dispatcher built before the watch began (its closure, which the watch
    cannot replace), one that nothing calls: each is named by the watch, the file and certify."""
    kern = _module(tmp_path, "kern_never", wp.NEVER)
    try:
        dispatch = kern.dispatcher()
        path = tmp_path / "calls.safetensors"
        q = torch.nn.functional.normalize(torch.randn(1, 3, 1, 4), dim=-1)
        with parity.watch({"kda.recurrent": "kern_never:recurrent", "kda.chunked": "kern_never:chunked"}, out=path):
            dispatch(q, q, torch.randn(1, 3, 1, 2), -torch.rand(1, 3, 1, 4), torch.rand(1, 3, 1))
    finally:
        sys.modules.pop("kern_never", None)
    err = [line for line in capsys.readouterr().err.splitlines() if "never called" in line]
    assert len(err) == 2, err
    assert err[0].startswith("parity watch: kern_never:recurrent (kda.recurrent) was never called: likely it was "
                             "taken before the watch began and is held by the closure of "
                             "kern_never.dispatcher.<locals>.dispatch, where the watch cannot replace it"), err[0]
    assert err[1].startswith("parity watch: kern_never:chunked (kda.chunked) was never called: likely the program "
                             "dispatches elsewhere (e.g. transformers runs its own torch KDA functions"), err[1]
    head = callfile.read(path).header
    assert [(t["target"], t["why"]) for t in head["run"]["never_called"]] == \
        [(line.split(" ")[2], line.split("was never called: ")[1]) for line in err]
    rc, out, _ = run_cli(capsys, "certify", "--calls", str(path))
    lines = out.splitlines()
    assert rc == 1 and lines[1] == "no call judged: no watched target was called (2 never called, below)", out
    assert lines[2].startswith("  never called: kern_never:recurrent (kda.recurrent): likely it was taken before")
    doc = judge.judge_file(path)
    assert [t["target"] for t in doc.calls_entry()["never_called"]] == ["kern_never:recurrent", "kern_never:chunked"]


def test_a_file_without_never_called_targets_recorded_still_names_them(tmp_path):
    """A calls file written before the watch recorded ``run.never_called``: the judge finds the
    targets without calls from ``run.targets``, the reason unknown."""
    callfile.merge(tmp_path / "old.safetensors", run={"targets": {"kda.chunked": "m:f"}, "max_bytes": 0}, empty=True)
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(tmp_path / "old.safetensors"), framework="pt") as f:
        head = json.loads(f.metadata()[callfile.METADATA_KEY])
    del head["run"]["never_called"]
    save_file({}, str(tmp_path / "old.safetensors"), metadata={callfile.METADATA_KEY: json.dumps(head)})
    v = judge.judge_file(tmp_path / "old.safetensors")
    assert v.never_called == [{"watched": "kda.chunked", "target": "m:f", "why": callfile.UNKNOWN_WHY}]


def test_a_kernel_that_writes_its_inputs_in_place_is_recorded_with_the_values_it_was_given(tmp_path, parity_device):
    """The kept copies are taken in the stream's order (asynchronous device-to-host on a GPU, waited
    on only when the file is written): the inputs as the kernel got them, the outputs as it returned
    them, whatever the kernel and the caller write into those tensors afterwards."""
    kern = _module(tmp_path, "kern_in_place", wp.IN_PLACE)
    try:
        torch.manual_seed(0)
        dev = torch.device(parity_device)
        path = tmp_path / "calls.safetensors"
        with parity.watch({"kda.recurrent": "kern_in_place:recurrent_in_place"}, out=path) as rec:
            state = torch.randn(1, 2, 16, 8, device=dev)
            for T in (64, 1, 1):       # q, k: views with a head-major layout, as a model's projections give
                q, k = (torch.nn.functional.normalize(torch.randn(1, 2, T, 16, device=dev), dim=-1).transpose(1, 2)
                        for _ in range(2))
                v, g, beta = torch.randn(1, T, 2, 8, device=dev), -torch.rand(1, T, 2, 16, device=dev), \
                    torch.rand(1, T, 2, device=dev)
                o, new = kern.recurrent_in_place(q, k, v, g, beta, initial_state=state, output_final_state=True)
                o.zero_()                # the caller reuses the output buffer at once
                state = new.clone()
                new.fill_(float("nan"))
            assert not rec._entries or rec._entries[0]["device"] == parity_device
    finally:
        sys.modules.pop("kern_in_place", None)
    v = judge.judge_file(path)
    assert len(v.calls) == 3 and all(c.entry["kept"] for c in v.calls)
    assert v.certified, [c.summary for c in v.calls]


def test_the_wrappers_stay_between_blocks_pass_calls_through_and_unwatch_puts_the_functions_back(
        tmp_path, monkeypatch):
    """A second block finds its wrappers in place and searches no module again; between blocks the
    wrapper records nothing and returns the function's own result; unwatch restores identity."""
    from parity.record.watch import hook

    kern = _module(tmp_path, "kern_kept", wp.KERNEL)
    try:
        original = kern.recurrent
        q = torch.nn.functional.normalize(torch.randn(1, 3, 1, 4), dim=-1)
        args = (q, q, torch.randn(1, 3, 1, 2), -torch.rand(1, 3, 1, 4), torch.rand(1, 3, 1))
        searches = []
        rebind = hook._rebind
        monkeypatch.setattr(hook, "_rebind", lambda swaps, done: (searches.append(bool(swaps)), rebind(swaps, done)))
        counts = []
        for block in range(2):
            with parity.watch({"kda.recurrent": "kern_kept:recurrent"}, out=tmp_path / f"{block}.safetensors",
                              quiet=True) as rec:
                kern.recurrent(*args)
            counts.append(sum(rec.called.values()))
            between = kern.recurrent(*args)
            assert kern.recurrent is not original and kern.recurrent.__wrapped__ is original
            assert torch.equal(between[0], original(*args)[0])
        assert counts == [1, 1] and searches == [True, False]      # the second block: nothing to search for
        assert len(callfile.read(tmp_path / "1.safetensors").header["calls"]) == 1
        parity.watch.unwatch()
        assert kern.recurrent is original
    finally:
        parity.watch.unwatch()
        sys.modules.pop("kern_kept", None)

"""The FlashKDA adapter (parity/peers/flashkda.py) on the CPU, against a torch stand-in of FlashKDA's
documented ``fwd`` (tests/parity/peers/flashkda_standin.py; FlashKDA itself needs an SM90 GPU): its layouts
(the V-major state both ways, dt_bias as [H, K], the A_log-free gate as A_log = 0), what it refuses,
the bounded gate it declares (certified as the softplus gate it fails, naming that gate), and a
planted copy of FlashKDA 1ce47ea's NaN on repeated keys found by certify with a repro that
reproduces it in a fresh process. About 40 s on 2 cores."""
import json
import subprocess
import sys

import pytest

from parity import ops
from parity.certify import certify_op
from parity.errors import Unsupported
from parity.ops.kda.inputs import core_case
from parity.peers import SHORTHANDS, flashkda, implementations
from parity.testing import assert_parity
from . import flashkda_nan, flashkda_standin

from ..diff_helpers import run_cli

BOUNDED = "kda.fused_chunked+lower_bound"


def _case(**kw):
    args = dict(chunk=16, fused=True, lower_bound=-5.0)
    args.update(kw)
    return core_case(1, 40, 2, 2, 128, 128, 3, **args)


@pytest.mark.parametrize("has_A", [True, False])
def test_the_adapter_hands_flashkda_the_raw_gate_and_v_major_states(has_A):
    """A carried state (not symmetric) goes in V-major and comes back K-first: within the bound at
    bf16, so neither layout nor the fused gate (with and without A_log) is lost on the way."""
    case = _case(has_A=has_A)
    assert case.arrays["initial_state"] is not None and (case.arrays["A_log"] is None) == (not has_A)
    j = assert_parity(BOUNDED, case, dtype="bfloat16", device="cpu", candidate=flashkda_standin.fused_chunked)
    assert j.ratio < 0.2


def test_what_flashkda_does_not_take_is_unsupported_and_the_softplus_gate_an_error():
    case = _case()
    import torch

    t = {k: None if v is None else torch.tensor(v) for k, v in case.arrays.items()}
    bf = {k: None if v is None or k in ("A_log", "dt_bias", "initial_state") else v.to(torch.bfloat16)
          for k, v in t.items()}
    bf.update(A_log=t["A_log"].float(), dt_bias=t["dt_bias"].float())
    args = [bf[n] for n in ("q", "k", "v", "g_raw", "beta_logits", "A_log", "dt_bias")]
    with pytest.raises(Unsupported, match="bf16 only"):
        flashkda_standin.fused_chunked(*[a.float() for a in args], lower_bound=-5.0)
    with pytest.raises(Unsupported, match="K = V = 128"):
        flashkda_standin.fused_chunked(*[a[..., :64] if a.dim() == 4 else a for a in args[:5]], *args[5:],
                                       lower_bound=-5.0)
    gva = list(args)
    gva[2] = torch.cat([args[2], args[2]], dim=2)
    with pytest.raises(Unsupported, match="value heads"):
        flashkda_standin.fused_chunked(*gva, lower_bound=-5.0)
    with pytest.raises(ValueError, match="only the bounded gate"):
        flashkda_standin.fused_chunked(*args)


def test_the_shorthand_declares_the_bounded_gate_and_no_cpu_kernel():
    assert "flashkda" in SHORTHANDS
    assert implementations("flashkda", "cpu") == {}
    cuda = implementations("flashkda", "cuda")
    assert set(cuda) == {BOUNDED, "kda.fused_chunked"}
    fn = cuda[BOUNDED]
    assert (fn.parity_gate, fn.parity_contract, fn.parity_wraps) == ("lower_bound", "bf16-storage", "flash_kda:fwd")


def test_certified_as_the_softplus_gate_it_fails_and_the_certificate_names_its_gate(tmp_path, capsys):
    cert = certify_op(ops.get("kda.fused_chunked"), candidate=flashkda_standin.fused_chunked,
                      dtypes=("bfloat16",), examples=1, device="cpu")
    assert not cert.certified and not cert.runs
    assert cert.reasons() == [f"gate: tests.parity.peers.flashkda_standin:fused_chunked computes only the bounded gate "
                              "b sigmoid(exp(A_log) (g_raw + dt_bias)) (Kimi-K3, GLM-5.3); kda.fused_chunked is "
                              "the softplus gate -exp(A_log) softplus(g_raw + dt_bias) (Kimi-Linear-48B)"]
    d = cert.to_dict()
    assert d["implementation"]["gate"] == "lower_bound" and d["gate"] == "softplus"
    out = tmp_path / "c.json"
    rc, stdout, err = run_cli(capsys, "certify", "--device", "cpu", "--dtype", "bfloat16", "--ops", "kda.fused_chunked",
                              "--impl", "kda.fused_chunked=tests.parity.peers.flashkda_standin:fused_chunked",
                              "--json", str(out))
    assert rc == 1 and "computes only the bounded gate" in stdout, stdout + err
    doc = json.loads(out.read_text())
    assert doc["ops"][0]["implementation"]["gate"] == "lower_bound" and "softplus gate" in doc["ops"][0]["error"]


def test_a_nan_on_repeated_keys_is_found_with_a_repro_that_reproduces_it(tmp_path):
    """FlashKDA 1ce47ea's NaN on 16 repeated keys, planted in the stand-in: the hostile inputs of the
    bounded gate's record reach it; each failing input's repro fails again in a fresh process."""
    cert = certify_op(ops.get(BOUNDED), candidate=flashkda_nan.fused_chunked, dtypes=("bfloat16",), examples=3,
                      device="cpu", repro=str(tmp_path))
    run = cert.runs["bfloat16"]
    bad = [c for c in run.cases if not c.passed]
    assert bad and all("non-finite" in c.summary and "K=128 V=128" in c.label for c in bad), run.cases
    assert all(any(h in c.label for h in ("identical", "neumann")) for c in bad)
    assert all("K = V = 128" in why for why in run.unsupported)
    folder = next(tmp_path.iterdir())
    res = subprocess.run([sys.executable, str(folder / "repro.py"), "cpu"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and "nan vs" in res.stdout and "FAILS the bound" in res.stdout, res.stdout + res.stderr


def test_the_adapter_inlines_into_a_repro_without_kimi_parity():
    from parity.certify.repro import implementation_source

    src, who = implementation_source(flashkda.fused_chunked)
    assert who == "flash_kda:fwd" and "importlib.import_module(\"flash_kda\")" in src and "def run(" in src
    assert "parity" not in src.replace("parity_", "")

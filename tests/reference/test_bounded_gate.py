"""The bounded KDA gate in the float64 reference: the op (``kda.gate(..., lower_bound=)``, with and
without A_log), the config that names it (``linear_attn_config.gate_lower_bound``, ``safe_gate``), a
checkpoint without A_log, and the models' ``kda_gate`` variant. About 5 s."""
import dataclasses
import json

import numpy as np
import pytest

import reference
from kimi.checkpoint import CheckpointError, open_source
from kimi.config import PRESETS, ConfigError, KimiConfig, kda_gate_name
from kimi.fixtures import write_fixture
from kimi.synthetic import SyntheticSource
from kimi.tensors import expected_tensors
from reference import kda
from reference.checks import kda_gate_bound

R = np.random.default_rng(0)
G_RAW = R.standard_normal((2, 3, 2, 4)) * 3
A_LOG = R.uniform(-1, 1, 2)
DT = R.standard_normal(8)


def _sig(x):
    return 1 / (1 + np.exp(-x))


def test_the_bounded_gate_is_b_times_the_sigmoid_with_or_without_A_log():
    z = G_RAW + DT.reshape(2, 4)
    np.testing.assert_allclose(kda.gate(G_RAW, A_LOG, DT, lower_bound=-5), -5 * _sig(np.exp(A_LOG)[:, None] * z),
                               rtol=1e-15)
    np.testing.assert_allclose(kda.gate(G_RAW, None, DT, lower_bound=-2.5), -2.5 * _sig(z), rtol=1e-15)
    np.testing.assert_array_equal(kda.gate(G_RAW, A_LOG, DT), kda.gate(G_RAW, A_LOG, DT, lower_bound=None))
    g = kda.gate(np.full((1, 1, 1, 2), [800.0, -800.0]), np.zeros(1), np.zeros(2), lower_bound=-5)
    assert g[0, 0, 0, 0] == -5.0 and -1e-300 < g[0, 0, 0, 1] <= 0   # saturated at b; underflowed to ~0


@pytest.mark.parametrize("bad", [0, 0.0, -5.5, float("nan"), True, "x", 1])
def test_a_lower_bound_outside_minus_five_to_zero_is_an_error(bad):
    with pytest.raises(ValueError, match=r"lower_bound: expected a number in \[-5, 0\)"):
        kda.gate(G_RAW, A_LOG, DT, lower_bound=bad)


def test_the_softplus_gate_needs_A_log():
    with pytest.raises(ValueError, match="A_log: None is the bounded gate's form only"):
        kda.gate(G_RAW, None, DT)


def test_the_fused_ops_apply_the_bounded_gate_before_the_core():
    T, H, K, V = 5, 2, 4, 3
    q, k, v = R.standard_normal((1, T, H, K)), R.standard_normal((1, T, H, K)), R.standard_normal((1, T, H, V))
    g_raw, bl = R.standard_normal((1, T, H, K)), R.standard_normal((1, T, H))
    o, s = kda.fused_recurrent(q, k, v, g_raw, bl, A_LOG, DT, lower_bound=-3.0)
    qn, kn = (x / np.sqrt(np.sum(x * x, -1, keepdims=True) + 1e-6) for x in (q, k))
    o2, s2 = kda.recurrent(qn, kn, v, kda.gate(g_raw, A_LOG, DT, lower_bound=-3.0), _sig(bl))
    np.testing.assert_allclose(o, o2, rtol=1e-12)
    np.testing.assert_allclose(kda.fused_chunked(q, k, v, g_raw, bl, None, DT, lower_bound=-3.0, chunk_size=2)[1],
                               kda.fused_recurrent(q, k, v, g_raw, bl, None, DT, lower_bound=-3.0)[1], rtol=1e-12)


def _hub(**lac):
    d = PRESETS["tiny"].to_hub_dict()
    d["linear_attn_config"].update(lac)
    return d


def test_the_config_names_the_gate():
    assert KimiConfig.from_hub_dict(_hub()).kda_gate == "softplus"
    assert "gate_lower_bound" not in PRESETS["tiny"].to_hub_dict()["linear_attn_config"]   # softplus configs unchanged
    c = KimiConfig.from_hub_dict(_hub(gate_lower_bound=-5.0))
    assert (c.gate_lower_bound, c.kda_gate) == (-5.0, "lower_bound:-5")
    assert KimiConfig.from_hub_dict(c.to_hub_dict()) == c == PRESETS["tiny-bounded"]
    assert KimiConfig.from_hub_dict(_hub(gate_lower_bound=None, safe_gate=True)).gate_lower_bound == -5.0
    assert KimiConfig.from_hub_dict(_hub(gate_lower_bound=-2.5, safe_gate=True)).gate_lower_bound == -2.5
    assert KimiConfig.from_hub_dict(_hub(safe_gate=False)).kda_gate == "softplus"


@pytest.mark.parametrize("lac, message", [
    ({"gate_lower_bound": 0.0}, "linear_attn_config.gate_lower_bound: 0.0 is outside its domain (expected < 0)"),
    ({"gate_lower_bound": -6}, "linear_attn_config.gate_lower_bound: -6.0 is outside its domain"),
    ({"gate_lower_bound": "-5"}, "linear_attn_config.gate_lower_bound: expected a number"),
    ({"safe_gate": 1}, "linear_attn_config.safe_gate: expected true or false"),
])
def test_a_gate_the_config_cannot_mean_is_refused_naming_the_key(lac, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        KimiConfig.from_hub_dict(_hub(**lac))


def test_a_bounded_gate_checkpoint_without_A_log_drops_that_term(tmp_path):
    cfg = dataclasses.replace(PRESETS["tiny-bounded"], kda_A_log=False)
    assert not any(n.endswith("A_log") for n in expected_tensors(cfg))
    write_fixture(cfg, tmp_path / "noA", seed=1)
    src = open_source(tmp_path / "noA")
    assert src.config.kda_A_log is False and "gate_lower_bound" in json.loads((tmp_path / "noA" / "config.json")
                                                                              .read_text())["linear_attn_config"]
    model = reference.load(src)
    assert model.variants["kda_gate"] == "lower_bound:-5" and np.all(np.isfinite(model.forward(np.array([3, 4]))))
    with pytest.raises(ValueError, match="kda_gate: softplus needs A_log"):
        reference.load(src, kda_gate="softplus")
    # one KDA layer without it is a missing tensor, as for the softplus gate
    write_fixture(PRESETS["tiny-bounded"], tmp_path / "some", seed=1)
    from safetensors.torch import load_file, save_file

    f = tmp_path / "some" / "model.safetensors"
    tensors = load_file(str(f))
    del tensors["model.layers.1.self_attn.A_log"]
    save_file(tensors, str(f))
    with pytest.raises(CheckpointError, match="missing tensor model.layers.1.self_attn.A_log"):
        open_source(tmp_path / "some")


def test_the_models_gate_is_the_configs_unless_the_variant_names_one():
    src = SyntheticSource(PRESETS["tiny-bounded"], 2)
    ids = np.array([5, 9, 2])
    bounded = reference.load(src)
    assert bounded.variants == {"moe_combine": "unbiased", "kv_norm_eps": 1e-6, "kda_gate": "lower_bound:-5"}
    same = reference.load(SyntheticSource(PRESETS["tiny"], 2), kda_gate="lower_bound:-5")
    np.testing.assert_array_equal(same.forward(ids), bounded.forward(ids))   # the same weights, the same gate
    soft = reference.load(src, kda_gate="softplus")
    assert soft.variants["kda_gate"] == "softplus" and np.max(np.abs(soft.forward(ids) - bounded.forward(ids))) > 1e-3
    with pytest.raises(ValueError, match="kda_gate: expected softplus or lower_bound:<b>"):
        reference.load(src, kda_gate="lower_bound:-9")


def test_the_variant_names_read_back():
    for b in (-5.0, -2.5, -0.1, -4.75):
        assert kda_gate_bound(kda_gate_name(b)) == b
    assert kda_gate_name(None) == "softplus" and kda_gate_bound("softplus") is None

"""KimiConfig: presets, hub round trip, validation; the §(c) tensor table built from it."""
import json

import pytest

from kimi.config import PRESETS, ConfigError, KimiConfig
from kimi.tensors import alternative_shapes, expected_tensors, num_parameters, storage_dtype


def test_the_48b_preset_matches_the_released_config():
    c = KimiConfig.from_name("kimi-linear-48b")
    assert [i for i in range(27) if not c.is_kda_layer(i)] == [3, 7, 11, 15, 19, 23, 26]
    assert c.layer_kind(0) == ("kda", "dense") and c.layer_kind(3) == ("mla", "moe")
    assert all(c.is_moe_layer(i) for i in range(1, 27))
    assert (c.kda_dim, c.qk_head_dim) == (4096, 192)


def test_the_48b_tensor_table_has_the_hub_count_and_parameter_count():
    c = KimiConfig.from_name("kimi-linear-48b")
    table = expected_tensors(c)
    assert len(table) == 20493  # spec §(a): the hub index's tensor count
    assert num_parameters(c) == 49_122_681_728
    assert table["model.layers.0.self_attn.A_log"] == (1, 1, 32, 1)
    assert table["model.layers.0.self_attn.q_conv1d.weight"] == (4096, 1, 4)
    assert table["model.layers.3.self_attn.kv_b_proj.weight"] == (8192, 512)
    assert table["model.layers.26.block_sparse_moe.experts.255.w2.weight"] == (2304, 1024)
    assert list(table)[0] == "model.embed_tokens.weight" and list(table)[-1] == "lm_head.weight"


def test_conv_weights_also_accept_the_two_dimensional_layout():
    assert alternative_shapes("model.layers.0.self_attn.k_conv1d.weight", (64, 1, 4)) == ((64, 4),)
    assert alternative_shapes("model.layers.0.self_attn.k_proj.weight", (64, 64)) == ()


def test_storage_policy_keeps_decay_and_router_bias_parameters_in_float32():
    assert storage_dtype("model.layers.0.self_attn.A_log") == "float32"
    assert storage_dtype("model.layers.0.self_attn.dt_bias") == "float32"
    assert storage_dtype("model.layers.1.block_sparse_moe.gate.e_score_correction_bias") == "float32"
    assert storage_dtype("model.layers.0.self_attn.q_conv1d.weight") == "bfloat16"
    assert storage_dtype("lm_head.weight") == "bfloat16"


def test_tied_embeddings_have_no_lm_head_tensor():
    import dataclasses

    c = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
    assert "lm_head.weight" not in expected_tensors(c)


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_survives_a_hub_json_round_trip(name, tmp_path):
    c = PRESETS[name]
    c.to_json(tmp_path / "config.json")
    assert KimiConfig.from_json(tmp_path / "config.json") == c


def test_config_errors_name_the_file_and_the_key(tmp_path):
    d = PRESETS["tiny"].to_hub_dict()
    del d["hidden_size"]
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(ConfigError, match=r"config\.json.*hidden_size"):
        KimiConfig.from_json(tmp_path / "config.json")
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        KimiConfig.from_json(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="not found"):
        KimiConfig.from_json(tmp_path / "missing.json")


def test_a_layer_map_that_does_not_cover_every_layer_is_rejected():
    d = PRESETS["tiny"].to_hub_dict()
    d["linear_attn_config"]["kda_layers"] = [1, 2]
    with pytest.raises(ConfigError, match="cover"):
        KimiConfig.from_hub_dict(d)


def test_unknown_presets_are_named():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        KimiConfig.from_name("huge")


def test_a_list_of_end_tokens_is_the_hf_form_and_survives_a_round_trip():
    d = PRESETS["tiny"].to_hub_dict()
    d["eos_token_id"] = [2, 3]
    c = KimiConfig.from_hub_dict(d)
    assert c.eos_token_id == (2, 3) and c.special_ids("eos_token_id") == (2, 3)
    assert c.to_hub_dict()["eos_token_id"] == [2, 3] and KimiConfig.from_hub_dict(c.to_hub_dict()) == c
    for bad, message in (([], "at least 1"), ([2, 512], "eos_token_id: 512 is above the limit of 511"),
                         ([2, 2.0], "expected an integer")):
        d["eos_token_id"] = bad
        with pytest.raises(ConfigError, match=message):
            KimiConfig.from_hub_dict(d)


def _transformers_form(c: KimiConfig) -> dict:
    """The config.json transformers' save_pretrained writes for ``c`` (no linear_attn_config)."""
    d = c.to_hub_dict()
    lac = d.pop("linear_attn_config")
    for key in ("first_k_dense_replace", "moe_layer_freq"):
        d.pop(key, None)
    d.update(layer_types=["linear_attention" if c.is_kda_layer(i) else "full_attention" for i in range(c.num_hidden_layers)],
             mlp_layer_types=["sparse" if c.is_moe_layer(i) else "dense" for i in range(c.num_hidden_layers)],
             linear_num_heads=lac["num_heads"], linear_head_dim=lac["head_dim"],
             linear_conv_kernel_dim=lac["short_conv_kernel_size"])
    return d


@pytest.mark.parametrize("name", ["tiny", "small", "kimi-linear-48b"])
def test_the_transformers_form_of_a_config_reads_as_the_hub_form(name):
    assert KimiConfig.from_hub_dict(_transformers_form(PRESETS[name])) == PRESETS[name]


def test_transformers_layer_lists_that_disagree_or_describe_another_model_are_refused():
    c = PRESETS["tiny"]
    d = _transformers_form(c)
    d["mlp_layer_types"] = ["sparse", "dense", "sparse", "sparse"]
    with pytest.raises(ConfigError, match="mlp_layer_types: dense layers after a MoE layer"):
        KimiConfig.from_hub_dict(d)
    d = dict(c.to_hub_dict(), layer_types=["linear_attention"] * 4)
    with pytest.raises(ConfigError, match="layer_types disagrees with linear_attn_config"):
        KimiConfig.from_hub_dict(d)
    d = dict(_transformers_form(c), layer_types=["linear_attention"] * 3)
    with pytest.raises(ConfigError, match="layer_types: 3 entries for num_hidden_layers 4"):
        KimiConfig.from_hub_dict(d)
    d = dict(_transformers_form(c), layer_types=["linear_attention"] * 3 + ["sliding"])
    with pytest.raises(ConfigError, match=r"layer_types\[3\]: expected one of linear_attention, full_attention"):
        KimiConfig.from_hub_dict(d)


def test_a_layer_listed_twice_or_out_of_range_is_named():
    d = PRESETS["tiny"].to_hub_dict()
    d["linear_attn_config"]["kda_layers"] = [1, 2, 3, 4]
    with pytest.raises(ConfigError, match=r"layer 4 is listed twice \(linear_attn_config.kda_layers and "
                                          r"linear_attn_config.full_attn_layers\)"):
        KimiConfig.from_hub_dict(d)
    d["linear_attn_config"]["kda_layers"] = [1, 2, 9]
    with pytest.raises(ConfigError, match=r"linear_attn_config.kda_layers: 9 is above the limit of 4"):
        KimiConfig.from_hub_dict(d)
    d["linear_attn_config"]["kda_layers"] = "123"
    with pytest.raises(ConfigError, match=r"linear_attn_config.kda_layers: expected an array, got a string"):
        KimiConfig.from_hub_dict(d)
    d["linear_attn_config"]["kda_layers"] = [[1], [2], [3]]
    for types in (None, ["linear_attention"] * 3 + ["full_attention"]):  # also where the lists are compared
        if types:
            d["layer_types"] = types
        with pytest.raises(ConfigError, match=r"linear_attn_config.kda_layers\[0\]: expected an integer, got an "
                                              r"array of 1 elements$"):
            KimiConfig.from_hub_dict(d)


@pytest.mark.parametrize("key, value, message", [
    ("hidden_act", "gelu", 'hidden_act: expected "silu" \\(SwiGLU experts and MLP\\), got a string of 4 characters'),
    ("hidden_act", None, 'hidden_act: expected "silu" .*, got null'),
    ("moe_router_activation_func", "softmax", 'moe_router_activation_func: expected "sigmoid"'),
    ("use_grouped_topk", "true", "use_grouped_topk: expected true or false, got a string of 4 characters"),
])
def test_keys_that_fix_the_math_must_name_this_models_math(key, value, message):
    d = PRESETS["tiny"].to_hub_dict()
    d[key] = value
    with pytest.raises(ConfigError, match=message):
        KimiConfig.from_hub_dict(d)


def test_ungrouped_routing_is_refused_only_where_the_config_has_groups():
    d = PRESETS["tiny"].to_hub_dict()
    d["use_grouped_topk"] = False
    assert KimiConfig.from_hub_dict(d) == PRESETS["tiny"]  # one group: the same router
    d = PRESETS["small"].to_hub_dict()
    d["use_grouped_topk"] = False
    with pytest.raises(ConfigError, match="use_grouped_topk: false with num_expert_group above 1"):
        KimiConfig.from_hub_dict(d)

"""The registry: every op family is registered with its reference, optimized op and >= 3 mutants."""
import pytest

from parity import registry

FAMILIES = {
    "elementwise": {"silu", "sigmoid", "softplus"},
    "norm": {"rms_norm", "gated_rms_norm", "l2norm"},
    "conv": {"short_conv", "short_conv_step"},
    "kda": {"gate", "recurrent", "chunked", "fused_chunked", "fused_recurrent"},
    "mla": {"absorbed", "paged_decode"},
    "moe": {"router_logits", "router", "swiglu", "experts"},
    "embed": {"embedding", "lm_head"},
}


def test_every_op_of_every_family_is_registered():
    names = set(registry.names())
    for fam, ops in FAMILIES.items():
        assert {f"{fam}.{o}" for o in ops} <= names, fam


@pytest.mark.parametrize("op", registry.names())
def test_each_record_names_a_real_optimized_op_and_at_least_three_distinct_mutants(op):
    rec = registry.get(op)
    fn = rec.optimized_callable()
    assert callable(fn)
    assert len(rec.mutants) >= 3 and len({m.name for m in rec.mutants}) == len(rec.mutants)
    assert all(m.kind in ("wrap", "internal") and m.doc for m in rec.mutants)
    assert set(rec.strengths) <= set(registry.STRENGTHS) and rec.bound_doc


def test_the_design_catalogue_of_mutants_is_present():
    muts = {r.name: {m.name for m in r.mutants} for r in registry.records()}
    assert {"gate_sign_flipped", "beta_dropped", "state_stored_transposed", "chunk_boundary_off_by_one"} <= muts["kda.chunked"]
    assert {"A_log_plus_one", "l2norm_skipped"} <= muts["kda.fused_chunked"]
    assert {"tie_break_flipped", "bias_used_in_combine"} <= muts["moe.router"]
    assert {"wrong_scale", "latent_not_normed"} <= muts["mla.absorbed"]
    assert "taps_reversed" in muts["conv.short_conv"]


def test_selecting_by_family_or_name_and_unknown_names_are_named():
    assert {"conv.short_conv", "conv.short_conv_step"} <= {r.name for r in registry.select(["conv"])}
    assert all(r.family == "conv" for r in registry.select(["conv"]))
    assert [r.name for r in registry.select(["kda.gate"])] == ["kda.gate"]
    with pytest.raises(KeyError, match="nosuch"):
        registry.select(["nosuch"])


def test_registering_a_record_with_too_few_mutants_is_refused():
    rec = registry.get("elementwise.silu")
    import dataclasses

    with pytest.raises(ValueError, match="at least 3 mutants"):
        registry.register(dataclasses.replace(rec, name="x.y", mutants=rec.mutants[:2]))

"""The registry: every public optimized op has a record (found by its family) with its reference,
optimized op and >= 3 mutants; the records are a plain list (the import graph: tests/test_layering.py)."""
import ast
import dataclasses
import importlib
import inspect
import sys
from pathlib import Path

import pytest

from parity import ops, registry

FAMILIES = ("elementwise", "norm", "conv", "kda", "mla", "moe", "embed")

# Names in optimized.<family>.__all__ that are not ops, each with the reason it has no record.
EXEMPT = {
    "mla.PagedLatentCache": "a cache class, not an op: its write path runs inside the mla.paged_decode record",
    "moe.GEMV_MAX_PAIRS": "a constant (the T * k_e above which experts takes the grouped form)",
}


def uncovered(family: str, recorded: set) -> list:
    """Public names of optimized.<family> that are neither recorded (``family.name`` in
    ``recorded``) nor exempt; a public non-function that is not exempt counts too."""
    module = importlib.import_module(f"optimized.{family}")
    out = []
    for name in module.__all__:
        full = f"{family}.{name}"
        if full in EXEMPT and not inspect.isfunction(getattr(module, name)):
            continue
        if not inspect.isfunction(getattr(module, name)) or full not in recorded:
            out.append(full)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_every_public_optimized_function_has_a_record_of_its_family_or_a_reasoned_exemption(family):
    assert uncovered(family, {r.name for r in ops.select([family])}) == []


def test_the_coverage_check_names_a_public_op_without_a_record():
    recorded = {r.name for r in ops.records()} - {"norm.add_rms_norm", "mla.naive"}
    assert uncovered("norm", recorded) == ["norm.add_rms_norm"] and uncovered("mla", recorded) == ["mla.naive"]


@pytest.mark.parametrize("op", ops.names())
def test_each_record_holds_callables_and_at_least_three_distinct_mutants(op):
    rec = ops.get(op)
    assert rec.family == op.split(".")[0] and rec in ops.select([rec.family])
    assert inspect.isfunction(rec.reference) and rec.reference.__module__.startswith(("reference.", "parity.ops."))
    assert inspect.isfunction(rec.optimized) and rec.optimized_callable() is rec.optimized   # no Ref: a callable
    if rec.optimized.__module__.startswith("optimized."):   # the same function name on both sides
        assert registry.describe(rec.optimized) == f"optimized.{rec.family}:{rec.reference.__name__}"
    assert len(rec.mutants) >= 3 and len({m.name for m in rec.mutants}) == len(rec.mutants)
    assert all(m.kind in ("wrap", "internal") and m.doc for m in rec.mutants)
    assert set(rec.strengths) <= set(registry.STRENGTHS) and rec.bound_doc


def test_the_design_catalogue_of_mutants_is_present():
    muts = {r.name: {m.name for m in r.mutants} for r in ops.records()}
    assert {"gate_sign_flipped", "beta_dropped", "state_stored_transposed", "chunk_boundary_off_by_one",
            "initial_state_read_transposed"} <= muts["kda.chunked"]
    assert {"A_log_plus_one", "l2norm_skipped"} <= muts["kda.fused_chunked"]
    assert {"tie_break_flipped", "bias_used_in_combine"} <= muts["moe.router"]
    assert {"wrong_scale", "latent_not_normed"} <= muts["mla.absorbed"] & muts["mla.naive"]
    assert {"taps_reversed", "taps_shifted"} <= muts["conv.short_conv"]


def test_selecting_by_family_or_name_and_unknown_names_are_named():
    assert [r.name for r in ops.select(["conv"])] == ["conv.short_conv", "conv.short_conv_step", "conv.short_conv_step_"]
    assert [r.name for r in ops.select(["kda.gate"])] == ["kda.gate"]
    assert [r.name for r in ops.select(["kda.gate", "kda"])][:2] == ["kda.gate", "kda.recurrent"]
    with pytest.raises(KeyError, match="nosuch"):
        ops.select(["nosuch"])
    with pytest.raises(KeyError, match="nosuch"):
        ops.get("mla.nosuch")


def test_a_record_with_too_few_mutants_or_an_unknown_strength_cannot_be_built():
    rec = ops.get("elementwise.silu")
    with pytest.raises(ValueError, match="at least 3 mutants"):
        dataclasses.replace(rec, name="x.y", mutants=rec.mutants[:2])
    with pytest.raises(ValueError, match="duplicate mutant"):
        dataclasses.replace(rec, mutants=rec.mutants[:2] + rec.mutants[:1])
    with pytest.raises(ValueError, match="unknown strength"):
        dataclasses.replace(rec, strengths=("bytes", "fast"))


def test_the_records_are_a_plain_list_with_no_registration_side_effect():
    a, b = ops.records(), ops.records()
    assert [r.name for r in a] == [r.name for r in b] and len({r.name for r in a}) == len(a)
    src = Path(ops.__file__).parent
    for path in src.rglob("*.py"):
        text = path.read_text()
        assert "register(" not in text and "_REGISTRY" not in text and "_LOADED" not in text, path.name


def test_every_family_is_one_package_with_the_same_module_names():
    for family in ops.FAMILIES:
        modules = {p.stem for p in Path(family.__file__).parent.glob("*.py")}
        assert {"__init__", "inputs", "bounds", "emulate", "mutants"} <= modules, family.__name__


def test_the_record_types_import_nothing_of_the_project_and_nothing_outside_the_standard_library():
    source = Path(registry.__file__).read_text()
    imported = {(n.module if isinstance(n, ast.ImportFrom) else a.name).split(".")[0]
                for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom))
                for a in n.names}
    assert imported and imported <= set(sys.stdlib_module_names) | {"__future__"}, imported

"""The certification verdict: what makes an op not certified, and what the report says."""
import dataclasses

from optimized import elementwise
from parity import ops
from parity.certify import certify_op
from parity.certify.candidate import Candidate
from parity.mutants import wrap
from parity.registry import Ref

SILU = ops.get("elementwise.silu")


def test_a_wrong_kernel_is_not_certified_and_the_stand_in_is_named_nearer_the_truth():
    wrong = Candidate("optimized", elementwise.sigmoid, counter="elementwise.sigmoid", triton=True)
    cert = certify_op(SILU, candidate=wrong, examples=1, dtypes=("float32",))
    assert not cert.certified and "lifted" not in cert.reached()
    why = cert.reasons()[0]
    assert "past the bound" in why and "worst at" in why and "nearer the float64 truth: y: stand-in" in why


def test_any_callable_with_the_records_signature_is_a_candidate():
    """The record's optimized op is one candidate among others: a plain callable is certified by
    the same engine (its mutants and controls run around it), named by module and function, with no
    launch counter to move."""
    from parity.ops.elementwise.emulate import silu

    cert = certify_op(SILU, candidate=silu, examples=1, dtypes=("float32",))
    assert cert.certified, cert.reasons()
    d = cert.to_dict()
    assert d["candidate"] == "parity.ops.elementwise.emulate:silu" and d["counter"] is None
    assert d["mutants_killed"] == d["mutants_total"] == len(SILU.mutants)


def test_an_op_whose_mutant_survives_is_not_certified():
    toothless = wrap("identity", "changes nothing", inputs=lambda d: d)
    rec = dataclasses.replace(SILU, mutants=SILU.mutants[:2] + (toothless,))
    cert = certify_op(rec, candidate="reference-f32", examples=2, dtypes=("float32",))
    assert not cert.certified and cert.mutants_killed() == (2, 3)
    assert any("mutant identity survived" in r for r in cert.reasons())


def test_a_kernel_that_never_records_a_launch_is_not_certified():
    from parity.ops.elementwise.emulate import silu

    silent = Candidate("optimized", silu, counter="elementwise.silu")
    cert = certify_op(SILU, candidate=silent, examples=1, dtypes=("float32",))
    assert cert.runs["float32"].passed and cert.runs["float32"].kernel_ran is False
    assert not cert.certified and any("did not record a launch" in r for r in cert.reasons())


def test_an_unavailable_optimized_op_is_reported_not_raised():
    missing = dataclasses.replace(SILU, optimized=Ref("optimized.elementwise", "no_such_op"))
    cert = certify_op(missing, examples=1)
    assert not cert.certified and "unavailable" in cert.reasons()[0]


def test_the_certificate_dict_has_no_infinite_numbers():
    import json

    cert = certify_op(SILU, candidate="reference-f32", examples=1, dtypes=("float32",))
    json.dumps(cert.to_dict(), allow_nan=False)
    assert cert.to_dict()["teeth"]["missing_x"] is None   # infinite teeth (the degenerate check) -> null

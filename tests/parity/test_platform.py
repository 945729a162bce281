"""parity.platform: the float32 -> bf16 rounding of the platform running the kernels, measured."""
from parity.bounds.core import precision_for
from parity.platform import NEAREST, TOWARD_ZERO, store_rounding


def test_full_precision_runs_round_to_nearest_and_bf16_is_measured_as_nearest(parity_device):
    """A GPU rounds float32 -> bf16 to nearest even, and so does the interpreter once made faithful
    (optimized/_interpreter.py; the stock one truncates: tests/optimized/test_interpreter.py)."""
    assert store_rounding("float32", parity_device) == NEAREST and store_rounding("float64", parity_device) == NEAREST
    assert store_rounding("bfloat16", parity_device) == NEAREST


def test_the_measured_mode_sets_the_bound_of_every_bf16_rounding(parity_device):
    near, tz = (precision_for("bfloat16", {"y": "bfloat16"}, rounding=m).uo("y") for m in (NEAREST, TOWARD_ZERO))
    assert near >= 2.0**-8 and tz >= 2 * 2.0**-8 and tz > near
    measured = store_rounding("bfloat16", parity_device)
    assert precision_for("bfloat16", {"y": "bfloat16"}, rounding=measured).uo("y") == near

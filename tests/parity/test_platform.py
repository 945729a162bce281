"""parity.platform: the float32 -> bf16 rounding of the platform running the kernels, measured."""
import optimized

from parity.bounds.core import precision_for
from parity.platform import NEAREST, TOWARD_ZERO, store_rounding


def test_full_precision_runs_round_to_nearest_and_bf16_is_measured():
    assert store_rounding("float32") == NEAREST and store_rounding("float64") == NEAREST
    mode = store_rounding("bfloat16")
    assert mode in (NEAREST, TOWARD_ZERO)
    if not optimized.interpreting():
        assert mode == NEAREST   # a GPU rounds to nearest even


def test_the_measured_mode_sets_the_bound_of_every_bf16_rounding():
    mode = store_rounding("bfloat16")
    p = precision_for("bfloat16", {"y": "bfloat16"}, rounding=mode)
    assert p.uo("y") >= 2.0**-8 * (2 if mode == TOWARD_ZERO else 1)

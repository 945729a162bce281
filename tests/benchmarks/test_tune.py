"""benchmarks/tune.py: every sweep setting is a valid launch config of its op, and the bit check that
decides whether a setting may become a default without re-certifying has teeth."""
from dataclasses import replace

import pytest
import torch

from benchmarks import tune
from optimized import conv, mla, moe
from optimized.kda import ChunkLaunch


@pytest.mark.parametrize("default,settings", [
    (ChunkLaunch(), [s for group in tune.KDA.values() for s in group]),
    (mla.Launch(), [s for settings, _ in tune.MLA_PARTS.values() for s in settings]),
    (moe.GEMV, tune.MOE["gate_up"] + tune.MOE["down"]),
    (moe.ROUTER_LOGITS, tune.MOE["router"]),
    (moe.GROUPED_DECODE, tune.MOE["grouped_gate_up"] + tune.MOE["grouped_down"]),
    (conv.StepLaunch(), tune.CONV),
], ids=["kda", "mla", "moe-gemv", "moe-router", "moe-grouped", "conv"])
def test_every_setting_is_a_field_of_its_launch_config(default, settings):
    assert settings
    for s in settings:
        launch = replace(default, **s)  # a misspelled field is a TypeError here
        assert all(isinstance(getattr(launch, k), (bool, int)) for k in s), s


def test_same_bits_sees_one_ulp_a_sign_of_zero_and_a_shape():
    a = torch.tensor([1.0, 0.0, float("nan")], dtype=torch.bfloat16)
    assert tune.same_bits(a, a.clone()) and tune.same_bits((a, a), (a.clone(), a.clone()))
    one_ulp = a.view(torch.int16).add(torch.tensor([1, 0, 0], dtype=torch.int16)).view(torch.bfloat16)
    assert not tune.same_bits(a, one_ulp)
    assert not tune.same_bits(a, torch.tensor([1.0, -0.0, float("nan")], dtype=torch.bfloat16))
    assert not tune.same_bits(a, a[:2]) and not tune.same_bits((a,), (a, a))


def test_conv_step_settings_keep_the_bits_and_a_different_op_does_not(parity_device):
    """The conv step's settings only choose which program computes a channel (interpreter here);
    a run that computes something else is reported as different."""
    g = torch.Generator().manual_seed(3)
    x, w, state = (t.to(parity_device) for t in (torch.randn(3, 40, generator=g), torch.randn(40, 4, generator=g),
                                                  torch.randn(3, 40, 3, generator=g)))
    run = lambda launch: conv.short_conv_step(x, w, state, launch=launch)  # noqa: E731
    got = tune.bits_against_defaults(run, conv.StepLaunch(), [dict(block_c=16), dict(block_c=32, num_warps=2)])
    assert [same for _, same in got] == [True, True]
    wrong = lambda launch: conv.short_conv_step(x, w, state if launch.block_c is None else state * 2, launch=launch)  # noqa: E731
    assert tune.bits_against_defaults(wrong, conv.StepLaunch(), [dict(block_c=16)])[0][1] is False
    failed = tune.bits_against_defaults(run, conv.StepLaunch(), [dict(block_c=3)])[0][1]
    assert isinstance(failed, str)  # a setting that cannot run is reported, not raised

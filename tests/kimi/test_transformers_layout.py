"""Checkpoints as transformers' own ``save_pretrained`` writes them load on both paths: its
config.json form (``layer_types``, ``linear_*`` keys), its names of the dense MLP
(``block_sparse_moe.{gate,up,down}_proj``) and F64 tensors of a model held in float64."""
import dataclasses

import numpy as np
import pytest

from kimi.checkpoint import open_source
from kimi.config import KimiConfig
from kimi.tensors import transformers_aliases

try:
    import torch
    from transformers import KimiLinearConfig, KimiLinearForCausalLM
except ImportError:
    pytest.skip("transformers with KimiLinear is not installed (pip install -e '.[peers]'): the checkpoints "
                "its save_pretrained writes are not tested here", allow_module_level=True)

TINY = KimiConfig.from_name("tiny")


@pytest.fixture(scope="module", params=["float64", "bfloat16"])
def saved(request, tmp_path_factory):
    """(checkpoint folder, its tensors as the safetensors library reads them) of a tiny KimiLinear
    that transformers saved in ``request.param``."""
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = KimiLinearForCausalLM(KimiLinearConfig(**TINY.to_hub_dict()))
    model = model.to(getattr(torch, request.param)).eval()
    out = tmp_path_factory.mktemp("hf") / request.param
    model.save_pretrained(out)
    return out, load_file(out / "model.safetensors")


def test_its_config_reads_as_the_preset(saved):
    folder, _ = saved
    cfg = open_source(folder).config
    assert dataclasses.replace(cfg, torch_dtype=TINY.torch_dtype) == TINY


def test_every_tensor_reads_back_bit_for_bit_under_the_hub_name(saved):
    folder, state = saved
    ckpt, aliases = open_source(folder), transformers_aliases(TINY)
    assert any(name in aliases for name in state)  # it did write its own names of the dense MLP
    assert sorted(ckpt.names()) == sorted(aliases.get(n, n) for n in state)
    for name, t in state.items():
        hub = aliases.get(name, name)
        assert ckpt.storage_dtype(hub) == str(t.dtype).replace("torch.", "")
        np.testing.assert_array_equal(ckpt.get(hub).reshape(t.shape), t.double().numpy(), err_msg=name)


def test_the_reference_runs_on_it(saved):
    import reference

    logits = reference.load(saved[0]).forward([5, 17, 300])
    assert logits.shape == (3, TINY.vocab_size) and np.isfinite(logits).all()


def test_the_optimized_path_reads_the_dense_mlp_through_the_same_source(saved, parity_device):
    import optimized

    folder, state = saved
    model = optimized.load(folder, device=parity_device, dtype="float64")
    dense = model.weights.layers[0].ffn
    for proj, got in (("gate_proj", dense.gate), ("up_proj", dense.up), ("down_proj", dense.down)):
        want = state[f"model.layers.0.block_sparse_moe.{proj}.weight"].double()
        assert torch.equal(got.cpu(), want), proj

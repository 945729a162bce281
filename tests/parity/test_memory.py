"""Memory is checked before work starts: the byte counts behind the checks equal what a real model
holds (the loaded tensors' bytes), and a device said to have too little memory gets one line with
the numbers and the ways out, before anything is allocated. The free memory is a parameter here
(``main(free_memory=...)``, the checks' ``free``): every test runs on any machine."""
import numpy as np
import pytest
import torch

import optimized
import reference
from kimi.config import KimiConfig
from kimi.fixtures import default_checkpoint_path
from optimized.backends import resolve
from optimized.cache import sequence_bytes
from optimized.weights import resident_bytes
from parity import memory
from parity.errors import InputError
from reference.cache import cache_bytes

from .diff_helpers import one_line_error, run_cli

GIB = 1 << 30
BIG = KimiConfig.from_name("kimi-linear-48b")


def _storages(obj, seen: dict) -> dict:
    """Every tensor storage reachable from ``obj`` (dataclasses, lists): its address -> bytes."""
    if isinstance(obj, torch.Tensor):
        seen[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            _storages(o, seen)
    elif hasattr(obj, "__dataclass_fields__"):
        for name in obj.__dataclass_fields__:
            _storages(getattr(obj, name), seen)
    return seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_weight_estimate_is_the_loaded_models_bytes(dtype, parity_device):
    """Counted from the tensor table before loading; measured as the loaded model's storages."""
    model = optimized.load(default_checkpoint_path(), device=parity_device, dtype=dtype)
    held = sum(_storages(model.weights, {}).values())
    assert resident_bytes(model.config, getattr(torch, dtype)) == held == model.weights.nbytes()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_cache_estimates_are_the_bytes_each_model_holds_for_a_sequence(dtype):
    """A 70-token prompt and three decode steps (73 positions: two MLA blocks of 64). The op
    families run the reference math (``backends``: seconds, not the interpreter's minutes); the
    cache pool is the model's own either way."""
    ids = [int(t) for t in np.arange(70) % 500 + 1]
    model = optimized.load(default_checkpoint_path(), device="cpu", dtype=dtype,
                           backends={family: "reference" for family in resolve(None)})
    pool = model.new_pool(1)
    _, seq = model.prefill(ids, cache=pool.new_sequence())
    for t in (5, 6, 7):
        _, seq = model.decode(t, seq)
    held = sum(st.conv[seq.slot].nbytes + st.state[seq.slot].nbytes for st in pool.kda.values())
    held += sum(len(seq.blocks) * c.kv[0].nbytes for c in pool.mla.values())
    assert seq.length == 73 and sequence_bytes(model.config, 73, dtype=getattr(torch, dtype)) == held
    ref = reference.load(default_checkpoint_path())
    _, cache = ref.prefill(ids)
    for t in (5, 6, 7):
        _, cache = ref.decode(t, cache)
    held = sum(a.nbytes for layer in cache.layers for a in vars(layer).values())
    assert cache_bytes(ref.config, 73) == held


def test_a_model_that_cannot_fit_is_refused_with_the_numbers_and_the_ways_out():
    need = resident_bytes(BIG, torch.bfloat16)
    assert 90 * GIB < need < 100 * GIB   # the 48B model's bf16 weights (docs/cli.md)
    with pytest.raises(InputError) as info:
        memory.check_weights(BIG, dtype="bfloat16", device="cuda", synthetic="kimi-linear-48b",
                             free=lambda device: 10 * GIB if device == "cuda" else 500 * GIB)
    msg = str(info.value)
    assert "\n" not in msg and f"need {need / GIB:.1f} GiB on cuda, 10.0 GiB free on cuda" in msg, msg
    assert "--device cpu (the host has 500.0 GiB available" in msg and "--synthetic medium" in msg, msg
    with pytest.raises(InputError, match=r"--dtype bfloat16 \(91.5 GiB of weights\)"):
        memory.check_weights(BIG, dtype="float32", device="cpu", free=lambda device: 100 * GIB)
    assert memory.check_weights(BIG, dtype="bfloat16", device="cpu", free=lambda device: 100 * GIB) == need
    assert memory.check_weights(BIG, dtype="bfloat16", device="cpu", free=lambda device: None) == need  # unknown


def test_parity_diff_refuses_the_48b_model_on_a_10_gib_device_before_loading_anything(capsys, parity_device):
    rc, out, err = run_cli(capsys, "diff", "--synthetic", "kimi-linear-48b", "--seed", "0", "--steps", "8",
                           "--device", parity_device, free_memory=lambda device: 10 * GIB)
    one_line_error(rc, out, err, "the optimized model's weights (bfloat16)")
    assert err.count("\n") == 1 and "10.0 GiB" in err and "nothing was loaded" in err, err


def test_the_largest_batch_is_counted_from_the_longest_prompts_on_every_device():
    c = KimiConfig.from_name("tiny")
    lengths = [100, 4000, 300, 4000]
    eng, ref = memory.batch_bytes(c, sorted(lengths, reverse=True), engine_dtype="bfloat16", replay=True)
    two_longest = eng[0] + eng[1] + ref[0] + ref[1]
    fits, per = memory.largest_batch(c, lengths, engine_dtype="bfloat16", engine_device="cpu",
                                     reference_device="cpu", replay=True, free=lambda d: two_longest + 1)
    assert fits == 2 and per == {"cpu": (eng[0] + ref[0], two_longest + 1)}
    # apart: the engine's device holds its caches, the reference's its own
    fits, _ = memory.largest_batch(c, lengths, engine_dtype="bfloat16", engine_device="cuda", reference_device="cpu",
                                   replay=True, free=lambda d: eng[0] + eng[1] + eng[2] if d == "cuda" else 10 * GIB)
    assert fits == 3


def test_a_batch_whose_caches_cannot_fit_is_refused_naming_the_largest_that_fits(tmp_path, capsys, parity_device):
    """50,000 steps a prompt: each holds about 34.5 MiB of caches (the engine's at bf16, the reference's
    and its replay's at float64); 150 MiB free after loading holds 4 of 8."""
    corpus = tmp_path / "p.jsonl"
    corpus.write_text("".join(f'{{"ids": [{i + 1}, 2, 3]}}\n' for i in range(8)))
    rc, out, err = run_cli(capsys, "diff", "--prompts", str(corpus), "--batch", "8", "--steps", "50000",
                           "--device", parity_device, "--reference-device", "cpu", "--no-progress",
                           free_memory=lambda device: 150 << 20)
    one_line_error(rc, out, err, "--batch 8: the caches of 8 prompts of up to 50003 tokens")
    assert "the largest batch that fits is 4: give --batch 4" in err, err

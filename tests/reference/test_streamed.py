"""Weights applied from their storage bits (``reference.streamed``): ``x @ W.T`` in cache-sized row
blocks on every core equals ``x @ W.T`` of the whole upcast weight up to float64 rounding, refuses a
non-finite block before returning anything, names the tensor, and the model that streams agrees
with the one that upcasts.

Rounding bound: each output is a float64 dot product of length ``D``; any summation order is within
``gamma_D * sum |x| |w|`` of the exact value (``gamma_D = D u / (1 - D u)``, ``u = 2**-53``), so two
orders differ by at most twice that. Errors are reported in units of that bound."""
import numpy as np
import pytest

import reference
from kimi.checkpoint import CheckpointError, open_source, save_checkpoint
from kimi.config import KimiConfig
from kimi.storage import raw_to_float64, to_storage
from kimi.synthetic import SyntheticSource
from reference import streamed
from reference.executor import get_executor, to_numpy
from reference.streamed import NonFiniteBlock, StreamedWeight, linear, linear_from_storage

U = 2.0 ** -53
STORAGES = ("bfloat16", "float16", "float32", "float64")
TINY = KimiConfig.from_name("tiny")
TOL = 1e-12  # the executors' agreement measure (tests/reference/test_executors.py)


def bound_units(got, x, w) -> float:
    """max |got - x @ w.T| over 2 gamma_D (|x| @ |w|.T): <= 1 for any float64 summation order; an
    output whose bound is 0 (an exactly zero product) must be exactly right."""
    got = np.asarray(got, dtype=np.float64)
    want = x @ w.T
    if got.shape != want.shape or not np.isfinite(got).all():
        return np.inf
    D = w.shape[1]
    scale = 2 * (D * U / (1 - D * U)) * (np.abs(x) @ np.abs(w).T)
    err = np.abs(got - want)
    if np.any(err[scale == 0] > 0):
        return np.inf
    return float(np.max(err[scale > 0] / scale[scale > 0], initial=0.0))


def case(storage: str, N: int, D: int, T: int, seed: int = 0):
    """(x [T, D], storage bits [N, D], their float64 values) with magnitudes spread over decades."""
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((N, D)) * np.exp(rng.uniform(-4, 4, (N, D)))
    raw = to_storage(values, storage)
    return rng.standard_normal((T, D)), raw, raw_to_float64(raw, storage)


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of 64 weights and 5 tasks: a 301 x 37 weight takes the parallel path (partial blocks,
    a short last task) in a fraction of a second."""
    monkeypatch.setattr(streamed, "BLOCK", 64)
    monkeypatch.setattr(streamed, "THREADS", 5)


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("T", [0, 1, 3])  # 0: x is one vector [D]
@pytest.mark.parametrize("path", ["calling-thread", "parallel"])
def test_a_streamed_product_is_x_at_w_t_of_the_upcast_weight_to_float64_rounding(storage, T, path, request):
    if path == "parallel":
        request.getfixturevalue("small_blocks")
    x, raw, w = case(storage, 301, 37, max(T, 1))
    got = linear_from_storage(x[0] if T == 0 else x, raw, storage)
    assert got.shape == ((301,) if T == 0 else (T, 301))
    assert bound_units(got.reshape(max(T, 1), 301), x, w) <= 1


@pytest.mark.parametrize("device", ["numpy", "torch-cpu"])
def test_linear_on_each_executor_is_x_at_w_t_to_float64_rounding(device, small_blocks):
    """NumPy streams the weight from its bits; torch keeps the whole upcast weight (a GPU converts at
    memory speed): one ``linear`` for both."""
    x, raw, w = case("bfloat16", 301, 37, 2)
    if device == "numpy":
        got = linear(x, StreamedWeight(raw.shape, lambda h: linear_from_storage(h, raw, "bfloat16")))
    else:
        ex = get_executor("cpu", "torch")
        got = to_numpy(linear(ex.asarray(x), ex.from_storage(raw, "bfloat16")))
    assert bound_units(got, x, w) <= 1


def test_the_rounding_check_fails_on_a_planted_bug_and_degenerate_outputs(small_blocks, monkeypatch):
    x, raw, w = case("bfloat16", 301, 37, 2)
    good = linear_from_storage(x, raw, "bfloat16")
    assert bound_units(good, x, w) <= 1
    for bad in (good * (1 + 1e-12), np.zeros_like(good), np.full_like(good, good.mean()),
                np.where(np.arange(good.size).reshape(good.shape) == 7, np.nan, good)):
        assert bound_units(bad, x, w) > 1
    monkeypatch.setattr(streamed, "_SIXTEEN", np.uint32(15))  # a wrong shift: other float32 values
    assert bound_units(linear_from_storage(x, raw, "bfloat16"), x, w) > 1


NON_FINITE = {"bfloat16": (0x7FC0, 0x7F80, 0xFF80), "float16": (np.nan, np.inf, -np.inf),
              "float32": (np.nan, np.inf, -np.inf), "float64": (np.nan, np.inf, -np.inf)}


@pytest.mark.parametrize("storage", STORAGES)
@pytest.mark.parametrize("row", [0, 150, 300])  # first block, a middle one, the partial last block
@pytest.mark.parametrize("path", ["calling-thread", "parallel"])
def test_a_non_finite_weight_is_refused_before_any_result(storage, row, path, request):
    if path == "parallel":
        request.getfixturevalue("small_blocks")
    x, raw, _ = case(storage, 301, 37, 1)
    for value in NON_FINITE[storage]:
        bad = raw.copy()
        bad[row, 11] = value
        with pytest.raises(NonFiniteBlock) as info:
            linear_from_storage(x, bad, storage)
        assert info.value.row <= row  # the first row of the block that holds it


def test_the_largest_finite_values_pass(small_blocks):
    x, raw, w = case("bfloat16", 301, 37, 1)
    raw[5, :] = 0x7F7F  # bf16 max, and its negative: finite, exponent one below all ones
    raw[6, :] = 0xFF7F
    assert bound_units(linear_from_storage(x, raw, "bfloat16"), x, raw_to_float64(raw, "bfloat16")) <= 1


def test_bad_arguments_are_refused():
    x, raw, _ = case("bfloat16", 4, 3, 1)
    with pytest.raises(ValueError, match="unsupported storage dtype 'int8'"):
        linear_from_storage(x, raw, "int8")
    with pytest.raises(TypeError, match="expected \\[N, D\\] float32 bits of float32"):
        linear_from_storage(x, raw, "float32")
    with pytest.raises(ValueError, match="expected x \\[T, 3\\]"):
        linear_from_storage(np.ones((1, 4)), raw, "bfloat16")


def test_blas_runs_at_one_thread_inside_the_blocks_and_is_restored(small_blocks, monkeypatch):
    threadpoolctl = pytest.importorskip("threadpoolctl")

    def blas_threads():
        return [i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"]

    before, inside = blas_threads(), []
    rows = streamed._rows

    def spy(*args):
        inside.append(blas_threads())
        return rows(*args)

    monkeypatch.setattr(streamed, "_rows", spy)
    x, raw, _ = case("bfloat16", 301, 37, 1)
    linear_from_storage(x, raw, "bfloat16")
    assert inside and all(t == [1] * len(before) for t in inside)
    assert blas_threads() == before


# -- the model -------------------------------------------------------------------------------------

def _nan_checkpoint(tmp_path, bad: str):
    src = SyntheticSource(TINY, 0)
    tensors = {n: src.get_raw(n) for n in src.names()}
    tensors[bad] = tensors[bad].copy()
    tensors[bad][2, 5] = 0x7FC0  # a bf16 NaN
    return open_source(save_checkpoint(tmp_path / "ckpt", TINY, tensors, dtypes=src.storage_dtype))


def test_a_streamed_nan_weight_is_an_error_naming_the_tensor(tmp_path):
    bad = "model.layers.1.self_attn.q_proj.weight"
    src = _nan_checkpoint(tmp_path, bad)
    with pytest.raises(CheckpointError, match=rf"model.safetensors: {bad}: 1 non-finite values "
                                              r"\(first at index \(2, 5\)"):
        streamed.source_linear(src, bad, np.ones(TINY.hidden_size))
    model = reference.load(src, weight_cache_bytes=0)
    assert model._w.streams
    for _ in range(2):  # never cached: the second call reads it again and refuses again
        with pytest.raises(CheckpointError, match=bad):
            model.forward([1, 2])
    ok = "model.layers.1.self_attn.k_proj.weight"
    assert streamed.source_linear(src, ok, np.ones(TINY.hidden_size)).shape == (TINY.kda_dim,)


def test_the_streaming_model_agrees_with_the_upcast_model_and_streams(monkeypatch):
    calls = []
    real = streamed.linear_from_storage
    monkeypatch.setattr("reference.streamed.linear_from_storage",
                        lambda x, raw, storage, **kw: calls.append(raw.shape) or real(x, raw, storage, **kw))
    src = SyntheticSource(TINY, 0)
    whole, stream = reference.load(src), reference.load(src, weight_cache_bytes=0)
    assert not whole._w.streams and stream._w.streams
    ids = [3, 1, 4, 1, 5]
    got, want = (_forward_prefill_decode(m, ids) for m in (stream, whole))
    assert calls  # the streaming model went through the kernel, the other did not
    n = len(calls)
    _forward_prefill_decode(whole, ids)
    assert len(calls) == n
    for call in want:
        assert np.abs(got[call] - want[call]).max() <= TOL * np.abs(want[call]).max(), call


def _forward_prefill_decode(model, ids) -> dict:
    out = {"forward": model.forward(ids)}
    out["prefill"], cache = model.prefill(ids[:3])
    for t in range(3, len(ids)):
        out[f"decode{t}"], cache = model.decode(ids[t], cache)
    return out


@pytest.mark.parametrize("budget", [None, 0])
def test_only_the_routed_experts_are_read_when_streaming_too(budget):
    read = []

    class Counting(SyntheticSource):
        def get_raw_rows(self, name, rows):
            read.append(name)
            return super().get_raw_rows(name, rows)

        def get_raw(self, name):
            read.append(name)
            return super().get_raw(name)

    trace = {}
    reference.load(Counting(TINY, 0), weight_cache_bytes=budget).forward([5], trace=trace)
    for i in range(1, TINY.num_hidden_layers):
        prefix = f"model.layers.{i}.block_sparse_moe.experts."
        got = {int(n.split(".")[5]) for n in read if n.startswith(prefix)}
        assert got == set(trace[f"layers.{i}.router.ids"][0].tolist()), i

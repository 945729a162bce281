"""The KDA family's parity-layer code (parity/ops/kda/): its records, its wide inputs, the sequences
its bound and emulation walk, and the read-out condition behind the localization's KDA bound."""
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from parity import ops
from parity.ops.kda.args import segments
from parity.ops.kda.bounds import readout_condition
from reference import kda as rkda


def test_the_fused_kda_references_are_reference_kdas_own():
    assert ops.get("kda.fused_recurrent").reference is rkda.fused_recurrent
    assert ops.get("kda.fused_chunked").reference is rkda.fused_chunked


def test_the_sequences_of_a_batch_are_the_same_from_numpy_torch_and_a_list():
    assert segments(2, 5, None) == [(0, 0, 5, 0), (1, 0, 5, 1)]
    want = [(0, 0, 3, 0), (0, 3, 3, 1), (0, 3, 7, 2)]
    for cu in (np.array([0, 3, 3, 7]), torch.tensor([0, 3, 3, 7]), [0, 3, 3, 7]):
        assert segments(1, 7, cu) == want


@settings(max_examples=12, deadline=None, database=None, derandomize=True)
@given(ops.get("kda.chunked").search_cases("full"))
def test_the_wide_kda_inputs_are_valid_inputs_of_the_record(case):
    a = case.arrays
    B, T, H, K = a["q"].shape
    HV, V = a["v"].shape[2:]
    assert HV % H == 0 and 1 <= H <= 8 and HV <= 8 and K in (16, 32, 64, 128) and V in (16, 32, 64, 128)
    assert a["g"].shape == (B, T, HV, K) and np.all(a["g"] <= 0) and np.all((0 < a["beta"]) & (a["beta"] < 1))
    np.testing.assert_allclose(np.linalg.norm(a["q"], axis=-1), 1.0)
    cu = a["cu_seqlens"]
    n = B if cu is None else len(cu) - 1
    assert cu is None or (B == 1 and cu[0] == 0 and cu[-1] == T and np.all(np.diff(cu) > 0))
    assert a["initial_state"] is None or a["initial_state"].shape == (n, HV, K, V)
    assert case.kwargs["chunk_size"] in (16, 32, 64)


def _states(q, k, v, g, beta):
    """S_t after every step, from the reference recurrence (one token at a time)."""
    S, out = None, []
    for t in range(q.shape[0]):
        _, S = rkda.recurrent(q[None, t:t + 1], k[None, t:t + 1], v[None, t:t + 1], g[None, t:t + 1],
                              beta[None, t:t + 1], initial_state=S)
        out.append(S[0])
    return np.stack(out)


def _core(r, T=6, H=2, HV=4, K=8, V=5):
    q = r.standard_normal((T, H, K))
    k = r.standard_normal((T, H, K))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    return q, k, r.standard_normal((T, HV, V)), -r.uniform(0.01, 1.0, (T, HV, K)), r.uniform(0, 1, (T, HV))


@pytest.mark.parametrize("block", [64, 3])  # the read-outs taken a block of positions at a time
def test_readout_condition_is_the_ratio_of_the_terms_to_the_readout_on_the_references_states(block, monkeypatch):
    monkeypatch.setattr("parity.ops.kda.bounds.READOUT_BLOCK", block)
    r = np.random.default_rng(0)
    q, k, v, g, beta = _core(r)
    kappa, S_end = readout_condition(q, k, v, g, beta)
    S = _states(q, k, v, g, beta)                        # [T, HV, K, V]
    qv = q[:, np.arange(4) // 2]                         # GVA: value head hv reads qk head hv // 2
    want = (np.sqrt(np.einsum("thk,thkv->th", qv ** 2, S ** 2))
            / np.linalg.norm(np.einsum("thk,thkv->thv", qv, S), axis=-1))
    np.testing.assert_allclose(kappa, want, rtol=1e-12)
    np.testing.assert_allclose(S_end, S[-1], rtol=1e-12, atol=1e-15)
    assert np.all(kappa > 0.2) and np.median(kappa) < 3   # generic queries: about 1


def test_a_query_the_state_cancels_has_a_large_condition_and_a_zero_state_none():
    r = np.random.default_rng(1)
    q, k, v, g, beta = _core(r, T=1, H=1, HV=1, K=4, V=3)
    S0 = r.standard_normal((1, 4, 3))
    beta = beta * 0   # the step only decays: S_1 = exp(g) S0; aim q almost into the null space of S_1^T
    S1 = np.exp(g[0, 0])[:, None] * S0[0]
    null = np.linalg.svd(S1.T)[2][-1]                    # S1^T null = 0 (K=4 > V=3)
    q[0, 0] = null + 1e-6 * r.standard_normal(4)
    q[0, 0] /= np.linalg.norm(q[0, 0])
    kappa, _ = readout_condition(q, k, v, g, beta, S0)
    assert kappa[0, 0] > 1e4
    kappa, _ = readout_condition(q, k, np.zeros_like(v), g, beta)  # nothing stored: no error to amplify
    assert kappa[0, 0] == 1.0

"""Sigmoid-routed MoE (spec b.13/b.14): ``router_logits``, ``router``, ``swiglu`` and ``experts``.

Compute dtype float32 (float64 for fp64 inputs); outputs in x's dtype, except the router's combine
weights, which are returned in the compute dtype (float32 for bf16/fp32 logits, as HF and vLLM keep
them) so that ``experts`` combines with unrounded weights.

The model's decode layer is six launches (``router_logits``, ``router``, and the grouped experts'
sort, gate/up, down and combine, with the shared expert as one more group): each expert's weights
are read once a step however many of the batch's tokens chose it; at B=1 each kernel's fixed cost
is a large share of the layer, so the shared expert rides in the routed launches rather than in
launches of its own, and each kernel launches with programmatic dependent launch. Figures against
the layer's byte floor, with and without either: docs/BENCHMARKS.md, "MoE layer"
(``benchmarks/bench_ops.py --only moe``, ``--pdl off``). ``router_logits`` is the fp32 gate GEMM,
batch invariant, x read in bf16 (``ROUTER_LOGITS`` tiles, ``benchmarks/tune.py moe --kernels
router``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .. import _counters, _launch, _pdl
from .._checks import check_float, check_same_device, check_shape, out_or_new, require_ieee_fp32_matmul
from ..elementwise._precision import compute_dtype, tl_compute_dtype
from .kernels import (_bucket_kernel, _combine_kernel, _gemv_down_kernel, _gemv_gate_up_kernel,
                      _grouped_down_kernel, _grouped_gate_up_kernel, _router_kernel,
                      _router_logits_kernel, _silu_mul_kernel)


__all__ = ["router_logits", "router", "swiglu", "experts", "GEMV_MAX_PAIRS"]

#: ``experts`` uses the GEMV form (no sort, two launches) up to this many (token, expert) pairs and
#: the grouped tl.dot form above it. The two forms round differently (within the same bound).
GEMV_MAX_PAIRS = 16
#: Up to this many (token, expert) pairs the grouped form sorts them by expert in one program
#: (``_bucket_kernel``: one launch, as a decode step needs); above, with torch's argsort.
BUCKET_MAX_PAIRS = 2048

@dataclass(frozen=True)
class GemvLaunch:
    """Launch settings of the GEMV form's two kernels (``experts`` up to :data:`GEMV_MAX_PAIRS`
    pairs; ``swiglu`` likewise). ``*_lanes`` is the width of each dot
    product's lane sums, i.e. its summation order: a new default changes bits and is re-certified.
    Rows per program and warps choose only which program computes a row, though warps can change
    the warp layout of the lane sums (``benchmarks/tune.py moe`` compares each setting bit for bit
    with the defaults at B=1 and B=64; on the H200 gate/up 4 rows on 8 warps, down 8 rows on 8 or
    16 warps and 16 rows on 16 changed bits), so only a setting whose bits equal the defaults' may
    be chosen by the batch size.

    gate/up: ``gate_up_rows`` rows of F per program, ``gate_up_lanes`` lanes over D, warps;
    down: ``down_rows`` rows of D per program, ``down_lanes`` lanes over F, warps.
    """
    gate_up_rows: int = 8
    gate_up_lanes: int = 128
    gate_up_warps: int = 8
    down_rows: int = 32
    down_lanes: int = 128
    down_warps: int = 8


#: GEMV-form defaults, chosen from ``benchmarks/tune.py moe``'s sweep at B=1 and B=64 (one layer's
#: 8 routed experts and its shared expert as a ninth pair, weights from HBM; the figures:
#: docs/BENCHMARKS.md, "MoE layer"): gate/up 8 rows x 128 lanes on 8 warps (16 rows x 256 lanes on
#: 2 warps makes 576 programs per B=1 call with the shared pair, past the one wave of 512 the routed
#: pairs alone fill); down 32 rows x 128 lanes on 8 warps.
GEMV = GemvLaunch()
#: Under the CPU interpreter a program costs its Python overhead, not its loads: 32 gate/up rows
#: per program there (a 4x shorter grid; rows per program never change a value).
GEMV_CPU = GemvLaunch(gate_up_rows=32)


@dataclass(frozen=True)
class GroupedLaunch:
    """Launch settings of the grouped form's two ``tl.dot`` kernels. ``rows``: rows of one expert a
    tile (BLOCK_M, at least 16 for the MMA); gate/up: ``gate_up_cols`` columns of F a program,
    ``gate_up_depth`` of D a step (the reduction's chunk), warps, pipeline stages; down likewise
    over D and F. A row's bits never depend on its tile's other rows, but a setting can change the
    MMA instruction (warps, rows) and with it the bits: the decode form's settings are fixed
    (:data:`GROUPED_DECODE`, never chosen from the batch), and a new default is re-certified."""
    rows: int = 16
    gate_up_cols: int = 64
    gate_up_depth: int = 64
    gate_up_warps: int = 4
    gate_up_stages: int = 3
    down_cols: int = 64
    down_depth: int = 64
    down_warps: int = 4
    down_stages: int = 3


#: Prefill's grouped tiles: 16 rows, or 64 where the pairs fill 64-row tiles of every expert.
GROUPED = GroupedLaunch()
GROUPED_WIDE = GroupedLaunch(rows=64)
#: The decode form (the model's decode at any batch: each expert's weights read once per step, the
#: shared expert one more group): 16 rows, the decode step's few tokens per expert; gate/up 32
#: columns x 128 deep, down 64 x 128, 4 warps each, from ``benchmarks/tune.py moe --kernels
#: grouped_gate_up grouped_down`` at B=1 and B=64 (every setting swept kept the defaults' bits; the
#: figures: docs/BENCHMARKS.md, "MoE layer").
GROUPED_DECODE = GroupedLaunch(gate_up_cols=32, gate_up_depth=128, down_depth=128)


def _grouped_default(pairs: int, E: int) -> GroupedLaunch:
    return GROUPED_WIDE if pairs >= 64 * E else GROUPED


@dataclass(frozen=True)
class RouterLogitsLaunch:
    """Launch settings of ``router_logits``: ``tokens`` and ``experts`` per program, ``lanes``
    (BLOCK_D: each logit is BLOCK_D lane sums, then a tree, so it sets the summation order and is
    never chosen from T, for batch invariance), warps."""
    tokens: int = 8
    experts: int = 2
    lanes: int = 1024
    num_warps: int = 4


#: ``router_logits`` tiles for bf16/fp32 x, chosen for the decode's B=1 (``benchmarks/tune.py moe
#: --kernels router``, weights from HBM; the figures: docs/BENCHMARKS.md, "MoE layer"): 1024-lane
#: slices make each program's chain of dependent loads 3 long where 256 lanes make it 9. One token
#: per program with one 4096-lane slice is faster still at B=1 but many times slower at B=64.
ROUTER_LOGITS = RouterLogitsLaunch()
#: fp64 (lifted runs only) takes shorter slices to keep its accumulator in registers.
ROUTER_LOGITS_FP64 = RouterLogitsLaunch(tokens=8, experts=4, lanes=64, num_warps=4)


def _router_logits_default(dtype: torch.dtype) -> RouterLogitsLaunch:
    return ROUTER_LOGITS_FP64 if dtype == torch.float64 else ROUTER_LOGITS


def router_logits_config(E: int, D: int, dtype: torch.dtype = torch.bfloat16,
                         launch: RouterLogitsLaunch | None = None) -> dict:
    """Kernel arguments of ``router_logits`` for ``E`` experts, hidden size ``D``, x's dtype and
    ``launch`` (default: :data:`ROUTER_LOGITS`, :data:`ROUTER_LOGITS_FP64` for float64 x).

    Never a function of T (batch invariance: see :class:`RouterLogitsLaunch`). Against torch's cast
    + fp32 GEMM the kernel gains at decode-sized T and loses at prefill sizes, where torch's GEMM
    picks its tiling by T, which a batch-invariant kernel may not (so prefill keeps torch's GEMM;
    docs/BENCHMARKS.md, "MoE layer"). E does not enter the choice.
    """
    if launch is None:
        launch = _router_logits_default(dtype)
    return {"BLOCK_T": launch.tokens, "BLOCK_E": launch.experts,
            "BLOCK_D": min(launch.lanes, max(16, triton.next_power_of_2(max(D, 1)))),
            "num_warps": launch.num_warps, "num_stages": 3}


def router_logits(x: torch.Tensor, weight: torch.Tensor, *,
                  launch: RouterLogitsLaunch | None = None) -> torch.Tensor:
    """Router logits ``x @ weight.T`` in one Triton kernel (the MoE gate's linear layer).

    x: [T, D] bf16/fp16/fp32/fp64 (a row stride other than D is fine; a non-contiguous last dim is
    copied); weight: [E, D] float32 (float64 for float64 x): the router weight stays fp32 in bf16
    runs. Returns [T, E] float32 (float64 for float64 x). x is widened in registers; products and
    sums run in fp32 (fp64), never TF32.

    Batch invariant: the bits of a row do not depend on T or on the row's position (fixed tiles
    from :func:`router_logits_config`, chosen from E, D and the dtype; one fixed summation order
    per logit; no split-K, no atomics). ``launch``: a :class:`RouterLogitsLaunch` (default: the
    tuned one for x's dtype).
    """
    op = "moe.router_logits"
    _counters.record(op)
    check_float(op, "x", x)
    check_float(op, "weight", weight)
    if x.dim() != 2:
        raise ValueError(f"{op}: x: expected [T, D], got {tuple(x.shape)}")
    T, D = x.shape
    if weight.dim() != 2 or weight.shape[1] != D:
        raise ValueError(f"{op}: weight: expected [E, D] with D = {D}, got {tuple(weight.shape)}")
    cd = compute_dtype(x.dtype)
    if weight.dtype != cd:
        raise TypeError(f"{op}: weight: expected {cd} for x of dtype {x.dtype} (the router weight "
                        f"is kept in the compute dtype), got {weight.dtype}")
    check_same_device(op, x=x, weight=weight)
    launch = _launch.resolve(op, launch, _router_logits_default(x.dtype))
    E = weight.shape[0]
    x = x if x.stride(1) == 1 else x.contiguous()
    weight = weight if weight.stride(1) == 1 else weight.contiguous()
    out = torch.empty((T, E), dtype=cd, device=x.device)
    if T == 0 or E == 0:
        return out
    cfg = router_logits_config(E, D, x.dtype, launch)
    pdl = _pdl.enabled(x.device)
    _router_logits_kernel[(triton.cdiv(E, cfg["BLOCK_E"]), triton.cdiv(T, cfg["BLOCK_T"]))](
        x, weight, out, T, E, D, x.stride(0), weight.stride(0), out.stride(0),
        CD=tl_compute_dtype(x.dtype), PDL=pdl, launch_pdl=pdl, **cfg)
    return out


def router(logits: torch.Tensor, bias: torch.Tensor, *, top_k: int, num_groups: int = 1,
           topk_groups: int = 1, renormalize: bool = True, scaling: float = 1.0,
           combine: str = "unbiased"):
    """noaux_tc sigmoid router, one Triton kernel per block of tokens.

    logits: [T, E] (any float dtype); bias: [E] (``e_score_correction_bias``).
    ``s = sigmoid(logits)``; selection score ``s + bias``; with ``num_groups > 1`` the experts form
    ``num_groups`` contiguous equal groups scored by the sum of their two best selection scores (the
    best one for groups of one expert), and only the
    ``topk_groups`` best groups stay selectable; then the ``top_k`` best selection scores win. Every
    tie (experts or groups) goes to the lower index; ids come out in descending selection score.
    Combine weights: ``s[id]`` (``combine="unbiased"``, vLLM) or ``s[id] + bias[id]``
    (``"biased"``, HF remote code), divided by their sum (summed in selection order) if
    ``renormalize`` and ``top_k > 1`` (HF's rule; with one expert the weight stays ``s[id]``), then
    multiplied by ``scaling``. All in fp32 (fp64 for fp64 logits).

    Returns ``(weights [T, top_k] float32 (float64 for fp64 logits), ids [T, top_k] int64)``.
    """
    op = "moe.router"
    _counters.record(op)
    check_float(op, "logits", logits)
    check_float(op, "bias", bias)
    if logits.dim() != 2:
        raise ValueError(f"{op}: logits: expected [T, E], got {tuple(logits.shape)}")
    T, E = logits.shape
    check_shape(op, "bias", bias, (E,), "[E]")
    check_same_device(op, logits=logits, bias=bias)
    if combine not in ("unbiased", "biased"):
        raise ValueError(f"{op}: combine: expected 'unbiased' or 'biased', got {combine!r}")
    if num_groups < 1 or E % num_groups:
        raise ValueError(f"{op}: num_groups = {num_groups} must divide E = {E}")
    EG = E // num_groups
    if not 1 <= topk_groups <= num_groups:
        raise ValueError(f"{op}: topk_groups = {topk_groups} must be in [1, num_groups = {num_groups}]")
    if not 1 <= top_k <= topk_groups * EG:
        raise ValueError(f"{op}: top_k = {top_k} must be in [1, {topk_groups * EG}] "
                         f"(experts in the kept groups)")
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    cd = compute_dtype(logits.dtype)
    weights = torch.empty((T, top_k), dtype=cd, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    # the routing is a chain of ~50 dependent row reductions: for a decode batch one token per
    # program on one warp (shuffles only, no shared-memory round trips); tokens never interact,
    # so the tiling changes the speed, not a bit of the result
    small = T <= 128 and block_e <= 1024
    block_t = 1 if small else max(1, min(16, 4096 // block_e, triton.next_power_of_2(T)))
    pdl = _pdl.enabled(logits.device)
    _router_kernel[(triton.cdiv(T, block_t),)](
        logits, bias.contiguous(), weights, ids, T, E, EG, logits.stride(0), float(scaling),
        K=top_k, K_PAD=triton.next_power_of_2(top_k), G=num_groups,
        G_PAD=triton.next_power_of_2(num_groups), KG=topk_groups, RENORM=bool(renormalize) and top_k > 1,
        BIASED=combine == "biased", CD=tl_compute_dtype(logits.dtype), BLOCK_T=block_t,
        BLOCK_E=block_e, PDL=pdl, launch_pdl=pdl, num_warps=1 if small else 4)
    return weights, ids


def _silu_mul(g: torch.Tensor, u: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    n, F = g.shape
    h = torch.empty((n, F), dtype=out_dtype, device=g.device)
    if n and F:
        block_f = min(1024, triton.next_power_of_2(F))
        rows = max(1, min(16, 4096 // block_f, triton.next_power_of_2(n)))
        _silu_mul_kernel[(triton.cdiv(n, rows), triton.cdiv(F, block_f))](
            g, u, h, n, F, g.stride(0), u.stride(0), h.stride(0), CD=tl_compute_dtype(out_dtype),
            ROWS=rows, BLOCK_F=block_f, num_warps=4)
    return h


def swiglu(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """Dense SwiGLU MLP ``w_down (silu(w_gate x) * (w_up x))`` (dense MLP, shared expert).

    x: [T, D]; w_gate, w_up: [F, D]; w_down: [D, F]; all one dtype. Returns [T, D] in x's dtype.
    Up to ``GEMV_MAX_PAIRS`` tokens (decode) it runs the GEMV kernels of ``experts`` (two launches,
    ``h`` rounded once to x's dtype); above, torch GEMMs (fp32 accumulation for bf16; float32
    refuses TF32) and a Triton kernel for ``silu(g) * u`` in fp32 (g and u rounded to x's dtype by
    the GEMMs, as in HF/vLLM). When ``w_up``'s rows directly follow ``w_gate``'s in memory (the
    model's layout), gate and up are one GEMM over that ``[2F, D]`` block.
    """
    op = "moe.swiglu"
    _counters.record(op)
    for name, t in (("x", x), ("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        check_float(op, name, t)
        if t.dtype != x.dtype:
            raise TypeError(f"{op}: {name}: dtype {t.dtype} differs from x's {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x: expected [T, D], got {tuple(x.shape)}")
    T, D = x.shape
    if w_gate.dim() != 2 or w_gate.shape[1] != D:
        raise ValueError(f"{op}: w_gate: expected [F, D] with D = {D}, got {tuple(w_gate.shape)}")
    F = w_gate.shape[0]
    check_shape(op, "w_up", w_up, (F, D), "[F, D]")
    check_shape(op, "w_down", w_down, (D, F), "[D, F]")
    check_same_device(op, x=x, w_gate=w_gate, w_up=w_up, w_down=w_down)
    if T <= GEMV_MAX_PAIRS:  # decode: the experts' GEMV kernels (two launches; h rounded once)
        y = torch.empty((T, D), dtype=x.dtype, device=x.device)
        if T:
            wg, wu, wd, xc = (t if t.stride(-1) == 1 else t.contiguous() for t in (w_gate, w_up, w_down, x))
            _gemv(xc, None, None, wg[None], wd[None], wu[None], y, T=T, D=D, KE=1, F=F)
        return y
    require_ieee_fp32_matmul(op, x)
    if _stacked(w_gate, w_up):  # one GEMM over the [2F, D] block (optimized.weights lays them so)
        gu = x @ w_gate.as_strided((2 * F, D), (D, 1)).T
        h = _silu_mul(gu[:, :F], gu[:, F:], x.dtype)
    else:
        h = _silu_mul(x @ w_gate.T, x @ w_up.T, x.dtype)
    return h @ w_down.T


def _stacked(top: torch.Tensor, bottom: torch.Tensor) -> bool:
    """Whether ``bottom``'s rows follow ``top``'s in one storage: together one contiguous matrix.
    (Adjacent addresses alone are not enough: two tensors of the caching allocator can sit back to
    back in different storages, and a view over both would reach outside ``top``'s.)"""
    return (top.is_contiguous() and bottom.is_contiguous() and top.shape == bottom.shape
            and bottom.data_ptr() == top.data_ptr() + top.numel() * top.element_size()
            and top.untyped_storage().data_ptr() == bottom.untyped_storage().data_ptr())


def _check_experts(op, x, weights, ids, w1, w2, w3):
    check_float(op, "x", x)
    if x.dim() != 2:
        raise ValueError(f"{op}: x: expected [T, D], got {tuple(x.shape)}")
    T, D = x.shape
    check_float(op, "weights", weights)
    if weights.dim() != 2 or weights.shape[0] != T:
        raise ValueError(f"{op}: weights: expected [T, k_e] with T = {T}, got {tuple(weights.shape)}")
    KE = weights.shape[1]
    if ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{op}: ids: expected int32/int64, got {ids.dtype}")
    check_shape(op, "ids", ids, (T, KE), "[T, k_e]")
    for name, w in (("w1", w1), ("w2", w2), ("w3", w3)):
        if not isinstance(w, torch.Tensor):
            raise TypeError(f"{op}: {name}: expected a stacked [E, ...] tensor, got {type(w).__name__}")
        check_float(op, name, w)
        if w.dtype != x.dtype:
            raise TypeError(f"{op}: {name}: dtype {w.dtype} differs from x's {x.dtype}")
        if w.dim() != 3 or w.stride(-1) != 1:
            raise ValueError(f"{op}: {name}: expected a 3-D [E, ...] tensor with a contiguous last dim, "
                             f"got shape {tuple(w.shape)} strides {w.stride()}")
    E, F = w1.shape[0], w1.shape[1]
    check_shape(op, "w1", w1, (E, F, D), "[E, F, D]")
    check_shape(op, "w3", w3, (E, F, D), "[E, F, D]")
    check_shape(op, "w2", w2, (E, D, F), "[E, D, F]")
    check_same_device(op, x=x, weights=weights, ids=ids, w1=w1, w2=w2, w3=w3)
    return T, D, KE, E, F


def experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w1: torch.Tensor,
            w2: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """Routed experts: ``y[t] = sum_k weights[t, k] * swiglu(x[t], w1[e], w3[e], w2[e])``,
    ``e = ids[t, k]``.

    x: [T, D]; weights: [T, k_e] (float; read in fp32/fp64); ids: [T, k_e] int32/int64, each in
    [0, E) (not checked on the device); w1 (gate), w3 (up): [E, F, D]; w2 (down): [E, D, F], stacked,
    x's dtype. Only routed experts' weights are read. Returns [T, D] in x's dtype; the intermediate
    ``h = silu(w1 x) * (w3 x)`` is rounded to x's dtype, everything else accumulates in fp32 (fp64).
    """
    op = "moe.experts"
    _counters.record(op)
    return _experts(op, x, weights, ids, w1, w2, w3, form=None)


def _gemv_default(device: torch.device) -> GemvLaunch:
    return GEMV_CPU if device.type == "cpu" else GEMV


def _gemv(x, weights, ids, w1, w2, w3, y, *, T, D, KE, F, h=None, add=False, shared=None, launch=None):
    """GEMV form into ``y`` (``add``: added to y's values); ``ids is None``: one dense expert (w* of
    shape [1, ...]), weight 1. ``shared`` ((gate [F, D], up [F, D], down [D, F])): each token's
    shared expert runs as one more pair in the same launches and is added in the combine.
    ``launch``: a :class:`GemvLaunch` (default :data:`GEMV`, :data:`GEMV_CPU` on CPU)."""
    dense = ids is None
    P = KE + 1 if shared is not None else KE  # pairs per token
    if h is None:
        h = torch.empty((T * P, F), dtype=x.dtype, device=x.device)
    cd = tl_compute_dtype(x.dtype)
    cfg = launch if launch is not None else _gemv_default(x.device)
    bf = min(cfg.gate_up_rows, triton.next_power_of_2(F))
    bd = min(cfg.gate_up_lanes, triton.next_power_of_2(D))
    sg, su, sd = shared if shared is not None else (w1[0], w3[0], w2[0])  # unread without SHARED
    pdl = _pdl.enabled(x.device)
    _gemv_gate_up_kernel[(T * P, triton.cdiv(F, bf))](
        x, x if dense else ids, w1, w3, sg, su, h, D, F, KE, x.stride(0), w1.stride(0), w1.stride(1),
        w3.stride(0), w3.stride(1), sg.stride(0), su.stride(0), h.stride(0), CD=cd, DENSE=dense,
        SHARED=shared is not None, BLOCK_F=bf, BLOCK_D=bd, PDL=pdl, launch_pdl=pdl,
        num_warps=cfg.gate_up_warps)
    bdo = min(cfg.down_rows, triton.next_power_of_2(D))
    bf2 = min(cfg.down_lanes, triton.next_power_of_2(F))
    out = y if dense else torch.empty((T * P, D), dtype=compute_dtype(x.dtype), device=x.device)
    _gemv_down_kernel[(T * P, triton.cdiv(D, bdo))](
        h, x if dense else ids, w2, sd, out, D, F, KE, h.stride(0), w2.stride(0), w2.stride(1),
        sd.stride(0), out.stride(0), CD=cd, DENSE=dense, SHARED=shared is not None, BLOCK_DO=bdo,
        BLOCK_F=bf2, PDL=pdl, launch_pdl=pdl, num_warps=cfg.down_warps)
    if not dense:
        bc = min(1024, triton.next_power_of_2(D))
        _combine_kernel[(T, triton.cdiv(D, bc))](
            out, weights, y, D, KE, out.stride(0), y.stride(0), CD=cd, BLOCK_D=bc, ADD=add,
            SHARED=shared is not None, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return y


def _check_shared(op, shared, x, F, D):
    if not (isinstance(shared, tuple) and len(shared) == 3):
        raise TypeError(f"{op}: shared: expected a (gate, up, down) tuple of tensors")
    for name, w, shape, spec in (("gate", shared[0], (F, D), "[F, D]"), ("up", shared[1], (F, D), "[F, D]"),
                                 ("down", shared[2], (D, F), "[D, F]")):
        check_float(op, f"shared {name}", w)
        if w.dtype != x.dtype:
            raise TypeError(f"{op}: shared {name}: dtype {w.dtype} differs from x's {x.dtype}")
        check_shape(op, f"shared {name}", w, shape, spec + " (the routed experts' F)")
        if w.stride(-1) != 1:
            raise ValueError(f"{op}: shared {name}: expected a contiguous last dim, got strides {w.stride()}")
        check_same_device(op, x=x, **{f"shared_{name}": w})


def _experts(op, x, weights, ids, w1, w2, w3, *, form, add_to=None, shared=None, out=None, launch=None):
    """``experts`` with the form forced (``"gemv"``, ``"grouped"``) or chosen by the pair count
    (None). ``add_to`` ([T, D], x's dtype): the result is added into it in place (``add_to +=
    experts(...)``, the same bits, without a separate add) and it is returned. ``shared`` ((gate
    [F, D], up [F, D], down [D, F]), x's dtype, the routed experts' F): the shared expert's SwiGLU
    added, run as one more pair per token in the same launches (the grouped form: one more group),
    with the bits of ``experts(add_to=<the shared expert as a dense expert of the same form>)``.
    ``out`` ([T, D] contiguous, x's dtype; with ``shared``): where the result goes. ``launch``: the
    form's :class:`GemvLaunch` or :class:`GroupedLaunch` (default: the tuned one; the model's
    decode passes :data:`GROUPED_DECODE`)."""
    T, D, KE, E, F = _check_experts(op, x, weights, ids, w1, w2, w3)
    if form is None:
        form = "gemv" if T * KE <= GEMV_MAX_PAIRS else "grouped"
    if form not in ("gemv", "grouped"):
        raise ValueError(f"{op}: form: expected 'gemv' or 'grouped', got {form!r}")
    default = _gemv_default(x.device) if form == "gemv" else _grouped_default(T * KE, E)
    launch = _launch.resolve(op, launch, default)
    run = _gemv if form == "gemv" else _grouped
    x = x if x.stride(1) == 1 else x.contiguous()
    weights = weights.contiguous()
    ids = ids.contiguous()
    if shared is not None:
        if add_to is not None:
            raise ValueError(f"{op}: shared: not with add_to")
        _check_shared(op, shared, x, F, D)
        y = out_or_new(op, out, (T, D), x)
        if T and D:
            run(x, weights, ids, w1, w2, w3, y, T=T, D=D, KE=KE, F=F, shared=shared, launch=launch)
        return y
    if out is not None:
        raise ValueError(f"{op}: out: only with shared")
    if add_to is not None:
        if add_to.shape != (T, D) or add_to.dtype != x.dtype or add_to.stride(1) != 1:
            raise ValueError(f"{op}: add_to: expected a [T, D] = {(T, D)} {x.dtype} tensor with "
                             f"contiguous rows, got {tuple(add_to.shape)} {add_to.dtype}")
        y = add_to
    else:
        y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    if T * KE == 0 or D == 0:
        return y if add_to is not None else y.zero_()
    return run(x, weights, ids, w1, w2, w3, y, T=T, D=D, KE=KE, F=F, add=add_to is not None, launch=launch)


def _sorted_pairs(ids, T, KE, E, shared: bool, block_m: int, pdl: bool):
    """The grouped form's tile map: (order [N] pair indices by expert, cum_tiles [G], offs [G],
    counts [G], int32), G = E (+1 with the shared expert as group E), N = T * (k_e (+1)), sorted on
    the device with no host sync: one ``_bucket_kernel`` program up to :data:`BUCKET_MAX_PAIRS`."""
    P, G = (KE + 1, E + 1) if shared else (KE, E)
    N = T * P
    dev = ids.device
    if N <= BUCKET_MAX_PAIRS:
        order = torch.empty(N, dtype=torch.int32, device=dev)
        cum, offs, counts = torch.empty((3, G), dtype=torch.int32, device=dev)
        _bucket_kernel[(1,)](ids, order, cum, offs, counts, N, E, KE, SHARED=shared, BLOCK_M=block_m,
                             N_PAD=max(16, triton.next_power_of_2(N)), G_PAD=triton.next_power_of_2(G + 1),
                             PDL=pdl, launch_pdl=pdl, num_warps=4)
        return order, cum, offs, counts
    if shared:
        ids = torch.cat([ids, ids.new_full((T, 1), E)], 1)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pair indices, grouped by expert, token order inside
    counts = torch.zeros(G, dtype=torch.int64, device=dev).scatter_add_(
        0, flat.to(torch.int64), torch.ones_like(flat, dtype=torch.int64))  # no host sync (bincount syncs)
    cum = torch.cumsum((counts + block_m - 1) // block_m, 0).to(torch.int32)
    offs = (torch.cumsum(counts, 0) - counts).to(torch.int32)
    return order, cum, offs, counts.to(torch.int32)


def _grouped(x, weights, ids, w1, w2, w3, y, *, T, D, KE, F, add=False, shared=None, launch):
    """Grouped form into ``y`` (``add``: added to y's values). ``shared`` ((gate [F, D], up [F, D],
    down [D, F])): the shared expert as one more group, each token's last pair, added in the
    combine. ``launch``: a :class:`GroupedLaunch`."""
    E = w1.shape[0]
    P, G = (KE + 1, E + 1) if shared is not None else (KE, E)
    N = T * P
    BM = launch.rows
    pdl = _pdl.enabled(x.device)
    order, cum, offs, counts = _sorted_pairs(ids, T, KE, E, shared is not None, BM, pdl)
    cd = tl_compute_dtype(x.dtype)
    sg, su, sd = shared if shared is not None else (w1[0], w3[0], w2[0])  # unread without SHARED
    max_tiles = triton.cdiv(N, BM) + min(N, G)
    block_e = triton.next_power_of_2(G)
    bf = min(launch.gate_up_cols, max(16, triton.next_power_of_2(F)))
    bd = min(launch.gate_up_depth, max(16, triton.next_power_of_2(D)))
    h = torch.empty((N, F), dtype=x.dtype, device=x.device)
    _grouped_gate_up_kernel[(max_tiles, triton.cdiv(F, bf))](
        x, order, cum, offs, counts, w1, w3, sg, su, h, D, F, G, P, x.stride(0), w1.stride(0),
        w1.stride(1), w3.stride(0), w3.stride(1), sg.stride(0), su.stride(0), h.stride(0), CD=cd,
        SHARED=shared is not None, BLOCK_M=BM, BLOCK_F=bf, BLOCK_D=bd, BLOCK_E=block_e, PDL=pdl,
        launch_pdl=pdl, num_warps=launch.gate_up_warps, num_stages=launch.gate_up_stages)
    out = torch.empty((N, D), dtype=compute_dtype(x.dtype), device=x.device)
    bdo = min(launch.down_cols, max(16, triton.next_power_of_2(D)))
    bf2 = min(launch.down_depth, max(16, triton.next_power_of_2(F)))
    _grouped_down_kernel[(max_tiles, triton.cdiv(D, bdo))](
        h, order, cum, offs, counts, w2, sd, out, D, F, G, h.stride(0), w2.stride(0), w2.stride(1),
        sd.stride(0), out.stride(0), CD=cd, SHARED=shared is not None, BLOCK_M=BM, BLOCK_DO=bdo,
        BLOCK_F=bf2, BLOCK_E=block_e, PDL=pdl, launch_pdl=pdl, num_warps=launch.down_warps,
        num_stages=launch.down_stages)
    bc = min(1024, triton.next_power_of_2(D))
    _combine_kernel[(T, triton.cdiv(D, bc))](
        out, weights, y, D, KE, out.stride(0), y.stride(0), CD=cd, BLOCK_D=bc, ADD=add,
        SHARED=shared is not None, PDL=pdl, launch_pdl=pdl, num_warps=4)
    return y

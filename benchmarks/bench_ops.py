"""Short conv, gated RMSNorm, MLA decode over the paged latent cache and one MoE layer: ours against
fla-core (conv, norm: when installed) and against what a user writes first in plain torch.

    python benchmarks/bench_ops.py --out ops.json
    python benchmarks/bench_ops.py --smoke --out /tmp/ops.json   # same code paths, preset "tiny" shapes

Shapes come from the preset (kimi-linear-48b; ``--smoke``: tiny): short conv over C = H*K channels
(prefill B=1 T=4096, decode step B=64), gated RMSNorm ``[T, H, V]``, MLA decode (N heads, latent L,
rope R, nope P, value Vh) at 4k and 32k context for B=1 and B=64 over a ``PagedLatentCache`` of random
rows (blocks handed out in random order), the MoE layer (fp32 router GEMM + ``moe.router`` +
``moe.experts`` over the stacked experts + the shared expert) at B=1 and B=64 (``--moe-batch 1 16 64
256``: others).

Comparators: MLA = ``F.scaled_dot_product_attention`` over the per-head keys/values expanded from the
latent (``latent @ w_kvb^T``, ``k = [k_nope ; k_pe]``), expansion included; MoE = HF's eager MoE
(fp32 sigmoid gate, ``torch.topk``, a Python loop over the experts that got tokens). Every comparator
is checked against ours once (``max_rel_diff`` = max |ours - comparator| / max |comparator|).
Floors: bytes moved / 4.3 TB/s (``harness.Result``); see each function for what is counted.

Timing: ``harness.bench`` (CUDA events, L2 flushed) on the GPU; on CPU (``--smoke``, Triton
interpreter) a perf_counter median of a few calls, which only proves the code runs.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import optimized  # noqa: E402
from benchmarks.harness import (Result, add_pdl_option, apply_pdl, bench, graph_timings, save,  # noqa: E402
                                wall_per_call)
from kimi.config import KimiConfig  # noqa: E402

BF16 = torch.bfloat16
EPS = 1e-5
SMOKE_TOL = 0.1  # --smoke: ours vs comparator, max |diff| / max |comparator| (wiring check, bf16)


# -- timing that also runs on CPU (smoke) ----------------------------------------------------------
def on_gpu() -> bool:
    return torch.cuda.is_available()


def sync() -> None:
    if on_gpu():
        torch.cuda.synchronize()


def measure(fn) -> tuple[float, tuple[float, float]]:
    """Median and (p20, p80) ms of ``fn()``: ``harness.bench`` on the GPU, perf_counter on CPU."""
    if on_gpu():
        return bench(fn)
    fn()  # first call compiles / warms
    ts = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t0) * 1e3)
    ts.sort()
    return ts[1], (ts[0], ts[-1])


def wall(fn) -> float:
    """Wall-clock ms per call including the Python call (``harness.wall_per_call`` on the GPU)."""
    if on_gpu():
        return wall_per_call(fn)
    fn()
    t0 = time.perf_counter()
    for _ in range(3):
        fn()
    return (time.perf_counter() - t0) / 3 * 1e3


def rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> float:
    ours, ref = ours.float(), ref.float()
    return float((ours - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def check(name: str, diff: float, smoke: bool) -> None:
    print(f"  {name}: max_rel_diff vs comparator {diff:.2e}", flush=True)
    if smoke and not diff < SMOKE_TOL:
        raise AssertionError(f"{name}: ours and the comparator disagree (max rel diff {diff:.3g})")


def nbytes(*ts: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


class Rand:
    """Seeded random tensors on the device (fp32 normal, scaled, cast)."""

    def __init__(self, dev, seed=0):
        self.dev = dev
        self.g = torch.Generator(device=dev).manual_seed(seed)

    def __call__(self, *shape, scale=1.0, dtype=BF16):
        t = torch.randn(*shape, device=self.dev, dtype=torch.float32, generator=self.g)
        return t.mul_(scale).to(dtype)


def _fla_modules():
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        from fla.modules.causal_conv1d.ops import causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated

        return {"causal_conv1d": causal_conv1d, "causal_conv1d_update": causal_conv1d_update,
                "rms_norm_gated": rms_norm_gated}
    except Exception as exc:  # noqa: BLE001 - report any import failure, keep benchmarking ours
        print(f"fla-core not available: {exc}")
        return {}


def _try_fla(name, fn):
    """fla's time, or None (with a printed reason) when its call fails: never stops the run."""
    try:
        return measure(fn)[0], ""
    except Exception as exc:  # noqa: BLE001
        print(f"  fla {name} failed: {type(exc).__name__}: {exc}")
        return None, f"fla {name} failed: {type(exc).__name__}"


# -- short conv -------------------------------------------------------------------------------------
def bench_conv_prefill(dev, B, T, C, W, fla, smoke):
    """``conv.short_conv`` (silu(causal depthwise conv)); floor: x + y + weight + final state."""
    import optimized.conv as oconv

    r = Rand(dev, 10)
    x, w = r(B, T, C), r(C, W, scale=W ** -0.5)
    ours = lambda: oconv.short_conv(x, w)  # noqa: E731
    ms, spread = measure(ours)

    def torch_eager():  # HF's fallback without causal-conv1d: F.conv1d + slice + silu
        return F.silu(F.conv1d(x.transpose(1, 2), w[:, None, :], padding=W - 1, groups=C)[..., :T]).transpose(1, 2)

    base_ms, _ = measure(torch_eager)
    diff = rel_diff(ours()[0], torch_eager())
    check("conv.short_conv", diff, smoke)
    fla_ms, note = None, ""
    if "causal_conv1d" in fla:
        fla_ms, note = _try_fla("causal_conv1d", lambda: fla["causal_conv1d"](
            x, w, activation="silu", output_final_state=True))
    y, final = ours()
    return Result("conv.short_conv", {"B": B, "T": T, "C": C, "W": W, "dtype": "bfloat16"}, ms, spread,
                  fla_ms=fla_ms, baseline="torch F.conv1d + silu", baseline_ms=base_ms,
                  bytes_moved=nbytes(x, y, w, final), notes=note,
                  extra={"max_rel_diff": diff})


def bench_conv_step(dev, B, C, W, fla, smoke):
    """``conv.short_conv_step_`` over a slot-indexed state pool, in place; floor: x + y + weight + the
    state rows read and written."""
    import optimized.conv as oconv

    r = Rand(dev, 11)
    x, w = r(B, C), r(C, W, scale=W ** -0.5)
    pool = r(B, C, W - 1)
    slots = torch.arange(B, device=dev, dtype=torch.int32)
    ours = lambda: oconv.short_conv_step_(x, w, pool, slots)  # noqa: E731

    def torch_eager():  # what a user writes: window = cat(state, x), weighted sum, silu, shift
        win = torch.cat([pool, x[..., None]], -1)
        y = F.silu((win.float() * w.float()).sum(-1)).to(x.dtype)
        pool.copy_(win[..., 1:])
        return y

    saved = pool.clone()
    y_ours = ours()
    pool.copy_(saved)
    diff = rel_diff(y_ours, torch_eager())
    check("conv.short_conv_step_", diff, smoke)
    ms, spread = measure(ours)
    wall_ms = wall(ours)
    base_ms, _ = measure(torch_eager)
    fla_ms, note = None, ""
    if "causal_conv1d_update" in fla:
        cache = torch.zeros(B, C, W, device=dev, dtype=BF16)  # fla keeps W columns
        fla_ms, note = _try_fla("causal_conv1d_update", lambda: fla["causal_conv1d_update"](
            x, cache, weight=w, activation="silu"))
    return Result("conv.short_conv_step_", {"B": B, "C": C, "W": W, "dtype": "bfloat16"}, ms, spread,
                  fla_ms=fla_ms, baseline="torch eager (cat, sum, silu, copy)", baseline_ms=base_ms,
                  bytes_moved=nbytes(x, x, w) + 2 * nbytes(pool), notes=note,
                  extra={"wall_ms_per_call": wall_ms, "max_rel_diff": diff})


# -- gated RMSNorm ----------------------------------------------------------------------------------
def bench_gated_norm(dev, T, H, V, fla, smoke):
    """``norm.gated_rms_norm`` (KDA o_norm, sigmoid gate); floor: x + gate + y + weight."""
    import optimized.norm as onorm

    r = Rand(dev, 12)
    x, gate = r(T, H, V), r(T, H, V)
    w = r(V, scale=0.05).float().add_(1.0).to(BF16)
    ours = lambda: onorm.gated_rms_norm(x, gate, w, eps=EPS)  # noqa: E731
    ms, spread = measure(ours)

    def torch_eager():
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
        return (y * w.float() * torch.sigmoid(gate.float())).to(x.dtype)

    base_ms, _ = measure(torch_eager)
    diff = rel_diff(ours(), torch_eager())
    check("norm.gated_rms_norm", diff, smoke)
    fla_ms, note = None, ""
    if "rms_norm_gated" in fla:
        fla_ms, note = _try_fla("rms_norm_gated", lambda: fla["rms_norm_gated"](
            x, gate, w, None, activation="sigmoid", eps=EPS))
    return Result("norm.gated_rms_norm", {"T": T, "H": H, "V": V, "dtype": "bfloat16"}, ms, spread,
                  fla_ms=fla_ms, baseline="torch eager (fp32)", baseline_ms=base_ms,
                  bytes_moved=3 * nbytes(x) + nbytes(w), notes=note, extra={"max_rel_diff": diff})


# -- MLA decode -------------------------------------------------------------------------------------
def bench_mla_decode(dev, B, S, N, L, R, P, Vh, block_size, smoke):
    """``mla.paged_decode`` (absorbed) over a PagedLatentCache holding S random positions for each of
    B sequences, blocks in random order. Floor: the cache rows B*S*(L+R) + W_UK/W_UV once (+ q, o);
    compute floor: the absorbed attention (B*N*S*2*(L+R + L)) and the two per-head GEMMs.
    Comparator: plain torch, expansion + SDPA over [B, N, S, P+R] keys / [B, N, S, Vh] values, skipped
    when its tensors would not fit in free GPU memory."""
    import optimized.mla as omla

    r = Rand(dev, 13)
    per_seq = -(-S // block_size)
    cache = omla.PagedLatentCache(B * per_seq, block_size, L, R, BF16, dev)
    cache.kv.copy_(r(*cache.kv.shape))
    g = torch.Generator(device="cpu").manual_seed(14)
    block_tables = torch.randperm(B * per_seq, generator=g).view(B, per_seq).to(dev, torch.int32)
    seq_lens = torch.full((B,), S, device=dev, dtype=torch.int32)
    q = r(B, N, P + R)
    w_kvb = r(N * (P + Vh), L, scale=L ** -0.5)
    ours = lambda: omla.paged_decode(q, cache, block_tables, seq_lens, w_kvb)  # noqa: E731
    ms, spread = measure(ours)
    wall_ms = wall(ours)
    o = ours()
    cache_bytes = B * S * (L + R) * cache.kv.element_size()
    flops = B * N * S * 2 * ((L + R) + L) + 2 * B * N * L * (P + Vh)
    params = {"B": B, "S": S, "N": N, "L": L, "R": R, "P": P, "Vh": Vh, "block_size": block_size,
              "dtype": "bfloat16"}
    extra = {"wall_ms_per_call": wall_ms, **(graph_timings(ours) if on_gpu() else {})}

    # expanded kv [B,S,N,P+Vh], keys [B,S,N,P+R], a possible contiguous copy of the values, and the
    # contiguous latent/k_pe the comparator starts from
    base_bytes = B * S * N * ((P + Vh) + (P + R) + Vh) * 2 + 2 * cache_bytes
    free = torch.cuda.mem_get_info()[0] if on_gpu() else float("inf")
    base_ms, note = None, ""
    if base_bytes > 0.8 * free:
        note = (f"torch SDPA baseline skipped: its expanded keys/values need about "
                f"{base_bytes / 2**30:.0f} GiB, {free / 2**30:.0f} GiB free")
        print("  " + note)
    else:
        try:
            rows = cache.kv[block_tables.long()].reshape(B, per_seq * block_size, L + R)[:, :S]
            latent, k_pe = rows[..., :L].contiguous(), rows[..., L:].contiguous()
            del rows

            def torch_sdpa():  # what a user reaches for first: expand the latent, then SDPA
                kv = (latent @ w_kvb.T).view(B, S, N, P + Vh)
                k_nope, v = kv.split([P, Vh], dim=-1)
                k = torch.cat([k_nope, k_pe[:, :, None, :].expand(B, S, N, R)], dim=-1)
                return F.scaled_dot_product_attention(q[:, :, None, :], k.transpose(1, 2),
                                                      v.transpose(1, 2))[:, :, 0]

            extra["max_rel_diff"] = diff = rel_diff(o, torch_sdpa())
            check(f"mla.paged_decode B={B} S={S}", diff, smoke)
            base_ms, _ = measure(torch_sdpa)
            del latent, k_pe
        except torch.cuda.OutOfMemoryError as exc:
            note = f"torch SDPA baseline skipped: out of memory ({str(exc).splitlines()[0]})"
            print("  " + note)
        if on_gpu():
            torch.cuda.empty_cache()
    return Result("mla.paged_decode", params, ms, spread, baseline="torch expand + SDPA",
                  baseline_ms=base_ms, bytes_moved=cache_bytes + nbytes(w_kvb, q, o), flops=flops,
                  notes=note, extra=extra)


# -- MoE layer --------------------------------------------------------------------------------------
class MoELayer:
    """Random weights of one MoE layer as the model holds them: fp32 router and correction bias,
    stacked bf16 experts w1/w3 [E, F, D] and w2 [E, D, F], the shared expert."""

    def __init__(self, dev, cfg: KimiConfig):
        r = Rand(dev, 15)
        D, F_, E = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        Fs = F_ * cfg.num_shared_experts
        self.cfg, self.D, self.F, self.E, self.k = cfg, D, F_, E, cfg.num_experts_per_token
        self.router = r(E, D, scale=D ** -0.5, dtype=torch.float32)
        self.bias = r(E, scale=0.1, dtype=torch.float32)
        self.w1, self.w3 = r(E, F_, D, scale=D ** -0.5), r(E, F_, D, scale=D ** -0.5)
        self.w2 = r(E, D, F_, scale=F_ ** -0.5)
        self.sg, self.su, self.sd = r(Fs, D, scale=D ** -0.5), r(Fs, D, scale=D ** -0.5), r(D, Fs, scale=Fs ** -0.5)

    def route(self, logits):
        import optimized.moe as omoe

        c = self.cfg
        return omoe.router(logits, self.bias, top_k=self.k, num_groups=c.num_expert_group,
                           topk_groups=c.topk_group, renormalize=c.moe_renormalize and self.k > 1,
                           scaling=c.routed_scaling_factor)

    def ours(self, x, path="decode", form="grouped"):
        """``"decode"``: the model's decode step (``router_logits``, the router, the routed experts
        and the shared expert in one set of launches: ``form`` "grouped", the model's, or "gemv",
        one GEMV per (token, expert) pair); ``"prefill"``: the model's prefill (torch's fp32 router
        GEMM, ``experts`` in the form its pair count picks, ``swiglu``)."""
        import optimized.moe as omoe

        if path == "decode" and self.sg.shape[0] == self.F:
            w, ids = self.route(omoe.router_logits(x, self.router))
            launch = omoe.GROUPED_DECODE if form == "grouped" else None
            return omoe._experts("moe.experts", x, w, ids, self.w1, self.w2, self.w3, form=form,
                                 shared=(self.sg, self.su, self.sd), launch=launch)
        w, ids = self.route(x.float() @ self.router.T)
        return (omoe.experts(x, w, ids, self.w1, self.w2, self.w3)
                + omoe.swiglu(x, self.sg, self.su, self.sd))

    def hf_eager(self, x):
        """HF's eager MoE (DeepseekV3-style ``moe_infer``; Kimi's remote code is the same)."""
        c, T, k = self.cfg, x.shape[0], self.k
        scores = F.linear(x.float(), self.router).sigmoid()
        sel = scores + self.bias[None]
        if c.num_expert_group > 1:
            g = sel.view(T, c.num_expert_group, -1).topk(2, dim=-1)[0].sum(-1)
            keep = torch.zeros_like(g).scatter_(1, g.topk(c.topk_group, dim=-1, sorted=False)[1], 1)
            sel = sel.masked_fill(~keep.bool().repeat_interleave(self.E // c.num_expert_group, 1), 0.0)
        ids = torch.topk(sel, k=k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if c.moe_renormalize and k > 1:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        w = w * c.routed_scaling_factor
        cnts = ids.new_zeros((T, self.E)).scatter_(1, ids, 1)
        tokens_per_expert = cnts.sum(0).cpu().numpy()
        idxs = ids.view(-1).argsort()
        sorted_tokens = x[idxs // k]
        outputs, start = [], 0
        for e, n in enumerate(tokens_per_expert):
            if n == 0:
                continue
            t = sorted_tokens[start:start + n]
            outputs.append(F.linear(F.silu(F.linear(t, self.w1[e])) * F.linear(t, self.w3[e]), self.w2[e]))
            start += n
        outs = torch.cat(outputs, dim=0)
        new_x = torch.empty_like(outs)
        new_x[idxs] = outs
        y = new_x.view(T, k, -1).type(w.dtype).mul_(w.unsqueeze(-1)).sum(dim=1).type(x.dtype)
        return y + F.linear(F.silu(F.linear(x, self.sg)) * F.linear(x, self.su), self.sd)


def bench_moe(dev, layer: MoELayer, B, smoke, form="grouped", prefill=True):
    """One MoE layer for B tokens, its experts in ``form`` (see ``MoELayer.ours``); ``prefill``: the
    prefill path timed too (it does not depend on ``form``). Floor: the weights that must be read
    (the distinct routed experts the B tokens touch, counted from the router's ids, + the shared
    expert + the fp32 router) + x, y."""

    x = Rand(dev, 16 + B)(B, layer.D)
    ours = lambda: layer.ours(x, form=form)  # noqa: E731
    ms, spread = measure(ours)
    wall_ms = wall(ours)
    base = lambda: layer.hf_eager(x)  # noqa: E731
    diff = rel_diff(ours(), base())
    check(f"moe.layer B={B}", diff, smoke)
    base_ms, _ = measure(base)
    _, ids = layer.route(x.float() @ layer.router.T)
    distinct = int(torch.unique(ids).numel())
    expert_bytes = nbytes(layer.w1[0], layer.w2[0], layer.w3[0])
    bytes_moved = (distinct * expert_bytes + nbytes(layer.sg, layer.su, layer.sd, layer.router, layer.bias)
                   + 2 * nbytes(x))
    flops = 2 * B * (layer.k + 1) * 3 * layer.D * layer.F + 2 * B * layer.E * layer.D
    extra = {"distinct_experts": distinct, "wall_ms_per_call": wall_ms, "max_rel_diff": diff,
             **(graph_timings(ours) if on_gpu() else {})}
    if prefill:
        try:  # what the prefill path (torch router GEMM, the form the pair count picks) costs here
            extra["prefill_path_ms"] = measure(lambda: layer.ours(x, path="prefill"))[0]
        except Exception as exc:  # noqa: BLE001
            print(f"  prefill path failed: {type(exc).__name__}: {exc}")
    return Result("moe.layer", {"B": B, "D": layer.D, "F": layer.F, "E": layer.E, "k_e": layer.k,
                                "path": f"decode ({form} experts, shared expert fused)", "dtype": "bfloat16"},
                  ms, spread, baseline="torch eager (HF moe_infer loop)", baseline_ms=base_ms,
                  bytes_moved=bytes_moved, flops=flops, extra=extra)


# -- driver -----------------------------------------------------------------------------------------
def plan(smoke: bool) -> dict:
    cfg = KimiConfig.from_name("tiny" if smoke else "kimi-linear-48b")
    return {
        "cfg": cfg,
        "conv_prefill": (1, 32 if smoke else 4096),  # (B, T)
        "conv_step_B": 4 if smoke else 64,
        "norm_T": 16 if smoke else 4096,
        "mla_S": (64, 72) if smoke else (4096, 32768),
        "mla_B": (1, 3) if smoke else (1, 64),
        "mla_block": 16 if smoke else 64,
        "moe_B": (1, 16) if smoke else (1, 64),  # smoke: 16 tokens x 2 experts > GEMV_MAX_PAIRS: grouped
    }


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="ops.json")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (preset 'tiny'); runs on CPU")
    ap.add_argument("--only", nargs="*", default=["conv", "norm", "mla", "moe"],
                    choices=["conv", "norm", "mla", "moe"])
    ap.add_argument("--moe-batch", nargs="+", type=int, default=None, metavar="B",
                    help="MoE layer batch sizes (default: 1 64; --smoke: 1 16)")
    ap.add_argument("--moe-form", nargs="+", default=["grouped"], choices=["grouped", "gemv"],
                    help="the decode's expert forms to time: grouped (the model's), gemv (per pair)")
    add_pdl_option(ap)
    args = ap.parse_args(argv)
    if args.moe_batch is not None and min(args.moe_batch) < 1:
        ap.error(f"--moe-batch: expected positive batch sizes, got {args.moe_batch}")
    apply_pdl(args.pdl)
    if not on_gpu() and not args.smoke:
        ap.error("no CUDA device: the full-size benchmark needs the GPU (use --smoke on CPU)")
    dev = torch.device(optimized.use("cuda" if on_gpu() else "cpu"))   # on CPU the faithful interpreter
    p = plan(args.smoke)
    cfg: KimiConfig = p["cfg"]
    C, W = cfg.kda_dim, cfg.short_conv_kernel_size
    N, L, R = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    P, Vh = cfg.qk_nope_head_dim, cfg.v_head_dim
    fla = _fla_modules() if on_gpu() else {}  # fla's kernels autotune: they cannot run on CPU
    results = []
    cmd = "python benchmarks/bench_ops.py" + (" --smoke" if args.smoke else "") + " --out ops.json"

    def done(r):  # saved after every case: a run cut short by its time limit keeps what it measured
        results.append(r)
        print(r.as_dict(), flush=True)
        save(results, args.out, command=cmd)
        if on_gpu():
            torch.cuda.empty_cache()

    t_start = time.perf_counter()
    with torch.inference_mode():
        if "conv" in args.only:
            done(bench_conv_prefill(dev, *p["conv_prefill"], C, W, fla, args.smoke))
            done(bench_conv_step(dev, p["conv_step_B"], C, W, fla, args.smoke))
        if "norm" in args.only:
            done(bench_gated_norm(dev, p["norm_T"], cfg.kda_num_heads, cfg.kda_head_dim, fla, args.smoke))
        if "mla" in args.only:
            for S in p["mla_S"]:
                for B in p["mla_B"]:
                    done(bench_mla_decode(dev, B, S, N, L, R, P, Vh, p["mla_block"], args.smoke))
        if "moe" in args.only:
            layer = MoELayer(dev, cfg)
            for form in args.moe_form:
                for B in args.moe_batch or p["moe_B"]:
                    done(bench_moe(dev, layer, B, args.smoke, form, prefill=form == args.moe_form[0]))
            del layer
    print(f"bench_ops: {len(results)} results in {time.perf_counter() - t_start:.1f} s", flush=True)


if __name__ == "__main__":
    main()

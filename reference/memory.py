"""How much memory a call of the float64 reference may need at its peak, before it allocates any.

The model (``reference.model``) checks ``call_bytes`` against the executor's free memory first
(``check_fits``) and refuses a call that cannot fit with one line (``DoesNotFit``), instead of
failing deep inside with a traceback after minutes of work; running out anyway is ``DoesNotFit``
too (``out_of_memory``). The estimate counts float64 arrays (8 bytes) of the shapes the
model allocates, by the letters of docs/ARCHITECTURE.md (``T`` new tokens, ``S`` = cached + T
positions, ``Ts = min(T, SEGMENT)`` tokens of a KDA / routed-expert segment):

- the residual stream and branch outputs: ``4 T D``;
- the largest layer: KDA ``16 Ts (H K)`` (projections, conv outputs, normalized q/k, gate, decay,
  output) plus ``2 T (H K)`` for the segment outputs and the chunked form's working set on a block
  of chunks (``KDA_BLOCK_ARRAYS`` arrays of ``kda.block_bytes``); MLA ``3 T N (P+R) + 3 T N Vh`` plus the
  blocked attention's working set (``mla.attention_bytes``: score blocks and, in the naive form,
  the per-head keys and values ``N S (P+Vh)``); MoE ``5 T E`` (router) + ``Ts k_e D + 3 T D``
  (expert outputs in expert order, gathered back per slot) + ``3 T F_shared``, and with experts
  run ``n`` at a time their weights ``4 n F D``, padded rows ``n Ts (3 D + 3 F)`` (a bound:
  one expert may take every token) and ``2 Ts k_e D`` more outputs; dense ``4 T F``;
- the new cache's MLA arrays ``S (L+R)`` per MLA layer;
- the weights: the LRU's budget plus twice the largest tensor in flight (its raw bits and its
  float64 form; a layer's attention projections fetched as one count as one), or a streamed
  product's scratch if larger (``streamed.scratch_bytes``: a block of uint32 and float64 per core);
- the trace when asked for: ``3 T D`` per layer, ``2 T E + T k_e`` per MoE layer, ``T D``; with
  the KDA core's values (``trace_kda_core``) ``5 T (H K) + T H + H K^2`` per KDA layer more;
- the logits ``2 T' vocab`` (blocks and their concatenation; ``T' = 1`` for ``logits="last"``).

It is an upper estimate for the shapes (every named temporary alive at once); the model adds a
25% margin for allocator slack. A ``decode_batch`` step of B sequences (``step_bytes``) counts as a
call on B tokens after the longest cache, plus every sequence's new MLA cache.
"""
from __future__ import annotations

from contextlib import contextmanager

from kimi.config import KimiConfig
from kimi.tensors import layer_tensors

from .kda import block_bytes
from .mla import attention_bytes
from .streamed import scratch_bytes

F64 = 8
KDA_BLOCK_ARRAYS = 24  # the chunked form's working set of a block of chunks (``kda.block_bytes``):
# q, k, v, g and their products, the masked products and the WY solve's operands, with room
MEMORY_MARGIN = 1.25  # the estimate times this must fit: allocator slack, fragmentation
SEGMENT = 8192  # a long prefill's KDA layers and routed experts run on this many tokens at a time
# (a multiple of the KDA chunk 64: the chunks, the carried states and so the results are those of
# one pass; the activations of a 32k-token 48B prefill shrink 4x)


class DoesNotFit(MemoryError):
    """A call whose estimated peak memory exceeds what the executor's device has free (one line)."""


def call_bytes(config: KimiConfig, T: int, *, cached: int = 0, trace: bool = False, logits: str = "all",
               lm_head_rows: int = 4096, weight_bytes: int = 64 << 20, segment: int | None = None,
               trace_kda_core: bool = False, expert_group: int | None = None) -> int:
    """Peak bytes of a forward/prefill/decode call on ``T`` new tokens after ``cached`` ones.
    ``expert_group``: the routed experts run that many at a time (``moe.experts(group=)``)."""
    c = config
    S = cached + T
    Ts = min(T, SEGMENT if segment is None else segment)
    D, HK, E, k = c.hidden_size, c.kda_dim, c.num_experts, c.num_experts_per_token
    H, K = c.kda_num_heads, c.kda_head_dim
    N, P, R, Vh, L = (c.num_attention_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim,
                      c.kv_lora_rank)
    layers = range(c.num_hidden_layers)
    kda = 16 * Ts * HK + 2 * T * HK + KDA_BLOCK_ARRAYS * block_bytes(1, Ts, H, K, K) // F64
    form = "naive" if cached == 0 else "absorbed"
    mla = 3 * T * N * (P + R) + 3 * T * N * Vh + attention_bytes(1, T, S, N, P, R, Vh, L, form=form) // F64
    F = c.moe_intermediate_size
    moe = 5 * T * E + Ts * k * D + 3 * T * D + 3 * T * F * c.num_shared_experts
    if expert_group:  # a group's weights (float64 and their stacked storage) and padded rows
        n = min(expert_group, E)
        moe += 2 * Ts * k * D + 4 * n * F * D + n * Ts * (3 * D + 3 * F)
    dense = 4 * T * c.intermediate_size
    largest = max([kda if c.is_kda_layer(i) else mla for i in layers]
                  + [moe if c.is_moe_layer(i) else dense for i in layers])
    n_mla = sum(not c.is_kda_layer(i) for i in layers)
    n_moe = sum(c.is_moe_layer(i) for i in layers)
    tensor = max(n for i in layers for n in map(_numel, layer_tensors(c, i).values()))
    # a layer's input projections may be fetched as one (``Weights.linears``): at most all of them
    tensor = max(tensor, max(sum(_numel(s) for n, s in layer_tensors(c, i).items() if "self_attn." in n
                                 and n.endswith("proj.weight")) for i in layers))
    tensor = max(tensor, lm_head_rows * D)
    kept = 4 * T * D + n_mla * S * (L + R)  # alive through the call
    if trace:
        kept += c.num_hidden_layers * 3 * T * D + n_moe * (2 * T * E + T * k) + T * D
    rows = T if logits == "all" else 1
    weights = max(2 * tensor, scratch_bytes() // F64)
    peak = max(largest + weights, 2 * rows * c.vocab_size + lm_head_rows * D)
    core = 0  # the KDA core's values a trace holds with trace_kda_core: q, k, v, g, normed, beta, state
    if trace and trace_kda_core:
        n_kda = sum(c.is_kda_layer(i) for i in layers)
        core = n_kda * (5 * T * c.kda_dim + T * c.kda_num_heads + c.kda_num_heads * c.kda_head_dim ** 2) * F64
    return core + (kept + peak) * F64 + weight_bytes


def check_fits(need: int, executor, call: str, T: int, cached: int) -> None:
    """``DoesNotFit`` when ``need`` bytes (``call_bytes``) and the margin exceed ``executor``'s free
    memory (nothing is checked where the free memory is unknown)."""
    free = executor.free_bytes()
    if free is not None and need * MEMORY_MARGIN > free:
        raise DoesNotFit(f"the float64 reference's {call} of {T} token(s) after {cached} needs about "
                         f"{need * MEMORY_MARGIN / 2**30:.1f} GiB on {_where(executor)} "
                         f"({_gib(need)} estimated + {MEMORY_MARGIN - 1:.0%} margin), "
                         f"{_gib(free)} free")


@contextmanager
def out_of_memory(executor, call: str, T: int, cached: int):
    """Running out of ``executor``'s memory inside the block raises ``DoesNotFit`` naming the call
    (one line, the library's first line in parentheses)."""
    try:
        yield
    except executor.oom_errors() as exc:
        if isinstance(exc, DoesNotFit):
            raise
        raise DoesNotFit(f"the float64 reference ran out of {_where(executor)} in its {call} of {T} "
                         f"token(s) after {cached} ({_oom_text(exc)})") from None


def _where(executor) -> str:
    return "host memory" if executor.device == "cpu" else executor.device


def _oom_text(exc) -> str:
    """The first line of an out-of-memory error ('Tried to allocate 2.00 GiB ...' for torch)."""
    lines = str(exc).strip().splitlines()
    return " ".join(lines[0].split())[:200] if lines else type(exc).__name__


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def step_bytes(config: KimiConfig, lengths: list[int], *, riding: int = 0, **kw) -> int:
    """Peak bytes of a ``decode_batch`` step: one new token after each of B caches of ``lengths``
    tokens. The B rows' activations (and ``riding`` rows riding along with an FFN) as a call on
    that many tokens after the longest cache (each sequence's attention runs on its own, none
    longer than that one's), plus the new MLA caches of every sequence, not only the longest's.
    ``kw``: as ``call_bytes``."""
    c = config
    B, longest = len(lengths), max(lengths)
    n_mla = sum(not c.is_kda_layer(i) for i in range(c.num_hidden_layers))
    others = sum(n + 1 for n in lengths) - (longest + B)  # positions of the other sequences' new caches
    return (call_bytes(c, B + riding, cached=longest, **kw)
            + n_mla * max(0, others) * (c.kv_lora_rank + c.qk_rope_head_dim) * F64)

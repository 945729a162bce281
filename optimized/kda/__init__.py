"""Optimized KDA (Kimi Delta Attention) ops: Triton kernels with the reference's names and shapes.

- :func:`gate` (gate.py): the softplus forget gate, float32 out.
- :func:`chunked`, :func:`fused_chunked` (chunk.py): the chunked algorithm, five kernels
  (gate/prefix sums, intra-chunk matrices + the diagonal blocks' exact inverses, the merged inverse
  + WY, sequential state pass, output).
- :func:`recurrent`, :func:`fused_recurrent`, :func:`fused_recurrent_decode` (recurrent.py): one
  fused kernel walking the tokens; the decode form updates a state pool in place by slot id.

Shapes (docs/ARCHITECTURE.md): q, k [B,T,H,K]; v [B,T,HV,V]; g [B,T,HV,K] (log-space, <= 0);
beta [B,T,HV]; states [B,HV,K,V] K-first (or [N,HV,K,V] with cu_seqlens), float32 (float64 for
fp64 inputs); o [B,T,HV,V] in the input dtype. Every public op records ``kda.<name>`` in
``optimized._counters`` once per call.
"""
from .chunk import ChunkLaunch, chunked, fused_chunked  # noqa: F401  (ChunkLaunch: launch settings)
from .gate import gate
from .recurrent import fused_recurrent, fused_recurrent_decode, recurrent


__all__ = ["gate", "recurrent", "chunked", "fused_recurrent", "fused_chunked",
           "fused_recurrent_decode"]

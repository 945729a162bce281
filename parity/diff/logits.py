"""The logits' own bound: what an engine's logits must satisfy whatever its hidden state was.

Every engine computes its logits as ``o = fl(W x~)``: the lm_head ``W [V, D]`` (the checkpoint's,
stored exactly) applied to its own final normed hidden state ``x~``. Whatever ``x~`` is, ``W x~``
lies in the span of ``W``'s columns, so the part of ``o`` outside that span (and outside the
constant vector, which softmax ignores: a constant shift of every logit changes nothing) is the
lm_head op's own error ``delta = o - W x~``:

    |delta_v| <= u_out |o_v| + LAMBDA sqrt(D) ua (|W| |x~|)_v

``u_out`` rounds each logit to the dtype the engine stores it in (the run's storage ``u``, or the
logits' own dtype where that is coarser), ``ua`` is the fp32 accumulation of the ``D``-term dot
(probabilistic, ``parity.bounds.core.LAMBDA``), and ``x~`` is recovered from ``o`` by least squares.
The projection ``P`` out of the span never lengthens a vector, so ``||P o|| <= sqrt(sum_v b_v^2)``,
plus the float64 projection's own rounding (normal equations: ``cond(W)^2 D 2^-53 ||o||``). This
holds for any correct engine that accumulates in fp32 (a TF32 lm_head does not): past it, the
logits are not lm_head of anything (garbage rows, an added bias, a non-linear post-processing). It is the one bound an engine without traces can be held to; with
traces the localization judges every op before it.

Needs ``V > D + 1`` (else every vector is in the span: the check reports itself inactive).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parity.bounds.core import LAMBDA, U_REFERENCE, UNIT_ROUNDOFF

from .numerics import finite_or_none

BLOCK_ROWS = 16384  # rows of W read from the source at a time


@dataclass(frozen=True)
class LogitsCheck:
    residual: float   # ||P o||: the logits' part outside lm_head's span (and the constants)
    bound: float
    units: float      # residual / bound

    def to_dict(self) -> dict:
        return {k: finite_or_none(getattr(self, k)) for k in ("residual", "bound", "units")}

    def describe(self) -> str:
        return (f"logits: {self.residual:.3g} outside lm_head's span = {self.units:.3g}x the lm_head "
                f"bound {self.bound:.3g}")


class LmHeadSpan:
    """Projection onto the complement of ``span([W, 1])`` for one checkpoint (module docstring),
    held as float64 on ``device`` (3 GB at the real size: a GPU does a step's three passes in about
    a millisecond, 16 CPU cores in about a second)."""

    def __init__(self, source, config, *, device: str = "cpu"):
        name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        V, D = config.vocab_size, config.hidden_size
        self.D, self.active, self.chol = D, V > D + 1, None
        if not self.active:
            return
        self.A = torch.ones((V, D + 1), dtype=torch.float64, device=device)
        for lo in range(0, V, BLOCK_ROWS):
            rows = np.arange(lo, min(V, lo + BLOCK_ROWS))
            self.A[lo:lo + len(rows), :D] = torch.from_numpy(source.get_rows(name, rows)).to(device)
        G = self.A.T @ self.A
        eig = torch.linalg.eigvalsh(G)
        self.cond = float(torch.sqrt(eig[-1] / eig[0])) if eig[0] > 0 else np.inf
        if np.isfinite(self.cond):
            self.chol = torch.linalg.cholesky(G)

    def check(self, logits: np.ndarray, *, u_out: float, ua: float) -> LogitsCheck | None:
        """The check of one logit vector ``[V]`` (float64 values of what the engine returned), or None
        when the check cannot apply (inactive, singular lm_head, non-finite logits)."""
        o_np = np.asarray(logits, dtype=np.float64)
        if self.chol is None or not np.all(np.isfinite(o_np)):
            return None
        return self._checks(o_np[None, :], u_out, ua)[0]

    def check_rows(self, logits: np.ndarray, *, u_out: float, ua: float) -> list[LogitsCheck | None]:
        """``check`` of each row of ``logits [B, V]``: on a GPU the rows' products at once (one
        read of the 3 GB span for the batch); on the CPU row by row, each with the bits of its own
        ``check`` (a corpus's batched report equals its prompts' own, number for number)."""
        rows = np.asarray(logits, dtype=np.float64)
        if self.chol is None or self.A.device.type == "cpu":
            return [self.check(o, u_out=u_out, ua=ua) for o in rows]
        ok = np.flatnonzero(np.all(np.isfinite(rows), axis=-1))
        out: list[LogitsCheck | None] = [None] * len(rows)
        for b, c in zip(ok, self._checks(rows[ok], u_out, ua) if ok.size else []):
            out[b] = c
        return out

    def _checks(self, rows: np.ndarray, u_out: float, ua: float) -> list[LogitsCheck]:
        """The checks of finite ``rows [B, V]``, their products taken together."""
        o = torch.from_numpy(np.ascontiguousarray(rows.T)).to(self.A.device)  # [V, B]
        c = torch.cholesky_solve(self.A.T @ o, self.chol)                    # [D+1, B]
        residual = torch.linalg.vector_norm(o - self.A @ c, dim=0)
        acc = self.A[:, :self.D].abs() @ c[:self.D].abs()  # sum_d |W_vd| |x~_d| per logit
        per_logit = u_out * o.abs() + LAMBDA * np.sqrt(self.D) * ua * acc
        norm_o = torch.linalg.vector_norm(o, dim=0)
        bound = torch.linalg.vector_norm(per_logit, dim=0) + self.cond ** 2 * (self.D + 1) * U_REFERENCE * norm_o
        out = []
        for r, b in zip(residual.tolist(), bound.tolist()):
            out.append(LogitsCheck(residual=r, bound=b, units=r / b if b > 0 else (0.0 if r == 0 else np.inf)))
        return out


def output_roundoff(precision, logits_dtype: str | None) -> float:
    """``u_out``: the run's storage ``u`` (its platform's rounding included), or the unit roundoff of
    the dtype the logits came back in where that is coarser."""
    return max(precision.u, UNIT_ROUNDOFF.get(logits_dtype or "float64", 0.0))

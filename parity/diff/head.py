"""The head replayed: the engine's logits at a step recomputed through lm_head from its own
final-normed hidden state at the position the step reads, and held to lm_head's bound.

An engine's logits at a step are ``o = fl(W' x')``: its lm_head ``W'`` (the checkpoint's ``W [V,
D]``, rounded to the run dtype where the checkpoint stores it finer: ``u_w``) applied to the
``final_norm`` row ``x'`` it traced at the position the step reads (stored with rounding ``l_x``
where the trace is coarser than the run). Per logit ``v`` (docs/error-bounds.md, "The head"):

    |o_v - (W x)_v| <= u_out |o_v| + (gamma_D(ua) + u_w + l_x) (1 + u_w) (1 + l_x) (|W| |x|)_v

``u_out`` rounds the logit to the dtype the engine returns it in; ``gamma_D(ua)`` is the fp32
accumulation of the ``D``-term dot, worst case. Every term is an upper bound of its rounding, so a
correct engine never exceeds the norm of that vector: ``||o - W x|| <= ||b||``. Past it the logits
are not lm_head of the row the step reads: a wrong row, a scaled or biased lm_head, logits taken
before the norm. Unlike ``logits.py``'s span check this sees a scale (``2 W x`` is in the span).

``LmHead`` also gives ``|W| |x|``, the magnitudes of the model-level logit bound
(``parity.bounds.model``) the twin is held to (``noise.py``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from parity.bounds.core import UNIT_ROUNDOFF, gamma

from .numerics import finite_or_none

BLOCK_ROWS = 16384  # rows of W read from the source at a time
KEEP_ABS = 1 << 26  # elements of W up to which |W| is kept (512 MB of float64)


@dataclass(frozen=True)
class HeadCheck:
    """One step's logits against lm_head of the engine's own ``final_norm`` row."""
    position: int     # the sequence position whose final_norm row was replayed
    err: float        # ||o - W x||
    bound: float      # ||b|| (module docstring)
    units: float      # err / bound

    def to_dict(self) -> dict:
        return {"position": self.position, **{k: finite_or_none(getattr(self, k)) for k in ("err", "bound", "units")}}

    def describe(self) -> str:
        return (f"lm_head at position {self.position}: the engine's logits differ from lm_head of its own final_norm "
                f"row by {self.err:.3g} = {self.units:.3g}x the bound {self.bound:.3g}")


class LmHead:
    """The checkpoint's lm_head ``W [V, D]`` as float64 on a torch device (shared with the
    ``LmHeadSpan`` of the run where there is one), and ``u_w`` for a run at ``dtype``."""

    def __init__(self, W, *, storage: str):
        self.W, self.storage = W, storage
        # |W| kept beside W where it is small; at the real size (3 GB) it is taken per call, as
        # LmHeadSpan takes it
        self._absW = W.abs() if W.numel() <= KEEP_ABS else None

    @classmethod
    def of(cls, source, config, *, span=None, device: str = "cpu") -> "LmHead":
        """The lm_head of ``source`` (a ``WeightSource``): ``span``'s copy when given (its ``A``
        holds ``W`` in its first ``D`` columns), else read from the source in blocks."""
        name = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
        storage = source.storage_dtype(name)
        if span is not None and getattr(span, "A", None) is not None:
            return cls(span.A[:, :config.hidden_size], storage=storage)
        V, D = config.vocab_size, config.hidden_size
        W = torch.empty((V, D), dtype=torch.float64, device=device)
        for lo in range(0, V, BLOCK_ROWS):
            rows = np.arange(lo, min(V, lo + BLOCK_ROWS))
            W[lo:lo + len(rows)] = torch.from_numpy(source.get_rows(name, rows)).to(device)
        return cls(W, storage=storage)

    def weight_roundoff(self, dtype: str) -> float:
        """``u_w``: the run dtype's rounding of a weight stored finer than it (else 0: exact)."""
        u, us = UNIT_ROUNDOFF.get(dtype, 0.0), UNIT_ROUNDOFF.get(self.storage, 0.0)
        return u if us < u else 0.0

    def _rows(self, x: np.ndarray):
        """``(W x, |W| |x|)`` of each row of ``x [B, D]`` as float64 ``[B, V]``, each row its own
        product (a row's bits do not depend on its batch)."""
        W = self.W
        absW = self._absW if self._absW is not None else W.abs()
        out, mag = [], []
        for row in np.asarray(x, dtype=np.float64):
            xr = torch.from_numpy(np.ascontiguousarray(row)).to(W.device)
            out.append((W @ xr).cpu().numpy())
            mag.append((absW @ xr.abs()).cpu().numpy())
        return np.stack(out), np.stack(mag)

    def magnitude(self, x: np.ndarray) -> np.ndarray:
        """``|W| |x|`` ``[V]`` of one row ``x [D]``."""
        return self._rows(np.asarray(x)[None])[1][0]

    def check(self, x: np.ndarray, o: np.ndarray, *, position: int, u_out: float, ua: float, u_w: float,
              l_x: float) -> HeadCheck:
        """The logits ``o [V]`` (float64 values of what the engine returned) against lm_head of its
        ``final_norm`` row ``x [D]`` (module docstring); non-finite logits give ``inf`` units."""
        wx, mag = self._rows(np.asarray(x)[None])
        wx, mag = wx[0], mag[0]
        o = np.asarray(o, dtype=np.float64)
        D = x.shape[-1]
        with np.errstate(invalid="ignore", over="ignore"):
            b = u_out * np.abs(o) + (gamma(D, ua) + u_w + l_x) * (1 + u_w) * (1 + l_x) * mag
            err = float(np.linalg.norm(o - wx))
            bound = float(np.linalg.norm(b))
        if not np.isfinite(err) or not np.isfinite(bound):
            return HeadCheck(position, err, bound, float("inf"))
        units = err / bound if bound > 0 else (0.0 if err == 0 else float("inf"))
        return HeadCheck(position, err, bound, units)

"""The certified twin: the noise that may excuse a token flip, from an implementation certified
here, never from the engine under test.

A buggy engine's logits disagree with the reference more than a correct one's; a noise measured on
them widens the very bound they are judged by. The twin is a correct implementation at the engine's
declared dtype on the reference's own weights, fed the same tokens; its disagreement with the
reference is the noise a correct implementation at that dtype shows on this prompt
(``parity.diff.neartie.twin_bound``). Two twins:

* ``emulated``: the reference's math with the dtype's rounding emulated: our optimized model with
  every op family on the reference backend (``optimized.backends``: each op the float64 reference,
  its result rounded to the dtype at the op's boundary; the projections torch GEMMs at the dtype).
  It shares no kernel with our optimized model, so it is the twin of that model (the default
  ``parity diff``): never the engine under test. On the CPU it is also the cheaper twin of every
  engine (0.1 s a decode step of the bundled fixture against 2.4 s for the Triton kernels under the
  interpreter). Inside its ops it computes exactly, so it lacks the arithmetic rounding an
  implementation may add there: its noise is scaled by ``arith_scale`` (below);
* ``triton``: our optimized model (every op certified by ``parity certify``): the twin of any other
  engine on a GPU.

``arith_scale``: the localization's model of one op's fresh error, ``KAPPA_STORAGE u + KAPPA_ARITH
ua`` (``localize.py``), against the storage part the emulated twin has: ``1 + KAPPA_ARITH ua /
(KAPPA_STORAGE u)``, 1.0002 at bf16 and 17 at fp32 (where fp32 arithmetic rounds as finely as the
storage). Measured on the bundled fixture at fp32: the Triton model's logits sit up to 3.6x the
emulated twin's distance from the reference (1.4x at bf16).

Twins are memoized per (weights, dtype, device, backends, prompt length, consumed tokens): a forced-mode
run feeds every engine the reference's tokens, so several engines diffed on one prompt share one twin
run. The prompt length is part of the key because prefill and decode round differently: a corpus
whose prompt is another's prompt plus its generated tokens gets the logits its own run would.
Between calls the twin keeps each prompt's decode state (the last ``LIVE`` prompts it ran), so a
later step of a prompt continues from where that prompt's run stopped, also when a batched corpus
asks for the steps of several prompts in turn: the logits are those of one prefill and the decode
steps after it either way.
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

import optimized
from optimized.backends import FAMILIES
from optimized.model import Model
from parity.bounds.core import precision_for
from parity.memory import check_weights, free_bytes
from parity.metrics import to_numpy

from .localize import KAPPA_ARITH, KAPPA_STORAGE

TWIN_DTYPES = ("bfloat16", "float32", "float64")  # what the optimized model runs at
_MEMO: OrderedDict = OrderedDict()   # (key, consumed tokens) -> logits [vocab]
_MEMO_SIZE = 4096
LIVE = 16  # prompts whose decode state a twin keeps (each a one-sequence cache of the optimized model)
KINDS = ("emulated", "triton")


class Twin:
    """A twin (module docstring) on ``source`` at ``dtype`` on ``device``, loaded on first use,
    giving the logits of the last consumed token for each step's consumed sequence. ``kind``:
    "emulated" or "triton"."""

    def __init__(self, source, *, dtype: str, device: str, variants: dict | None = None, kind: str = "triton",
                 free=None):
        if kind not in KINDS:
            raise ValueError(f"twin kind: expected one of {KINDS}, got {kind!r}")
        self.source, self.dtype, self.device, self.kind = source, dtype, device, kind
        self.free = free or free_bytes  # its weights are checked against it before they load
        self.variants = dict(variants or {})
        self._model = None
        # (prompt length, prompt) -> (tokens consumed, cache): each prompt's run so far
        self._live: OrderedDict = OrderedDict()
        self.key = (id(source), dtype, device, kind, tuple(sorted(self.variants.items())))

    @property
    def arith_scale(self) -> float:
        """How much the twin's noise is scaled for the arithmetic inside the ops (module docstring)."""
        if self.kind == "triton":
            return 1.0
        p = precision_for(self.dtype)
        return 1.0 + KAPPA_ARITH * p.ua / (KAPPA_STORAGE * p.u)

    def describe(self) -> str:
        if self.kind == "emulated":
            return (f"the reference's math with {self.dtype} rounding at every op's boundary (our optimized "
                    f"model with every op family on the reference backend) on {self.device}, on the reference's "
                    f"weights; its noise x{self.arith_scale:.3g} for the arithmetic inside the ops")
        return f"our optimized model (Triton kernels) at {self.dtype} on {self.device}, on the reference's weights"

    def logits(self, seq: list[int], prompt_len: int) -> np.ndarray:
        """``[vocab]`` float64: the twin's logits after consuming ``seq`` (its first ``prompt_len``
        tokens a prefill, each later one a decode step)."""
        key = (self.key, prompt_len, tuple(seq))
        hit = _MEMO.get(key)
        if hit is not None:
            _MEMO.move_to_end(key)
            return hit
        model = self._load()
        seq = tuple(int(t) for t in seq)
        run = (prompt_len, seq[:prompt_len])
        done, cache = self._live.pop(run, ((), None))
        if cache is None or not (len(done) < len(seq) and seq[:len(done)] == done):  # nothing to continue
            logits, cache = model.prefill(list(seq[:prompt_len]))
            done, logits = seq[:prompt_len], logits[-1]
        for t in seq[len(done):]:
            logits, cache = model.decode(t, cache)
        self._live[run] = (seq, cache)
        while len(self._live) > LIVE:
            self._live.popitem(last=False)
        out = to_numpy(logits).astype(np.float64).reshape(-1)
        if not np.all(np.isfinite(out)):
            raise RuntimeError(f"the certified twin ({self.describe()}) returned non-finite logits")
        _MEMO[key] = out
        while len(_MEMO) > _MEMO_SIZE:
            _MEMO.popitem(last=False)
        return out

    def _load(self):
        if self._model is None:
            check_weights(self.source.config, dtype=self.dtype, device=self.device, free=self.free,
                          what="the certified twin")

            if self.device == "cpu" and optimized.interpreting():
                optimized.install_faithful_bf16_dot()
            backends = None
            if self.kind == "emulated":
                backends = {f: "reference" for f in FAMILIES}
            self._model = optimized.load(self.source, device=self.device, dtype=self.dtype, backends=backends,
                                         **self.variants)
        return self._model


def runs_our_kernels(engine) -> bool:
    """Whether ``engine`` (possibly behind ``CheckedEngine``) is our optimized model with some op
    family on its Triton kernels: the Triton twin would share them."""
    inner = getattr(engine, "engine", engine)
    return isinstance(inner, Model) and any(v == "triton" for v in inner.ops.choice.values())


def twin_for(engine, ref_model, *, dtype: str, device: str | None = None, free=None) -> Twin:
    """The twin of ``engine`` (module docstring): the emulated reference where the engine runs our
    kernels or the twin runs on the CPU, else our optimized model. ``device``: where the twin runs
    (default: the engine's, else cuda when present, else cpu). ``free``: the free-memory source its
    weights are checked against before they load (``parity.memory``)."""
    source = ref_model.source
    if device is None:
        inner = getattr(engine, "engine", engine)
        dev = getattr(inner, "device", None)
        if dev is not None and str(dev).split(":")[0] in ("cpu", "cuda"):
            device = str(dev).split(":")[0]
        else:
            device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype not in TWIN_DTYPES:
        raise ValueError(f"no certified twin runs at {dtype} (ours run at {', '.join(TWIN_DTYPES)})")
    kind = "emulated" if runs_our_kernels(engine) or device == "cpu" else "triton"
    return Twin(source, dtype=dtype, device=device, variants=dict(getattr(ref_model, "variants", {}) or {}),
                kind=kind, free=free)

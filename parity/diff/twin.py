"""The certified twin: the noise that may excuse a token flip, from an implementation certified
here, never from the engine under test.

A buggy engine's logits disagree with the reference more than a correct one's; a noise measured on
them widens the very bound they are judged by. The twin is our optimized model (its every op
certified by ``parity certify``) on the reference's own weights, at the engine's declared dtype, fed
the same tokens. Its disagreement with the reference is the noise a correct implementation at that
dtype shows on this prompt (``parity.neartie.twin_bound``). When the engine *is* that model (the
default ``parity diff``: our optimized model on the reference's checkpoint, no ``--backend``), its
logits are the twin's and no second run is made.

Twins are memoized per (weights, dtype, device, prompt length, consumed tokens): a forced-mode run
feeds every engine the reference's tokens, so several engines diffed on one prompt share one twin
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

from parity.metrics import to_numpy

TWIN_DTYPES = ("bfloat16", "float32", "float64")  # what the optimized model runs at
_MEMO: OrderedDict = OrderedDict()   # (key, consumed tokens) -> logits [vocab]
_MEMO_SIZE = 4096
LIVE = 16  # prompts whose decode state a twin keeps (each a one-sequence cache of the optimized model)


class Twin:
    """Our optimized model on ``source`` at ``dtype`` on ``device``, loaded on first use, giving the
    logits of the last consumed token for each step's consumed sequence."""

    def __init__(self, source, *, dtype: str, device: str, variants: dict | None = None, free=None):
        from parity.memory import free_bytes

        self.source, self.dtype, self.device = source, dtype, device
        self.free = free or free_bytes  # its weights are checked against it before they load
        self.variants = dict(variants or {})
        self._model = None
        # (prompt length, prompt) -> (tokens consumed, cache): each prompt's run so far
        self._live: OrderedDict = OrderedDict()
        self.key = (id(source), dtype, device, tuple(sorted(self.variants.items())))

    def describe(self) -> str:
        return f"our optimized model at {self.dtype} on {self.device}, on the reference's weights"

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
            import optimized

            from parity.memory import check_weights

            check_weights(self.source.config, dtype=self.dtype, device=self.device, free=self.free,
                          what="the certified twin")

            if self.device == "cpu" and optimized.interpreting():
                optimized.install_faithful_bf16_dot()
            self._model = optimized.load(self.source, device=self.device, dtype=self.dtype, **self.variants)
        return self._model


def is_own_twin(engine, source, dtype: str) -> bool:
    """Whether ``engine`` (possibly behind ``CheckedEngine``) is our optimized model on ``source``'s
    weights at ``dtype`` with every op family on its kernels: then it is the twin itself."""
    from optimized.model import Model

    inner = getattr(engine, "engine", engine)
    return (isinstance(inner, Model) and inner.source is source and str(inner.dtype) == f"torch.{dtype}"
            and not any(v == "reference" for v in inner.ops.choice.values()))


def twin_for(engine, ref_model, *, dtype: str, device: str | None = None, free=None) -> Twin | None:
    """The twin of ``engine`` (None: the engine is its own twin, ``is_own_twin``). ``device``:
    where the twin runs (default: the engine's, else cuda when present, else cpu). ``free``: the
    free-memory source its weights are checked against before they load (``parity.memory``)."""
    source = ref_model.source
    if is_own_twin(engine, source, dtype):
        return None
    if device is None:
        inner = getattr(engine, "engine", engine)
        dev = getattr(inner, "device", None)
        if dev is not None and str(dev).split(":")[0] in ("cpu", "cuda"):
            device = str(dev).split(":")[0]
        else:
            import torch

            device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype not in TWIN_DTYPES:
        raise ValueError(f"no certified twin runs at {dtype} (ours run at {', '.join(TWIN_DTYPES)})")
    return Twin(source, dtype=dtype, device=device, variants=dict(getattr(ref_model, "variants", {}) or {}),
                free=free)

"""Named semantic bugs of the embedding and the LM head, per op: wrap mutants, transformations of
the real candidate's inputs and outputs (parity/mutants.py)."""
from __future__ import annotations

from parity.mutants import wrap


def _ids_plus_one(d):
    d["ids"] = (d["ids"] + 1) % d["table"].shape[0]
    return d


def _ids_reversed(d):
    d["ids"] = d["ids"].flip(0).contiguous()
    return d


def _roll_cols(out, inp):
    out["y"] = out["y"].roll(1, dims=-1)
    return out


def _rows_shifted(d):
    d["weight"] = d["weight"].roll(1, dims=0).contiguous()
    return d


def _scaled(out, inp):
    out["logits"] = out["logits"] * inp["h"].shape[-1] ** -0.5
    return out


def _last_dim_dropped(d):
    d["h"] = d["h"].clone()
    d["h"][..., -1] = 0
    return d


EMBEDDING = (
    wrap("ids_off_by_one", "row id + 1 gathered", inputs=_ids_plus_one),
    wrap("ids_reversed", "tokens gathered in reverse order", inputs=_ids_reversed),
    wrap("columns_rolled", "hidden columns shifted by one", outputs=_roll_cols),
)

LM_HEAD = (
    wrap("vocab_rows_shifted", "logit i computed from row i - 1 of the head", inputs=_rows_shifted),
    wrap("logit_scale_applied", "logits scaled by D^-0.5 (a tied-embedding convention)", outputs=_scaled),
    wrap("hidden_last_dim_dropped", "the last hidden column left out of the contraction", inputs=_last_dim_dropped),
)

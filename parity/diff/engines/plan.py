"""Token plans: the prompt and the reference's greedy tokens, for an engine to teacher-force.

``parity diff CKPT --plan plan.json`` runs the reference alone and writes one (schema
``parity/schemas/plan.schema.json``). An engine prefills ``prompt_ids`` and then decodes
``tokens[1:]`` one by one, writing the logits after each call: that is a forced-mode dump
(docs/dump-format.md), whose ``tokens`` are the plan's ``tokens`` as they stand (``tokens[0]`` is the
last prompt token, the one step 0 consumed).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kimi.validate import InvalidInput, read_json_file
from parity.atomic import atomic_write
from parity.metrics import to_numpy
from parity.schema import errors, load

from .checked import EngineError

FORMAT = "kimi-parity/plan"
VERSION = 1
MAX_PLAN_BYTES = 64 << 20  # 100,000 steps of ids: ~1 MB


def make_plan(ref_model, prompt_ids: list[int], *, steps: int, config, checkpoint: dict,
              on_step=None) -> dict:
    """Greedy-decode ``steps`` steps on ``ref_model`` (step 0: the prefill) and return the plan.
    ``on_step(step)`` is called after each step."""
    prompt = [int(t) for t in prompt_ids]
    tokens = [prompt[-1]]
    logits, cache = ref_model.prefill(prompt)
    for step in range(1, steps):
        tokens.append(int(np.argmax(to_numpy(logits).reshape(-1, config.vocab_size)[-1])))  # any executor's
        if on_step is not None:
            on_step(step - 1)
        logits, cache = ref_model.decode(tokens[-1], cache)
    if on_step is not None:
        on_step(steps - 1)
    return {"format": FORMAT, "version": VERSION, "checkpoint": checkpoint, "config": config.to_hub_dict(),
            "prompt_ids": prompt, "tokens": tokens, "steps": steps}


def write_plan(path, plan: dict) -> Path:
    return atomic_write(path, json.dumps(plan, indent=1) + "\n")


def load_plan(path) -> dict:
    """Read and validate a plan (strict JSON, ``kimi.validate``; its schema; ``EngineError``
    names the problem)."""
    path = Path(path)
    try:
        plan = read_json_file(path, max_bytes=MAX_PLAN_BYTES)
    except InvalidInput as exc:
        raise EngineError(str(exc)) from None
    if not isinstance(plan, dict) or plan.get("format") != FORMAT or plan.get("version") != VERSION:
        raise EngineError(f"{path}: not a plan (format {FORMAT!r}, version {VERSION} expected)")
    bad = errors(plan, load("plan"))
    if bad:
        raise EngineError(f"{path}: {bad[0]}")
    if not plan["prompt_ids"] or len(plan["tokens"]) != plan["steps"] or plan["tokens"][0] != plan["prompt_ids"][-1]:
        raise EngineError(f"{path}: malformed plan (steps tokens, tokens[0] = the last prompt id)")
    return plan

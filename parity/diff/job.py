"""What one diff is, as frozen records: ``DiffJob``, the command ``parity diff`` builds from its
arguments and ``parity.diff.command.run`` runs (one prompt, a corpus, or a token plan), and
``Decode``, how the decode loop of one prompt runs (``parity.diff.runner.PromptRun``, ``run_diff``,
``parity.diff.batch.run_diff_batch``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Decode:
    """How one prompt is decoded and judged (``run_diff``'s keywords): ``config`` the
    ``KimiConfig`` of both models, ``steps`` decode steps, ``mode`` ``forced`` or ``free``,
    ``dtype`` the engine's compute dtype and ``rounding`` its platform's conversion to it (together:
    ``u`` of the bounds), ``localize`` (replay the engine's traced calls), ``tokens`` (``[steps]``
    ids both paths consume instead of the reference's; None: the reference's), ``lm_head`` (the
    checkpoint's ``LmHeadSpan``; None: the logits' own bound unchecked), ``twin`` ("auto", a
    ``Twin`` or None) and ``twin_every_step``."""

    config: object
    steps: int
    mode: str = "forced"
    dtype: str = "bfloat16"
    rounding: str = "nearest"
    localize: bool = True
    tokens: list[int] | None = None
    lm_head: object | None = None
    twin: object = "auto"
    twin_every_step: bool = False


@dataclass(frozen=True)
class DiffJob:
    """The ``parity diff`` command, every argument read and checked (docs/cli.md): the checkpoint
    (``checkpoint`` a directory, None: the bundled one; or ``synthetic`` preset and ``seed``),
    ``optimized_from``, ``engine`` (its spec), the prompt (``prompt`` text or ``prompt_ids`` text
    of ids; or ``prompts``, a corpus file, with ``batch`` and ``shard`` ``(i, n)``), ``steps``,
    ``mode`` and ``dtype`` (None: the default, or a dump's own), ``device`` (cpu or cuda, chosen),
    ``reference_device`` (cpu, cuda or auto), ``variants`` and ``backends`` (parsed), the outputs
    (``plan``, ``json``, ``plot`` paths), ``progress`` (a progress bar on a terminal) and
    ``free_memory(device) -> bytes or None`` (what allocations are checked against)."""

    device: str
    checkpoint: str | None = None
    synthetic: str | None = None
    seed: int = 0
    optimized_from: str | None = None
    engine: str = "optimized"
    prompt: str | None = None
    prompt_ids: str | None = None
    prompts: str | None = None
    batch: int | None = None
    shard: tuple[int, int] | None = None
    steps: int | None = None
    mode: str | None = None
    dtype: str | None = None
    reference_device: str = "auto"
    variants: dict | None = None
    backends: dict | None = None
    plan: str | None = None
    json: str | None = None
    plot: str | None = None
    progress: bool = True
    free_memory: Callable | None = None


@dataclass(frozen=True)
class Loaded:
    """What ``parity.diff.command.run`` opened and loaded for a ``DiffJob``: the checkpoint and
    ``--optimized-from``'s (``parity.diff.setup.Checkpoint``, None), the engine (a
    ``CheckedEngine``), the float64 reference, the report's environment, the platform's rounding to
    the job's dtype, and ``err``, the console of the header and the progress bars (stderr)."""

    ckpt: object
    opt_ckpt: object | None
    engine: object
    ref: object
    env: dict
    rounding: str
    err: object

    @property
    def variants(self) -> dict:
        """The semantic variants each path ran (the report's ``variants``)."""
        return {"reference": dict(getattr(self.ref, "variants", {}) or {}),
                "optimized": dict(getattr(self.engine, "variants", {}) or {})}

"""A corpus for ``parity diff --prompts FILE [--batch B] [--shard I/N]`` (or ``--engine dump:FOLDER``)
and ``parity diff merge SHARD.json ... --json PATH``: the driver of ``parity.diff.corpus``'s records.

One ``run_diff`` per prompt with one engine object, one float64 reference and one certified twin
(``parity.diff.corpus``); with an engine that has ``decode_batch``, up to ``--batch`` prompts at a
time decode together (``parity.diff.batch``: every prompt's report is the one its own run writes),
else one prompt at a time. On stdout: one summary line per prompt (its index and file line first),
the prompts that diverged with their first bad step and localization, then the corpus summary line
last. Exit status over the corpus: 1 when any prompt diverged or is past its bound, else 0; 2 for
unusable input. Documented in docs/cli.md.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from parity import memory
from parity.errors import InputError, check_outputs, write_output

from . import reference_device, setup
from .batch import DEFAULT_BATCH, diff_batch
from .corpus import CorpusResult, PromptResult, corpus_digest
from .corpus import fmt as _g
from .corpus import load
from .corpus import merge as merge_shards
from .corpus import read_dumps, read_prompts, shard_of
from .engines import DumpEngine, EngineError
from .job import Decode, DiffJob, Loaded
from .plot import write_corpus_plot
from .report import write_json
from .runner import diff_prompt
from .setup import checkpoint_errors, one_line
from .twin import twin_for


def dump_folder(engine: str):
    """The folder of ``--engine dump:DIR`` (``engine`` the spec; a corpus of dumps), else None."""
    if engine.startswith("dump:") and Path(engine[len("dump:"):]).is_dir():
        return Path(engine[len("dump:"):])
    return None


def read(path: str, ckpt) -> list:
    """The corpus file ``path`` (every prompt; ``run`` takes the shard)."""
    try:
        tok = setup.tokenizer_for(ckpt)
    except (ValueError, OSError, ImportError):  # no tokenizer: fine for a corpus of ids
        tok = None
    return read_prompts(path, vocab=ckpt.source.config.vocab_size,
                        encode=None if tok is None else tok.encode)


def read_dump_folder(job: DiffJob, folder) -> tuple[list, dict]:
    """The dumps of ``folder`` as a corpus, and the ``steps``, ``mode`` and ``dtype`` they share
    (the job's, where given, checked against them)."""
    prompts, shared = read_dumps(folder, steps=job.steps, mode=job.mode, dtype=job.dtype)
    return prompts, {"steps": shared["steps"], "mode": shared["mode"], "dtype": shared["dtype"]}


def describe(job: DiffJob, prompts) -> str:
    """The corpus line of the header."""
    shard = job.shard
    part = f", shard {shard[0]}/{shard[1]}: {len(shard_of(prompts, shard))} of them" if shard else ""
    what = f"{job.prompts}, {len(prompts)} prompts" if job.prompts else \
        f"{len(prompts)} dumps in {job.engine[len('dump:'):]}"
    return f"corpus: {what}{part}"


def batch_size(job: DiffJob, engine) -> int:
    """Prompts decoded together: ``--batch`` (default ``DEFAULT_BATCH``) where the engine has
    ``decode_batch`` and one engine serves the corpus, else 1."""
    if dump_folder(job.engine) is not None or not engine.batches:
        return 1
    return DEFAULT_BATCH if job.batch is None else job.batch


def _how(job: DiffJob, engine) -> str:
    n = batch_size(job, engine)
    if n > 1:
        return f"up to {n} prompts at a time through decode_batch"
    if dump_folder(job.engine) is not None:
        return "one dump at a time"
    if not engine.batches:
        return f"one prompt at a time ({job.engine} has no decode_batch)"
    return "one prompt at a time (--batch 1)"


def run(job: DiffJob, loaded: Loaded, prompts, *, engine_for=None) -> int:
    """Diff every prompt of this shard with ``loaded.engine`` (``engine_for(prompt)``: a folder of dumps, one
    engine each), print and write the corpus report; the corpus's exit status."""
    ckpt, opt_ckpt, engine, ref, env, rounding, err = (loaded.ckpt, loaded.opt_ckpt, loaded.engine, loaded.ref,
                                                       loaded.env, loaded.rounding, loaded.err)
    device, config = job.device, ckpt.source.config
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=140)
    shard = job.shard
    mine = shard_of(prompts, shard)
    settings = {"checkpoint": ckpt.info, "optimized_checkpoint": opt_ckpt.info if opt_ckpt else None,
                "engine": job.engine, "mode": job.mode, "steps": job.steps, "dtype": job.dtype,
                "rounding": rounding, "variants": loaded.variants, "backends": job.backends or {},
                "config": config.to_hub_dict()}
    source = str(job.prompts) if job.prompts else job.engine[len("dump:"):]
    result = CorpusResult(corpus={"file": source, "size": len(prompts), "digest": corpus_digest(prompts)},
                          shard=shard, settings=settings, environment=env)
    try:  # one for the corpus: its runs are memoized
        twin = twin_for(engine, ref, dtype=job.dtype, free=job.free_memory)
    except ValueError as exc:
        raise InputError(setup.one_line(exc)) from None
    lm_head = setup.lm_head_span(ckpt, device)
    t0 = time.perf_counter()
    batch = 1 if engine_for is not None else batch_size(job, engine)
    _check_batch(job, config, engine, mine, batch, device)
    err.print(f"decoding: {_how(job, engine)}", markup=False)
    decode = Decode(config, job.steps, mode=job.mode, dtype=job.dtype, rounding=rounding, lm_head=lm_head, twin=twin)
    with reference_device.memory_errors(job.reference_device, device):
        for prompt, res in _decode_all(ref, engine_for or (lambda p: engine), mine, decode, job, err, batch):
            p = PromptResult.of(prompt, res)
            result.prompts.append(p)
            out.print(f"prompt {p.index} ({_where(p)}): {p.summary['line']}", markup=False, highlight=False,
                      soft_wrap=True)
    result.seconds = time.perf_counter() - t0
    print_corpus(result, out)
    report = result.to_dict()
    if job.json:
        write_output(job.json, lambda: write_json(job.json, report))
    if job.plot:
        write_output(job.plot, lambda: write_corpus_plot(result, job.plot))
    return result.exit_code


def _check_batch(job: DiffJob, config, engine, prompts, batch: int, device: str) -> None:
    """``batch`` prompts' caches fit their devices before the first prefill (``parity.memory``):
    our optimized engine's at its dtype on ``device``, the reference's and, for that engine (it
    fills traces), the replay's on the reference's device; an engine of your own or a dump holds
    caches not counted here."""
    ours = job.engine == "optimized"
    memory.check_batch(config, [len(p.ids) + job.steps for p in prompts], batch,
                       engine_dtype=job.dtype if ours else None, engine_device=device,
                       reference_device=job.reference_device, replay=ours, free=job.free_memory,
                       default=job.batch is None)


def _where(p) -> str:
    return f"line {p.line}" if p.source is None else p.source


def _where_of(d: dict) -> str:
    return f"line {d['line']}" if d["source"] is None else d["source"]


def _decode_all(ref, engine_for, prompts, decode: Decode, job: DiffJob, err, batch: int):
    """``(prompt, DiffResult)`` per prompt, in order, ``batch`` prompts decoded together; a
    progress bar over the prompts on a terminal."""
    show = job.progress and err.is_terminal
    with Progress(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=not show) as progress:
        task = progress.add_task("corpus", total=len(prompts), last="")
        for lo in range(0, len(prompts), batch):
            group = prompts[lo:lo + batch]
            engine = engine_for(group[0])
            try:
                if batch > 1:
                    results = diff_batch(ref, engine, [list(p.ids) for p in group], decode)
                else:
                    dump = engine.engine if isinstance(engine.engine, DumpEngine) else None
                    # a free-mode dump already ran: both paths consume its tokens (as a single dump's diff does)
                    tokens = dump.tokens if dump is not None and dump.mode == "free" else None
                    results = [diff_prompt(ref, engine, list(group[0].ids), replace(decode, tokens=tokens))]
            except checkpoint_errors() as exc:
                raise InputError(one_line(exc)) from None
            except EngineError as exc:
                where = ", ".join(f"{p.index} ({_where(p)})" for p in group)
                raise InputError(f"prompt{'s' if len(group) > 1 else ''} {where}: {one_line(exc)}") from None
            for prompt, res in zip(group, results):
                progress.update(task, advance=1, last=f"prompt {prompt.index}: {res.verdict}")
                yield prompt, res


def print_corpus(result, console) -> None:
    """The prompts that are not clean (diverged first, each with its first bad step and its
    localization), the per-op units, the rates; the corpus summary line last."""
    s = result.summary()
    for d in s["diverged"]:
        console.print(f"diverged: prompt {d['index']} ({_where_of(d)}), first at step {d['first_step']}"
                      + (f": {d['localization']}" if d["localization"] else ""), markup=False)
    for d in s["past_bound"]:
        console.print(f"past its bound: prompt {d['index']} ({_where_of(d)}): {d['past_bound']}", markup=False)
    worst = sorted(s["op_units"].items(), key=lambda kv: -(kv[1]["units"]["max"] or 0.0))[:4]
    if worst:
        console.print("median error per op in units of its bound, over the prompts (median / p99 / max): "
                      + "; ".join(f"{name} {_g(v['units']['median'])} / {_g(v['units']['p99'])} / "
                                  f"{_g(v['units']['max'])}" for name, v in worst), markup=False)
    nt, rf, kl = s["near_ties"], s["router_flips"], s["kl"]
    console.print(f"near-ties: {nt['near_ties']} of {nt['flipped_steps']} flipped steps, {nt['steps']} steps; "
                  f"router flips: {rf['flips']} ({rf['past_bound']} past their bound) over {rf['positions']} "
                  f"positions; KL(ref || engine): mean {_g(kl['mean'])}, p99 {_g(kl['p99'])}, max {_g(kl['max'])}; "
                  f"top-1 agreement {_g(kl['top1_agreement'])}", markup=False)
    console.print(s["line"], markup=False, highlight=False, soft_wrap=True)


def merge(files, *, json: str | None, plot: str | None = None) -> int:
    """``parity diff merge SHARD.json ... --json PATH [--plot PATH]``: the unsharded corpus report
    of the shard reports ``files``, printed and written; the corpus's exit status."""
    if not files:
        raise InputError("merge: give the shard reports (parity diff merge r1.json r2.json --json out.json)")
    if json is None:
        raise InputError("merge: --json PATH is required (where the merged report goes)")
    check_outputs(("--json", json), ("--plot", plot))
    result = merge_shards([(path, load(path)) for path in files])
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=140)
    print_corpus(result, out)
    report = result.to_dict()
    write_output(json, lambda: write_json(json, report))
    if plot:
        write_output(plot, lambda: write_corpus_plot(result, plot))
    return result.exit_code

"""``parity diff --prompts FILE [--batch B] [--shard I/N]`` and ``parity diff merge SHARD.json ... --json PATH``.

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
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from parity import memory
from parity.cli.args import check_count, check_outputs, parse_shard, write_output
from parity.diff import reference_device, run_diff, setup
from parity.diff.batch import DEFAULT_BATCH, run_diff_batch
from parity.diff.corpus import CorpusResult, PromptResult, corpus_digest
from parity.diff.corpus import fmt as _g
from parity.diff.corpus import load
from parity.diff.corpus import merge as merge_shards
from parity.diff.corpus import read_dumps, read_prompts, shard_of
from parity.diff.engines import DumpEngine, EngineError
from parity.diff.plot import write_corpus_plot
from parity.diff.report import write_json
from parity.diff.setup import checkpoint_errors, one_line
from parity.diff.twin import twin_for
from parity.errors import InputError

MAX_BATCH = 1024  # --batch at most this many prompts decoded together


def dump_folder(args):
    """The folder of ``--engine dump:DIR`` (a corpus of dumps), else None."""
    if args.engine.startswith("dump:") and Path(args.engine[len("dump:"):]).is_dir():
        return Path(args.engine[len("dump:"):])
    return None


def check_exclusive(args) -> None:
    """What ``--prompts``, a folder of dumps and ``--shard`` cannot be combined with, refused before
    anything loads."""
    folder = dump_folder(args)
    if args.shard is not None and not args.prompts and folder is None:
        raise InputError("--shard splits a corpus: give --prompts FILE or --engine dump:FOLDER")
    if folder is not None and not args.prompts:
        for flag, value in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids), ("--plan", args.plan)):
            if value is not None:
                raise InputError(f"--engine dump:{folder} is a corpus of dumps, each with its own prompt: "
                                 f"leave out {flag}")
    if folder is not None or args.shard is not None:
        parse_shard(args.shard)
    if args.batch is not None:
        if not args.prompts and folder is None:
            raise InputError("--batch decodes the prompts of a corpus together: give --prompts FILE")
        check_count("--batch", args.batch, MAX_BATCH, "prompts")
    if not args.prompts:
        return
    for flag, value in (("--prompt", args.prompt), ("--prompt-ids", args.prompt_ids), ("--plan", args.plan)):
        if value is not None:
            raise InputError(f"--prompts and {flag}: give the prompts either as a corpus file or as one prompt")
    if args.engine.startswith("dump:"):
        raise InputError("--prompts with --engine dump:PATH: a dump carries its own prompt; diff each dump "
                         "on its own (parity diff --engine dump:PATH)")
    parse_shard(args.shard)


def read(args, ckpt) -> list:
    """The corpus (every prompt; ``run`` takes the shard)."""
    try:
        tok = setup.tokenizer_for(ckpt)
    except (ValueError, OSError, ImportError):  # no tokenizer: fine for a corpus of ids
        tok = None
    return read_prompts(args.prompts, vocab=ckpt.source.config.vocab_size,
                        encode=None if tok is None else tok.encode)


def read_dump_folder(args, folder) -> list:
    """The dumps of ``folder`` as a corpus; ``args.steps``, ``mode`` and ``dtype`` become theirs."""
    prompts, shared = read_dumps(folder, steps=args.steps, mode=args.mode, dtype=args.dtype)
    args.steps, args.mode, args.dtype = shared["steps"], shared["mode"], shared["dtype"]
    return prompts


def describe(args, prompts) -> str:
    shard = parse_shard(args.shard)
    part = f", shard {shard[0]}/{shard[1]}: {len(shard_of(prompts, shard))} of them" if shard else ""
    what = f"{args.prompts}, {len(prompts)} prompts" if args.prompts else \
        f"{len(prompts)} dumps in {args.engine[len('dump:'):]}"
    return f"corpus: {what}{part}"


def batch_size(args, engine) -> int:
    """Prompts decoded together: ``--batch`` (default ``DEFAULT_BATCH``) where the engine has
    ``decode_batch`` and one engine serves the corpus, else 1."""
    if dump_folder(args) is not None or not engine.batches:
        return 1
    return DEFAULT_BATCH if args.batch is None else args.batch


def _how(args, engine) -> str:
    n = batch_size(args, engine)
    if n > 1:
        return f"up to {n} prompts at a time through decode_batch"
    if dump_folder(args) is not None:
        return "one dump at a time"
    if not engine.batches:
        return f"one prompt at a time ({args.engine} has no decode_batch)"
    return "one prompt at a time (--batch 1)"


def run(args, ckpt, opt_ckpt, engine, prompts, *, ref, env, rounding, variants, backends, device, err,
        engine_for=None) -> int:
    """Diff every prompt of this shard with ``engine`` (``engine_for(prompt)``: a folder of dumps, one
    engine each), print and write the corpus report; the corpus's exit status."""
    config = ckpt.source.config
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=140)
    shard = parse_shard(args.shard)
    mine = shard_of(prompts, shard)
    settings = {"checkpoint": ckpt.info, "optimized_checkpoint": opt_ckpt.info if opt_ckpt else None,
                "engine": args.engine, "mode": args.mode, "steps": args.steps, "dtype": args.dtype,
                "rounding": rounding, "variants": variants, "backends": backends, "config": config.to_hub_dict()}
    source = str(args.prompts) if args.prompts else args.engine[len("dump:"):]
    result = CorpusResult(corpus={"file": source, "size": len(prompts), "digest": corpus_digest(prompts)},
                          shard=shard, settings=settings, environment=env)
    try:  # one for the corpus: its runs are memoized
        twin = twin_for(engine, ref, dtype=args.dtype, free=args.free_memory)
    except ValueError as exc:
        raise InputError(setup.one_line(exc)) from None
    lm_head = setup.lm_head_span(ckpt, device)
    t0 = time.perf_counter()
    batch = 1 if engine_for is not None else batch_size(args, engine)
    _check_batch(args, config, engine, mine, batch, device)
    err.print(f"decoding: {_how(args, engine)}", markup=False)
    with reference_device.memory_errors(args.reference_device, device):
        for prompt, res in _decode_all(ref, engine_for or (lambda p: engine), mine, config, args, err, rounding,
                                       lm_head, twin, batch):
            p = PromptResult.of(prompt, res)
            result.prompts.append(p)
            out.print(f"prompt {p.index} ({_where(p)}): {p.summary['line']}", markup=False, highlight=False,
                      soft_wrap=True)
    result.seconds = time.perf_counter() - t0
    print_corpus(result, out)
    report = result.to_dict()
    if args.json:
        write_output(args.json, lambda: write_json(args.json, report))
    if args.plot:
        write_output(args.plot, lambda: write_corpus_plot(result, args.plot))
    return result.exit_code


def _check_batch(args, config, engine, prompts, batch: int, device: str) -> None:
    """``batch`` prompts' caches fit their devices before the first prefill (``parity.memory``):
    our optimized engine's at its dtype on ``device``, the reference's and, for that engine (it
    fills traces), the replay's on the reference's device; an engine of your own or a dump holds
    caches not counted here."""
    ours = args.engine == "optimized"
    memory.check_batch(config, [len(p.ids) + args.steps for p in prompts], batch,
                       engine_dtype=args.dtype if ours else None, engine_device=device,
                       reference_device=args.reference_device, replay=ours, free=args.free_memory,
                       default=args.batch is None)


def _where(p) -> str:
    return f"line {p.line}" if p.source is None else p.source


def _where_of(d: dict) -> str:
    return f"line {d['line']}" if d["source"] is None else d["source"]


def _decode_all(ref, engine_for, prompts, config, args, err, rounding, lm_head, twin, batch: int):
    """``(prompt, DiffResult)`` per prompt, in order, ``batch`` prompts decoded together; a
    progress bar over the prompts on a terminal."""
    show = not args.no_progress and err.is_terminal
    same = dict(config=config, steps=args.steps, mode=args.mode, dtype=args.dtype, rounding=rounding,
                lm_head=lm_head, twin=twin)
    with Progress(TextColumn("prompts"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=not show) as progress:
        task = progress.add_task("corpus", total=len(prompts), last="")
        for lo in range(0, len(prompts), batch):
            group = prompts[lo:lo + batch]
            engine = engine_for(group[0])
            try:
                if batch > 1:
                    results = run_diff_batch(ref, engine, [list(p.ids) for p in group], **same)
                else:
                    dump = engine.engine if isinstance(engine.engine, DumpEngine) else None
                    # a free-mode dump already ran: both paths consume its tokens (as a single dump's diff does)
                    tokens = dump.tokens if dump is not None and dump.mode == "free" else None
                    results = [run_diff(ref, engine, list(group[0].ids), tokens=tokens, **same)]
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


def merge(args) -> int:
    """``parity diff merge SHARD.json ... --json PATH``: the unsharded corpus report."""
    if not args.files:
        raise InputError("merge: give the shard reports (parity diff merge r1.json r2.json --json out.json)")
    if args.json is None:
        raise InputError("merge: --json PATH is required (where the merged report goes)")
    check_outputs(("--json", args.json), ("--plot", args.plot))
    result = merge_shards([(path, load(path)) for path in args.files])
    out = Console(highlight=False)
    if not out.is_terminal:
        out = Console(highlight=False, width=140)
    print_corpus(result, out)
    report = result.to_dict()
    write_output(args.json, lambda: write_json(args.json, report))
    if args.plot:
        write_output(args.plot, lambda: write_corpus_plot(result, args.plot))
    return result.exit_code

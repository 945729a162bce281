"""``parity diff``: decode on the reference and an engine (default: the optimized model), compare
step by step; ``parity diff merge``: combine a corpus's shard reports.

This module reads the arguments: each check of a flag, then one ``parity.diff.job.DiffJob`` handed
to ``parity.diff.command.run`` (``parity.diff.corpus_driver.merge`` for ``merge``). Exit status: 0
when no step diverged and every number is within its bound (matches and near-ties only), 1 when a
step diverged or numbers are past their bound, 2 for unusable input (one ``error:`` line).
``--plan PATH`` runs the reference alone and writes a token plan. ``--prompts FILE`` diffs a
corpus. Documented in docs/cli.md.
"""
from __future__ import annotations

import argparse

from parity.cli.args import MAX_STEPS, check_count, check_outputs, check_seed, check_text, parse_shard
from parity.cli.options import add_reference_device, parse_backends, parse_variants
from parity.diff import command, corpus_driver, setup
from parity.diff.corpus_driver import dump_folder
from parity.diff.job import DiffJob
from parity.errors import InputError

MAX_BATCH = 1024  # --batch at most this many prompts decoded together


def register(sub):
    p = sub.add_parser(
        "diff", help="decode on both paths and diff the logits step by step (the main job)",
        description="Decode N tokens greedily on the float64 reference and on the optimized path and "
                    "classify every step: match, near-tie (a token flip that the optimized path's "
                    "noise explains) or diverged (a bug until shown otherwise, localized to a layer "
                    "and op). Without CHECKPOINT: the bundled default fixture and a built-in prompt.")
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory (config.json + safetensors); default: the bundled fixture "
                        "(parity diff merge SHARD.json ... --json PATH: the subcommand that combines corpus "
                        "shard reports)")
    p.add_argument("files", nargs="*", metavar="SHARD.json", help=argparse.SUPPRESS)  # merge after options
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (the checkpoint's tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--prompts", metavar="FILE",
                   help="a corpus: a text file, one prompt a line, or JSONL (*.jsonl) with text or ids a line; "
                        "every prompt is diffed and a corpus report written")
    p.add_argument("--batch", type=int, default=None, metavar="B",
                   help="with --prompts: decode up to B prompts together through both paths' decode_batch "
                        "(default 8; each prompt's report is its own run's; engines without decode_batch "
                        "run one prompt at a time)")
    p.add_argument("--shard", metavar="I/N",
                   help="with --prompts: run the I-th of N shares (prompt k goes to shard k %% N + 1); "
                        "combine the reports with parity diff merge")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="decode steps, each one generated token (default 128 on a GPU, 16 on CPU)")
    p.add_argument("--mode", choices=("forced", "free"), default=None,
                   help="forced: both paths consume the reference's tokens; free: each its own, "
                        "re-anchored at a split (default forced; a dump's own)")
    p.add_argument("--engine", default="optimized", metavar="ENGINE",
                   help="what is held to the reference: optimized (default), transformers, dump:PATH "
                        "(a dump file, docs/dump-format.md) or module:factory (your engine, "
                        "factory(checkpoint, *, dtype, device))")
    p.add_argument("--plan", metavar="PATH",
                   help="run the reference alone and write the token plan (prompt + its greedy tokens) "
                        "an engine teacher-forces to write a forced-mode dump")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device of the engine (default: cuda if present, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                   help="compute dtype of the engine (default bfloat16; a dump's own)")
    add_reference_device(p)
    p.add_argument("--variant", action="append", metavar="NAME=VALUE",
                   help="semantic variant for both paths: moe_combine=unbiased|biased, "
                        "kv_norm_eps=1e-6|1e-5 (repeatable)")
    p.add_argument("--backend", action="append", metavar="FAMILY=reference",
                   help="run one op family of the optimized path on the reference math "
                        "(kda, mla, moe, norm, conv, elementwise, embed; repeatable)")
    p.add_argument("--synthetic", metavar="PRESET",
                   help="generated weights of a preset (tiny, small, medium, kimi-linear-48b) instead of a checkpoint")
    p.add_argument("--seed", type=int, default=0, help="seed of --synthetic (default 0)")
    p.add_argument("--optimized-from", metavar="CHECKPOINT",
                   help="load the engine from this checkpoint instead (same config): compare a "
                        "converted or patched checkpoint against the original, or plant a bug")
    p.add_argument("--json", metavar="PATH", help="write the JSON report (docs/diff-report-schema.json; a corpus: "
                        "parity/schemas/diff-corpus.schema.json)")
    p.add_argument("--plot", metavar="PATH",
                   help="write a PNG: per-step error, bound, margins, router flips (a corpus: KL per prompt, "
                        "units per op, verdicts)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def register_merge(sub):
    """``parity diff merge SHARD.json ... --json PATH [--plot PATH]``."""
    p = sub.add_parser("merge", help="combine the shard reports of a corpus (parity diff --prompts --shard I/N)",
                       description="Combine the reports of a corpus's shards (parity diff --prompts FILE --shard "
                                   "I/N) into the report the unsharded run writes.")
    p.add_argument("files", nargs="*", metavar="SHARD.json", help="the shard reports")
    p.add_argument("--json", metavar="PATH", help="where the merged report goes (required)")
    p.add_argument("--plot", metavar="PATH", help="write the corpus PNG too")
    p.set_defaults(func=run_merge)


def run_merge(args: argparse.Namespace) -> int:
    return corpus_driver.merge(args.files, json=args.json, plot=args.plot)


def run(args: argparse.Namespace) -> int:
    if args.checkpoint == "merge":   # merge after options (parity diff --json X merge ...): kept a release
        return corpus_driver.merge(args.files, json=args.json, plot=args.plot)
    if args.files:
        raise InputError(f"unexpected argument {args.files[0]!r} (shard reports are given to: parity diff merge)")
    return command.run(job_of(args))


def job_of(args: argparse.Namespace) -> DiffJob:
    """The ``DiffJob`` of ``args``, every flag checked (the kernels' backend chosen for the device)."""
    check_outputs(("--json", args.json), ("--plot", args.plot), ("--plan", args.plan))
    check_exclusive(args)
    check_text("--prompt", args.prompt)
    check_count("--steps", args.steps, MAX_STEPS, "steps")
    check_seed("--seed", args.seed)
    variants = parse_variants(args.variant)
    backends = parse_backends(args.backend)
    device = setup.check_device(args.device)
    return DiffJob(device, checkpoint=args.checkpoint, synthetic=args.synthetic, seed=args.seed,
                   optimized_from=args.optimized_from, engine=args.engine, prompt=args.prompt,
                   prompt_ids=args.prompt_ids, prompts=args.prompts, batch=args.batch, shard=parse_shard(args.shard),
                   steps=args.steps, mode=args.mode, dtype=args.dtype, reference_device=args.reference_device,
                   variants=variants, backends=backends, plan=args.plan, json=args.json, plot=args.plot,
                   progress=not args.no_progress, free_memory=args.free_memory)


def check_exclusive(args) -> None:
    """What ``--prompts``, a folder of dumps and ``--shard`` cannot be combined with, refused before
    anything loads."""
    folder = dump_folder(args.engine)
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

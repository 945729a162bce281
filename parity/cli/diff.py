"""``parity diff``: decode on the reference and an engine (default: the optimized model), compare
step by step.

Exit status: 0 when no step diverged and every number is within its bound (matches and near-ties
only), 1 when a step diverged or numbers are past their bound, 2 for unusable input (one
``error:`` line). ``--plan PATH`` runs the reference alone and writes a token plan. ``--prompts
FILE`` diffs a corpus (``diff_corpus``), ``parity diff merge`` combines its shards. Documented in
docs/cli.md.
"""
from __future__ import annotations

import argparse

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from parity.cli import diff_corpus
from parity.cli.args import MAX_STEPS, check_count, check_outputs, check_seed, check_text, write_output
from parity.cli.diff_corpus import dump_folder
from parity.diff import build_report, reference_device, run_diff, setup, write_json
from parity.diff.engines import DumpEngine, EngineError
from parity.diff.engines.plan import make_plan, write_plan
from parity.diff.plot import write_plot
from parity.diff.render import print_result
from parity.diff.report import environment
from parity.diff.setup import checkpoint_errors, one_line
from parity.errors import InputError

DEFAULT_STEPS = {"cuda": 128, "cpu": 16}  # the Triton interpreter takes ~1-3 s per decode step


def register(sub):
    p = sub.add_parser(
        "diff", help="decode on both paths and diff the logits step by step (the main job)",
        description="Decode N tokens greedily on the float64 reference and on the optimized path and "
                    "classify every step: match, near-tie (a token flip that the optimized path's "
                    "noise explains) or diverged (a bug until shown otherwise, localized to a layer "
                    "and op). Without CHECKPOINT: the bundled default fixture and a built-in prompt.")
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory (config.json + safetensors); default: the bundled fixture. "
                        "'merge': parity diff merge SHARD.json ... --json PATH combines corpus shard reports")
    p.add_argument("files", nargs="*", metavar="SHARD.json", help="merge: the shard reports (--shard I/N runs)")
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
    reference_device.add_argument(p)
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


def run(args: argparse.Namespace) -> int:
    if args.checkpoint == "merge":  # a checkpoint directory of that name is given as ./merge
        return diff_corpus.merge(args)
    if args.files:
        raise InputError(f"unexpected argument {args.files[0]!r} (shard reports are given to: parity diff merge)")
    check_outputs(("--json", args.json), ("--plot", args.plot), ("--plan", args.plan))
    diff_corpus.check_exclusive(args)
    check_text("--prompt", args.prompt)
    check_count("--steps", args.steps, MAX_STEPS, "steps")
    check_seed("--seed", args.seed)
    variants = setup.parse_variants(args.variant)
    backends = setup.parse_backends(args.backend)
    device = setup.check_device(args.device)
    ckpt = setup.open_checkpoint(args.checkpoint, synthetic=args.synthetic, seed=args.seed)
    err = Console(stderr=True, highlight=False)
    if not err.is_terminal:
        err = Console(stderr=True, highlight=False, width=140)
    if args.plan:
        return _write_plan(args, ckpt, variants, device, err)
    opt_ckpt = None
    if args.optimized_from:
        opt_ckpt = setup.open_checkpoint(args.optimized_from)
        setup.same_model(ckpt, opt_ckpt)
    folder = diff_corpus.dump_folder(args)  # a folder of dumps: a corpus, one prompt each
    prompts = diff_corpus.read(args, ckpt) if args.prompts else \
        diff_corpus.read_dump_folder(args, folder) if folder is not None else None

    def load(spec):
        return setup.load_engine(spec, opt_ckpt or ckpt, dtype=args.dtype, device=device, variants=variants,
                                 backends=backends, reference_source=ckpt.source, free=args.free_memory,
                                 reference_device=args.reference_device)

    engine = load(args.engine if folder is None else f"dump:{folder / prompts[0].source}")
    if prompts is not None:
        args.steps = args.steps or DEFAULT_STEPS[device]
        args.mode = args.mode or "forced"
        args.dtype = args.dtype or "bfloat16"
        ref, env, rounding = _prepare(args, ckpt, opt_ckpt, engine, variants, backends, device, err,
                                      diff_corpus.describe(args, prompts))
        return diff_corpus.run(args, ckpt, opt_ckpt, engine, prompts, ref=ref, env=env, rounding=rounding,
                               variants={"reference": _variants(ref), "optimized": _variants(engine)},
                               backends=backends, device=device, err=err,
                               engine_for=None if folder is None else lambda p: load(f"dump:{folder / p.source}"))
    ids, text, tok, tokens = _run_shape(args, ckpt, engine, device)
    return _diff(args, ckpt, opt_ckpt, engine, ids, text, tok, tokens, variants, backends, device, err)


def _run_shape(args, ckpt, engine, device):
    """(prompt ids, text, tokenizer, tokens both paths consume or None): a dump fixes the prompt,
    the steps, the mode and, in free mode, the tokens; the options may only agree with it."""
    dump = engine.engine if isinstance(engine.engine, DumpEngine) else None
    if dump is None:
        ids, text, tok = setup.prompt_ids(ckpt, text=args.prompt, ids=args.prompt_ids)
        args.steps = args.steps or DEFAULT_STEPS[device]
        args.mode = args.mode or "forced"
        args.dtype = args.dtype or "bfloat16"
        return ids, text, tok, None
    ids, text, tok = dump.prompt_ids, None, None
    if args.prompt is not None or args.prompt_ids is not None:
        given, text, tok = setup.prompt_ids(ckpt, text=args.prompt, ids=args.prompt_ids)
        if given != ids:
            raise InputError(f"{dump.path}: the dump ran another prompt ({len(ids)} tokens) than the one given "
                             f"({len(given)} tokens); leave out --prompt/--prompt-ids")
    if args.steps is not None and args.steps > dump.steps:
        raise InputError(f"--steps {args.steps}: {dump.path} holds {dump.steps} steps")
    if args.mode is not None and args.mode != dump.mode:
        raise InputError(f"--mode {args.mode}: {dump.path} is a {dump.mode}-mode dump")
    args.steps, args.mode, args.dtype = args.steps or dump.steps, dump.mode, dump.dtype
    return ids, text, tok, (dump.tokens if dump.mode == "free" else None)


def _describe_engine(args, engine, env, rounding, backends) -> str:
    device = env["device"]
    if args.engine == "optimized":
        info = env["backend_info"]
        how = "CUDA " + str(info.get("cuda")) if device == "cuda" else (
            "CPU, Triton interpreter" + (", faithful bf16 dot installed" if info["faithful_bf16_dot"] else "")
            if info["triton_interpreter"] else "CPU")
        return (f"optimized path: {args.dtype} on {how}"
                + (f" (rounds to {args.dtype} {rounding})" if rounding != "nearest" else "")
                + (f"; backends {backends}" if backends else ""))
    inner = engine.engine
    folder = dump_folder(args)
    if folder is not None:
        return f"engine: the dumps in {folder} ({inner.dtype}, {inner.mode} mode), each on its own prompt"
    if args.engine.startswith("dump:"):
        return (f"engine: dump {inner.path} ({inner.engine_name or 'unnamed engine'}, {inner.dtype}, "
                f"{inner.mode} mode, {inner.steps} steps, {'traces' if inner.traced else 'no traces'})")
    return f"engine: {args.engine} ({type(inner).__name__}), {args.dtype} on {device}"


def _prepare(args, ckpt, opt_ckpt, engine, variants, backends, device, err, what: str):
    """The float64 reference, the environment and the platform's rounding; the header on stderr
    (``what``: the prompt or corpus line)."""
    # on one GPU the reference reads the optimized model's resident weights (same checkpoint only)
    share = engine.engine if args.engine == "optimized" and opt_ckpt is None else None
    ref = reference_device.load(ckpt, variants, args.reference_device, share=share)
    args.reference_device = reference_device.where(ref)  # auto, resolved: the advice on memory errors
    env = environment(device=device, dtype=args.dtype)
    env["reference"] = reference_device.info(ref)
    rounding = setup.platform_rounding(args.dtype, device) if args.engine == "optimized" else "nearest"
    env["rounding"] = rounding
    err.print(f"reference: {ckpt.info['describe']}", markup=False)
    if opt_ckpt is not None:
        err.print(f"{'optimized' if args.engine == 'optimized' else 'engine'}: {opt_ckpt.info['describe']}",
                  markup=False)
    err.print(_describe_engine(args, engine, env, rounding, backends), markup=False)
    err.print(f"float64 reference: {ref.executor.describe()}"
              + (", reading the optimized model's weights" if ref.shares_weights else ""), markup=False)
    err.print(f"variants: {_variants(ref)}; {what}; mode {args.mode}; {args.steps} steps", markup=False)
    return ref, env, rounding


def _diff(args, ckpt, opt_ckpt, engine, ids, text, tok, tokens, variants, backends, device, err) -> int:
    config = ckpt.source.config
    out = Console(highlight=False)
    if not out.is_terminal:  # a pipe or a file: room for every column
        out = Console(highlight=False, width=140)
    ref, env, rounding = _prepare(args, ckpt, opt_ckpt, engine, variants, backends, device, err,
                                  f"prompt: {len(ids)} tokens")

    lm_head = setup.lm_head_span(ckpt, device)
    with reference_device.memory_errors(args.reference_device, device):
        result = _decode(ref, engine, ids, config, args, err, rounding, tokens, lm_head)
    decode = (lambda t: tok.decode([t])) if tok is not None else None
    print_result(result, out, decode=decode)

    if args.json or args.plot:
        prompt = {"text": text, "ids": ids}
        report = build_report(result, checkpoint=ckpt.info, config=config,
                              variants={"reference": _variants(ref), "optimized": _variants(engine)},
                              env=env, prompt=prompt, backends=backends,
                              optimized_checkpoint=opt_ckpt.info if opt_ckpt else None,
                              engine=args.engine)
        if args.json:
            write_output(args.json, lambda: write_json(args.json, report))
        if args.plot:
            moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
            write_output(args.plot, lambda: write_plot(result, args.plot, moe_layers=moe))
    return 1 if result.verdict in ("diverged", "past-bound") else 0


def _write_plan(args, ckpt, variants, device, err) -> int:
    """``--plan PATH``: the reference alone, greedy; the plan an engine teacher-forces."""
    if args.engine != "optimized" or args.optimized_from or args.backend:
        raise InputError("--plan runs the reference alone: leave out --engine, --optimized-from and --backend")
    ids, _, _ = setup.prompt_ids(ckpt, text=args.prompt, ids=args.prompt_ids)
    steps = args.steps or DEFAULT_STEPS[device]
    ref = reference_device.load(ckpt, variants, args.reference_device)
    args.reference_device = reference_device.where(ref)
    err.print(f"reference: {ckpt.info['describe']}; plan: {len(ids)} prompt tokens, {steps} steps", markup=False)
    try:
        with reference_device.memory_errors(args.reference_device, device):
            plan = make_plan(ref, ids, steps=steps, config=ckpt.source.config, checkpoint=ckpt.info)
    except setup.checkpoint_errors() as exc:
        raise InputError(setup.one_line(exc)) from None
    write_output(args.plan, lambda: write_plan(args.plan, plan))
    print(f"wrote {args.plan}: prefill the {len(ids)} prompt ids, then decode tokens[1:] ({steps - 1} tokens); "
          f"write the logits of all {steps} steps to a dump (docs/dump-format.md)")
    return 0


def _variants(model) -> dict:
    return dict(getattr(model, "variants", {}) or {})


def _decode(ref, opt, ids, config, args, err, rounding, tokens, lm_head):
    show = not args.no_progress and err.is_terminal
    with Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=not show) as progress:
        task = progress.add_task("decode", total=args.steps, last="")

        def on_step(rec):
            progress.update(task, advance=1, last=f"step {rec.step}: {rec.verdict}")

        try:
            return run_diff(ref, opt, ids, config=config, steps=args.steps, mode=args.mode,
                            dtype=args.dtype, rounding=rounding, on_step=on_step, tokens=tokens,
                            lm_head=lm_head)
        except checkpoint_errors() as exc:  # the reference reads (and validates) weights as it goes
            raise InputError(one_line(exc)) from None
        except EngineError as exc:  # an engine that broke the protocol mid-run: nothing is written
            raise InputError(one_line(exc)) from None


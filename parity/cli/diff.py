"""``parity diff``: decode on the reference and the optimized path, compare step by step.

Exit status: 0 when no step diverged (matches and near-ties only), 1 when a step diverged, 2 for
unusable input (one ``error:`` line). Documented in docs/cli.md.
"""
from __future__ import annotations

import argparse

from parity import reference_device

DEFAULT_STEPS = {"cuda": 128, "cpu": 16}  # the Triton interpreter takes ~1-3 s per decode step


def register(sub):
    p = sub.add_parser(
        "diff", help="decode on both paths and diff the logits step by step (the main job)",
        description="Decode N tokens greedily on the float64 reference and on the optimized path and "
                    "classify every step: match, near-tie (a token flip that the optimized path's "
                    "noise explains) or diverged (a bug until shown otherwise, localized to a layer "
                    "and op). Without CHECKPOINT: the bundled default fixture and a built-in prompt.")
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory (config.json + safetensors); default: the bundled fixture")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (the checkpoint's tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--steps", type=int, default=None, metavar="N",
                   help="decode steps, each one generated token (default 128 on a GPU, 16 on CPU)")
    p.add_argument("--mode", choices=("forced", "free"), default="forced",
                   help="forced: both paths consume the reference's tokens; free: each its own, "
                        "re-anchored at a split (default forced)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="device of the optimized path (default: cuda if present, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="compute dtype of the optimized path (default bfloat16)")
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
                   help="load the optimized path from this checkpoint instead (same config): compare a "
                        "converted or patched checkpoint against the original, or plant a bug")
    p.add_argument("--json", metavar="PATH", help="write the JSON report (docs/diff-report-schema.json)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG: per-step error, bound, margins, router flips")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from parity.cli.args import MAX_STEPS, check_count, check_outputs, check_seed, check_text, write_output
    from parity.diff import build_report, setup, write_json
    from parity.diff.render import print_result
    from parity.diff.report import environment

    check_outputs(("--json", args.json), ("--plot", args.plot))
    check_text("--prompt", args.prompt)
    check_count("--steps", args.steps, MAX_STEPS, "steps")
    check_seed("--seed", args.seed)
    variants = setup.parse_variants(args.variant)
    backends = setup.parse_backends(args.backend)
    device = setup.check_device(args.device)
    if args.steps is None:
        args.steps = DEFAULT_STEPS[device]
    ckpt = setup.open_checkpoint(args.checkpoint, synthetic=args.synthetic, seed=args.seed)
    opt_ckpt = None
    if args.optimized_from:
        opt_ckpt = setup.open_checkpoint(args.optimized_from)
        setup.same_model(ckpt, opt_ckpt)
    ids, text, tok = setup.prompt_ids(ckpt, text=args.prompt, ids=args.prompt_ids)
    config = ckpt.source.config

    out, err = Console(highlight=False), Console(stderr=True, highlight=False)
    if not out.is_terminal:  # a pipe or a file: room for every column
        out = Console(highlight=False, width=140)
    if not err.is_terminal:
        err = Console(stderr=True, highlight=False, width=140)
    opt = setup.load_optimized(opt_ckpt or ckpt, device=device, dtype=args.dtype, variants=variants,
                               backends=backends)
    ref = reference_device.load(ckpt, variants, args.reference_device, share=None if opt_ckpt else opt)
    env = environment(device=device, dtype=args.dtype)
    env["reference"] = reference_device.info(ref)
    env["rounding"] = rounding = setup.platform_rounding(args.dtype, device)
    err.print(f"reference: {ckpt.info['describe']}", markup=False)
    if opt_ckpt is not None:
        err.print(f"optimized: {opt_ckpt.info['describe']}", markup=False)
    info = env["backend_info"]
    how = "CUDA " + str(info.get("cuda")) if device == "cuda" else (
        "CPU, Triton interpreter" + (", faithful bf16 dot installed" if info["faithful_bf16_dot"] else "")
        if info["triton_interpreter"] else "CPU")
    err.print(f"optimized path: {args.dtype} on {how}"
              + (f" (rounds to {args.dtype} {rounding})" if rounding != "nearest" else "")
              + (f"; backends {backends}" if backends else ""), markup=False)

    err.print(f"float64 reference: {ref.executor.describe()}"
              + (", reading the optimized model's weights" if ref.shares_weights else ""), markup=False)
    err.print(f"variants: {_variants(ref)}; prompt: {len(ids)} tokens; mode {args.mode}; "
              f"{args.steps} steps", markup=False)

    with reference_device.memory_errors(args.reference_device, device):
        result = _decode(ref, opt, ids, config, args, err, rounding)
    decode = (lambda t: tok.decode([t])) if tok is not None else None
    print_result(result, out, decode=decode)

    if args.json or args.plot:
        prompt = {"text": text, "ids": ids}
        report = build_report(result, checkpoint=ckpt.info, config=config,
                              variants={"reference": _variants(ref), "optimized": _variants(opt)},
                              env=env, prompt=prompt, backends=backends,
                              optimized_checkpoint=opt_ckpt.info if opt_ckpt else None)
        if args.json:
            write_output(args.json, lambda: write_json(args.json, report))
        if args.plot:
            from parity.diff.plot import write_plot

            moe = [i for i in range(config.num_hidden_layers) if config.is_moe_layer(i)]
            write_output(args.plot, lambda: write_plot(result, args.plot, moe_layers=moe))
    return 1 if result.verdict == "diverged" else 0


def _variants(model) -> dict:
    return dict(getattr(model, "variants", {}) or {})


def _decode(ref, opt, ids, config, args, err, rounding):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from parity.diff import run_diff
    from parity.diff.setup import checkpoint_errors, one_line
    from parity.errors import InputError

    show = not args.no_progress and err.is_terminal
    with Progress(TextColumn("decoding"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                  TimeElapsedColumn(), console=err, transient=True, disable=not show) as progress:
        task = progress.add_task("decode", total=args.steps, last="")

        def on_step(rec):
            progress.update(task, advance=1, last=f"step {rec.step}: {rec.verdict}")

        try:
            return run_diff(ref, opt, ids, config=config, steps=args.steps, mode=args.mode,
                            dtype=args.dtype, rounding=rounding, on_step=on_step)
        except checkpoint_errors() as exc:  # the reference reads (and validates) weights as it goes
            raise InputError(one_line(exc)) from None


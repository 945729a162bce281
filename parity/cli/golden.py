"""``parity golden record`` / ``parity golden check``: freeze the reference's answer, check against it.

Exit status: record 0 (written), 1 (a step diverged or numbers are past their bound: nothing
written); check 0 (no step diverged), 1 (a step diverged); 2 unusable input. ``check --engine``
holds any engine to the golden (``parity.diff.engines``: transformers, dump:PATH, module:factory).
Format: parity/diff/golden.py, docs/cli.md.
"""
from __future__ import annotations

import argparse
import json

from parity.cli.args import MAX_STEPS, MAX_TOP_K, check_count, check_outputs, check_seed, check_text, write_output
from parity.cli.options import VARIANTS, add_reference_device, parse_backends, parse_variants
from parity.diff import golden, reference_device, setup
from parity.diff.engines import EngineError
from parity.diff.report import atomic_write, environment
from parity.errors import InputError

DEFAULT_STEPS = 32


def register(sub):
    p = sub.add_parser("golden", help="record a golden file of the reference, or check the optimized path against one",
                       description="Golden files hold the reference's tokens, per-step logit digests, top-k "
                                   "logits and noise bounds, so CI can check the optimized path without "
                                   "recomputing the float64 reference.")
    gsub = p.add_subparsers(dest="golden_command", metavar="{record,check}", parser_class=type(p))
    gsub.required = True

    r = gsub.add_parser("record", help="decode on both paths and write a golden file of the reference")
    r.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory; default: the bundled fixture")
    r.add_argument("--out", required=True, metavar="FILE", help="golden file to write (JSON)")
    prompt = r.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="comma-separated token ids")
    r.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N", help=f"default {DEFAULT_STEPS}")
    r.add_argument("--top-k", type=int, default=16, metavar="K", help="logits kept per step (default 16)")
    r.add_argument("--device", choices=("cpu", "cuda"), default=None)
    r.add_argument("--dtype", choices=("bfloat16", "float32"), default="float32",
                   help="dtype the optimized path is held to (default float32: no router flips, tight "
                        "bounds, the same on every platform; a bfloat16 golden holds the noise of the "
                        "platform it was recorded on)")
    r.add_argument("--variant", action="append", metavar="NAME=VALUE")
    add_reference_device(r)
    r.add_argument("--synthetic", metavar="PRESET")
    r.add_argument("--seed", type=int, default=0)
    r.set_defaults(func=run_record)

    c = gsub.add_parser("check", help="run an engine (default: the optimized path) and compare it with a golden file")
    c.add_argument("file", metavar="FILE", help="golden file")
    c.add_argument("--engine", default="optimized", metavar="ENGINE",
                   help="optimized (default), transformers, dump:PATH (a dump forced on the golden's "
                        "tokens) or module:factory")
    c.add_argument("--checkpoint", metavar="DIR",
                   help="checkpoint directory (default: the one recorded in the golden file)")
    c.add_argument("--device", choices=("cpu", "cuda"), default=None)
    c.add_argument("--backend", action="append", metavar="FAMILY=reference")
    c.add_argument("--steps", type=int, default=None, metavar="N",
                   help="check only the first N recorded steps (default: all)")
    c.add_argument("--json", metavar="PATH", help="write the per-step results as JSON")
    c.set_defaults(func=run_check)


def run_record(args: argparse.Namespace) -> int:
    check_outputs(("--out", args.out))
    check_text("--prompt", args.prompt)
    check_count("--steps", args.steps, MAX_STEPS, "steps")
    check_seed("--seed", args.seed)
    if not 2 <= args.top_k <= MAX_TOP_K:
        raise InputError(f"--top-k {args.top_k}: expected 2 to {MAX_TOP_K}")
    variants = parse_variants(args.variant)
    device = setup.check_device(args.device)
    ckpt = setup.open_checkpoint(args.checkpoint, synthetic=args.synthetic, seed=args.seed)
    ids, text, _ = setup.prompt_ids(ckpt, text=args.prompt, ids=args.prompt_ids)
    opt = setup.load_engine("optimized", ckpt, dtype=args.dtype, device=device, variants=variants, backends={},
                            free=args.free_memory, reference_device=args.reference_device)
    ref = reference_device.load(ckpt, variants, args.reference_device, share=opt.engine)
    try:
        with reference_device.memory_errors(reference_device.where(ref), device):
            body, result = golden.record(ref, opt, ids, config=ckpt.source.config, steps=args.steps,
                                         dtype=args.dtype, top_k=args.top_k,
                                         rounding=setup.platform_rounding(args.dtype, device))
    except (EngineError, *setup.checkpoint_errors()) as exc:
        raise InputError(setup.one_line(exc)) from None
    summary = result.summary()
    print(summary["line"])
    if result.verdict == "diverged":
        print(f"not recorded: a golden certifies agreement, and step "
              f"{next(s.step for s in result.steps if s.verdict == 'diverged')} diverged")
        return 1
    if result.verdict == "past-bound":
        print("not recorded: a golden certifies agreement, and numbers are past their bound")
        return 1
    g = golden.make_golden(body, checkpoint=_portable(ckpt.info), config=ckpt.source.config,
                           weights_sha256=golden.weights_fingerprint(ckpt.source),
                           variants=ref.variants, backends={}, dtype=args.dtype,
                           environment={**environment(device=device, dtype=args.dtype),
                                        "reference": reference_device.info(ref)},
                           prompt={"text": text, "ids": ids}, summary=summary)
    write_output(args.out, lambda: golden.write(args.out, g))
    print(f"wrote {args.out}: {len(body['steps'])} steps, top-{args.top_k} logits, {args.dtype} bounds")
    return 0


def _portable(info: dict) -> dict:
    """The bundled fixture is recorded by name, not by this machine's absolute path."""
    if info.get("kind") == "bundled":
        return {"kind": "bundled", "describe": "the bundled default checkpoint (fixtures/default)"}
    return info


def run_check(args: argparse.Namespace) -> int:
    check_outputs(("--json", args.json))
    check_count("--steps", args.steps, MAX_STEPS, "steps")
    try:
        g = golden.load(args.file)
    except golden.GoldenError as exc:
        raise InputError(str(exc)) from None
    backends = parse_backends(args.backend)
    device = setup.check_device(args.device)
    info = g["checkpoint"]
    if args.checkpoint is not None:
        ckpt = setup.open_checkpoint(args.checkpoint)
    elif info.get("kind") == "synthetic":
        ckpt = setup.open_checkpoint(synthetic=info["preset"], seed=info["seed"])
    elif info.get("kind") == "bundled":
        ckpt = setup.open_checkpoint(None)
    else:
        ckpt = setup.open_checkpoint(info["path"])
    if ckpt.source.config.to_hub_dict() != g["config"]:
        raise InputError(f"{args.file}: recorded for a different config than {ckpt.info['describe']}")
    if g.get("weights_sha256") and golden.weights_fingerprint(ckpt.source) != g["weights_sha256"]:
        raise InputError(f"{args.file}: recorded on different weights than {ckpt.info['describe']} "
                         "(weights_sha256 differs)")
    vocab = ckpt.source.config.vocab_size  # the golden's own ids were checked against its config, equal to this one
    variants = {k: v for k, v in (g.get("variants") or {}).items() if k in VARIANTS}
    if args.engine not in ("optimized", "transformers"):  # a dump or a factory runs its own semantics:
        variants = {}                                        # the numbers will say if they differ
    opt = setup.load_engine(args.engine, ckpt, dtype=g["dtype"], device=device, variants=variants,
                            backends=backends, free=args.free_memory)
    try:
        result = golden.check(g, opt, vocab_size=vocab, steps=args.steps)
    except EngineError as exc:
        raise InputError(setup.one_line(exc)) from None
    for s in result.steps:
        if s.verdict != "match":
            print(f"step {s.step}: {s.verdict}: token {s.opt_token} (golden {s.token}), "
                  f"max|dlogit| {s.max_abs_diff:.3g}, bound {s.bound:.3g}" + (f"; {s.reason}" if s.reason else ""))
    print(result.summary_line())
    if args.json is not None:
        text = json.dumps({"golden": str(args.file), "verdict": result.verdict, "summary": result.summary_line(),
                           "steps": [s.to_dict() for s in result.steps]}, indent=1, allow_nan=False) + "\n"
        write_output(args.json, lambda: atomic_write(args.json, text))
    return 1 if result.verdict == "diverged" else 0

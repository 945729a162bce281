"""`parity capture`: record the inputs each registered op receives while the optimized model runs a
prefill and a few decode steps, for ``parity certify --cases`` (docs/cli.md).

    parity capture [CHECKPOINT | --synthetic PRESET --seed S] --out FILE
                   [--prompt TEXT | --prompt-ids IDS] [--prompt-length N] [--steps N]
                   [--device cpu|cuda] [--dtype bfloat16|float32] [--store-limit BYTES]

Prints one line per captured case (op, call site, calls it stands for, kind, shapes) and the model
calls left uncaptured. Exit 0 on success, 2 for unusable input (one ``error:`` line).
"""
from __future__ import annotations

import argparse

from rich.console import Console

import optimized
from parity.cli.args import MAX_STEPS, check_count, check_outputs, check_seed, check_text, write_output
from parity.diff import setup
from parity.errors import InputError
from parity.record import capture
from parity.record.capture import sites

DEFAULT_STEPS = 2
MAX_PROMPT = 1 << 20


def register(sub):
    p = sub.add_parser("capture", help="record the inputs the model's ops receive, for certify --cases",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", metavar="CHECKPOINT",
                   help="checkpoint directory (config.json + safetensors); default: the bundled fixture")
    p.add_argument("--synthetic", metavar="PRESET",
                   help="generated weights of a preset (tiny, small, medium, kimi-linear-48b) instead of a checkpoint")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of --synthetic and of the regenerated inputs' seeds (default 0)")
    p.add_argument("--out", required=True, metavar="FILE", help="the cases file to write (safetensors)")
    prompt = p.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", metavar="TEXT", help="prompt text (the checkpoint's tokenizer)")
    prompt.add_argument("--prompt-ids", metavar="IDS", help="prompt token ids, comma-separated: 1,2,3")
    p.add_argument("--prompt-length", type=int, default=None, metavar="N",
                   help="repeat the prompt's ids (given or built-in) to exactly N tokens: a long prefill")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, metavar="N",
                   help=f"decode steps after the prefill, each one greedy token (default {DEFAULT_STEPS})")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the model runs (default: cuda if available, else cpu)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the model's compute dtype (default bfloat16)")
    p.add_argument("--store-limit", type=int, default=None, metavar="BYTES",
                   help="a float input of more bytes is regenerated from statistics and a seed instead "
                        "of stored (default 1 MiB)")
    p.set_defaults(func=run)


def _checks(args) -> None:
    check_outputs(("--out", args.out))
    check_text("--prompt", args.prompt)
    check_seed("--seed", args.seed)
    check_count("--prompt-length", args.prompt_length, MAX_PROMPT, "tokens")
    if not 0 <= args.steps <= MAX_STEPS:
        raise InputError(f"--steps {args.steps}: expected 0 to {MAX_STEPS} decode steps")
    if args.store_limit is not None and args.store_limit < 0:
        raise InputError(f"--store-limit {args.store_limit}: expected a number of bytes >= 0")


def run(args: argparse.Namespace) -> int:
    _checks(args)
    device = setup.check_device(args.device)
    ckpt = setup.open_checkpoint(args.checkpoint, synthetic=args.synthetic, seed=args.seed)
    ids, _, _ = setup.prompt_ids(ckpt, text=args.prompt, ids=args.prompt_ids)
    if args.prompt_length is not None:
        ids = [ids[i % len(ids)] for i in range(args.prompt_length)]
    setup.check_fits(ckpt, dtype=args.dtype, device=device, free=args.free_memory, reference_device=None)
    model = _load(ckpt, device, args.dtype)
    limit = capture.STORE_LIMIT if args.store_limit is None else args.store_limit
    console = Console(highlight=False, width=None if Console().is_terminal else 160)
    console.print(f"parity capture: {ckpt.info['describe']}, {args.dtype} on {device}, prompt of {len(ids)} "
                  f"token(s), {args.steps} decode step(s), inputs over {limit} bytes regenerated")
    try:
        rec = capture.run(model, ids, steps=args.steps, store_limit=limit, seed=args.seed)
    except ValueError as exc:  # an op received non-finite values
        raise InputError(setup.one_line(exc)) from None
    cases = list(rec.cases.values())
    info = {k: v for k, v in ckpt.info.items()}
    run_info = {"checkpoint": info, "dtype": args.dtype, "device": device, "prompt_ids": ids,
                "steps": args.steps, "store_limit": limit, "seed": args.seed,
                "uncaptured": dict(rec.uncaptured)}
    write_output(args.out, lambda: capture.casefile.write(args.out, cases, run=run_info))
    _print(console, cases, rec, args.out)
    return 0


def _load(ckpt, device: str, dtype: str):
    """The optimized model, decode steps eager (a replayed CUDA graph makes no op calls to record)."""
    try:
        return optimized.load(ckpt.source, device=device, dtype=dtype, cuda_graphs=False)
    except setup.load_errors() as exc:
        raise InputError(setup.one_line(exc)) from None


def _print(console, cases, rec, out) -> None:
    for i, c in enumerate(cases):
        kind = "captured" if all(f is None or f.stored for f in c.inputs.values()) else "regenerated"
        shapes = " ".join(f"{n}={'x'.join(map(str, f.shape))}" for n, f in c.inputs.items() if f is not None)
        console.print(f"  c{i:<3} {c.op:<28} {c.call_site:<26} {c.first:<9} x{c.calls:<3} {kind:<11} {shapes}")
    kinds = [all(f is None or f.stored for f in c.inputs.values()) for c in cases]
    console.print(f"{len(cases)} case(s) ({sum(kinds)} captured, {len(kinds) - sum(kinds)} regenerated) "
                  f"from {sum(c.calls for c in cases)} op call(s), written to {out}")
    for name, n in rec.uncaptured.items():
        console.print(f"  not captured: ops.{name} ({n} call(s)): {sites.SITES[name].note if name in sites.SITES else 'no record'}")
    for what in sites.UNCAPTURED:
        console.print(f"  not captured: {what}")

"""`parity fixture PRESET OUT_DIR --seed S [--shards N] [--force]`: write a synthetic checkpoint.

The weights are ``kimi.synthetic.SyntheticSource(PRESET, S)`` rounded to their storage dtypes
(bf16; float32 for A_log, dt_bias and the router bias), in the hub layout (``config.json`` +
``model.safetensors``, or N shards + ``model.safetensors.index.json``).
"""
from __future__ import annotations

from pathlib import Path

from kimi.config import ConfigError, KimiConfig
from kimi.fixtures import write_fixture
from parity.cli.args import check_seed
from parity.errors import InputError


def register(sub):
    p = sub.add_parser("fixture", help="write a synthetic checkpoint (hub layout) for a preset",
                       description="Write SyntheticSource(PRESET, SEED) as a hub-layout checkpoint "
                                   "(config.json + model.safetensors, or N shards + index).")
    p.add_argument("preset", help="config preset: tiny, tiny-bounded (the bounded KDA gate), small, medium or "
                   "kimi-linear-48b")
    p.add_argument("out_dir", help="checkpoint directory to create")
    p.add_argument("--seed", type=int, default=0, help="weight seed, 0 <= S < 2**32 (default 0)")
    p.add_argument("--shards", type=int, default=None, metavar="N",
                   help="write N safetensors shards plus model.safetensors.index.json")
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists and is not empty")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        config = KimiConfig.from_name(args.preset)
    except ConfigError as exc:
        raise InputError(str(exc)) from None
    check_seed("--seed", args.seed)
    if args.shards is not None and args.shards < 1:
        raise InputError(f"--shards: expected a positive count, got {args.shards}")
    if not str(args.out_dir).strip():
        raise InputError("OUT_DIR: empty path; give a directory name")
    out = Path(args.out_dir)
    if out.exists() and not out.is_dir():
        raise InputError(f"{out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not args.force:
        raise InputError(f"{out}: directory is not empty (use --force to replace it)")
    try:
        write_fixture(config, out, seed=args.seed, shards=args.shards, overwrite=args.force)
    except ValueError as exc:  # e.g. more shards than tensors
        raise InputError(f"--shards {args.shards}: {exc}") from None
    except OSError as exc:
        raise InputError(f"{out}: cannot write ({exc.strerror or exc})") from None
    files = sorted(p.name for p in out.iterdir())
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"wrote {args.preset} (seed {args.seed}) to {out}: {len(files)} files, {size / 1e6:.2f} MB")
    return 0

"""`parity search`: look for inputs on which a correct implementation exceeds its bound
(docs/certificates.md, "Searching for a counterexample").

    parity search [--ops OP|FAMILY ...] [--candidate optimized|reference-f32 ...]
                  [--impl OP=module:function | OP=path/to/file.py:function | fla ...]
                  [--contract ieee|tf32|bf16-storage] [--dtype bfloat16|float32|float64 ...]
                  [--device cpu|cuda] [--examples N] [--seconds S] [--space cheap|full|buckets]
                  [--random] [--json PATH] [--keep DIR]

For every op, candidate and dtype, draws the record's wide inputs and climbs toward the worst error
in bound units (``parity.certify.search``); prints one line per run and writes them all with ``--json``.
``--seconds`` is the budget of the whole command, shared among its runs. Exit 0 when no input
exceeded its bound, 1 when one did, 2 for unusable arguments.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from parity.atomic import atomic_write
from parity.bounds.core import CONTRACTS
from parity.certify.search import FORMAT, save_case, search
from parity.cli.args import MAX_EXAMPLES, check_count, check_outputs, write_output
from parity.cli.certify import parse_impls, select_impls
from parity.cli.impls import DTYPES, select_runs, setup_device
from parity.environment import environment
from parity.errors import InputError
from parity.peers import SHORTHANDS
from parity.registry import SEARCH_SPACES

CANDIDATES = ("optimized", "reference-f32")
MAX_SECONDS = 7 * 24 * 3600.0


def register(sub):
    p = sub.add_parser("search", help="search for inputs past an op's error bound",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", nargs="+", metavar="OP", help="ops (kda.chunked) or families (kda); default: all")
    p.add_argument("--candidate", nargs="+", choices=CANDIDATES, default=None, dest="candidates",
                   help="what is searched: the optimized ops and/or the float32 stand-in "
                        "(default: optimized, or only the --impl implementations when given)")
    p.add_argument("--impl", action="append", default=[], metavar="OP=SPEC",
                   help="search your implementation of OP (repeatable): OP=module:function or "
                        "OP=path/to/file.py:function, a callable with the op's signature; or a shorthand "
                        f"for a set of adapters ({', '.join(SHORTHANDS)})")
    p.add_argument("--contract", choices=tuple(CONTRACTS), default=None,
                   help="the arithmetic every --impl claims (default: what each declares, else ieee)")
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=None, dest="dtypes",
                   help="run dtypes (default: float32 bfloat16)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None,
                   help="where the candidates run (default: cuda if available, else cpu)")
    p.add_argument("--examples", type=int, default=60, help="drawn inputs per op, candidate and dtype")
    p.add_argument("--seconds", type=float, default=270.0, help="wall-clock budget of the whole search")
    p.add_argument("--space", choices=SEARCH_SPACES, default=None,
                   help="how widely inputs are drawn: cheap (small shapes, seconds under the interpreter), "
                        "full (any shape up to a cost cap), buckets (a few shapes, long sequences; on a GPU "
                        "each new shape compiles); default buckets on cuda, else full")
    p.add_argument("--random", action="store_true", help="fresh draws each run (default: derandomized)")
    p.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the results here")
    p.add_argument("--keep", metavar="DIR", default=None,
                   help="save each run's worst input past its bound here (.npz, parity.certify.search.load_case)")
    p.set_defaults(func=run)


def run(args) -> int:
    check_outputs(("--json", args.json_path))
    check_count("--examples", args.examples, MAX_EXAMPLES, "examples")
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= MAX_SECONDS):
        raise InputError(f"--seconds {args.seconds:g}: expected a positive budget of at most {MAX_SECONDS:g}")
    if args.keep is not None:
        if not Path(args.keep).is_dir():
            raise InputError(f"--keep {args.keep}: not a folder")
    parse_impls(args.impl)   # unusable --impl values: refused before anything loads
    records, dtypes = select_runs(args.ops, args.dtypes)
    device = setup_device(args.device)
    candidates = args.candidates if args.candidates is not None else ([] if args.impl else ["optimized"])
    # with --impl and no --ops, the ops given an implementation
    records, impls = select_impls(args.impl, records, ops_given=bool(args.ops), device=device, contract=args.contract)
    runs = [(rec, cand) for rec in records for cand in candidates]
    runs += [(rec, i.candidate) for rec in records for i in impls if i.op == rec.name]
    runs = [(rec, cand, dt) for rec, cand in runs for dt in dtypes]
    if not runs:
        raise InputError("nothing to search: give --candidate or an --impl of a selected op")
    space = args.space or ("buckets" if device == "cuda" else "full")

    print(f"parity search: {len(runs)} run(s), device {device}, space {space}, up to {args.examples} input(s) "
          f"each, {args.seconds:g} s in all", flush=True)
    results, t0, past = [], time.monotonic(), False
    for i, (rec, cand, dt) in enumerate(runs):
        share = max(0.0, args.seconds - (time.monotonic() - t0)) / (len(runs) - i)  # what is left, shared
        name = cand if isinstance(cand, str) else cand.name
        r = search(rec, cand, dt, device=device, examples=args.examples, seconds=share, space=space,
                   derandomize=not args.random)
        results.append(r.to_dict())
        past = past or r.past_bound > 0
        if args.keep is not None and r.worst_case is not None and r.worst_ratio > 1:
            save_case(r.worst_case, f"{args.keep}/{rec.name}-{name.replace(':', '_')}-{dt}.npz")
        if r.examples == 0 and r.unsupported == 0:
            print(f"{rec.name:26s} {name:14s} {dt:9s} not run: the --seconds budget was spent", flush=True)
            continue
        print(f"{rec.name:26s} {name:14s} {dt:9s} worst {r.worst_ratio:9.3g} over {r.examples:3d} "
              f"({r.past_bound} past, {r.unsupported} unsupported, {r.seconds:.0f}s)  {r.worst_label}", flush=True)
    if args.json_path is not None:
        doc = {"format": FORMAT, "version": 1, "device": device, "space": space,
               "implementations": {i.op: i.spec for i in impls}, "environment": environment(device), "results": results}
        write_output(args.json_path, lambda: atomic_write(args.json_path, json.dumps(doc, indent=1)))
    return 1 if past else 0

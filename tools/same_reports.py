"""Compare two certificates, or two diff reports, field for field with what varies from run to run
set aside: the timings (every ``seconds``, ``created``), the command line, and the run-dependent
fields of the environment and of an outside implementation's provenance (git revision and dirt,
thread counts; an ``--impl`` file's repository moves with every commit). Used to show that a change of the code's
layout leaves what the tools write byte for byte the same.

    parity certify --device cpu --json before/c.json          # on the old tree
    parity diff --steps 8 --json before/r.json
    ...                                                      # the same on the new tree, into after/
    python tools/same_reports.py before/c.json after/c.json before/r.json after/r.json

Exit 0 when every pair is the same once normalized (the normalized documents are compared as the
JSON text the tools write, so a float that prints otherwise differs), 1 with the first differing
paths otherwise, 2 on unusable arguments.
"""
from __future__ import annotations

import json
import sys

VOLATILE_KEYS = {"seconds", "created", "command"}
VOLATILE_ENVIRONMENT = {"git", "torch_threads", "threads"}
PROVENANCE = {"environment", "implementation"}   # the objects whose VOLATILE_ENVIRONMENT fields vary


def normalized(doc, *, inside_environment: bool = False):
    """``doc`` with the run-dependent fields replaced by a placeholder (kept, so that a field that
    appears or disappears still counts as a difference)."""
    if isinstance(doc, dict):
        out = {}
        for key, value in doc.items():
            volatile = key in VOLATILE_KEYS or (inside_environment and key in VOLATILE_ENVIRONMENT)
            out[key] = "<varies>" if volatile else normalized(
                value, inside_environment=inside_environment or key in PROVENANCE)
        return out
    if isinstance(doc, list):
        return [normalized(v, inside_environment=inside_environment) for v in doc]
    return doc


def differences(a, b, path: str = "$", limit: int = 10) -> list[str]:
    """Up to ``limit`` JSON paths where ``a`` and ``b`` differ."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} vs {type(b).__name__}"]
    if isinstance(a, dict):
        out = [f"{path}.{k}: only in one" for k in sorted(set(a) ^ set(b))]
        for k in a:
            if k in b and len(out) < limit:
                out += differences(a[k], b[k], f"{path}.{k}", limit - len(out))
        return out[:limit]
    if isinstance(a, list):
        out = [] if len(a) == len(b) else [f"{path}: {len(a)} vs {len(b)} items"]
        for i, (x, y) in enumerate(zip(a, b)):
            if len(out) >= limit:
                break
            out += differences(x, y, f"{path}[{i}]", limit - len(out))
        return out[:limit]
    return [] if json.dumps(a) == json.dumps(b) else [f"{path}: {a!r} vs {b!r}"]


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or len(args) % 2:
        print("error: expected pairs of files: BEFORE AFTER [BEFORE AFTER ...]", file=sys.stderr)
        return 2
    failed = False
    for before, after in zip(args[::2], args[1::2]):
        try:
            a, b = (normalized(json.load(open(p))) for p in (before, after))
        except (OSError, ValueError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        same = json.dumps(a, indent=1) == json.dumps(b, indent=1)
        print(f"{before} vs {after}: {'same' if same else 'DIFFERENT'}")
        for line in [] if same else differences(a, b):
            print(f"  {line}")
        failed |= not same
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

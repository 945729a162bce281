"""Repros of failing inputs (``parity certify --repro DIR``): per failing (op, dtype, input), a folder
with the inputs the candidate was handed and the float64 reference with its bound (safetensors),
and a standalone script that imports the implementation, runs it on those inputs and prints the
error in bound units. The script needs torch, safetensors and the implementation, not kimi-parity:
what one attaches to an upstream bug report.

The bound written is the one certify judged by (the claimed contract, the outputs' dtypes); an
adapter of parity.peers is inlined into the script with the module-level helpers it uses, so the
script calls the outside library directly.
"""
from __future__ import annotations

import inspect
import json
import re
import textwrap
import types
from pathlib import Path

import numpy as np
import torch
from ..files import write_tensors
from ..metrics import dtype_of

SCRIPT = '''\
#!/usr/bin/env python3
"""{title}

{detail}
Run: python repro.py [DEVICE]  (default {device}); needs torch, safetensors and the implementation.
Prints each output's worst error in units of the bound certify judged it by; exit 1 past it."""
import json, os, sys
import torch
from safetensors.torch import load_file

{impl}
HERE = os.path.dirname(os.path.abspath(__file__))
DEVICE = sys.argv[1] if len(sys.argv) > 1 else {device!r}
META = json.load(open(os.path.join(HERE, "meta.json")))
x = load_file(os.path.join(HERE, "inputs.safetensors"), device=DEVICE)
want = load_file(os.path.join(HERE, "expected.safetensors"))   # float64 reference and bound
kwargs = dict({{n: x[n] for n in META["kwarg_arrays"] if n in x}}, **META["kwargs"])
out = impl(*[x.get(n) for n in META["args"]], **kwargs)   # an absent optional input: None
out = out if isinstance(out, (tuple, list)) else (out,)
worst = 0.0
for name, o in zip(META["outputs"], out):
    o, ref, bound = o.detach().double().cpu(), want[name], want[name + ".bound"]
    err = (o - ref).abs()
    ratio = torch.where(err == 0, 0.0, err / bound).nan_to_num(nan=0.0)
    ratio[(o.isnan() != ref.isnan()) | (o.isinf() != ref.isinf())] = float("inf")   # NaN/Inf pattern
    at = tuple(int(i) for i in torch.unravel_index(ratio.argmax(), ratio.shape))
    worst = max(worst, ratio.max().item())
    print(f"{{name}}: worst {{ratio.max().item():.3g}} x bound at {{at}}: {{o[at].item():.9g}} vs {{ref[at].item():.9g}}")
print(f"worst {{worst:.3g}} x bound: {{'FAILS' if worst > 1 else 'within'}} the bound")
sys.exit(1 if worst > 1 else 0)
'''


def write(root, record, cand, prep, entry, outputs, device: str) -> Path:
    """Write the repro of one failing input (``entry``: its parity.certify.CaseResult; ``outputs``:
    what the candidate returned, None on a raise or fault; ``device``: where it ran) under
    ``root``; returns its folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    stem = _slug(f"{record.name}-{prep.dtype}-{entry.label}")
    folder = root / stem
    n = 2
    while folder.exists():
        folder, n = root / f"{stem}-{n}", n + 1
    folder.mkdir()
    tensors = {k: v.detach().cpu().contiguous() for k, v in prep.tensors.items() if isinstance(v, torch.Tensor)}
    scalars = {k: v for k, v in prep.tensors.items() if v is not None and not isinstance(v, torch.Tensor)}
    write_tensors(folder / "inputs.safetensors", tensors)
    if outputs is not None:
        out_dtypes = {k: dtype_of(v) for k, v in outputs.items() if dtype_of(v)}
    else:   # no outputs (a raise, a fault): the bound of outputs in the run dtype
        out_dtypes = {k: prep.dtype for k in record.outputs if np.asarray(prep.ref[k]).dtype.kind == "f"}
    bounds = prep.bound(out_dtypes)
    want = {}
    for k in record.outputs:
        want[k] = torch.from_numpy(np.ascontiguousarray(prep.ref[k], dtype=np.float64))
        want[k + ".bound"] = torch.from_numpy(np.array(np.broadcast_to(bounds[k], np.shape(prep.ref[k])),
                                                        dtype=np.float64, order="C"))
    write_tensors(folder / "expected.safetensors", want)
    meta = {"op": record.name, "dtype": prep.dtype, "label": entry.label, "args": list(record.args),
            "kwarg_arrays": list(record.kwarg_arrays), "kwargs": {**scalars, **dict(prep.case.kwargs)},
            "outputs": list(record.outputs), "contract": prep.contract, "summary": entry.summary,
            "implementation": cand.name}
    (folder / "meta.json").write_text(json.dumps(meta, indent=1, default=str) + "\n")
    impl, who = implementation_source(cand.fn, cand.spec)
    shapes = ", ".join(f"{k} {list(v.shape)} {str(v.dtype).replace('torch.', '')}" for k, v in tensors.items())
    detail = "\n".join(textwrap.wrap(f"Inputs: {shapes}. Certify found: {entry.summary}", 96))
    script = SCRIPT.format(title=f"Repro: {who} as {record.name} at {prep.dtype} ({entry.label}).",
                           detail=detail, device="cuda" if device.startswith("cuda") else device,
                           impl=impl)
    (folder / "repro.py").write_text(script)
    return folder


def _slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9.=_-]+", "_", s).strip("_")[:120]


def implementation_source(fn, spec: str | None = None) -> tuple[str, str]:
    """(python defining ``impl``, who it is): the ``module:function`` or ``file.py:function`` it was
    loaded from (``spec``), else its module imported from the folder that holds it, or, for an
    adapter of parity.peers, the adapter's own source with the module-level helpers and constants
    it names (no kimi-parity import left)."""
    module = getattr(fn, "__module__", "") or ""
    name = getattr(fn, "__qualname__", getattr(fn, "__name__", "impl"))
    if module.startswith("parity.") or module == "parity":
        wraps = getattr(fn, "parity_wraps", None) or f"{module}:{name}"
        return _inline(fn) + f"impl = {fn.__name__}\n", wraps
    if spec is not None:
        where, _, attr = spec.rpartition(":")
        if where.endswith(".py") or "/" in where:
            path = str(Path(where).resolve())
            return (f"import importlib.util\n_spec = importlib.util.spec_from_file_location({Path(where).stem!r}, {path!r})\n"
                    f"_mod = importlib.util.module_from_spec(_spec)\n_spec.loader.exec_module(_mod)\n"
                    f"impl = _mod.{attr}\n"), spec
        return f"from {where} import {attr} as impl\n", spec
    path = Path(inspect.getsourcefile(fn)).resolve()
    root = path.parents[len(module.split(".")) - 1] if path.name != "__init__.py" else path.parents[len(module.split("."))]
    return (f"sys.path.insert(0, {str(root)!r})\nfrom {module} import {name} as impl\n"), f"{module}:{name}"


def _inline(fn) -> str:
    """``fn``'s source (decorators dropped) and, before it, what it names from kimi-parity: functions
    (recursively), modules (imported), constants (as literals), exception classes (redefined)."""
    seen, parts, imports = set(), [], []

    def names(code):
        yield from code.co_names
        for c in code.co_consts:
            if isinstance(c, types.CodeType):
                yield from names(c)

    def visit(f):
        if f.__name__ in seen:
            return
        seen.add(f.__name__)
        g = f.__globals__
        for name in names(f.__code__):
            obj = g.get(name)
            if name in seen or obj is None:
                continue
            if isinstance(obj, types.ModuleType):
                imports.append(f"import {obj.__name__} as {name}" if obj.__name__ != name else f"import {name}")
                seen.add(name)
            elif isinstance(obj, types.FunctionType) and obj.__module__.startswith("parity."):
                visit(obj)
            elif isinstance(obj, type) and issubclass(obj, Exception):
                parts.append(f"class {name}(Exception):\n    pass\n")
                seen.add(name)
            elif isinstance(obj, (int, float, str, tuple, frozenset)):
                parts.append(f"{name} = {obj!r}\n")
                seen.add(name)
        src = textwrap.dedent(inspect.getsource(f))
        src = re.sub(r"^@.*\n", "", src, flags=re.M)
        parts.append(src)

    visit(fn)
    return "\n".join(dict.fromkeys(imports)) + "\n\n" + "\n".join(parts)

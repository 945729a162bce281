"""The reference imports no GPU library unless a GPU executor is asked for, and nothing from
optimized/parity: NumPy (through array-api-compat) by default; torch only inside the functions of
reference/executor.py that a torch executor calls and of reference/graphs.py that capture a CUDA
graph; never triton or cupy. kimi/ (the model's files, which the reference reads through) imports
none of them, torch included, nor the reference."""
import ast
import subprocess
import sys
from pathlib import Path

import kimi
import reference

REFERENCE_DIR = Path(reference.__file__).parent
KIMI_DIR = Path(kimi.__file__).parent
FORBIDDEN = ("torch", "triton", "cupy", "optimized", "parity")
TORCH_ALLOWED_IN = ("executor.py", "graphs.py")  # the executor's plumbing, inside functions only


def _imports(tree):
    """(node, imported top-level names, inside a function?) of every absolute import."""
    inside = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            inside |= {id(n) for n in ast.walk(fn)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        yield node, [n.split(".")[0] for n in names], id(node) in inside


def test_the_numpy_reference_runs_without_loading_any_gpu_library_and_torch_loads_on_request():
    modules = sorted(f"reference.{p.stem}" for p in REFERENCE_DIR.glob("*.py") if p.stem != "__init__")
    code = ("import sys, reference, " + ", ".join(modules) + "\n"
            "from kimi.config import KimiConfig\n"
            "src = reference.SyntheticSource(KimiConfig.from_name('tiny'), 0)\n"
            "logits, cache = reference.load(src).prefill([1, 2, 3])\n"
            "reference.load(src).decode(4, cache)\n"
            "bad = [m for m in ('torch', 'triton', 'cupy') if m in sys.modules]\n"
            "assert not bad, bad\n"
            "m = reference.load(src, executor='torch')\n"
            "assert 'torch' in sys.modules and 'triton' not in sys.modules\n"
            "assert type(m.forward([1, 2])).__module__.startswith('torch')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_reference_sources_import_torch_only_inside_the_executor_and_never_the_others():
    offenders = []
    for path in sorted(REFERENCE_DIR.rglob("*.py")):
        for node, names, in_function in _imports(ast.parse(path.read_text(), filename=str(path))):
            for n in names:
                allowed = n == "torch" and path.name in TORCH_ALLOWED_IN and in_function
                if n in FORBIDDEN and not allowed:
                    offenders.append(f"{path.name}:{node.lineno}: {n}")
    assert not offenders, offenders


def test_kimi_sources_import_no_gpu_library_and_nothing_of_the_project_above_them():
    offenders = []
    for path in sorted(KIMI_DIR.rglob("*.py")):
        for node, names, _ in _imports(ast.parse(path.read_text(), filename=str(path))):
            offenders += [f"{path.name}:{node.lineno}: {n}" for n in names if n in FORBIDDEN + ("reference",)]
    assert not offenders, offenders


def test_the_import_rule_catches_a_module_level_torch_import_in_the_executor():
    tree = ast.parse("import numpy\nimport torch\ndef f():\n    import torch\n")
    found = [(names, inside) for _, names, inside in _imports(tree)]
    assert found == [(["numpy"], False), (["torch"], False), (["torch"], True)]


def test_the_lazy_exports_resolve():
    import reference as r

    assert r.load.__module__ == "reference.model"
    assert {"load", "ModelCache", "KDACache", "MLACache", "get_executor"} <= set(r.__all__)

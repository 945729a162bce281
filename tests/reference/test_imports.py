"""The reference is NumPy only: it never imports torch or triton, nor anything from optimized/parity."""
import ast
import subprocess
import sys
from pathlib import Path

import reference

REFERENCE_DIR = Path(reference.__file__).parent
FORBIDDEN = ("torch", "triton", "optimized", "parity")


def test_importing_the_whole_reference_loads_neither_torch_nor_triton():
    modules = sorted(f"reference.{p.stem}" for p in REFERENCE_DIR.glob("*.py") if p.stem != "__init__")
    code = ("import sys, reference, " + ", ".join(modules) + "\n"
            "reference.load, reference.SyntheticSource, reference.open_source\n"
            "bad = [m for m in ('torch', 'triton') if m in sys.modules]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_reference_sources_import_nothing_from_optimized_parity_torch_or_triton():
    offenders = []
    for path in sorted(REFERENCE_DIR.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            else:
                continue
            offenders += [f"{path.name}:{node.lineno}: {n}" for n in names if n.split(".")[0] in FORBIDDEN]
    assert not offenders, offenders


def test_the_lazy_exports_resolve():
    import reference as r

    assert r.load.__module__ == "reference.model"
    assert {"load", "ModelCache", "KDACache", "MLACache"} <= set(r.__all__)

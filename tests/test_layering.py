"""The layering of the three packages: dependencies flow reference <- optimized <- parity, and the
import graph of all three has no cycle, counting imports inside functions (a function-level import
that closes a cycle holds the cycle apart; it does not remove it)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("reference", "optimized", "parity")  # each may import only those before it


def module_of(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(tree: ast.AST, me: str, is_package: bool, modules: set) -> set:
    """The modules of ``modules`` that the module ``me`` (parsed as ``tree``) imports, at any depth
    of its file, relative imports resolved."""
    package = me if is_package else me.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        out |= {t for t in targets if t in modules and t != me}
    return out


def graph(root: Path = ROOT) -> dict:
    """``{module: modules it imports}`` over the three packages."""
    files = {module_of(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    return {m: imports(ast.parse(p.read_text(), filename=str(p)), m, p.name == "__init__.py", set(files))
            for m, p in files.items()}


def cycles(g: dict) -> list:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on, stack, comps = {}, {}, set(), [], []
    for root in g:
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(g[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return comps


def upward(g: dict) -> list:
    """Imports against the flow: a package importing one that comes after it in ``PACKAGES``."""
    rank = {p: i for i, p in enumerate(PACKAGES)}
    rank_of = lambda m: rank[m.split(".")[0]]  # noqa: E731
    return sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts if rank_of(t) > rank_of(m))


def test_the_three_packages_have_no_import_cycle_even_through_function_level_imports():
    g = graph()
    assert {"reference.model", "optimized.model", "parity.ops.kda"} <= set(g)
    assert "parity.ops" in g["parity.testing"] and "parity.registry" in g["parity.ops.kda"]
    assert cycles(g) == []


def test_dependencies_flow_from_reference_to_optimized_to_parity():
    g = graph()
    assert any(t.startswith("reference.") for t in g["optimized.model"])
    assert upward(g) == []


def test_the_cycle_check_sees_a_cycle_closed_by_an_import_inside_a_function():
    modules = {"pkg.a", "pkg.b", "pkg.c"}
    sources = {"pkg.a": "from . import b\n", "pkg.b": "from .c import f\n",
               "pkg.c": "def f():\n    from .a import g\n    return g\n"}
    g = {m: imports(ast.parse(src), m, False, modules) for m, src in sources.items()}
    assert g["pkg.c"] == {"pkg.a"} and cycles(g) == [["pkg.a", "pkg.b", "pkg.c"]]
    g["pkg.c"] = set()
    assert cycles(g) == []


def test_the_real_graph_with_one_planted_back_edge_has_a_cycle_and_an_upward_import():
    g = graph()
    g["reference.executor"] = g["reference.executor"] | {"reference.checkpoint"}
    assert any({"reference.executor", "reference.checkpoint"} <= set(c) for c in cycles(g))
    g["reference.config"] = g["reference.config"] | {"optimized.model"}
    assert "reference.config -> optimized.model" in upward(g)

"""The layering of the four packages: dependencies flow kimi <- reference <- optimized <- parity,
and the import graph of all four has no cycle, counting imports inside functions (a function-level import
that closes a cycle holds the cycle apart; it does not remove it). The same holds a level up, for
every package's subpackages and modules each taken whole, and parity's rooms are floors: each
imports only the floors below it (``PARITY_FLOORS``)."""
import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kimi", "reference", "optimized", "parity")  # each may import only those before it
# parity's floors, lowest first, each importing only those below it: the foundation (the records,
# the catalogue ops/ and bounds/, metrics, errors, ...: every module not named here), the rooms,
# and the entry points that users and pytest call
PARITY_FLOORS = ("foundation", "certify", "record", "peers", "diff", "cli", "entry")
PARITY_ENTRY = {"parity", "parity.__main__", "parity.testing", "parity.pytest_plugin"}


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
    """``{module: modules it imports}`` over the four packages."""
    files = {module_of(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}
    return {m: imports(ast.parse(p.read_text(), filename=str(p)), m, p.name == "__init__.py", set(files))
            for m, p in files.items()}


def users_of(names) -> list[str]:
    """``"module -> name"`` for every project module that imports one of ``names`` (old module names
    kept as aliases), after checking each is still a file the import graph sees."""
    g = graph()
    old = set(names)
    assert old <= set(g), sorted(old - set(g))
    return sorted(f"{m} -> {t}" for m, ts in g.items() for t in ts if t in old)


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


def collapsed(g: dict, package: str) -> dict:
    """The graph of ``package``'s direct children (subpackages and modules, each taken whole: a
    subpackage stands for every module under it): ``{child: children it imports}``."""
    def child(m):
        rest = m[len(package) + 1:] if m.startswith(package + ".") else None
        return f"{package}.{rest.split('.')[0]}" if rest else None

    out = {}
    for m, targets in g.items():
        a = child(m)
        if a is not None:
            out.setdefault(a, set()).update(b for b in map(child, targets) if b not in (None, a))
    return out


def packages(g: dict) -> list:
    """Every package of the graph (a module with modules under it)."""
    return sorted(m for m in g if any(o.startswith(m + ".") for o in g))


def floor_of(module: str) -> int:
    """The index in ``PARITY_FLOORS`` of a module of parity."""
    if module in PARITY_ENTRY:
        return PARITY_FLOORS.index("entry")
    room = module.split(".")[1]
    return PARITY_FLOORS.index(room) if room in PARITY_FLOORS else 0


def up_a_floor(g: dict) -> list:
    """Imports in parity from a floor to one above it."""
    return sorted(f"{m} -> {t}" for m, ts in g.items() if m.split(".")[0] == "parity"
                  for t in ts if t.split(".")[0] == "parity" and floor_of(t) > floor_of(m))


def test_the_four_packages_have_no_import_cycle_even_through_function_level_imports():
    g = graph()
    assert {"kimi.checkpoint", "reference.model", "optimized.model", "parity.ops.kda"} <= set(g)
    assert "parity.ops" in g["parity.testing"] and "parity.registry" in g["parity.ops.kda"]
    assert cycles(g) == []


def test_dependencies_flow_from_kimi_to_reference_to_optimized_to_parity():
    g = graph()
    assert any(t.startswith("reference.") for t in g["optimized.model"])
    assert "kimi.checkpoint" in g["reference.model"]
    assert upward(g) == []


def test_kimi_imports_nothing_of_the_project_but_itself():
    g = graph()
    kimi = {m for m in g if m.split(".")[0] == "kimi"}
    assert {"kimi.checkpoint", "kimi.config", "kimi.synthetic"} <= kimi
    assert "kimi.tensors" in g["kimi.checkpoint"]   # its own modules are seen
    assert sorted(f"{m} -> {t}" for m in kimi for t in g[m] if t.split(".")[0] != "kimi") == []


def test_no_package_has_a_cycle_among_its_subpackages_and_modules():
    g = graph()
    assert {"parity", "parity.certify", "parity.diff", "parity.record", "parity.diff.engines"} <= set(packages(g))
    assert "parity.certify" in collapsed(g, "parity")["parity.cli"]   # a subpackage stands for its modules
    found = {p: cycles(collapsed(g, p)) for p in packages(g)}
    assert {p: c for p, c in found.items() if c} == {}


def test_parity_imports_only_down_its_floors():
    g = graph()
    assert floor_of("parity.certify.run") < floor_of("parity.record.watch.judge") < floor_of("parity.cli.certify")
    assert floor_of("parity.registry") == floor_of("parity.ops.kda") == 0
    assert up_a_floor(g) == []


def test_the_package_checks_see_a_cycle_of_subpackages_that_no_module_closes():
    g = {"p": set(), "p.a": set(), "p.a.x": {"p.b.y"}, "p.a.z": set(), "p.b": set(), "p.b.y": set(),
         "p.b.w": {"p.a.z"}}
    assert cycles(g) == []   # no cycle of modules
    assert cycles(collapsed(g, "p")) == [["p.a", "p.b"]]
    g = graph()
    g["parity.certify.check"] = g["parity.certify.check"] | {"parity.cli.args"}
    assert "parity.certify.check -> parity.cli.args" in up_a_floor(g)
    assert any({"parity.certify", "parity.cli"} <= set(c) for c in cycles(collapsed(g, "parity")))


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
    g["reference.executor"] = g["reference.executor"] | {"reference.weights"}
    assert any({"reference.executor", "reference.weights"} <= set(c) for c in cycles(g))
    g["reference.cache"] = g["reference.cache"] | {"optimized.model"}
    assert "reference.cache -> optimized.model" in upward(g)


def test_a_function_level_import_of_the_reference_in_kimi_is_an_upward_import():
    g = graph()
    source = "def f():\n    from reference.streamed import source_linear\n    return source_linear\n"
    g["kimi.checkpoint"] = g["kimi.checkpoint"] | imports(ast.parse(source), "kimi.checkpoint", False, set(g))
    assert upward(g) == ["kimi.checkpoint -> reference.streamed"]
    assert "kimi" in packages(g) and "kimi.checkpoint" in collapsed(g, "kimi")

"""Imports flow one way: transports and cluster above broker, broker above
storage and meta, nothing imports upward (docs/architecture.md, module map)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "narad"

# A package may import only packages of a lower rank (and itself).
RANK = {
    "errors": 0, "_native": 0, "BUILD": 0, "__version__": 0,
    "config": 1, "logs": 1, "metrics": 1,
    "ipc": 2, "storage": 2,
    "meta": 3,
    "broker": 4,
    "cluster": 5, "api": 5, "client": 5,
    "worker": 6, "cli": 6,
    "supervisor": 7,
    "ctl": 8,
}


def _imports() -> dict[tuple[str, str], set[str]]:
    """(package, file) -> the narad packages it imports."""
    out: dict[tuple[str, str], set[str]] = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT).with_suffix("").parts
        pkg = rel[0]
        found: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "narad":
                names = [f"narad.{a.name}" for a in node.names] if node.module == "narad" else [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "narad"]
            for n in names:
                parts = n.split(".")
                if len(parts) > 1 and parts[1] != pkg:
                    found.add(parts[1])
        out[(pkg, str(f.relative_to(ROOT)))] = found
    return out


def test_every_package_has_a_rank() -> None:
    pkgs = {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    mods = {p.stem for p in ROOT.glob("*.py") if p.stem != "__init__"}
    missing = (pkgs | mods) - RANK.keys()
    assert not missing, f"give these a place in the layering: {sorted(missing)}"


def test_no_upward_imports() -> None:
    bad = []
    for (pkg, path), deps in _imports().items():
        mine = RANK.get(pkg, 0) if pkg != "__init__" else 0
        for d in deps:
            if RANK.get(d, 99) >= mine and not (pkg == "__init__" and d in ("_native",)):
                bad.append(f"{path} imports narad.{d}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def _module_graph() -> dict[str, set[str]]:
    """narad module -> narad modules it imports (anywhere in the file, TYPE_CHECKING
    blocks and function-level imports included)."""
    mods = {".".join(("narad", *f.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
            for f in ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for f in ROOT.rglob("*.py"):
        me = ".".join(("narad", *f.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
        deps: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "narad":
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name.split(".")[0] == "narad"]
            deps |= {n for n in names if n in mods and n != me and n != "narad"}
        graph[me] = deps
    return graph


def test_no_import_cycles_between_modules() -> None:
    graph = _module_graph()
    assert graph.get("narad.supervisor.main"), "the graph must see imports"
    cycles: list[str] = []
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                cycles.append(" -> ".join([*stack[stack.index(d):], d]))
            elif d not in state:
                visit(d)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    assert not cycles, "import cycles:\n" + "\n".join(cycles)

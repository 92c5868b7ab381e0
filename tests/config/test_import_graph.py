"""No import cycles among the modules of rsearch_verl and retrieval_server, nor among their rooms.

The graph is read from the source with `ast` (nothing is imported): every `import` / `from ... import` counts, at
module level and inside functions alike, since a function-level import only hides a cycle until someone calls it.
An edge goes from a module to every package module it names (`from rsearch_verl.a import b` names rsearch_verl.a and,
when it exists, the submodule rsearch_verl.a.b). A package's `__init__` is the package's own node, so the edge that
Python adds from a submodule to its parent package (importing a.b runs a/__init__ first) is not a cycle by itself.

Rooms: each folder directly under a package (rsearch_verl/trainer/, with everything below it) and each module file
beside them (rsearch_verl/batch.py, retrieval_server/app.py) is one room. Rooms without cycles have a floor order in
which no import runs back up: the bottom floor (segments.py, batch.py, signals.py, formats.py, ...) imports nothing
above it, config/ sits on it, and so on up to main.py. Importing the package itself (`from rsearch_verl import x`
names rsearch_verl/__init__.py) is no edge between rooms.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("rsearch_verl", "retrieval_server")


def module_files() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool) -> list[str]:
    """The dotted names one import statement refers to (absolute; relative imports resolved against `module`)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    return [base, *(f"{base}.{alias.name}" for alias in node.names)]


def import_sites() -> dict[str, dict[str, list[int]]]:
    """module -> {package module it imports anywhere in its source: the lines that import it}."""
    files = module_files()
    sites: dict[str, dict[str, list[int]]] = {name: {} for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported(node, name, path.name == "__init__.py"):
                while target and target not in files:  # `a.b.func` -> module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    sites[name].setdefault(target, []).append(node.lineno)
    return sites


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source."""
    return {name: set(targets) for name, targets in import_sites().items()}


def room_of(path: Path) -> str:
    """The room of a source file: its folder directly under the package, or the file itself when it lies beside them."""
    parts = path.relative_to(ROOT).parts
    return "/".join(parts[:2]) if len(parts) > 2 else "/".join(parts)


def room_edges() -> dict[tuple[str, str], list[str]]:
    """(room, room it imports from) -> the `file:line` sites of those imports, function-level ones included."""
    files = module_files()
    packages = {ROOT / package / "__init__.py" for package in PACKAGES}
    edges: dict[tuple[str, str], list[str]] = {}
    for name, targets in import_sites().items():
        source = room_of(files[name])
        for target, lines in targets.items():
            if files[target] in packages or room_of(files[target]) == source:
                continue
            where = [f"{files[name].relative_to(ROOT)}:{line}" for line in lines]
            edges.setdefault((source, room_of(files[target])), []).extend(where)
    return edges


def room_cycles(edges: dict[tuple[str, str], list[str]]) -> list[str]:
    """One report per group of rooms that depend on each other: the rooms, then every edge between them with its
    import sites. Empty when the rooms have a floor order."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    reports = []
    for comp in strongly_connected(graph):
        group = set(comp)
        lines = [f"rooms that depend on each other: {', '.join(sorted(group))}"]
        for (a, b), where in sorted(edges.items()):
            if a in group and b in group:
                lines.append(f"  {a} -> {b}: {', '.join(sorted(set(where)))}")
        reports.append("\n".join(lines))
    return reports


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module, as a closed path."""
    return [_cycle_in(graph, set(comp)) for comp in strongly_connected(graph)]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                components.append(comp)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return components


def _cycle_in(graph: dict[str, set[str]], comp: set[str]) -> list[str]:
    """A shortest closed path through the component's smallest module (breadth-first back to it)."""
    start = min(comp)
    parents: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & comp):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(parents[path[-1]])
                    return [start, *reversed(path[:-1]), start] if len(path) > 1 else [start, v, start]
                if w not in parents:
                    parents[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


def test_graph_sees_function_level_and_relative_imports():
    graph = import_graph()
    assert len(graph) > 80 and "rsearch_verl.config" in graph and "retrieval_server.app" in graph
    # function-level imports count: the trainer session imports the training loop inside train()
    assert "rsearch_verl.trainer.loop" in graph["rsearch_verl.trainer.session"]
    # the cycle finder finds a planted cycle, also one hidden behind a function-level import
    planted = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(planted) == [["a", "b", "c", "a"]]
    source = "import os\ndef f():\n    from rsearch_verl.config import load_config\n"
    node = ast.parse(source).body[1].body[0]
    assert _imported(node, "rsearch_verl.x", False)[0] == "rsearch_verl.config"
    rel = ast.parse("from .engines import hf").body[0]
    engines = "rsearch_verl.rollout.engines"
    assert _imported(rel, "rsearch_verl.rollout", True) == [engines, f"{engines}.hf"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_rooms_are_read_from_the_source():
    edges = room_edges()
    # a function-level import is an edge: main.run imports the plots (eval/) inside the function, and only there
    assert ("rsearch_verl/main.py", "rsearch_verl/eval") in edges
    # a module deeper down belongs to its folder's room; importing the package itself is no edge
    assert ("rsearch_verl/trainer", "rsearch_verl/signals.py") in edges
    assert not any(b.endswith("__init__.py") for _, b in edges)
    planted = {("a", "b"): ["a.py:1"], ("b", "c"): ["b.py:2"], ("c", "a"): ["c.py:3"], ("d", "a"): ["d.py:4"]}
    assert room_cycles(planted) == [
        "rooms that depend on each other: a, b, c\n  a -> b: a.py:1\n  b -> c: b.py:2\n  c -> a: c.py:3"
    ]


def test_no_cycles_between_rooms():
    cycles = room_cycles(room_edges())
    assert not cycles, "\n".join(cycles)

"""No import cycles among the modules of rsearch_verl and retrieval_server.

The graph is read from the source with `ast` (nothing is imported): every `import` / `from ... import` counts, at
module level and inside functions alike, since a function-level import only hides a cycle until someone calls it.
An edge goes from a module to every package module it names (`from rsearch_verl.a import b` names rsearch_verl.a and,
when it exists, the submodule rsearch_verl.a.b). A package's `__init__` is the package's own node, so the edge that
Python adds from a submodule to its parent package (importing a.b runs a/__init__ first) is not a cycle by itself.
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


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its source."""
    files = module_files()
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported(node, name, path.name == "__init__.py"):
                while target and target not in files:  # `a.b.func` -> module a.b
                    target = target.rpartition(".")[0]
                if target and target != name:
                    graph[name].add(target)
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan), as a closed path."""
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
    return [_cycle_in(graph, set(comp)) for comp in components]


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

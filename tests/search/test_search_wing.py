"""The retriever wing (rsearch_verl/search/) stands on its own: none of its modules imports the rollout or the
trainer (the client, breaker, types, the embedded server's process and its supervisor are all here)."""

from __future__ import annotations

import ast
from pathlib import Path

import rsearch_verl.search

WING = Path(rsearch_verl.search.__file__).parent
FORBIDDEN = ("rsearch_verl.rollout", "rsearch_verl.trainer", "rsearch_verl.workers")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_search_imports_nothing_from_rollout_or_trainer():
    files = sorted(WING.rglob("*.py"))
    assert {"client.py", "breaker.py", "types.py", "service.py", "supervisor.py", "process.py"} <= {
        f.name for f in files
    }
    bad = {
        f"{f.relative_to(WING)} imports {name}"
        for f in files
        for name in imported_modules(f)
        if name.startswith(FORBIDDEN)
    }
    assert not bad, sorted(bad)

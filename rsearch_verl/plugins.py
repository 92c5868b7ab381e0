"""Plug-ins named by import path: wherever a recipe names an implementation (`rollout.engine`, ...), a name
`pkg.module:Class` picks a class outside the built-in table. The bottom floor: imports nothing of the package.

    is_import_path("my_pkg.engines:Echo")          # True
    cls = load_plugin("my_pkg.engines:Echo", "rollout.engine")   # ValueError naming the key when it cannot load
    check_import_path("my_pkg.engines:Echo", "rollout.engine")   # at config time: the module exists (not imported)
"""

from __future__ import annotations

import importlib
import importlib.util


def is_import_path(name: object) -> bool:
    return isinstance(name, str) and ":" in name


def _split(path: str, key: str) -> tuple[str, str]:
    module, _, attr = path.partition(":")
    if not module or not attr or not all(part.isidentifier() for part in [*module.split("."), *attr.split(".")]):
        raise ValueError(f"{key}: {path!r} is not an import path of the form pkg.module:Class")
    return module, attr


def check_import_path(path: str, key: str) -> None:
    """Raise ValueError naming `key` when `path` is malformed or its module cannot be found (nothing is imported)."""
    module, _ = _split(path, key)
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ValueError(f"{key}: module {module!r} of {path!r} is not importable (is its package installed?)")


def load_plugin(path: str, key: str):
    """The object `path` names (`pkg.module:Class`, attributes may be dotted); ValueError naming `key` if it can't."""
    module, attr = _split(path, key)
    try:
        obj = importlib.import_module(module)
    except ImportError as err:
        raise ValueError(f"{key}: cannot import {module!r} of {path!r}: {err}") from err
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{key}: {module!r} has no {attr!r} (from {path!r})")
        obj = getattr(obj, part)
    return obj

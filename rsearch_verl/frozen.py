"""Immutability for the validated config tree (rsearch_verl/config/): `freeze` makes a dataclass tree read-only in
place -- every node refuses assignments with a `ConfigError` naming the key, lists become tuples, mappings
`FrozenDict`s. `config.validate` calls it last. It imports nothing from the package.

    cfg = freeze(cfg)
    cfg.model.path = "x"    # ConfigError: model.path: the configuration is frozen after validation; ...
"""

from __future__ import annotations

import dataclasses
from typing import Any


class ConfigError(ValueError):
    """An impossible or inconsistent configuration; the message names the offending key."""


class FrozenDict(dict):
    """A read-only dict: the mappings of a frozen config (rollout.protocol_kwargs, reward.kwargs)."""

    def _refuse(self, *args, **kwargs):
        raise ConfigError(f"{self._key}: the configuration is frozen after validation")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = __ior__ = _refuse

    def __init__(self, items=(), key: str = "<mapping>"):
        super().__init__(items)
        object.__setattr__(self, "_key", key)

    def __reduce__(self):  # pickle / deepcopy (Ray) rebuild it through __init__, not item by item
        return (FrozenDict, (dict(self), self._key))


class ConfigNode:
    """Base of every config dataclass: once `freeze` has marked an instance, assigning a field raises ConfigError
    naming the key. dataclasses.replace builds a new, unfrozen instance (validate it to freeze it)."""

    def __setattr__(self, name: str, value: Any) -> None:
        key = self.__dict__.get("_frozen_at")
        if key is not None:
            raise ConfigError(
                f"{key + '.' if key else ''}{name}: the configuration is frozen after validation; set it in the "
                "recipe or as an override, or validate a changed copy (dataclasses.replace)"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        self.__setattr__(name, None)


def freeze(node: Any, key: str = "") -> Any:
    """Make a config tree immutable in place: lists become tuples, mappings FrozenDicts, and every dataclass node
    refuses assignments (ConfigError naming the key). Returns `node`."""
    for f in dataclasses.fields(node):
        name = f"{key}.{f.name}" if key else f.name
        object.__setattr__(node, f.name, _frozen_value(getattr(node, f.name), name))
    object.__setattr__(node, "_frozen_at", key)
    return node


def _frozen_value(value: Any, key: str) -> Any:
    if dataclasses.is_dataclass(value):
        return freeze(value, key)
    if isinstance(value, (list, tuple)):
        return tuple(_frozen_value(v, f"{key}[{i}]") for i, v in enumerate(value))
    if isinstance(value, dict):
        return FrozenDict(((k, _frozen_value(v, f"{key}.{k}")) for k, v in value.items()), key)
    return value

"""Search protocols, one file per paper, picked by YAML name with `get_protocol(name)`.

    proto = get_protocol("search_r1")      # search_r1 | research | r1_searcher | r_search | nl_dag | tool_call
    proto.stop_strings, proto.build_prompt(q), proto.parse_turn(text), await proto.observe(action, search, topk)

Modules are imported lazily so that `protocols.base` can be imported from anywhere (the search package
imports `Doc` from it) without pulling every protocol in.
"""

from __future__ import annotations

import importlib
from typing import Any

from rsearch_verl.rollout.protocols.base import Action, SearchProtocol

# YAML name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "search_r1": ("rsearch_verl.rollout.protocols.search_r1", "SearchR1Protocol"),
    "research": ("rsearch_verl.rollout.protocols.research", "ReSearchProtocol"),
    "r1_searcher": ("rsearch_verl.rollout.protocols.r1_searcher", "R1SearcherProtocol"),
    "r_search": ("rsearch_verl.rollout.protocols.r_search", "RSearchProtocol"),
    "nl_dag": ("rsearch_verl.rollout.protocols.nl_dag", "NLDagProtocol"),
    "tool_call": ("rsearch_verl.rollout.protocols.tool_call", "ToolCallProtocol"),
}


def protocol_names() -> list[str]:
    return sorted(_REGISTRY)


def get_protocol(name: str, **kwargs: Any) -> SearchProtocol:
    """A fresh protocol instance for its YAML name; keyword arguments go to the protocol's constructor."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown search protocol {name!r}; known: {', '.join(protocol_names())}")
    module_name, class_name = _REGISTRY[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    return cls(**kwargs)


__all__ = ["Action", "SearchProtocol", "get_protocol", "protocol_names"]

"""Search protocols: how a policy asks for search and how the results come back, picked by YAML name
(`rollout.protocol`).

    base.py          the interface: `SearchProtocol` (prompts, stop strings, turn parser, observation, `extract_answer`:
                     THE answer extractor) and `Action`
    tagged.py        `TagSearchProtocol`: the machinery every protocol below shares (query tag, observation tags,
                     `<answer>`); a protocol changes only its tags, templates, query parsing and document format
    search_r1.py, research.py, r1_searcher.py, r_search.py, nl_dag.py
                     one per paper: its prompts, parser, observation and demonstration formats
    tool_call.py     JSON tool calls through the model's chat template; call_formats.py: how each model family writes
                     a call (hermes, llama3_json)
    __init__.py      the registry (`_REGISTRY`) and the lookups below

Adding a protocol: one file here, one line in `_REGISTRY` and its name and constructor parameters in
rsearch_verl/choices.py (which the config validates against; `protocol_class` checks the two agree).

    proto = protocol_for(cfg)              # THE run's protocol (rollout.protocol + rollout.protocol_kwargs): built
                                           # once per process (driver, eval, each rollout worker) and handed down
    proto = get_protocol("search_r1")      # a protocol by name: search_r1 | research | r1_searcher | r_search |
                                           # nl_dag | tool_call (data preparation, demonstrations, the viewer)
    proto.stop_strings, proto.build_prompt(q), proto.parse_turn(text), await proto.observe(action, search, topk)

A protocol's module is imported when its name is first asked for, so importing this package (for `SearchProtocol` or
`protocol_for`) does not pull every protocol in.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from rsearch_verl.choices import PROTOCOL_KWARGS, check_parameters
from rsearch_verl.rollout.protocols.base import Action, SearchProtocol
from rsearch_verl.rollout.protocols.call_formats import FAMILY_FORMATS
from rsearch_verl.rollout.tools import build_tools

# YAML name -> (module, class)
_REGISTRY: dict[str, tuple[str, str]] = {
    "search_r1": ("rsearch_verl.rollout.protocols.search_r1", "SearchR1Protocol"),
    "research": ("rsearch_verl.rollout.protocols.research", "ReSearchProtocol"),
    "r1_searcher": ("rsearch_verl.rollout.protocols.r1_searcher", "R1SearcherProtocol"),
    "r_search": ("rsearch_verl.rollout.protocols.r_search", "RSearchProtocol"),
    "nl_dag": ("rsearch_verl.rollout.protocols.nl_dag", "NLDagProtocol"),
    "tool_call": ("rsearch_verl.rollout.protocols.tool_call", "ToolCallProtocol"),
}
if set(_REGISTRY) != set(PROTOCOL_KWARGS):
    raise ImportError(f"protocols registered {sorted(_REGISTRY)} != declared in rsearch_verl/choices.py")


def protocol_names() -> list[str]:
    return sorted(_REGISTRY)


def protocol_class(name: str) -> type[SearchProtocol]:
    """The protocol class registered under its YAML name (ValueError naming the known ones otherwise)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown search protocol {name!r}; known: {', '.join(protocol_names())}")
    module_name, class_name = _REGISTRY[name]
    cls = getattr(importlib.import_module(module_name), class_name)
    check_parameters(PROTOCOL_KWARGS, "protocol", name, list(inspect.signature(cls).parameters))
    return cls


def get_protocol(name: str, **kwargs: Any) -> SearchProtocol:
    """A fresh protocol instance for its YAML name; keyword arguments go to the protocol's constructor."""
    return protocol_class(name)(**kwargs)


def protocol_for(cfg) -> SearchProtocol:
    """The run's protocol: `rollout.protocol` built with `rollout.protocol_kwargs` (`cfg`: an RSearchConfig, not
    imported: the config validates its names against this registry). Call it once per process and hand the instance
    down (a protocol may hold per-tokenizer state: tool_call's observation frame).

    The model's conventions reach the protocol here, unless its kwargs say otherwise: `model.thinking` becomes the
    chat template's `enable_thinking` (every protocol's prompts and, for tool_call, its observation frames), the
    run's tools (`rollout.tools`, rsearch_verl/rollout/tools/) are bound (`bind_tools`), and
    tool_call's `call_format` follows `model.family` (llama3 -> llama3_json, qwen3_5 / qwen3_5_moe -> qwen3_xml,
    qwen2 / qwen3 -> hermes)."""
    kwargs = dict(cfg.rollout.protocol_kwargs)
    thinking = cfg.model.thinking if cfg.model.use_chat_template else None
    if cfg.rollout.protocol == "tool_call":
        if thinking is not None:
            kwargs.setdefault("enable_thinking", thinking)
        if cfg.model.family is not None:
            kwargs.setdefault("call_format", FAMILY_FORMATS.get(cfg.model.family, "hermes"))
    proto = get_protocol(cfg.rollout.protocol, **kwargs)
    proto.bind_tools(build_tools(list(cfg.rollout.tools)))  # rollout.tools: stop strings, prompts, declarations
    if thinking is not None and "enable_thinking" not in proto.chat_template_kwargs:
        proto.chat_template_kwargs = {**proto.chat_template_kwargs, "enable_thinking": thinking}
    return proto


__all__ = [
    "Action",
    "SearchProtocol",
    "get_protocol",
    "protocol_class",
    "protocol_for",
    "protocol_names",
]

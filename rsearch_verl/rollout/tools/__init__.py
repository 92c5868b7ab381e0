"""Tools: what the policy can call besides answering, one interface and one registry, picked by `rollout.tools`.

    base.py     the interface (`Tool`: name, description, JSON-schema `parameters`, async `call`, `render`,
                `observe`), `ToolContext`, `ToolError`, the registry (`TOOLS`, `register_tool`, `tool_class`,
                `build_tools`)
    search.py   `search`: the retriever's passages in the protocol's document format (every run has it)
    open.py     `open`: a whole document, one page at a time, by the id a search result showed

    tools = build_tools(cfg.rollout.tools)     # ["search", "open", "my_pkg.tools:Calculator"] -> Tool instances
    protocol.bind_tools(tools)                 # protocol_for(cfg) does this: stop strings, prompts, declarations

A built-in tool is one file here (decorated with `register_tool`), its import below and its name in
rsearch_verl/choices.py `TOOL_NAMES` (what the config validates); a user's tool is one file anywhere, named in YAML
by its import path (docs/research_agents.md has a worked example).
"""

from __future__ import annotations

from rsearch_verl.choices import TOOL_NAMES
from rsearch_verl.rollout.tools import open as _open  # noqa: F401 - registers "open"
from rsearch_verl.rollout.tools import search as _search  # noqa: F401 - registers "search"
from rsearch_verl.rollout.tools.base import TOOLS, Tool, ToolContext, ToolError, build_tools, register_tool, tool_class

if set(TOOLS) != set(TOOL_NAMES):
    raise ImportError(f"tools registered {sorted(TOOLS)} != declared in rsearch_verl/choices.py {sorted(TOOL_NAMES)}")

__all__ = ["TOOLS", "Tool", "ToolContext", "ToolError", "build_tools", "register_tool", "tool_class"]

"""The tool interface and the tool registry: what every action of the policy other than answering goes through.

A tool declares its name, a description and the JSON schema of its arguments (what the tool-call protocol hands the
chat template's `tools`), runs asynchronously through the trajectory's search handle (the run's `SearchClient` behind
its circuit breaker and the agent loop's per-trajectory counter: timeouts, bounded retries, outage accounting), and
renders its result as the body of an observation; the protocol wraps the body in its own observation tags.

    @register_tool                              # built-in tools; a plug-in is named by import path instead
    class Calculator(Tool):
        name = "calculator"
        description = "Evaluate an arithmetic expression."
        parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

        async def call(self, args, ctx):        # raise ToolError (the policy's fault) or SearchError (the backend's)
            return str(evaluate(args["expression"]))

        def render(self, result, args, ctx):   # the observation's body
            return result

    tool_class("open")                          # a registered class, or `pkg.module:Class` loaded by load_plugin
    body = await tool.observe(args, ctx)        # call + render; failures become text, never an exception

The tag protocols write a tool as `<name> body </name>` (`tag_arguments` turns the body into arguments: by default
the whole body is the one required string argument); the tool-call protocol as a JSON call naming the tool. The
built-in tools are `search` (rollout/tools/search.py) and `open` (rollout/tools/open.py); see docs/research_agents.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

from rsearch_verl.plugins import is_import_path, load_plugin
from rsearch_verl.search.client import SearchError

_JSON_TYPES: dict[str, tuple[type, ...]] = {
    "string": (str,),
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "array": (list,),
    "object": (dict,),
}


class ToolError(Exception):
    """A call the tool cannot answer for a reason that is not an outage (a bad argument, a capability this run lacks);
    its message is shown to the policy: "<tool> failed: <message>"."""


@dataclass
class ToolContext:
    """What a tool runs with, per call. `search`: the trajectory's search handle, `await search(queries, topk,
    source)`, and `await search.documents(ids, page, source)` (0-based page; SearchError when the backend serves no
    documents); `protocol`: the run's (its `format_docs`, `empty_results`, `source`); `show_doc_ids`: a tool of the
    run takes document ids, so search results show them."""

    search: Any
    topk: int
    protocol: Any
    show_doc_ids: bool = False


class Tool(ABC):
    """One tool of a run. Built once per process with no arguments; holds no per-trajectory state."""

    name: ClassVar[str] = ""  # what the policy calls it: the tag name and the JSON call's "name"
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}, "required": []}
    tag_syntax: ClassVar[str] = ""  # the body of `<name> … </name>` as prompts show it ("" = the one string argument)
    takes_doc_ids: ClassVar[bool] = False  # search results show document ids when a tool of the run takes them

    def declaration(self) -> dict[str, Any]:
        """The tool for the chat template's `tools` (OpenAI function format)."""
        fn = {"name": self.name, "description": self.description, "parameters": self.parameters}
        return {"type": "function", "function": fn}

    def syntax(self) -> str:
        """How the body of the tool's tag is written (prompts and corrective observations)."""
        return self.tag_syntax or " ".join(self.parameters.get("required", [])) or "..."

    def tag_arguments(self, body: str) -> dict[str, Any] | str:
        """The arguments of a tag body, or an error message. Default: the body (whitespace collapsed) is the value of
        the one required argument (a string)."""
        required = list(self.parameters.get("required", []))
        if len(required) != 1:
            raise NotImplementedError(
                f"tool {self.name!r} has {len(required)} required arguments: define tag_arguments"
            )
        value = " ".join(body.split())
        return {required[0]: value} if value else f"empty {required[0]}"

    def check_arguments(self, args: Any) -> str | None:
        """Why `args` do not fit `parameters` (required keys, property types, `additionalProperties: false`, integer
        `minimum`), or None when they do."""
        if not isinstance(args, dict):
            return f"the arguments of {self.name!r} must be a JSON object"
        props = self.parameters.get("properties", {})
        missing = [k for k in self.parameters.get("required", []) if k not in args]
        if missing:
            return f"{self.name!r} needs the argument(s) {', '.join(map(repr, missing))}"
        if self.parameters.get("additionalProperties") is False and set(args) - set(props):
            return f"{self.name!r} takes no argument(s) {', '.join(map(repr, sorted(set(args) - set(props))))}"
        for key, value in args.items():
            spec = props.get(key, {})
            kinds = _JSON_TYPES.get(spec.get("type", ""), (object,))
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                return f"argument {key!r} of {self.name!r} must be of type {spec['type']}"
            if "minimum" in spec and value < spec["minimum"]:
                return f"argument {key!r} of {self.name!r} must be >= {spec['minimum']}"
        return None

    @abstractmethod
    async def call(self, args: dict[str, Any], ctx: ToolContext) -> Any:
        """Run the tool on checked arguments; raise ToolError or SearchError when it cannot answer."""

    @abstractmethod
    def render(self, result: Any, args: dict[str, Any], ctx: ToolContext) -> str:
        """The observation body of a result (the protocol adds its tags)."""

    def render_error(self, exc: SearchError, args: dict[str, Any], ctx: ToolContext) -> str:
        """The observation body of a backend failure (after the client's retries)."""
        return f"{self.name} failed: {exc.short()}"

    async def observe(self, args: dict[str, Any], ctx: ToolContext) -> str:
        """Call, then render; a failure becomes its observation body."""
        try:
            result = await self.call(args, ctx)
        except ToolError as exc:
            return f"{self.name} failed: {exc}"
        except SearchError as exc:
            return self.render_error(exc, args, ctx)
        return self.render(result, args, ctx)


# YAML name -> class (the built-in tools register themselves; rollout/tools/__init__.py imports them)
TOOLS: dict[str, type[Tool]] = {}


def register_tool(cls: type[Tool]) -> type[Tool]:
    """Class decorator: register a built-in tool under its `name`."""
    if not (isinstance(cls, type) and issubclass(cls, Tool)) or not cls.name:
        raise TypeError(f"register_tool needs a Tool subclass with a name, got {cls!r}")
    if cls.name in TOOLS and TOOLS[cls.name] is not cls:
        raise ValueError(f"tool {cls.name!r} is already registered ({TOOLS[cls.name].__qualname__})")
    TOOLS[cls.name] = cls
    return cls


def tool_class(name: str) -> type[Tool]:
    """The class of a `rollout.tools` entry: a registered name, or a `pkg.module:Class` plug-in (a Tool subclass)."""
    if is_import_path(name):
        cls = load_plugin(name, "rollout.tools")
        if not (isinstance(cls, type) and issubclass(cls, Tool)) or not cls.name:
            raise ValueError(f"rollout.tools: {name!r} is not a Tool subclass with a name (rsearch_verl.rollout.tools)")
        return cls
    if name not in TOOLS:
        raise ValueError(f"rollout.tools: unknown tool {name!r}; known: {', '.join(sorted(TOOLS))} or pkg.module:Class")
    return TOOLS[name]


def build_tools(names: list[str] | tuple[str, ...]) -> list[Tool]:
    """The run's tools, in the order `rollout.tools` lists them; two tools of one name are an error."""
    tools = [tool_class(n)() for n in names]
    seen = [t.name for t in tools]
    dupes = sorted({n for n in seen if seen.count(n) > 1})
    if dupes:
        raise ValueError(f"rollout.tools: more than one tool named {', '.join(dupes)}")
    return tools

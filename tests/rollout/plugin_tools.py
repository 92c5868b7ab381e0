"""A user's tool outside the package (docs/research_agents.md's worked example): named in YAML by its import path,
`rollout.tools=[search,plugin_tools:Calculator]` (tests/rollout is on the tests' import path).

    <calculator> 2 * (3 + 4) </calculator>                                   ->  "2 * (3 + 4) = 14"
    {"name": "calculator", "arguments": {"expression": "2 * (3 + 4)"}}      (tool_call)
"""

from __future__ import annotations

import ast
import operator
from typing import Any

from rsearch_verl.rollout.tools import Tool, ToolContext, ToolError

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
}


def _evaluate(node: ast.AST) -> float:
    """Numbers and + - * / only (never `eval`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    raise ToolError("only numbers and + - * / ( ) are allowed")


class Calculator(Tool):
    name = "calculator"
    description = "Evaluate an arithmetic expression (numbers, + - * / and parentheses)."
    parameters = {
        "type": "object",
        "properties": {"expression": {"type": "string", "description": "e.g. 2 * (3 + 4)"}},
        "required": ["expression"],
    }

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> float:
        try:
            tree = ast.parse(args["expression"], mode="eval")
            return _evaluate(tree.body)
        except (SyntaxError, ZeroDivisionError) as exc:
            raise ToolError(f"cannot evaluate {args['expression']!r}: {exc.__class__.__name__}") from exc

    def render(self, result: float, args: dict[str, Any], ctx: ToolContext) -> str:
        value = int(result) if float(result).is_integer() else result
        return f"{args['expression']} = {value}"


class NotATool:
    """A class that does not implement the interface (rollout.tools must refuse it)."""

    name = "not_a_tool"

"""The `search` tool: the query goes to the run's retriever, the passages come back in the protocol's own document
format (`protocol.format_docs`), byte for byte what every protocol wrote before tools were pluggable.

    body = await SearchTool().observe({"query": "hamlet author"}, ctx)   # 'Doc 1(Title: "Hamlet") …' (search_r1)

`query` may also be a list (the tool-call protocol's `max_queries`): the passages of all queries, in order. When a
tool of the run takes document ids (`open`), each passage's title carries its document's id, `[id: <doc_id>]`, so
the policy can name it; otherwise the text is unchanged.
"""

from __future__ import annotations

from typing import Any

from rsearch_verl.rollout.tools.base import Tool, ToolContext, register_tool
from rsearch_verl.search.types import Doc


def with_doc_id(doc: Doc) -> Doc:
    """`doc` whose title shows its document's id (what `open` takes: `doc_id`, or `id` for an unchunked passage)."""
    key = doc.doc_id or doc.id
    titled = "\n" in doc.contents  # the corpus shape '"Title"\ntext'; otherwise the id goes before the text
    contents = f'"{doc.title} [id: {key}]"\n{doc.text}' if titled else f"[id: {key}] {doc.contents}"
    return Doc(id=doc.id, contents=contents, score=doc.score, source=doc.source, doc_id=doc.doc_id)


@register_tool
class SearchTool(Tool):
    name = "search"
    description = "Search the knowledge source; returns the top passages for the query."
    parameters = {
        "type": "object",
        "properties": {"query": {"type": "string", "description": "what to look up (a few keywords)"}},
        "required": ["query"],
    }
    tag_syntax = "query"

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> list[list[Doc]]:
        query = args["query"]
        queries = list(query) if isinstance(query, list) else [query]
        return await ctx.search(queries, ctx.topk, ctx.protocol.source)

    def render(self, result: list[list[Doc]], args: dict[str, Any], ctx: ToolContext) -> str:
        docs = [d for per_query in result for d in per_query]
        if ctx.show_doc_ids:
            docs = [with_doc_id(d) for d in docs]
        return ctx.protocol.format_docs(docs) if docs else ctx.protocol.empty_results

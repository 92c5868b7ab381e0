"""The `open` tool: read a whole document one page at a time, by the id a search result showed.

    <open> atlas 2 </open>                                          # tag protocols: id, then the page (optional)
    {"name": "open", "arguments": {"id": "atlas", "page": 2}}       # tool_call (Hermes; Llama 3: "parameters")

`id` is a document id as search returned it (`Doc.doc_id`, or `Doc.id` for a passage that is its own document;
search results show it as `[id: …]` when `open` is among `rollout.tools`). Pages are numbered from 1 (the policy's
count; the retrieval server's `POST /documents` counts from 0, converted here); without a page, page 1. The
observation is the page's text and ends with `page i of n`. A page's size is the retrieval server's
`--page-tokens` (whitespace words; there is no rollout key for it): keep it within `rollout.max_obs_length` tokens
or the page is cut with the truncation marker like any long observation.

Failures are observations, never exceptions: an unknown id names it, a page past the end says how many pages the
document has, an outage says `open failed: timeout` (and counts as one, like a failed search). A URL (`http://`,
`https://`) is fetched when `retriever.fetch.enable` is set (rsearch_verl/search/sources/fetch.py: the page as text,
paged by `retriever.fetch.page_tokens` words, rendered like a document; a failed fetch is `open failed: <why>`, no
outage); otherwise it answers "fetching URLs is not available in this run".
"""

from __future__ import annotations

import re
from typing import Any

from rsearch_verl.rollout.tools.base import Tool, ToolContext, ToolError, register_tool
from rsearch_verl.search.client import SearchError
from rsearch_verl.search.sources.fetch import fetch_config_of, process_fetch_source
from rsearch_verl.search.types import DocumentPage

URL_PREFIXES = ("http://", "https://")
_PAGES_IN_DETAIL = re.compile(r"\((\d+) pages?")  # the server's 422 detail: "... (3 pages: 0..2)"


@register_tool
class OpenTool(Tool):
    name = "open"
    description = (
        "Read a whole document, one page at a time: the id a search result showed ([id: ...]) and the page "
        "(numbered from 1; default 1)."
    )
    parameters = {
        "type": "object",
        "properties": {
            "id": {"type": "string", "description": "the document id a search result showed"},
            "page": {"type": "integer", "description": "the page to read, from 1 (default 1)", "minimum": 1},
        },
        "required": ["id"],
    }
    tag_syntax = "doc-id [page]"
    takes_doc_ids = True

    def tag_arguments(self, body: str) -> dict[str, Any] | str:
        """`doc-id [page]` (also `doc-id page N`): a last word of digits is the page; the rest is the id."""
        words = body.split()
        page = 1
        if len(words) > 1 and words[-1].isdigit():
            page = int(words.pop())
            if len(words) > 1 and words[-1].lower() == "page":
                words.pop()
        if not words:
            return "empty document id"
        return {"id": " ".join(words), "page": page}

    async def call(self, args: dict[str, Any], ctx: ToolContext) -> DocumentPage:
        doc_id, page = args["id"].strip(), int(args.get("page", 1))
        if not doc_id:
            raise ToolError("empty document id")
        if doc_id.lower().startswith(URL_PREFIXES):
            return await _fetch_url(doc_id, page, ctx)
        documents = getattr(ctx.search, "documents", None)
        if documents is None:
            raise ToolError("this run's search backend serves no documents")
        return (await documents([doc_id], page - 1, ctx.protocol.source))[0]

    def render(self, result: DocumentPage, args: dict[str, Any], ctx: ToolContext) -> str:
        head = f"Document {result.id} (Title: {result.title})"
        return f"{head}\n{result.text.strip()}\npage {result.page + 1} of {result.pages}"

    def render_error(self, exc: SearchError, args: dict[str, Any], ctx: ToolContext) -> str:
        doc_id, page = str(args.get("id", "")).strip(), int(args.get("page", 1))
        if exc.kind == "http_404":
            return f"open failed: no document {doc_id!r} (open takes the [id: ...] a search result showed)"
        if exc.kind == "http_422":
            found = _PAGES_IN_DETAIL.search(exc.message)
            pages = f" (it has {found.group(1)} pages: 1..{found.group(1)})" if found else ""
            return f"open failed: page {page} is past the end of document {doc_id!r}{pages}"
        if exc.kind == "config":
            return "open failed: this run's search backend serves no documents"
        return super().render_error(exc, args, ctx)


async def _fetch_url(url: str, page: int, ctx: ToolContext) -> DocumentPage:
    """Page `page` (from 1) of a web page, when the run's `retriever.fetch.enable` is set; a failure is a ToolError."""
    fetch_cfg = fetch_config_of(ctx.search)
    if fetch_cfg is None or not fetch_cfg.enable:
        raise ToolError("fetching URLs is not available in this run; open takes a document id a search showed")
    result = await process_fetch_source(fetch_cfg).fetch(url, page - 1)
    if result.page is None:
        raise ToolError(result.message)
    return result.page

"""The arXiv Atom API: `GET {base_url}/api/query?search_query=all:<q>&start=0&max_results=k`.

Each Atom `<entry>` becomes a Doc `'"title"\\nabstract'` with the entry id (abs URL) as id; parsed with
`xml.etree`. `base_url` is configurable so tests point it at a local fake server.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET

import httpx

from rsearch_verl.search.sources.base import Source, SourceResponseError, make_title_doc
from rsearch_verl.search.types import Doc

ARXIV_URL = "https://export.arxiv.org"
_ATOM = "{http://www.w3.org/2005/Atom}"


def parse_atom(xml_text: str, topk: int) -> list[Doc]:
    """Docs from an arXiv Atom feed (at most `topk`)."""
    try:
        root = ET.fromstring(xml_text)
    except ET.ParseError as exc:
        raise SourceResponseError(f"arXiv answer is not valid XML: {exc}") from exc
    docs = []
    for entry in root.findall(f"{_ATOM}entry")[:topk]:
        doc_id = (entry.findtext(f"{_ATOM}id") or "").strip()
        title = entry.findtext(f"{_ATOM}title") or ""
        summary = " ".join((entry.findtext(f"{_ATOM}summary") or "").split())
        docs.append(make_title_doc(doc_id, title, summary, 0.0, "arxiv"))
    return docs


class ArxivSource(Source):
    """One query per request; the whole query goes to the `all:` field."""

    name = "arxiv"
    batched = False

    def __init__(self, base_url: str = ARXIV_URL):
        self.base_url = base_url.rstrip("/")

    async def search(self, http: httpx.AsyncClient, queries: list[str], topk: int, timeout_s: float) -> list[list[Doc]]:
        if len(queries) != 1:
            raise ValueError("ArxivSource takes one query per request")
        params = {"search_query": f"all:{queries[0]}", "start": 0, "max_results": int(topk)}
        resp = await http.get(f"{self.base_url}/api/query", params=params, timeout=timeout_s)
        resp.raise_for_status()
        return [parse_atom(resp.text, topk)]

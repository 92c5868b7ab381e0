"""Whole documents beside the passage index: chunking a document into passages, paging it, and its SQLite store.

A corpus line `{"id", "contents": "\"Title\"\ntext"}` is a document. `build --chunk-tokens N` (N > 0) splits its text
into passages of at most N tokens (`chunk_document`), each `{"id": "<doc id>#<k>", "contents": "\"Title\"\n<part>",
"doc_id": "<doc id>"}`; N = 0 keeps the line itself as the one passage (the index as before chunking existed).

Tokens are whitespace-separated words (`str.split()` words), for chunking and paging alike: encoder-independent (a BM25
and a MiniLM index over one corpus cut it at the same places), needs no model at serve time, and is what the policy's
`--page-tokens` budget is easiest to reason about in. A subword encoder sees about 1.3 tokens per English word.

`documents.sqlite` (in the index directory) holds one row per document: `id` (primary key), `contents` (the whole
text; NULL when unchunked, where the document is its passage and its text is read from the passage store instead of
being stored twice), `row` (its first passage's row) and `n_passages`. SQLite reads one document per lookup, so a large
corpus is served without loading its documents into memory.

Usage:
    with DocumentWriter("idx/documents.sqlite", chunk_tokens=128) as w:
        w.add(rec, row=0, n_passages=3, where="corpus.jsonl:1")
    docs = DocumentStore.open("idx/documents.sqlite", passages=corpus_store)
    page_text, pages = paginate(docs.get(["doc7"])["doc7"], page=0, page_tokens=512)
"""

from __future__ import annotations

import logging
import os
import re
import sqlite3
import threading
import urllib.parse
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DOCUMENTS_FILE = "documents.sqlite"
WORD = re.compile(r"\S+")
_SCHEMA = (
    "CREATE TABLE documents (id TEXT PRIMARY KEY, contents TEXT, row INTEGER NOT NULL, n_passages INTEGER NOT NULL)",
    "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER NOT NULL)",
)


class PageOutOfRange(ValueError):
    """A page number at or past a document's last page (`pages` says how many it has)."""

    def __init__(self, page: int, pages: int):
        super().__init__(f"page {page} out of range: the document has {pages} page(s), 0..{pages - 1}")
        self.page, self.pages = page, pages


def split_title(contents: str) -> tuple[str, str]:
    """`'"Title"\\ntext'` -> (`'"Title"\\n'`, `'text'`); contents without a newline are all text (no title)."""
    head, sep, body = contents.partition("\n")
    return (head + sep, body) if sep else ("", contents)


def chunk_document(rec: dict, chunk_tokens: int) -> list[dict]:
    """The passages of one document: its text cut into ceil(words / chunk_tokens) parts of near-equal word counts
    (each at most `chunk_tokens` words, so no tiny tail passage), each prefixed with the document's title line."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    head, body = split_title(rec["contents"])
    spans = [m.span() for m in WORD.finditer(body)]
    n_parts = max(1, -(-len(spans) // chunk_tokens))
    out = []
    for k in range(n_parts):
        a, b = k * len(spans) // n_parts, (k + 1) * len(spans) // n_parts
        text = body[spans[a][0] : spans[b - 1][1]] if b > a else ""
        out.append({"id": f"{rec['id']}#{k}", "contents": head + text, "doc_id": rec["id"]})
    return out


def paginate(contents: str, page: int, page_tokens: int) -> tuple[str, int]:
    """(page `page` of a document as `'"Title"\\n<text of the page>'`, the document's page count). Pages hold
    `page_tokens` words each (the last one fewer); a document without words has one empty page.

    A page runs from the start of its first word to the start of the next page's first word, so the pages put back
    together are the document's text exactly (whitespace and newlines included)."""
    if page_tokens < 1:
        raise ValueError(f"page_tokens must be >= 1, got {page_tokens}")
    head, body = split_title(contents)
    starts = [m.start() for m in WORD.finditer(body)]
    pages = max(1, -(-len(starts) // page_tokens))
    if not 0 <= page < pages:
        raise PageOutOfRange(page, pages)
    begin = 0 if page == 0 else starts[page * page_tokens]  # leading whitespace belongs to the first page
    end = len(body) if page == pages - 1 else starts[(page + 1) * page_tokens]
    return head + body[begin:end], pages


class DocumentWriter:
    """Writes `documents.sqlite` under a temporary name and moves it into place on a clean exit (so the file exists
    only when complete); a failed build removes the temporary file."""

    def __init__(self, path: str | Path, chunk_tokens: int):
        self.path = Path(path)
        self.tmp = self.path.with_name(self.path.name + ".tmp")
        self.chunk_tokens = chunk_tokens
        self.n_documents = 0
        self.duplicates = 0
        self._db: sqlite3.Connection | None = None

    def __enter__(self) -> DocumentWriter:
        self.tmp.unlink(missing_ok=True)
        self._db = sqlite3.connect(self.tmp)
        # a build writes the file once from scratch: no journal, no fsync per transaction (a crash leaves the .tmp)
        self._db.execute("PRAGMA journal_mode=OFF")
        self._db.execute("PRAGMA synchronous=OFF")
        for statement in _SCHEMA:
            self._db.execute(statement)
        return self

    def add(self, rec: dict, row: int, n_passages: int, where: str) -> None:
        """Record document `rec` whose passages are rows [row, row + n_passages) of the passage store."""
        assert self._db is not None, "DocumentWriter used outside its `with` block"
        contents = rec["contents"] if self.chunk_tokens else None
        cur = self._db.execute(
            "INSERT OR IGNORE INTO documents VALUES (?, ?, ?, ?)", (rec["id"], contents, row, n_passages)
        )
        if cur.rowcount == 1:
            self.n_documents += 1
            return
        if self.chunk_tokens:  # its passages' ids `<id>#k` would collide with the first document's
            raise ValueError(f"{where}: duplicate document id {rec['id']!r} (ids must be unique with --chunk-tokens)")
        self.duplicates += 1  # unchunked: the passages are indexed as before; /documents answers with the first

    def __exit__(self, exc_type: Any, *_exc: Any) -> None:
        assert self._db is not None
        db, self._db = self._db, None
        try:
            if exc_type is None:
                meta = {"n_documents": self.n_documents, "chunk_tokens": self.chunk_tokens}
                db.executemany("INSERT INTO meta VALUES (?, ?)", list(meta.items()))
                db.commit()
        finally:
            db.close()
        if exc_type is not None:
            self.tmp.unlink(missing_ok=True)
            return
        if self.duplicates:
            logger.warning("%d corpus lines repeat an earlier document id (/documents: the first)", self.duplicates)
        os.replace(self.tmp, self.path)


class DocumentStore:
    """Read side of `documents.sqlite`: `get(ids)` from any thread (one read-only connection per thread)."""

    def __init__(self, path: str | Path, passages: Any, meta: dict[str, int]):
        self.path = Path(path)
        self.passages = passages  # the CorpusStore: the text of an unchunked document is its passage's
        self.n_documents = int(meta["n_documents"])
        self.chunk_tokens = int(meta["chunk_tokens"])
        self._local = threading.local()

    @classmethod
    def open(cls, path: str | Path, passages: Any) -> DocumentStore:
        db = _connect_read_only(Path(path))
        try:
            meta = dict(db.execute("SELECT key, value FROM meta").fetchall())
        finally:
            db.close()
        return cls(path, passages, meta)

    def _connection(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = _connect_read_only(self.path)
        return db

    def get(self, ids: list[str]) -> dict[str, str]:
        """`{id: whole contents}` of the documents among `ids` that exist (unknown ids are simply absent)."""
        unique = list(dict.fromkeys(ids))
        marks = ",".join("?" * len(unique))
        sql = f"SELECT id, contents, row FROM documents WHERE id IN ({marks})"  # noqa: S608 (placeholders only)
        found = {}
        for doc_id, contents, row in self._connection().execute(sql, unique):
            found[doc_id] = contents if contents is not None else self.passages.get([row])[0]["contents"]
        return found


def _connect_read_only(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise FileNotFoundError(f"no document store at {path}")
    # immutable: the file never changes while served, so SQLite takes no locks and reads no journal
    return sqlite3.connect(f"file:{urllib.parse.quote(str(path.resolve()))}?mode=ro&immutable=1", uri=True)

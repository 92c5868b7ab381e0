"""The web page source of the `open` tool: a URL becomes text, paged like a document of our retrieval server.

    src = FetchSource(cfg.retriever.fetch)            # one per process: process_fetch_source(cfg.retriever.fetch)
    res = await src.fetch("https://example.org/a", page=0)
    res.ok, res.page        # True, DocumentPage(id=URL, contents='"Title"\\ntext', page, pages)
    res.kind, res.message   # a failure: "http_404", "https://example.org/a answered HTTP 404 Not Found"
    await src.aclose()

One shared `httpx.AsyncClient` (rebound to each new event loop, as `SearchClient` does) fetches with a deadline of
`timeout_s` on the whole request (connect, redirects, body), at most `max_redirects` redirects, and a body streamed
until `max_bytes` and no further. Only `text/html`, `application/xhtml+xml` and `text/plain` are read; HTML becomes
text with inscriptis (scripts and styles dropped, headings, lists and table cells kept). Pages hold `page_tokens`
whitespace words, cut by the retrieval server's own `paginate` (retrieval_server/documents.py, stdlib only), so
`open` renders a web page and a corpus document alike ("page i of n").

Nothing here raises for a bad page: every failure is a `FetchResult` with a `kind` and a one-line `message` fit for
the policy's observation (pages counted from 1, as the policy counts them). Kinds: `bad_url` (malformed, no host),
`unsupported_scheme` (not http / https), `http_<status>`, `timeout`, `connection`, `too_many_redirects`,
`content_type`, `too_large`, `bad_content` (undecodable HTML), `page_out_of_range`. Timeouts and HTTP 5xx are retried
up to `max_retries` times with a short backoff; nothing else is. The text of the last fetched URLs is cached (LRU), so
reading page 2 after page 1 costs no second request.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import json
import logging
import re

import httpx
from inscriptis import Inscriptis
from inscriptis.model.config import ParserConfig
from lxml.etree import ParserError
from lxml.html import document_fromstring

from retrieval_server.documents import PageOutOfRange, paginate
from rsearch_verl.config.schema import FetchConfig, RetrieverConfig
from rsearch_verl.search.types import DocumentPage

logger = logging.getLogger(__name__)

TEXT_TYPES = ("text/html", "application/xhtml+xml", "text/plain")
HTML_TYPES = ("text/html", "application/xhtml+xml")
SCHEMES = ("http", "https")
_XML_DECLARATION = re.compile(r"^\s*<\?xml[^>]*\?>")
_BLANK_LINES = re.compile(r"\n{3,}")
_TRAILING_SPACE = re.compile(r"[ \t]+\n")


@dataclasses.dataclass(frozen=True)
class FetchResult:
    """A fetched page (`page` set, `kind` None) or a failure (`kind` and `message` set, `page` None)."""

    url: str
    page: DocumentPage | None = None
    kind: str | None = None
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.kind is None


class _Failure(Exception):
    """One failed attempt: its kind, the policy-facing message and whether another attempt may succeed."""

    def __init__(self, kind: str, message: str, retryable: bool = False):
        super().__init__(message)
        self.kind, self.message, self.retryable = kind, message, retryable


def check_url(url: str) -> _Failure | None:
    """Why `url` cannot be fetched before any request is made (malformed, no host, a scheme other than http(s))."""
    if not url or any(ch.isspace() or ord(ch) < 32 for ch in url):
        return _Failure("bad_url", f"{url!r} is not a valid URL (it is empty or contains spaces)")
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        return _Failure("bad_url", f"{url!r} is not a valid URL ({exc})")
    if parsed.scheme not in SCHEMES:
        scheme = parsed.scheme or "none"
        return _Failure("unsupported_scheme", f"only http:// and https:// URLs can be fetched, not {scheme!r}: {url}")
    if not parsed.host:
        return _Failure("bad_url", f"{url!r} is not a valid URL (no host)")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return _Failure("bad_url", f"{url!r} is not a valid URL (port {parsed.port})")
    return None


def html_to_text(html: str, fallback_title: str) -> tuple[str, str]:
    """(title, text) of an HTML page: its <title> (else `fallback_title`) and inscriptis' rendering of the body
    (scripts, styles and the head dropped; block elements on their own lines; table cells in rows)."""
    html = _XML_DECLARATION.sub("", html, count=1).strip()
    if not html:
        return fallback_title, ""
    try:
        tree = document_fromstring(html)
    except (ParserError, ValueError) as exc:
        raise _Failure("bad_content", f"the HTML could not be parsed ({exc})") from exc
    title = " ".join((tree.findtext(".//title") or "").split()) or fallback_title
    text = Inscriptis(tree, ParserConfig(display_links=False, display_images=False)).get_text()
    return title, tidy(text)


def tidy(text: str) -> str:
    """Trailing spaces off every line and runs of blank lines cut to one (the words, and so the pages, unchanged)."""
    return _BLANK_LINES.sub("\n\n", _TRAILING_SPACE.sub("\n", text.replace("\r\n", "\n"))).strip()


def page_of(url: str, title: str, text: str, page: int, page_tokens: int) -> FetchResult:
    """Page `page` (0-based) of the fetched text as the DocumentPage `open` renders, or `page_out_of_range`."""
    title = title.replace('"', "'")
    try:
        contents, pages = paginate(f'"{title}"\n{text}', page, page_tokens)
    except PageOutOfRange as exc:
        message = f"page {page + 1} is past the end of {url} (it has {exc.pages} page(s): 1..{exc.pages})"
        return FetchResult(url, kind="page_out_of_range", message=message)
    return FetchResult(url, page=DocumentPage(id=url, contents=contents, page=page, pages=pages))


class FetchSource:
    """Fetches web pages as text (see the module docstring). Create it once per process; it binds to the running event
    loop lazily. `trust_env`: whether httpx reads proxy settings from the environment."""

    def __init__(
        self,
        cfg: FetchConfig,
        *,
        max_concurrency: int = 16,
        backoff_s: float = 0.1,
        cache_size: int = 32,
        trust_env: bool = True,
    ):
        self.cfg = cfg
        self.max_concurrency = max_concurrency
        self.backoff_s = backoff_s
        self.trust_env = trust_env
        self.counts = {"fetches": 0, "requests": 0, "retries": 0, "errors": 0, "cache_hits": 0}
        self._cache: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self._cache_size = cache_size
        self._loop: asyncio.AbstractEventLoop | None = None
        self._http: httpx.AsyncClient | None = None
        self._sem: asyncio.Semaphore | None = None

    async def fetch(self, url: str, page: int = 0) -> FetchResult:
        """Page `page` (0-based) of the text at `url`, or the failure (never raises for anything the page does)."""
        url = url.strip()
        self.counts["fetches"] += 1
        try:
            if page < 0:
                raise _Failure("page_out_of_range", f"page {page + 1} does not exist (pages count from 1)")
            failure = check_url(url)
            if failure is not None:
                raise failure
            title, text = await self._text(url)
        except _Failure as exc:
            self.counts["errors"] += 1
            logger.info("fetch %s failed: %s: %s", url, exc.kind, exc.message)
            return FetchResult(url, kind=exc.kind, message=exc.message)
        result = page_of(url, title, text, page, self.cfg.page_tokens)
        self.counts["errors"] += int(not result.ok)
        return result

    async def aclose(self) -> None:
        """Close the connection pool (reopened on the next fetch)."""
        http, self._http = self._http, None
        if http is not None and self._loop is asyncio.get_running_loop():
            await http.aclose()

    # ---- internals --------------------------------------------------------------------------------------------
    def _bind_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if loop is not self._loop or self._http is None:
            self._loop = loop
            self._http = httpx.AsyncClient(
                timeout=self.cfg.timeout_s,
                follow_redirects=True,
                max_redirects=self.cfg.max_redirects,
                limits=httpx.Limits(max_connections=self.max_concurrency),
                trust_env=self.trust_env,
                headers={"Accept": ", ".join(TEXT_TYPES)},
                event_hooks={"request": [self._guard]},  # every request, each redirect's too
            )
            self._sem = asyncio.Semaphore(self.max_concurrency)

    async def _guard(self, request: httpx.Request) -> None:
        """Refuse a request (a redirect's too) to an address that is not public -- loopback, private, link-local
        (cloud metadata), reserved -- unless `cfg.allow_private`: the policy must not reach the run's own services."""
        if self.cfg.allow_private:
            return
        host = request.url.host
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(host, request.url.port or 443)
        except OSError as exc:
            raise _Failure("connection", f"could not resolve {host} ({exc})") from exc
        for info in infos:
            address = ipaddress.ip_address(info[4][0].split("%")[0])
            if not address.is_global:
                raise _Failure("blocked_address", f"{request.url} resolves to {address}, which is not a public address")

    async def _text(self, url: str) -> tuple[str, str]:
        """(title, text) of `url`: from the cache, else downloaded with bounded retries and converted."""
        hit = self._cache.get(url)
        if hit is not None:
            self._cache.move_to_end(url)
            self.counts["cache_hits"] += 1
            return hit
        media_type, body = await self._download_with_retries(url)
        if media_type in HTML_TYPES:
            title, text = html_to_text(body, fallback_title=url)
        else:
            title, text = url, tidy(body)
        self._cache[url] = (title, text)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return title, text

    async def _download_with_retries(self, url: str) -> tuple[str, str]:
        """`_download` retried on timeouts and HTTP 5xx, at most `cfg.max_retries` times (exponential backoff)."""
        self._bind_loop()
        assert self._sem is not None
        for attempt in range(self.cfg.max_retries + 1):
            try:
                async with self._sem:
                    self.counts["requests"] += 1
                    return await self._download(url)
            except _Failure as exc:
                if not exc.retryable or attempt == self.cfg.max_retries:
                    raise
                self.counts["retries"] += 1
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable: the last attempt returns or raises")

    async def _download(self, url: str) -> tuple[str, str]:
        """One request, redirects followed, under one deadline of `cfg.timeout_s`: (media type, decoded body)."""
        assert self._http is not None
        try:
            async with asyncio.timeout(self.cfg.timeout_s):
                async with self._http.stream("GET", url) as response:
                    media_type = _checked(response, url, self.cfg.max_bytes)
                    body = await _read_capped(response, url, self.cfg.max_bytes)
                    return media_type, _decode(body, response.charset_encoding)
        except TimeoutError as exc:
            raise _Failure("timeout", f"{url} did not answer within {self.cfg.timeout_s:g} s", True) from exc
        except httpx.TimeoutException as exc:
            raise _Failure("timeout", f"{url} did not answer within {self.cfg.timeout_s:g} s", True) from exc
        except httpx.TooManyRedirects as exc:
            message = f"{url} redirected more than {self.cfg.max_redirects} time(s)"
            raise _Failure("too_many_redirects", message) from exc
        except (httpx.UnsupportedProtocol, httpx.InvalidURL) as exc:
            raise _Failure("bad_url", f"{url} led to a URL that cannot be fetched ({exc})") from exc
        except httpx.TransportError as exc:
            reason = _reason(exc)
            raise _Failure("connection", f"could not connect to {url} ({reason})") from exc


def _checked(response: httpx.Response, url: str, max_bytes: int) -> str:
    """The response's media type once its status, Content-Type and Content-Length pass; else the failure."""
    status = response.status_code
    if not 200 <= status < 300:
        reason = f" {response.reason_phrase}" if response.reason_phrase else ""
        raise _Failure(f"http_{status}", f"{url} answered HTTP {status}{reason}", retryable=status >= 500)
    media_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if media_type not in TEXT_TYPES:
        what = media_type or "of no declared type"
        raise _Failure("content_type", f"{url} is {what}, not a web page ({', '.join(TEXT_TYPES)} can be read)")
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _Failure("too_large", f"{url} is {int(declared):,} bytes, more than the {max_bytes:,} that are read")
    return media_type


async def _read_capped(response: httpx.Response, url: str, max_bytes: int) -> bytes:
    """The body, streamed; past `max_bytes` the download stops and the page is `too_large`."""
    chunks, size = [], 0
    async for chunk in response.aiter_bytes():
        size += len(chunk)
        if size > max_bytes:
            raise _Failure("too_large", f"{url} is more than the {max_bytes:,} bytes that are read")
        chunks.append(chunk)
    return b"".join(chunks)


def _decode(body: bytes, charset: str | None) -> str:
    """The body as text in its declared charset (UTF-8 when none or an unknown one), bad bytes replaced."""
    try:
        return body.decode(charset or "utf-8", errors="replace")
    except LookupError:
        return body.decode("utf-8", errors="replace")


def _reason(exc: httpx.TransportError) -> str:
    text = str(exc) or type(exc).__name__
    if "refused" in text.lower() or "errno 111" in text.lower():
        return "connection refused"
    return text[:160]


def fetch_config_of(search: object) -> FetchConfig | None:
    """The `retriever.fetch` config behind a trajectory's search handle (CountingSearch -> CircuitBreaker ->
    SearchClient: the first `.cfg` that is a RetrieverConfig along the `.search` chain), or None (a plain SearchFn)."""
    obj = search
    for _ in range(8):  # the handle is a short chain of wrappers; never loop on a cyclic one
        cfg = getattr(obj, "cfg", None)
        if isinstance(cfg, RetrieverConfig):
            return cfg.fetch
        obj = getattr(obj, "search", None)
        if obj is None:
            return None
    return None


_PROCESS_FETCH: dict[str, FetchSource] = {}


def process_fetch_source(cfg: FetchConfig) -> FetchSource:
    """The process's one FetchSource for this config (its connection pool and cache shared by every batch)."""
    key = json.dumps(dataclasses.asdict(cfg), sort_keys=True)
    if key not in _PROCESS_FETCH:
        _PROCESS_FETCH[key] = FetchSource(cfg)
    return _PROCESS_FETCH[key]

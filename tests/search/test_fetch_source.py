"""The `open` tool's web pages (rsearch_verl/search/sources/fetch.py) against a real HTTP server of ours on 127.0.0.1.

The server (http.server in a thread, one per module) serves a realistic article (nav, scripts, styles, headings, a list
and a table), a long page that pages, 404 / 500 / flaky 503, a slow page, a slow drip, 10 MB pages (declared and
streamed), a PNG, a redirect loop and a redirect chain. Every failure must come back as a FetchResult (kind + message)
or an `open failed: ...` observation, the server must stay up, and every test is bounded (timeouts of a fraction of a
second, retries at most 1, the slow handlers cut short when the module ends).

    .venv/bin/python -m pytest -q tests/search/test_fetch_source.py
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rsearch_verl.config.schema import FetchConfig, RetrieverConfig
from rsearch_verl.rollout.agent_loop import CountingSearch
from rsearch_verl.rollout.protocols import get_protocol
from rsearch_verl.rollout.tools import build_tools
from rsearch_verl.search.client import SearchClient
from rsearch_verl.search.sources.fetch import FetchSource, fetch_config_of, html_to_text

pytestmark = pytest.mark.timeout(20)

ARTICLE = """<!DOCTYPE html>
<html lang="en"><head>
<meta charset="utf-8"><title>Atlas moth - Encyclopedia of Moths</title>
<style>body { font-family: sans-serif; color: #333 } .nav a { margin: 0 4px }</style>
<script>var tracker = "utm-beacon"; window.dataLayer = [];</script>
<script type="application/ld+json">{"@type": "Article", "headline": "jsonld-headline"}</script>
</head><body>
<nav class="nav"><a href="/">Home</a> <a href="/moths">Moths</a> <a href="/about">About</a></nav>
<main>
<h1>The Atlas moth</h1>
<p>The <b>Atlas moth</b> (<i>Attacus atlas</i>) is a large saturniid moth endemic to the forests of Asia.</p>
<h2>Description</h2>
<ul><li>Wings of reddish brown</li><li>Snake-head pattern on the forewing tips</li></ul>
<table><thead><tr><th>Measure</th><th>Value</th></tr></thead>
<tbody><tr><td>Wingspan</td><td>25 to 30 cm</td></tr><tr><td>Lifespan</td><td>one to two weeks</td></tr></tbody></table>
<h2>Life cycle</h2><p>Adults do not feed and live on the fat stored as caterpillars.</p>
</main>
<footer>Copyright the encyclopedia</footer>
<script>document.write("late-script-text")</script>
</body></html>"""
LONG_WORDS = [f"w{i}" for i in range(1300)]
LONG_PAGE = "<html><head><title>Long</title></head><body><p>" + " ".join(LONG_WORDS) + "</p></body></html>"
PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 8
BIG = 10 * 1024 * 1024
STOP = threading.Event()  # set at module end: slow handlers return at once


class _Handler(BaseHTTPRequestHandler):
    """GET routes of the test site; HTTP/1.0 (a body without Content-Length runs until the connection closes)."""

    hits: Counter = Counter()
    lock = threading.Lock()

    def log_message(self, *args):  # the test output stays quiet
        pass

    def _send(self, status: int, body: bytes, ctype: str | None = "text/html; charset=utf-8", length: bool = True):
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        if length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, where: str):
        self.send_response(302)
        self.send_header("Location", where)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self):  # noqa: N802 - the http.server hook's name
        path = self.path.split("?")[0]
        with self.lock:
            self.hits[path] += 1
            n = self.hits[path]
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client stopped reading: expected
            self._route(path, n)

    def _route(self, path: str, n: int):  # noqa: C901 - a flat route table
        if path == "/article":
            self._send(200, ARTICLE.encode())
        elif path == "/long":
            self._send(200, LONG_PAGE.encode())
        elif path == "/plain":
            self._send(200, b"line one\nline two of plain text\n", "text/plain")
        elif path == "/xhtml":
            body = b'<?xml version="1.0"?><html xmlns="http://www.w3.org/1999/xhtml"><p>xhtml body</p></html>'
            self._send(200, body, "application/xhtml+xml")
        elif path == "/latin1":
            self._send(200, "<p>caf\u00e9 cr\u00e8me</p>".encode("latin-1"), "text/html; charset=iso-8859-1")
        elif path == "/missing":
            self._send(404, b"<h1>Not here</h1>")
        elif path == "/broken":
            self._send(500, b"<h1>Oops</h1>")
        elif path == "/flaky":
            self._send(503, b"busy") if n == 1 else self._send(200, b"<p>second try works</p>")
        elif path == "/slow":
            STOP.wait(3.0)
            self._send(200, b"<p>too late</p>")
        elif path == "/drip":  # a byte every 50 ms: each read is quick, the whole page never is
            self._send_drip()
        elif path == "/big":
            self._send(200, b"a" * BIG)
        elif path == "/big-stream":
            self._send_stream(BIG)
        elif path == "/image.png":
            self._send(200, PNG, "image/png")
        elif path == "/untyped":
            self._send(200, b"<p>no type</p>", ctype=None)
        elif path == "/loop":
            self._redirect("/loop")
        elif path.startswith("/chain/"):
            left = int(path.rsplit("/", 1)[1])
            self._redirect(f"/chain/{left - 1}") if left > 0 else self._send(200, b"<p>end of the chain</p>")
        elif path == "/to-ftp":
            self._redirect("ftp://127.0.0.1/file")
        else:
            self._send(404, b"no route")

    def _send_drip(self):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()
        for _ in range(100):
            if STOP.wait(0.05):
                return
            self.wfile.write(b"x ")
            self.wfile.flush()

    def _send_stream(self, size: int):
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.end_headers()  # no Content-Length: the client only learns the size by reading
        chunk = b"<p>" + b"b" * 65_530 + b"</p>"
        for _ in range(size // len(chunk) + 1):
            if STOP.is_set():
                return
            self.wfile.write(chunk)


@pytest.fixture(scope="module")
def site():
    """The base URL of the test site, serving until the module ends."""
    STOP.clear()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        STOP.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy", "all_proxy"):
        monkeypatch.delenv(var, raising=False)


def _cfg(**kw) -> FetchConfig:
    base = {"enable": True, "timeout_s": 1.0, "max_retries": 1, "max_redirects": 3, "page_tokens": 512,
            "allow_private": True}  # fmt: skip
    return FetchConfig(**{**base, **kw})


def _fetch(url: str, page: int = 0, **kw):
    """(result, seconds) of one fetch by a fresh FetchSource (closed afterwards)."""
    src = FetchSource(_cfg(**kw), backoff_s=0.01, trust_env=False)

    async def run():
        try:
            return await src.fetch(url, page)
        finally:
            await src.aclose()

    start = time.perf_counter()
    res = asyncio.run(run())
    return res, time.perf_counter() - start


def _hits(path: str) -> int:
    with _Handler.lock:
        return _Handler.hits[path]


def test_article_is_text_without_scripts_or_styles(site):
    res, _ = _fetch(f"{site}/article")
    assert res.ok and res.kind is None and res.message == ""
    page = res.page
    assert (page.id, page.page, page.pages) == (f"{site}/article", 0, 1)
    assert page.title == "Atlas moth - Encyclopedia of Moths"
    text = page.text
    for kept in ("The Atlas moth", "Description", "Life cycle", "Attacus atlas", "Wings of reddish brown"):
        assert kept in text  # headings, paragraphs, list items
    for cell in ("Measure", "Wingspan", "25 to 30 cm", "Lifespan", "one to two weeks"):
        assert cell in text  # table cells
    assert text.index("Wingspan") < text.index("25 to 30 cm") < text.index("Lifespan")  # row by row
    for dropped in ("tracker", "utm-beacon", "dataLayer", "jsonld-headline", "late-script-text", "font-family", "#333"):
        assert dropped not in text  # scripts (inline, JSON-LD, late) and styles
    assert "<" not in text and "Home" in text  # no markup; the nav is text like the rest


def test_long_page_pages_like_a_document(site):
    pages = []
    for p in range(3):
        res, _ = _fetch(f"{site}/long", page=p)
        assert res.ok and (res.page.page, res.page.pages) == (p, 3)
        pages.append(res.page.text.split())
    assert pages[0] == LONG_WORDS[:512] and pages[1] == LONG_WORDS[512:1024] and pages[2] == LONG_WORDS[1024:]
    past, _ = _fetch(f"{site}/long", page=3)
    assert past.kind == "page_out_of_range" and "page 4 is past the end" in past.message and "1..3" in past.message
    small, _ = _fetch(f"{site}/long", page=0, page_tokens=100)
    assert small.page.pages == 13  # ceil(1300 / 100)


def test_pages_come_from_one_download(site):
    src = FetchSource(_cfg(), trust_env=False)
    before = _hits("/long")

    async def run():
        first, second = await src.fetch(f"{site}/long", 0), await src.fetch(f"{site}/long", 1)
        await src.aclose()
        return first, second

    first, second = asyncio.run(run())
    assert first.ok and second.ok and second.page.page == 1
    assert _hits("/long") - before == 1 and src.counts["cache_hits"] == 1


def test_text_plain_xhtml_and_charset(site):
    plain, _ = _fetch(f"{site}/plain")
    assert plain.ok and plain.page.text == "line one\nline two of plain text" and plain.page.title == f"{site}/plain"
    xhtml, _ = _fetch(f"{site}/xhtml")
    assert xhtml.ok and xhtml.page.text == "xhtml body"
    latin, _ = _fetch(f"{site}/latin1")
    assert latin.ok and latin.page.text == "caf\u00e9 cr\u00e8me"


@pytest.mark.parametrize(
    ("path", "kind", "says", "requests"),
    [
        ("/missing", "http_404", "answered HTTP 404 Not Found", 1),  # a 4xx is not retried
        ("/broken", "http_500", "answered HTTP 500 Internal Server Error", 2),  # 5xx: once more (max_retries 1)
        ("/image.png", "content_type", "is image/png, not a web page", 1),
        ("/untyped", "content_type", "of no declared type", 1),
        ("/big", "too_large", "10,485,760 bytes, more than the 2,000,000", 1),  # declared: refused unread
        ("/big-stream", "too_large", "more than the 2,000,000 bytes", 1),  # undeclared: read to the cap, stopped
        ("/loop", "too_many_redirects", "redirected more than 3 time(s)", 4),  # the first request and 3 redirects
        ("/chain/4", "too_many_redirects", "redirected more than 3 time(s)", 1),
        ("/to-ftp", "bad_url", "cannot be fetched", 1),
    ],
)
def test_http_failures_are_results(site, path, kind, says, requests):
    before = _hits(path)
    res, seconds = _fetch(f"{site}{path}")
    assert not res.ok and res.page is None
    assert res.kind == kind and says in res.message and f"{site}{path}" in res.message
    assert _hits(path) - before == requests and seconds < 3.0
    again, _ = _fetch(f"{site}/article")  # the server stays up
    assert again.ok


def test_redirect_chain_within_the_bound(site):
    res, _ = _fetch(f"{site}/chain/3")
    assert res.ok and res.page.id == f"{site}/chain/3" and res.page.text == "end of the chain"
    none_allowed, _ = _fetch(f"{site}/chain/1", max_redirects=0)
    assert none_allowed.kind == "too_many_redirects"


def test_flaky_5xx_is_retried_once(site):
    res, _ = _fetch(f"{site}/flaky")
    assert res.ok and res.page.text == "second try works" and _hits("/flaky") == 2


def test_slow_page_times_out_within_the_bound(site):
    before = _hits("/slow")
    res, seconds = _fetch(f"{site}/slow", timeout_s=0.3)
    assert res.kind == "timeout" and "did not answer within 0.3 s" in res.message
    assert _hits("/slow") - before == 2 and seconds < 1.5  # two attempts of 0.3 s and a short backoff


def test_drip_is_bounded_by_the_whole_request_deadline(site):
    res, seconds = _fetch(f"{site}/drip", timeout_s=0.3, max_retries=0)
    assert res.kind == "timeout" and seconds < 1.0  # every read was quick; the deadline is on the whole request


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "169.254.169.254", "10.0.0.1", "[::1]"])
def test_addresses_that_are_not_public_are_refused_by_default(site, host):
    # nothing is sent: the guard resolves the host and refuses before a connection is made
    res, _ = _fetch(f"http://{host}:9/page", allow_private=False)
    assert res.kind == "blocked_address" and "not a public address" in res.message


def test_connection_refused():
    with socket.socket() as sock:  # bound, never listening: a connect is refused, and nobody else takes the port
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}/page"
        res, seconds = _fetch(url)
    assert res.kind == "connection" and "could not connect" in res.message and url in res.message and seconds < 2


@pytest.mark.parametrize(
    ("url", "kind"),
    [
        ("http://", "bad_url"),
        ("http:///path-only", "bad_url"),
        ("http://exa mple.com/", "bad_url"),
        ("https://[::1", "bad_url"),
        ("http://127.0.0.1:99999/", "bad_url"),
        ("", "bad_url"),
        ("ftp://127.0.0.1/file", "unsupported_scheme"),
        ("file:///etc/passwd", "unsupported_scheme"),
        ("javascript:alert(1)", "unsupported_scheme"),
        ("no scheme at all", "bad_url"),
    ],
)
def test_bad_urls_fail_before_any_request(url, kind):
    res, seconds = _fetch(url)
    assert res.kind == kind and res.message and seconds < 0.5


def test_html_to_text_handles_empty_and_xml_declared_pages():
    assert html_to_text("   ", "fallback") == ("fallback", "")
    assert html_to_text('<?xml version="1.0" encoding="utf-8"?><p>hi</p>', "t") == ("t", "hi")


# ---- through the open tool ------------------------------------------------------------------------------------------
def _open_run(site_urls: list[str], fetch: FetchConfig) -> list[str]:
    """The observations of `<open> URL [page] </open>` for each entry, through search_r1 and the rollout's counter."""
    proto = get_protocol("search_r1")
    proto.bind_tools(build_tools(["search", "open"]))
    client = SearchClient(RetrieverConfig(fetch=fetch))
    counted = CountingSearch(client)
    assert fetch_config_of(counted) == fetch and fetch_config_of(lambda *a: None) is None

    async def run():
        out = [await proto.observe(proto.parse_turn(f"<open> {u} </open>"), counted, 2) for u in site_urls]
        await client.aclose()
        return out

    return asyncio.run(run())


def test_open_renders_web_pages_like_documents(site):
    cfg = _cfg(timeout_s=0.5)
    first, last, past, article = _open_run([f"{site}/long", f"{site}/long 3", f"{site}/long 4", f"{site}/article"], cfg)
    assert first.startswith(f"\n\n<information>Document {site}/long (Title: Long)\nw0 w1 ")
    assert first.endswith("w511\npage 1 of 3</information>\n\n")
    assert last.endswith("w1299\npage 3 of 3</information>\n\n")
    assert "open failed: page 4 is past the end" in past and "1..3" in past
    assert "(Title: Atlas moth - Encyclopedia of Moths)" in article and "Wingspan" in article
    assert "tracker" not in article


def test_open_failures_are_observations(site):
    urls = [f"{site}/missing", f"{site}/image.png", f"{site}/loop", f"{site}/slow", "http://", "https://exa mple.com/"]
    obs = _open_run(urls, _cfg(timeout_s=0.3, max_retries=0))
    wrapped = [o.removeprefix("\n\n<information>").removesuffix("</information>\n\n") for o in obs]
    assert wrapped[0] == f"open failed: {site}/missing answered HTTP 404 Not Found"
    assert wrapped[1].startswith(f"open failed: {site}/image.png is image/png, not a web page")
    assert wrapped[2] == f"open failed: {site}/loop redirected more than 3 time(s)"
    assert wrapped[3] == f"open failed: {site}/slow did not answer within 0.3 s"
    assert wrapped[4].startswith("open failed: 'http://' is not a valid URL")
    assert wrapped[5].startswith("open failed: 'https://exa mple.com/' is not a valid URL")


def test_open_without_fetch_keeps_the_old_answer(site):
    (obs,) = _open_run([f"{site}/article"], _cfg(enable=False))
    assert "fetching URLs is not available in this run" in obs

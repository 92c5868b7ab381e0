"""Tag and `\\boxed{}` extraction: the tag formats the search protocols (rsearch_verl/rollout/protocols/) parse and the
rewards (rsearch_verl/rewards/) check. It sits on the bottom floor beside segments.py and imports nothing above it.

    extract_tag("<answer>a</answer> <answer>b</answer>", "answer")   -> "b"   (last complete pair)
    extract_boxed(r"so \\boxed{\\frac{1}{2}}")                         -> "\\frac{1}{2}"
    extract_tags(text, "search")                                     -> every complete pair, in order
    tag_balance(text, "answer")                                      -> (n_open, n_close)

Extraction never raises on malformed text: a missing or unbalanced tag gives None.
"""

from __future__ import annotations

import re
import unicodedata
from functools import lru_cache

_BOXED_PREFIXES = ("\\boxed{", "\\fbox{")


@lru_cache(maxsize=64)
def _tag_pattern(tag: str) -> re.Pattern[str]:
    # Non-greedy with a negative look-ahead so "<a>x<a>y</a>" yields "y": the content of the innermost
    # opening tag that is actually closed (an unclosed earlier opening tag is not part of the answer).
    open_t, close_t = re.escape(f"<{tag}>"), re.escape(f"</{tag}>")
    return re.compile(f"{open_t}((?:(?!{open_t}).)*?){close_t}", re.DOTALL)


def extract_tags(text: str | None, tag: str) -> list[str]:
    """Contents of every complete `<tag>…</tag>` pair in order (stripped); [] for None/empty text."""
    if not text:
        return []
    if not tag or "<" in tag or ">" in tag:
        raise ValueError(f"tag must be a bare name like 'answer', got {tag!r}")
    return [m.group(1).strip() for m in _tag_pattern(tag).finditer(text)]


def extract_tag(text: str | None, tag: str) -> str | None:
    """Content (stripped) of the LAST complete `<tag>…</tag>` pair, or None when there is none."""
    found = extract_tags(text, tag)
    return found[-1] if found else None


def tag_balance(text: str | None, tag: str) -> tuple[int, int]:
    """(number of `<tag>` openings, number of `</tag>` closings) in `text`."""
    if not text:
        return 0, 0
    return text.count(f"<{tag}>"), text.count(f"</{tag}>")


def _boxed_spans(text: str) -> list[tuple[int, int]]:
    """(start, end) of the content of every balanced `\\boxed{…}` / `\\fbox{…}`, in order of appearance."""
    spans: list[tuple[int, int]] = []
    i = 0
    while True:
        hits = [(text.find(p, i), p) for p in _BOXED_PREFIXES]
        hits = [(pos, p) for pos, p in hits if pos >= 0]
        if not hits:
            return spans
        pos, prefix = min(hits)
        start = pos + len(prefix)
        depth, j = 1, start
        while j < len(text) and depth:
            ch = text[j]
            if ch == "\\" and j + 1 < len(text):
                j += 2  # an escaped brace (\{ or \}) does not open or close a group
                continue
            depth += {"{": 1, "}": -1}.get(ch, 0)
            j += 1
        if depth:  # unbalanced: nothing after this point can be a complete box
            return spans
        spans.append((start, j - 1))
        i = j


def extract_boxed(text: str | None) -> str | None:
    """Content (stripped) of the LAST balanced `\\boxed{…}` (nested braces allowed), or None."""
    if not text:
        return None
    spans = _boxed_spans(text)
    if not spans:
        return None
    start, end = spans[-1]
    return text[start:end].strip()


def count_boxed(text: str | None) -> int:
    """Number of balanced `\\boxed{…}` groups in `text`."""
    return len(_boxed_spans(text)) if text else 0


def check_block_grammar(
    text: str,
    blocks: dict[str, tuple[str, str]],
    start: set[str],
    follows: dict[str, set[str]],
    final: set[str],
    text_between: bool = False,
) -> tuple[bool, str]:
    """Check that `text` is a sequence of the named blocks obeying a tiny grammar.

    blocks: name -> (open tag, close tag); no block may nest inside another. start: names allowed first;
    follows[name]: names allowed right after block `name` closes; final: names allowed last. With
    text_between=False only whitespace may sit outside blocks. Returns (ok, reason) — reason says what broke.
    """
    by_tag = {}
    for name, (open_t, close_t) in blocks.items():
        by_tag[open_t], by_tag[close_t] = (name, False), (name, True)
    pattern = re.compile("|".join(re.escape(t) for t in sorted(by_tag, key=len, reverse=True)))
    open_name: str | None = None
    prev: str | None = None
    pos = 0
    for m in pattern.finditer(text):
        name, closing = by_tag[m.group(0)]
        if open_name is None:
            if closing:
                return False, f"{m.group(0)} without its opening tag"
            if not text_between and text[pos : m.start()].strip():
                return False, f"text outside tags before {m.group(0)}"
            allowed = start if prev is None else follows.get(prev, set())
            if name not in allowed:
                return False, f"{name} cannot follow {prev or 'the start'}"
            open_name = name
        elif not closing or name != open_name:
            return False, f"{m.group(0)} inside an open {open_name} block"
        else:
            open_name, prev = None, name
        pos = m.end()
    if open_name is not None:
        return False, f"unclosed {open_name} block"
    if prev not in final:
        return False, f"must end with one of {sorted(final)}, ends with {prev or 'no block'}"
    if not text_between and text[pos:].strip():
        return False, "text after the last block"
    return True, ""


def is_garbled(text: str, max_bad_ratio: float = 0.02) -> bool:
    """True when text holds decoding debris: U+FFFD, or too many control / unassigned characters."""
    if not text:
        return False
    if "\ufffd" in text:
        return True
    bad = sum(1 for ch in text if ch not in "\n\r\t" and unicodedata.category(ch) in ("Cc", "Cn", "Co", "Cs"))
    return bad / len(text) > max_bad_ratio

"""Tag and `\\boxed{}` extraction shared by rewards and search protocols.

    extract_tag("<answer>a</answer> <answer>b</answer>", "answer")   -> "b"   (last complete pair)
    extract_boxed(r"so \\boxed{\\frac{1}{2}}")                         -> "\\frac{1}{2}"
    extract_tags(text, "search")                                     -> every complete pair, in order
    tag_balance(text, "answer")                                      -> (n_open, n_close)

Extraction never raises on malformed text: a missing or unbalanced tag gives None.
"""

from __future__ import annotations

import re
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

"""The shell commands the README and docs/*.md show: extraction shared by the docs tests.

`logical_lines` joins `\\`-continued lines and drops a leading `$ ` prompt; `fenced_commands` lists the commands of
every fenced shell block (```bash / sh / shell / console, or a fence without a language), one per logical line,
comment-only lines skipped and a trailing `# comment` dropped, whitespace collapsed: the text a run / skip list
names them by.

    from doc_commands import doc_files, fenced_commands
    for path in doc_files():
        for line_no, command in fenced_commands(open(path).read()): ...
"""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHELL_FENCES = ("bash", "sh", "shell", "console", "")
FENCE = re.compile(r"^\s*(```+|~~~+)\s*([\w+-]*)")
TRAILING_COMMENT = re.compile(r"\s+#(?:\s.*)?$")  # ` # ...` after a command (none of ours has ` #` in a string)


def doc_files() -> list[str]:
    return [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]


def logical_lines(text: str) -> list[tuple[int, str]]:
    """(1-based line number, line) with `\\`-continued lines joined; a leading `$ ` prompt is dropped."""
    out: list[tuple[int, str]] = []
    pending, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not pending:
            start = number
            line = line[2:] if line.startswith("$ ") else line
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        out.append((start, pending + line))
        pending = ""
    if pending:
        out.append((start, pending))
    return out


def fenced_blocks(text: str) -> list[tuple[int, str, str]]:
    """(line number of the block's first line, language, body) of every fenced block."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        fence, lang, body, j = match.group(1), match.group(2).lower(), [], i + 1
        while j < len(lines) and not lines[j].strip().startswith(fence):
            body.append(lines[j])
            j += 1
        blocks.append((i + 2, lang, "\n".join(body)))
        i = j + 1
    return blocks


def normalize(command: str) -> str:
    return " ".join(TRAILING_COMMENT.sub("", command).split())


def fenced_commands(text: str) -> list[tuple[int, str]]:
    """(line number, normalized command) of every command line in the fenced shell blocks of a markdown text."""
    out = []
    for first, lang, body in fenced_blocks(text):
        if lang not in SHELL_FENCES:
            continue
        for offset, line in logical_lines(body):
            if line and not line.startswith("#"):
                out.append((first + offset - 1, normalize(line)))
    return out


def all_fenced_commands() -> list[tuple[str, str]]:
    """(`file:line`, command) for the README and docs/."""
    found = []
    for path in doc_files():
        with open(path, encoding="utf-8") as f:
            for number, command in fenced_commands(f.read()):
                found.append((f"{os.path.relpath(path, ROOT)}:{number}", command))
    return found

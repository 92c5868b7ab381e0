"""Every training command the README and docs/*.md show composes and validates.

A command counts when a line (outside or inside a code block, `\\` continuations joined) starts like a shell command
(`VAR=value` prefixes, then `bash` / `python` / `.venv/bin/python` / `ray` / a launch script) and runs
`python -m rsearch_verl.main`, directly, through `ray job submit ... -- python -m rsearch_verl.main`, or through
`launch/submit.sh` / `launch/train.sh`. Its Hydra overrides are composed with `load_config` and validated; placeholder
values (HEAD_IP, /shared/... paths) are fine because validation reads neither the network nor the disk.

    .venv/bin/python -m pytest -q tests/config/test_documented_commands.py
"""

from __future__ import annotations

import os
import re
import shlex

import pytest
from doc_commands import ROOT, doc_files, logical_lines  # tests/config/doc_commands.py

from rsearch_verl.config import ConfigError, load_config

ENTRY_SCRIPTS = ("launch/submit.sh", "launch/train.sh")
# a line that starts like a command: optional VAR=value prefixes, then an interpreter, ray or a launch script
COMMAND_START = re.compile(
    r"^(?:[A-Za-z_][A-Za-z0-9_]*=\S*\s+)*(?:bash|sh|ray|\S*python3?|\S*launch/(?:submit|train)\.sh)(?:\s|$)"
)


def documented_commands(text: str) -> list[tuple[int, str]]:
    """The lines of a markdown text that run the trainer (see the module docstring)."""
    return [
        (number, line)
        for number, line in logical_lines(text)
        if COMMAND_START.match(line) and ("rsearch_verl.main" in line or any(s in line for s in ENTRY_SCRIPTS))
    ]


def hydra_overrides(command: str) -> list[list[str]]:
    """The Hydra overrides of each trainer invocation in a shell command line (`&&` / `;` / `|` chains split)."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="&|;")
    lexer.whitespace_split = True  # keep `a=b/c:d` in one token; `#` still starts a comment
    segments: list[list[str]] = [[]]
    for token in lexer:
        if token and set(token) <= set("&|;"):
            segments.append([])
        else:
            segments[-1].append(token)
    runs = []
    for tokens in segments:
        args = _trainer_args(tokens)
        if args is not None:
            runs.append(args)
    return runs


def _trainer_args(tokens: list[str]) -> list[str] | None:
    """The arguments after `-m rsearch_verl.main` or a launch script, or None when the segment runs neither."""
    for i, token in enumerate(tokens):
        if token == "-m" and tokens[i + 1 : i + 2] == ["rsearch_verl.main"]:
            args = tokens[i + 2 :]
            break
        if token.endswith(ENTRY_SCRIPTS):
            args = tokens[i + 1 :]
            break
    else:
        return None
    args = _drop_printing_flags(args)
    flags = [a for a in args if a.startswith("-")]
    if flags:  # other Hydra flags (--multirun, --config-name) would need handling here before a doc may show them
        raise ValueError(f"{flags}: not a Hydra override in {' '.join(tokens)!r}")
    return args


def _drop_printing_flags(args: list[str]) -> list[str]:
    """Without Hydra's `--cfg job|hydra|all` / `-c ...` and `--help`: flags that print the composed config instead of
    running; the overrides are validated the same way."""
    out, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in ("--cfg", "-c"):
            skip = True
        elif arg not in ("--help", "-h"):
            out.append(arg)
    return out


def all_doc_commands() -> list[tuple[str, list[str]]]:
    """(`file:line`, overrides) for every trainer invocation in the README and docs/."""
    found = []
    for path in doc_files():
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for number, line in documented_commands(text):
            for overrides in hydra_overrides(line):
                found.append((f"{os.path.relpath(path, ROOT)}:{number}", overrides))
    return found


DOC_COMMANDS = all_doc_commands()

SAMPLE = """\
# Title

Prose that names `python -m rsearch_verl.main` inline is no command, nor is this: launch/submit.sh runs it.

bash launch/install.sh && .venv/bin/python -m rsearch_verl.main +recipe=search_r1_ppo

```bash
RAY_ADDRESS=http://HEAD_IP:8265 bash launch/submit.sh +recipe=search_r1_grpo \\
    model=qwen2_5_3b_instruct rollout=vllm trainer=gpu_1x8   # a comment
ray job submit --address http://HEAD_IP:8265 --working-dir . -- python -m rsearch_verl.main +recipe=research_grpo
python -m retrieval_server serve --index DIR
$ bash launch/train.sh +recipe=search_r1_ppo trainer.total_steps=2
```

    python -m rsearch_verl.main +recipe=r_search_grpo seed=3
"""


def test_parser_on_a_sample():
    commands = documented_commands(SAMPLE)
    assert [number for number, _ in commands] == [5, 8, 10, 12, 15]
    runs = [run for _, line in commands for run in hydra_overrides(line)]
    assert runs == [
        ["+recipe=search_r1_ppo"],
        ["+recipe=search_r1_grpo", "model=qwen2_5_3b_instruct", "rollout=vllm", "trainer=gpu_1x8"],
        ["+recipe=research_grpo"],
        ["+recipe=search_r1_ppo", "trainer.total_steps=2"],
        ["+recipe=r_search_grpo", "seed=3"],
    ]
    assert hydra_overrides("python -m rsearch_verl.main +recipe=search_r1_ppo seed=2 --cfg job") == [
        ["+recipe=search_r1_ppo", "seed=2"]
    ]
    with pytest.raises(ValueError, match="--multirun"):
        hydra_overrides("python -m rsearch_verl.main +recipe=search_r1_ppo --multirun seed=1,2")


def test_docs_show_commands():
    # the parser must not silently find nothing: the README's main command, the cluster, async, LoRA / packing,
    # real-model and toy-world commands at least
    assert len(DOC_COMMANDS) >= 10, DOC_COMMANDS
    places = {place.split(":")[0] for place, _ in DOC_COMMANDS}
    assert {"README.md", "docs/cluster.md"} <= places
    assert any("trainer=gpu_1x8" in overrides for _, overrides in DOC_COMMANDS)


@pytest.mark.parametrize("place, overrides", DOC_COMMANDS, ids=[place for place, _ in DOC_COMMANDS])
def test_documented_command_composes(place, overrides):
    try:
        cfg = load_config(overrides)
    except ConfigError as exc:
        pytest.fail(f"{place}: {' '.join(overrides)}\n  {exc}")
    assert cfg.recipe != "default" or not any(o.startswith("+recipe=") for o in overrides)


def test_a_broken_command_fails():
    ((_, line),) = documented_commands(
        "python -m rsearch_verl.main +recipe=search_r1_ppo trainer=gpu_1x8 actor.ppo_mini_batch_size=3\n"
    )
    (overrides,) = hydra_overrides(line)
    with pytest.raises(ConfigError, match="ppo_mini_batch_size"):
        load_config(overrides)

"""Prompt datasets and the resumable loader the trainer draws batches from.

Rows come from parquet files made by `python -m rsearch_verl.data.prepare` (verl / Search-R1 layout: `prompt`
(a string or chat messages), `data_source`, `reward_model.ground_truth.target`, `question`, `extra_info`) or from
in-memory rows in the same layout (the toy world). Prompts are rendered (chat template for messages) and tokenised
once; prompts longer than `data.max_prompt_length` tokens are dropped with a warning, as verl does. A protocol that
declares tools (rsearch_verl/rollout/protocols/tool_call.py) passes them, and its chat-template variables, to the
template; a template that ignores `tools` gets them declared in the system message instead.

`PromptLoader` yields DataProto batches of `data.train_batch_size` prompts in a seeded order per epoch; its
`state_dict()` (epoch, position) goes into every checkpoint so a resumed run sees exactly the batches an
uninterrupted one would.

Usage:
    ds = PromptDataset.from_parquet(cfg.data.train_files, tokenizer, cfg.data.max_prompt_length, protocol=proto)
    loader = PromptLoader(ds, batch_size=4, seed=cfg.seed, shuffle=True)
    batch = loader.next_batch()      # DataProto: non_tensor prompt_ids, raw_prompt, question, ground_truth, ...
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

import numpy as np
from verl import DataProto

from rsearch_verl.rollout.protocols.tool_call import declare_tools

logger = logging.getLogger(__name__)


@dataclass
class PromptRow:
    id: str
    prompt_text: str  # rendered prompt (chat template applied)
    prompt_ids: list[int]
    question: str
    ground_truth: list[str]
    data_source: str
    extra: dict


def render_prompt(prompt, tokenizer, tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
    """A base-model prompt is used as is; chat messages go through the tokenizer's chat template, with `tools`
    (JSON schemas) and `template_kwargs` (e.g. Qwen3's enable_thinking) handed to it."""
    if isinstance(prompt, str):
        return prompt
    messages = [dict(m) for m in prompt]
    kwargs = dict(template_kwargs or {})

    def render(msgs: list[dict], with_tools: list[dict] | None) -> str:
        return tokenizer.apply_chat_template(
            msgs, tools=with_tools, add_generation_prompt=True, tokenize=False, **kwargs
        )

    text = render(messages, tools or None)
    if tools and text == render(messages, None):  # the template ignores `tools` (SmolLM2's): declare them in text
        text = render(declare_tools(messages, tools), None)
    return text


def _ground_truth(row: dict) -> list[str]:
    target = row["golden_answers"] if "golden_answers" in row else row["reward_model"]["ground_truth"]["target"]
    if isinstance(target, str):
        return [target]
    return [str(t) for t in list(target)]


class PromptDataset:
    """`protocol` (optional): the rollout protocol, whose `tools` and `chat_template_kwargs` the chat template gets."""

    def __init__(self, rows: list[dict], tokenizer, max_prompt_length: int, name: str = "data", protocol=None):
        self.rows: list[PromptRow] = []
        dropped = 0
        tools = list(protocol.tools) if protocol is not None else None
        template_kwargs = dict(protocol.chat_template_kwargs) if protocol is not None else None
        for i, row in enumerate(rows):
            text = render_prompt(row["prompt"], tokenizer, tools, template_kwargs)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) > max_prompt_length:
                dropped += 1
                continue
            extra = dict(row.get("extra_info") or {})
            self.rows.append(
                PromptRow(
                    id=str(row.get("id", extra.get("index", i))),
                    prompt_text=text,
                    prompt_ids=ids,
                    question=str(row.get("question", extra.get("question", ""))),
                    ground_truth=_ground_truth(row),
                    data_source=str(row.get("data_source", name)),
                    extra=extra,
                )
            )
        if dropped:
            logger.warning("%s: dropped %d prompts longer than %d tokens", name, dropped, max_prompt_length)
        if not self.rows:
            raise ValueError(f"{name}: no prompts left (all {len(rows)} missing or longer than {max_prompt_length})")

    @classmethod
    def from_parquet(cls, files: list[str], tokenizer, max_prompt_length: int, protocol=None) -> PromptDataset:
        # heavy: pandas only when a parquet file is read
        import pandas as pd

        if not files:
            raise ValueError("data.train_files / data.val_files: no parquet files given")
        frames = [pd.read_parquet(f) for f in files]
        rows = pd.concat(frames, ignore_index=True).to_dict("records")
        return cls(rows, tokenizer, max_prompt_length, name=",".join(files), protocol=protocol)

    def __len__(self) -> int:
        return len(self.rows)

    def to_batch(self, indices: list[int], uids: list[str] | None = None) -> DataProto:
        """DataProto of the given prompts; each prompt's uid names the group of its n samples."""
        picked = [self.rows[i] for i in indices]
        uids = uids or [uuid.uuid4().hex for _ in picked]

        def col(values) -> np.ndarray:
            arr = np.empty(len(values), dtype=object)
            arr[:] = values
            return arr

        return DataProto.from_dict(
            non_tensors={
                "uid": col(list(uids)),
                "index": col([r.id for r in picked]),
                "prompt_ids": col([r.prompt_ids for r in picked]),
                "raw_prompt": col([r.prompt_text for r in picked]),
                "question": col([r.question for r in picked]),
                "ground_truth": col([r.ground_truth for r in picked]),
                "data_source": col([r.data_source for r in picked]),
                "extra_info": col([r.extra for r in picked]),
            }
        )


class PromptLoader:
    """Endless, resumable iteration over a dataset in batches; a new seeded permutation every epoch."""

    def __init__(self, dataset: PromptDataset, batch_size: int, seed: int, shuffle: bool = True):
        if batch_size > len(dataset):
            raise ValueError(f"data.train_batch_size={batch_size} is larger than the dataset ({len(dataset)} prompts)")
        self.dataset, self.batch_size, self.seed, self.shuffle = dataset, batch_size, seed, shuffle
        self.epoch, self.pos = 0, 0

    def _order(self) -> np.ndarray:
        if not self.shuffle:
            return np.arange(len(self.dataset))
        return np.random.default_rng(self.seed + self.epoch).permutation(len(self.dataset))

    def next_batch(self) -> DataProto:
        if self.pos + self.batch_size > len(self.dataset):  # drop the ragged tail, as verl's drop_last
            self.epoch, self.pos = self.epoch + 1, 0
        idx = self._order()[self.pos : self.pos + self.batch_size].tolist()
        # uids are derived from (epoch, position), not random, so a resumed run reproduces them
        uids = [f"e{self.epoch}-p{self.pos + i}" for i in range(len(idx))]
        self.pos += self.batch_size
        return self.dataset.to_batch(idx, uids)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = int(state["epoch"]), int(state["pos"])

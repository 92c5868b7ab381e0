"""The toy world as a run's data (`data.source=toy_world`): builds (or reuses) the embedded world
(rsearch_verl/toy/world.py), renders its questions with the run's protocol and, for the tiny policy, trains the world's
tokenizer (rsearch_verl/toy/tokenizer.py).

    data = toy_world_data(cfg, protocol)   # -> rsearch_verl.run_data.RunData
"""

from __future__ import annotations

import json
import os

from rsearch_verl.config import RSearchConfig
from rsearch_verl.rollout.protocols import SearchProtocol
from rsearch_verl.run_data import RunData
from rsearch_verl.toy.tokenizer import toy_tokenizer
from rsearch_verl.toy.world import build_toy_world


def toy_world_data(cfg: RSearchConfig, proto: SearchProtocol) -> RunData:
    """Build or reuse the toy world; prompts rendered with the run's protocol `proto`."""
    world = build_toy_world(cfg.data.toy_world)
    tok_dir = toy_tokenizer(world, [cfg.rollout.protocol]) if cfg.model.path == "tiny" else None

    def rows(path: str) -> list[dict]:
        out = []
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                out.append(
                    {
                        "id": rec["id"],
                        "prompt": proto.build_prompt(rec["question"], cfg.prompt_variant),
                        "question": rec["question"],
                        "golden_answers": rec["golden_answers"],
                        "data_source": rec.get("data_source", "toy_world"),
                        "extra_info": {"hops": rec.get("hops"), "support": rec.get("support", [])},
                    }
                )
        return out

    index_dir = cfg.retriever.index_dir or os.path.join(
        os.path.dirname(world.corpus_path), f"index_{cfg.retriever.encoder}_{cfg.retriever.index_type}"
    )
    return RunData(rows(world.train_path), rows(world.val_path), world.corpus_path, index_dir, tok_dir)

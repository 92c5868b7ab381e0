"""The actor's forward on hybrid models (Qwen3.5 / 3.6: Gated DeltaNet layers with a recurrent state beside full
attention), tiny random Qwen3_5ForCausalLM / Qwen3_5MoeForCausalLM on transformers' torch delta-rule path.

- Padded micro-batches (the hybrids' only training layout): each sequence's response log-probs equal its real tokens
  alone, also in a micro-batch of ONE left-padded row (transformers zeroes padding before the linear-attention layers
  only in batches of two or more; rsearch_verl/workers/forward.py drops the columns that are padding in every row).
- Packing (`actor.use_remove_padding`): in a packed row the second sequence starts from the first one's recurrent and
  conv state (the torch path ignores the position-id restarts), so its log-probs differ from its own; the start-up
  check fails loudly and config validation refuses packing for the hybrid families, naming the key.

Run: .venv/bin/python -m pytest -q tests/workers/test_workers_hybrid.py
"""

from __future__ import annotations

import pytest
import torch
from verl import DataProto

from rsearch_verl.config import ConfigError, TinyModelConfig, load_config
from rsearch_verl.models import build_tiny_model
from rsearch_verl.workers.forward import check_remove_padding, response_log_probs

TINY = TinyModelConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=2,
                       num_key_value_heads=1)  # fmt: skip  # as model=tiny_qwen3_5
VOCAB, S, R = 512, 16, 6
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3_5_moe"])
def model(request):
    return build_tiny_model(request.param, TINY, VOCAB, seed=0).eval()


def _batch(ids: torch.Tensor, attn: torch.Tensor) -> DataProto:
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": attn, "position_ids": pos,
                                        "responses": ids[:, -R:]})  # fmt: skip


def _two_rows():
    """Row 0 left-padded by 4 (a short prompt), row 1 right-padded by 3 (a short response): the actor's layout."""
    ids = torch.randint(0, VOCAB, (2, S), generator=torch.Generator().manual_seed(0))
    attn = torch.ones(2, S, dtype=torch.long)
    attn[0, :4], attn[1, -3:] = 0, 0
    return ids, attn


def _alone(model, ids: torch.Tensor, attn: torch.Tensor) -> list[torch.Tensor]:
    """Each row's response log-probs from its real tokens only (no padding anywhere), [R] with 0 on padding."""
    out = []
    for i in range(len(ids)):
        real = attn[i].bool()
        row = _batch(ids[i][real][None], torch.ones(1, int(real.sum()), dtype=torch.long))
        with torch.no_grad():
            lp = response_log_probs(model, row, CPU)[0][0]
        resp_real = int(attn[i, -R:].sum())
        out.append(torch.cat([lp[-resp_real:], lp.new_zeros(R - resp_real)]))  # right padding after them
    return out


def test_padded_micro_batches_of_one_and_two_rows_equal_each_sequence_alone(model):
    ids, attn = _two_rows()
    alone = _alone(model, ids, attn)
    mask = attn[:, -R:].bool()
    with torch.no_grad():
        both = response_log_probs(model, _batch(ids, attn), CPU)[0]
        singles = [response_log_probs(model, _batch(ids[i : i + 1], attn[i : i + 1]), CPU)[0][0] for i in range(2)]
    for i in range(2):
        assert torch.allclose(both[i][mask[i]], alone[i][mask[i]], atol=1e-5)
        # a lone left-padded row: its pads would enter the recurrent state (~1e-2 here) were they not dropped
        assert torch.allclose(singles[i][mask[i]], alone[i][mask[i]], atol=1e-5)


def test_packing_leaks_state_across_sequences_so_it_is_refused(model):
    ids, attn = _two_rows()
    alone = _alone(model, ids, attn)
    mask = attn[:, -R:].bool()
    with torch.no_grad():
        packed = response_log_probs(model, _batch(ids, attn), CPU, remove_padding=True)[0]
    assert torch.allclose(packed[0][mask[0]], alone[0][mask[0]], atol=1e-5)  # the first sequence starts from zero
    # the second starts from the first one's recurrent / conv state: the torch path cannot reset it at the boundary
    assert float((packed[1] - alone[1])[mask[1]].abs().max()) > 1e-3
    with pytest.raises(RuntimeError, match="use_remove_padding"):
        check_remove_padding(model, CPU, VOCAB)  # what a worker would hit at start-up


@pytest.mark.parametrize("group", ["tiny_qwen3_5", "tiny_qwen3_6_moe", "qwen3_5_4b", "qwen3_6_35b_a3b"])
def test_config_refuses_packing_for_hybrid_families(group):
    for role in ("actor", "critic"):
        with pytest.raises(ConfigError, match=f"{role}.use_remove_padding"):
            load_config(["+recipe=search_r1_ppo", f"model={group}", f"{role}.use_remove_padding=true"])
    # the GPU trainer groups pack by default; the hybrid groups' sizes files turn it off there
    if not group.startswith("tiny"):
        for trainer in ("gpu_1x8", "gpu_1x1"):
            cfg = load_config(["+recipe=search_r1_ppo", f"model={group}", "rollout=vllm", f"trainer={trainer}"])
            assert not cfg.actor.use_remove_padding and not cfg.critic.use_remove_padding
    qwen3 = load_config(["+recipe=search_r1_ppo", "model=tiny_qwen3", "actor.use_remove_padding=true"])
    assert qwen3.actor.use_remove_padding  # attention-only families still pack

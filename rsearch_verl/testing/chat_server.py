"""A real OpenAI-compatible chat server on CPU: `POST /v1/chat/completions` answered by transformers `generate`.

The judge endpoint tests and CPU smoke runs talk to (`reward.judge.url`, `python -m rsearch_verl.eval --judge`):
the same wire format as vLLM's or a provider's server, with any Hugging Face causal LM behind it (a tiny random
model, the toy policy, a run's HF export). Greedy unless `temperature` > 0; one generation at a time.

    app = create_chat_app(model, tokenizer, model_name="judge")       # then serve_in_thread(app) in a test
    python -m rsearch_verl.testing.chat_server --model tiny --name judge --port 8001     # or a model directory

Endpoints: `POST /v1/chat/completions` body `{"model", "messages": [{"role", "content"}], "max_tokens",
"temperature"}` -> `{"choices": [{"message": {"role": "assistant", "content"}, "finish_reason"}], "usage", ...}`;
an unknown model -> 404, no messages or a bad body -> 400 / 422, each `{"detail": ...}` as OpenAI's servers do;
`GET /v1/models`, `GET /health`.
"""

from __future__ import annotations

import argparse
import threading
import time
import uuid
from typing import Any

import torch
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str
    messages: list[ChatMessage]
    max_tokens: int = Field(default=64, ge=1, le=4096)
    temperature: float = Field(default=0.0, ge=0.0)
    seed: int | None = None


def generate_reply(model, tokenizer, messages: list[dict], max_tokens: int, temperature: float, seed: int | None):
    """(reply text, prompt tokens, completion tokens, finish reason) for one conversation."""
    enc = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    sampling: dict[str, Any] = {"do_sample": False}
    if temperature > 0:
        sampling = {"do_sample": True, "temperature": temperature}
        torch.manual_seed(0 if seed is None else seed)
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_tokens, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
            **sampling,
        )  # fmt: skip
    prompt_len = enc["input_ids"].shape[1]
    new = out[0, prompt_len:].tolist()
    finish = "stop" if new and new[-1] == tokenizer.eos_token_id else "length"
    return tokenizer.decode(new, skip_special_tokens=True), prompt_len, len(new), finish


def create_chat_app(model, tokenizer, model_name: str = "judge") -> FastAPI:
    """The server for `model` (a transformers CausalLM, eval mode) under the name `model_name`."""
    app = FastAPI(title="rsearch-verl chat server")
    lock = threading.Lock()  # one generate at a time: the model is shared by the threadpool's handlers
    model.eval()

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "model": model_name}

    @app.get("/v1/models")
    def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "rsearch-verl"}]}

    @app.post("/v1/chat/completions")
    def chat(req: ChatRequest) -> dict:
        if req.model != model_name:
            raise HTTPException(404, f"model {req.model!r} not found (this server serves {model_name!r})")
        if not req.messages:
            raise HTTPException(400, "messages must not be empty")
        messages = [m.model_dump() for m in req.messages]
        with lock:
            text, n_prompt, n_new, finish = generate_reply(
                model, tokenizer, messages, req.max_tokens, req.temperature, req.seed
            )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex[:12]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_new, "total_tokens": n_prompt + n_new},
        }

    return app


def load(path: str, seed: int = 0):
    """(model, tokenizer) for 'tiny' (a random tiny Qwen2 with the offline ChatML tokenizer) or an HF directory."""
    from rsearch_verl.config.schema import ModelConfig
    from rsearch_verl.models import load_model, load_tokenizer

    model_cfg = ModelConfig(path=path)
    tokenizer = load_tokenizer(model_cfg)
    return load_model(model_cfg, tokenizer, seed=seed), tokenizer


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    parser = argparse.ArgumentParser(
        prog="python -m rsearch_verl.testing.chat_server", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--model", default="tiny", help="'tiny' or a Hugging Face model directory")
    parser.add_argument("--name", default="judge", help="the model name clients must send")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    args = parser.parse_args(argv)
    model, tokenizer = load(args.model)
    uvicorn.run(create_chat_app(model, tokenizer, args.name), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()

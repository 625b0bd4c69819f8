"""Sampling from a causal language model of any family, with its KV cache: `generate` (prompt -> continuation)
and `sample` (the next token from logits). The model takes `input_pos` and `kv_cache` (see `models`) and has a
`config.max_position_embeddings`."""

from __future__ import annotations

import torch
from torch import Tensor


def sample(logits: Tensor, temperature=1.0, top_k=None, top_p=None, generator=None) -> Tensor:
    """Next token ids (B,) from last-position logits (B, V); temperature 0 is greedy."""
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token once the mass before it reaches top_p; the top token always stays.
        sorted_logits = sorted_logits.masked_fill(probs.cumsum(dim=-1) - probs >= top_p, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()  # not inference_mode: torchao's float8 linears (and torch 2.11's FSDP2) fail under it
def generate(
    model, input_ids, max_new_tokens, *, temperature=1.0, top_k=None, top_p=None, eos_id=None, generator=None
) -> Tensor:
    """Prompt + continuation, a LongTensor (B, T + n), n <= max_new_tokens. Prompts must have equal
    length (no padding). A row that emitted ``eos_id`` repeats it; all rows done -> stop early."""
    B, T = input_ids.shape
    limit = model.config.max_position_embeddings
    if temperature < 0:
        raise ValueError(f"temperature={temperature} must be >= 0")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k={top_k} must be >= 1")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p={top_p} must be in (0, 1]")
    if not 0 <= max_new_tokens <= limit - T:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be in [0, {limit} - prompt length {T}]")
    device = input_ids.device
    cache = model.new_kv_cache(B, T + max_new_tokens, device=device)
    logits = model(input_ids, input_pos=torch.arange(T, device=device), kv_cache=cache)[:, -1]
    out, done = [input_ids], torch.zeros(B, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        token = sample(logits, temperature, top_k, top_p, generator)
        if eos_id is not None:
            token = token.masked_fill(done, eos_id)
            done |= token == eos_id
        out.append(token[:, None])
        if i == max_new_tokens - 1 or (eos_id is not None and bool(done.all())):
            break
        logits = model(token[:, None], input_pos=torch.tensor([T + i], device=device), kv_cache=cache)[:, -1]
    return torch.cat(out, dim=1)

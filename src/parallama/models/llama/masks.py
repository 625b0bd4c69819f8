"""Which keys each query attends to, built once per forward pass outside the layers from the attention's own
pattern, `Attention.mask_mod(b, h, q_idx, kv_idx)` (FlexAttention's signature; plain causal unless a family or a
user's attention class overrides it): here it is combined with what the batch says (`with_padding` for right-padded
samples, `within_documents` for packed ones) or what the KV cache holds (`at_positions`), and `build` makes SDPA's
boolean mask or, on the devices in `FLEX_ATTENTION_DEVICES` (document masks), a FlexAttention `BlockMask` run by
`compiled_flex_attention` (torch's `create_block_mask`).

Separate from `model`, whose layers only take a mask: what a mask looks like depends on the data layout
(`data.packing`, `data.document_mask`) and on the device, and FlexAttention brings torch.compile with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

# Devices on which document masks run as compiled FlexAttention (a fused kernel that skips the blocks the mask
# rules out); elsewhere SDPA gets a dense boolean (B, 1, T, T) mask.
FLEX_ATTENTION_DEVICES = {"cuda"}

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]  # (b, h, q_idx, kv_idx) -> may q_idx see kv_idx


def causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """Every earlier position and itself: the Llama's pattern."""
    return q_idx >= kv_idx


def with_padding(mask_mod: MaskMod, attention_mask: Tensor) -> MaskMod:
    """`mask_mod` over the real keys of a right-padded (B, T) 1/0 batch. The diagonal is always allowed: a fully
    masked row (left padding) makes SDPA return NaN, poisoning the backward."""
    real = attention_mask.bool()

    def padded(b, h, q_idx, kv_idx):
        return (mask_mod(b, h, q_idx, kv_idx) & real[b, kv_idx]) | (q_idx == kv_idx)

    return padded


def within_documents(mask_mod: MaskMod, document_ids: Tensor) -> MaskMod:
    """`mask_mod` inside each document of a packed (B, T) batch (its document index per token)."""

    def same_document(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) & (document_ids[b, q_idx] == document_ids[b, kv_idx])

    return same_document


def at_positions(mask_mod: MaskMod, input_pos: Tensor) -> MaskMod:
    """`mask_mod` for queries at `input_pos` (1D) against a KV cache's slots, slot i holding position i: prefill
    and each decode step see the keys the training forward sees."""

    def cached(b, h, q_idx, kv_idx):
        return mask_mod(b, h, input_pos[q_idx], kv_idx)

    return cached


# Made by the first flex mask: importing torch's compiler takes seconds.
compiled_flex_attention = None


def build(mask_mod: MaskMod, batch: int | None, q_len: int, kv_len: int, device, flex: bool = False):
    """`mask_mod` as a (batch or 1, 1, q_len, kv_len) boolean mask for SDPA, or with `flex` a FlexAttention
    ``BlockMask`` (`create_block_mask`). The boolean mask evaluates `mask_mod` once on broadcast index grids:
    torch's `create_mask` vmaps the same function, alike for the elementwise ops a mask_mod is made of, but costs
    ~100x more per call, which every decode step of generation would pay.

    Attention runs a ``BlockMask`` through compiled flex_attention (eager, it would materialize the whole score
    matrix), compiled here, outside any compiled block, once per process."""
    global compiled_flex_attention
    if flex:
        if compiled_flex_attention is None:
            compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
        plain = mask_mod  # torch tells a mask_mod from a score_mod by its arguments, counting a bound method's self
        return create_block_mask(
            lambda b, h, q, kv: plain(b, h, q, kv), batch, None, q_len, kv_len, device=device
        )
    b = torch.arange(batch or 1, device=device).view(-1, 1, 1, 1)
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device)
    q = torch.arange(q_len, device=device).view(1, 1, -1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    return mask_mod(b, h, q, kv).expand(batch or 1, 1, q_len, kv_len)

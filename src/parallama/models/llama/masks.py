"""Which keys each query attends to, built once per forward pass outside the layers: `padding_mask` for right-
padded samples, `document_mask` for packed ones ("causal and same document"), as SDPA's boolean masks or, on
the devices in `FLEX_ATTENTION_DEVICES`, a FlexAttention `BlockMask` run by `compiled_flex_attention`.

Separate from `model`, whose layers only take a mask: what a mask looks like depends on the data layout
(`data.packing`, `data.document_mask`) and on the device, and FlexAttention brings torch.compile with it.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

# Devices on which document masks run as compiled FlexAttention (a fused kernel that skips the blocks the mask
# rules out); elsewhere SDPA gets a dense boolean (B, 1, T, T) mask.
FLEX_ATTENTION_DEVICES = {"cuda"}


def padding_mask(attention_mask: Tensor) -> Tensor:
    """(B, T) 1/0 padding mask -> (B, 1, T, T) bool mask "causal and key is real". The diagonal is
    always allowed: a fully masked row (left padding) makes SDPA return NaN, poisoning the backward."""
    T, device = attention_mask.shape[-1], attention_mask.device
    mask = torch.ones(T, T, dtype=torch.bool, device=device).tril() & attention_mask.bool()[:, None, None]
    return mask | torch.eye(T, dtype=torch.bool, device=device)


# Made by the first flex document_mask: importing torch's compiler takes seconds.
compiled_flex_attention = None


def document_mask(document_ids: Tensor, flex: bool) -> Tensor | BlockMask:
    """(B, T) document index of every token -> "causal and same document": a FlexAttention ``BlockMask`` if
    ``flex``, else a (B, 1, T, T) bool mask for SDPA. The diagonal is always allowed, so no row is empty.

    Attention runs a ``BlockMask`` through compiled flex_attention (eager, it would materialize the whole
    score matrix), compiled here, outside any compiled block, once per process."""
    global compiled_flex_attention
    B, T = document_ids.shape
    if flex:
        if compiled_flex_attention is None:
            compiled_flex_attention = torch.compile(flex_attention, dynamic=False)

        def same_document_causal(b, h, q, kv):
            return (q >= kv) & (document_ids[b, q] == document_ids[b, kv])

        return create_block_mask(same_document_causal, B, None, T, T, device=document_ids.device)
    causal = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    return ((document_ids[:, :, None] == document_ids[:, None, :]) & causal)[:, None]

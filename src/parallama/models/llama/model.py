"""A Llama-style decoder, read top to bottom: rope, KV cache, attention, MLP, blocks, the model.
Its hyperparameters are `config.LlamaConfig`; the attention masks it takes are built in `masks`; sampling is
`models.generation`.

Parameter names follow Hugging Face's ``LlamaForCausalLM`` so that checkpoints map 1:1 (HF keys
are ours with a ``model.`` prefix, except ``lm_head``). Parallelism is applied from outside (parallelize.py),
per ``DecoderLayer``; nothing here knows about it, but nothing stands in its way either: layers are keyed by
their index (a pipeline stage keeps its own, under their own names), a stage without the embedding, the final
norm or the head passes hidden states through, and attention takes whatever share of the heads its
projections hold (tensor parallelism).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask

from parallama.models.llama import masks
from parallama.models.llama.config import LlamaConfig


def rope_inv_freq(config: LlamaConfig) -> Tensor:
    """Rotary inverse frequencies (float32, CPU), bit-identical to HF's default and llama3 rope."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if config.rope_scaling is None:
        return inv_freq
    # HF's _compute_llama3_parameters: keep high frequencies, divide low ones by `factor`,
    # interpolate smoothly in between.
    s = config.rope_scaling
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, inv_freq_llama)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, shared by all layers. Non-persistent buffers: they
    derive from the config, so checkpoints stay HF-compatible and meta-device init works."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        shape = (config.max_position_embeddings, config.head_dim)
        self.register_buffer("cos", torch.empty(shape, dtype=torch.float32), persistent=False)
        self.register_buffer("sin", torch.empty(shape, dtype=torch.float32), persistent=False)

    @torch.no_grad()
    def init_buffers(self) -> None:
        """Computed on CPU in float32 (as HF does), then copied to wherever the buffers live."""
        t = torch.arange(self.config.max_position_embeddings, dtype=torch.float32)
        freqs = torch.outer(t, rope_inv_freq(self.config))
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half convention, so HF checkpoints load without permuting q/k weights."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class KVCache:
    """Keys/values of one layer, (B, n_kv_heads, max_len, head_dim), indexed by absolute position so
    that prefill and single-token decode are the same code path.

    Without a dtype the buffers are allocated at the first update, in the dtype the layer computes in (which
    differs from the weights' under autocast or FSDP mixed precision: fp32 shards, bf16 compute) and with the
    heads the layer computes (a tensor-parallel rank holds 1/tp of them)."""

    def __init__(self, shape: tuple[int, int, int, int], device=None, dtype=None):
        self.shape, self.max_len = shape, shape[2]
        self.k = self.v = None
        if dtype is not None:
            self.k = torch.zeros(shape, device=device, dtype=dtype)
            self.v = torch.zeros(shape, device=device, dtype=dtype)

    def update(self, input_pos: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        if self.k is None:
            shape = (self.shape[0], k.shape[1], *self.shape[2:])
            self.k, self.v = k.new_zeros(shape), v.new_zeros(shape)
        self.k[:, :, input_pos] = k.to(self.k.dtype)
        self.v[:, :, input_pos] = v.to(self.v.dtype)
        return self.k, self.v


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.head_dim = hd
        self.q_proj = nn.Linear(d, config.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, config.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(config.num_attention_heads * hd, d, bias=False)

    def mask_mod(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        """Whether the query at position `q_idx` attends to the key at `kv_idx` (FlexAttention's mask_mod): the one
        place the attention pattern lives. Every mask of a forward pass is built from it (`masks`: training's SDPA
        mask, FlexAttention's BlockMask, the KV cache's slot mask), so a subclass that overrides it (a sliding
        window, docs/customize.md) is honoured by training, generation and evaluation alike."""
        return masks.causal(b, h, q_idx, kv_idx)

    @property
    def is_causal(self) -> bool:
        """Plain causal attention: SDPA's fast path (no mask built) and context parallel's ring attention."""
        return type(self).mask_mod is Attention.mask_mod

    def layout_refusal(self, dims) -> str | None:
        """Why this attention cannot run under the parallel layout `dims` (`parallel.dims.ParallelDims`), else None;
        asked before any rank starts (parallel/layout_checks.py). Context parallel runs torch's ring attention,
        which is plain causal: a pattern of a subclass's own has no place there."""
        if dims.cp > 1 and not self.is_causal:
            name = type(self).__name__
            return (
                f"strategy.cp={dims.cp} runs torch's causal ring attention, which has no place for {name}'s own "
                f"pattern ({name}.mask_mod); use strategy.cp=1"
            )
        return None

    def project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Queries, keys and values, each (B, T, heads, head_dim) (the heads this rank holds under tensor
        parallelism), before rope: the step a family changes (models/qwen3 normalizes q and k here)."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, -1, self.head_dim)
        k = self.k_proj(x).view(B, T, -1, self.head_dim)
        v = self.v_proj(x).view(B, T, -1, self.head_dim)
        return q, k, v

    def forward(self, x, cos, sin, attn_mask=None, kv_cache=None, input_pos=None) -> Tensor:
        """``attn_mask=None`` means plain causal attention (SDPA's fast path); a ``BlockMask`` runs FlexAttention;
        either way built by the model from `mask_mod`."""
        B, T, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self.project(x))  # (B, heads, T, head_dim)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(input_pos, k, v)
        # enable_gqa: each K/V head serves its group of query heads without materialized copies.
        if isinstance(attn_mask, BlockMask):
            y = masks.compiled_flex_attention(q, k, v, block_mask=attn_mask, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask, is_causal=attn_mask is None, enable_gqa=True
            )
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block. Tensors (or None) in, tensor out, so that FSDP, torch.compile and
    activation checkpointing can each wrap one layer.

    Its parts are class attributes, so that a family that differs in one of them subclasses and replaces it
    (models/qwen3: `attention = Qwen3Attention`) instead of copying this file. They are not named `self_attn`
    and `mlp`: those are the modules built from them, named as in Hugging Face checkpoints. `layer_idx`: the
    block's index, for a family whose blocks differ (models/qwen3_moe: experts in some, a dense MLP in others)."""

    attention: type[nn.Module] = Attention
    feed_forward: type[nn.Module] = MLP

    def __init__(self, config: LlamaConfig, layer_idx: int = 0):
        super().__init__()
        self.layer_idx = layer_idx
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.self_attn = self.attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = self.feed_forward(config)

    def forward(self, x, cos, sin, attn_mask=None, kv_cache=None, input_pos=None) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attn_mask, kv_cache, input_pos)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(nn.Module):
    """The decoder: embedding, `num_hidden_layers` blocks of `decoder_layer` (a family replaces it by
    subclassing), final norm, head (its vocabulary padded inside the matmul in training: `logits`)."""

    decoder_layer: type[nn.Module] = DecoderLayer
    # The model contract's ends (models/contract.py): what a first / last pipeline stage holds, what every one does
    input_modules = ("embed_tokens",)
    output_modules = ("norm", "lm_head")
    shared_modules = ("rotary_emb",)

    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        # Keyed by index, not a list: a pipeline stage that keeps layers 4-7 still names them layers.4-7.
        layers = {str(i): self.decoder_layer(config, i) for i in range(config.num_hidden_layers)}
        self.layers = nn.ModuleDict(layers)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary_emb = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        if not self.embed_tokens.weight.is_meta:
            self.init_weights()

    @torch.no_grad()
    def init_weights(self) -> None:
        """(Re)initialize all weights and the rope buffers: FSDP2 builds the model on the meta
        device, then calls ``to_empty()`` and this. Weights are N(0, initializer_range), but the
        projections into the residual stream (o_proj, down_proj) divide the std by
        sqrt(2 * num_hidden_layers), as GPT-2 does, so residual variance does not grow with depth."""
        if self.config.tie_word_embeddings and self.lm_head is not None and self.embed_tokens is not None:
            self.lm_head.weight = self.embed_tokens.weight  # to_empty() unties plain tensors
        self.rotary_emb.init_buffers()
        std = self.config.initializer_range
        residual_std = std / math.sqrt(2 * self.config.num_hidden_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                is_residual = name.endswith(("o_proj", "down_proj"))
                nn.init.normal_(module.weight, mean=0.0, std=residual_std if is_residual else std)
            elif isinstance(module, nn.RMSNorm):
                nn.init.ones_(module.weight)

    def new_kv_cache(self, batch_size: int, max_len: int, device=None, dtype=None) -> list[KVCache]:
        """One empty cache per layer, on the model's device; by default in the dtype attention computes in."""
        c = self.config
        shape = (batch_size, c.num_key_value_heads, max_len, c.head_dim)
        device = device or self.rotary_emb.cos.device
        return [KVCache(shape, device, dtype) for _ in self.layers]

    def forward(
        self,
        input_ids,
        attention_mask=None,
        *,
        position_ids=None,
        document_ids=None,
        input_pos=None,
        kv_cache=None,
        hidden_states=False,
    ) -> Tensor:
        """Logits (B, T, vocab_size) in the model's dtype for ``input_ids`` (B, T). A pipeline stage without
        the embedding takes the previous stage's hidden states (B, T, hidden) instead, and one without the head
        returns its own; ``hidden_states=True`` returns the final norm's output, for ``head``.

        - No mask: causal attention over the whole row (packed batches, fastest path).
        - ``attention_mask`` (B, T), 1 = token, 0 = padding: positions are still 0..T-1, so
          padding is assumed to be on the right (the usual training layout).
        - ``document_ids`` (B, T), the document each token belongs to (packed batches): a token attends
          to earlier tokens of its own document only, through compiled FlexAttention on the devices in
          ``masks.FLEX_ATTENTION_DEVICES`` (CUDA), SDPA with a block-diagonal mask elsewhere. Pass the
          ``position_ids`` (B, T) that restart at 0 with every document too, and each document's logits are
          those of the document alone (the data module's ``document_mask=true`` gives both).
        - ``kv_cache`` (from ``new_kv_cache``) needs ``input_pos``, the 1D positions of the given
          tokens: their keys/values go to those cache slots and a query at position p attends to the
          slots the pattern allows it (<= p, causal). This serves a multi-token prefill as well as single-token
          decode steps.

        Every mask comes from the attention's pattern, `Attention.mask_mod` (the blocks share one), combined with
        the padding, the documents or the cache slots in `masks`.
        """
        (B, T), device = input_ids.shape[:2], input_ids.device
        pattern = next(iter(self.layers.values())).self_attn
        mask_mod, mask = pattern.mask_mod, None
        if kv_cache is not None:
            if input_pos is None or any(x is not None for x in (attention_mask, position_ids, document_ids)):
                raise ValueError(
                    "kv_cache needs input_pos and takes no attention_mask, position_ids or document_ids"
                )
            mask = masks.build(masks.at_positions(mask_mod, input_pos), None, T, kv_cache[0].max_len, device)
        elif T > self.config.max_position_embeddings:
            raise ValueError(f"sequence length {T} > model.max_position_embeddings")
        elif document_ids is not None:
            if attention_mask is not None:
                raise ValueError(
                    "document_ids and attention_mask exclude each other (packed vs padded samples)"
                )
            flex = device.type in masks.FLEX_ATTENTION_DEVICES
            mask = masks.build(masks.within_documents(mask_mod, document_ids), B, T, T, device, flex=flex)
        elif attention_mask is not None:
            mask = masks.build(masks.with_padding(mask_mod, attention_mask), B, T, T, device)
        elif not pattern.is_causal:
            mask = masks.build(mask_mod, None, T, T, device)
        rope = self.rotary_emb
        h = self.embed_tokens(input_ids) if self.embed_tokens is not None else input_ids
        # Tables stay float32 (e.g. under FSDP mixed precision); rope runs in h's dtype, as in HF.
        if position_ids is not None:  # (B, T) -> (B, 1, T, head_dim), broadcast over heads
            cos, sin = (table[position_ids].unsqueeze(1).to(h.dtype) for table in (rope.cos, rope.sin))
        else:
            rows = slice(0, T) if input_pos is None else input_pos
            cos, sin = rope.cos[rows].to(h.dtype), rope.sin[rows].to(h.dtype)
        for i, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, mask, None if kv_cache is None else kv_cache[i], input_pos)
        h = self.norm(h) if self.norm is not None else h
        return self.logits(h) if self.lm_head is not None and not hidden_states else h

    def head(self, hidden: Tensor, loss=None) -> Tensor:
        """The head on the final hidden states (``forward(..., hidden_states=True)``): the logits, or with
        ``loss`` (a function of the hidden states and the head module) what it returns: the fused loss computes the
        head's matmul with the cross-entropy, chunk by chunk (training/loss.py), on the head as it is (unpadded).
        A method of its own, so that FSDP runs it under its hooks (distributed/blocks.py)."""
        return self.logits(hidden) if loss is None else loss(hidden, self.lm_head)

    def logits(self, hidden: Tensor) -> Tensor:
        """The head's logits, (..., vocab_size) exactly. In training (gradients taken) the matmul runs on the
        weight padded with zero rows to a multiple of ``config.pad_vocab_multiple`` (50000 leaves the GEMMs' last
        tile partial, 50048 fills it), and the padded columns are cut off here: no loss, metric or sampler ever sees
        them. Off by default: on an H200 it lost (the 180M 0.95x; `model.pad_vocab_multiple=64` turns it on).

        Padded in the computation, not in the parameter, so that nothing else has to know: ``lm_head.weight``
        keeps its (vocab_size, hidden) shape in checkpoints (those written before the padding load as they are),
        the optimizer, Hugging Face folders, tensor parallel and ZeRO-3; stored padded rows would change all of
        them. The price, against the head's three GEMMs of a training step: one copy of the weight (under
        autocast, of the compute-dtype cast the matmul makes anyway) and, in backward, the logits' gradient
        written into a padded buffer (one pass over it, which torch.compile can fuse into the loss's backward).
        Without gradients (validation, evaluation, generation's one-token steps, whose GEMM is bound by reading
        the weight) the copy would cost more than it saves, and the head runs as it is, as it does where its
        weight is not whole (a tensor-parallel DTensor, a ZeRO-3 partition), where it is not a plain
        ``nn.Linear``, or where the vocabulary is a multiple already."""
        weight = self.padded_head_weight()
        if weight is None:
            return self.lm_head(hidden)
        # A view, not a copy (a pass over the logits): FSDP2 warns that its root returned one, harmless while no
        # caller changes the logits in place
        return F.linear(hidden, weight)[..., : self.lm_head.out_features]

    def padded_head_weight(self) -> Tensor | None:
        """``lm_head.weight`` with zero rows up to a multiple of ``config.pad_vocab_multiple``, in the dtype the
        matmul computes in; None where the head runs as it is (see `logits`)."""
        weight, vocab = self.lm_head.weight, self.lm_head.out_features
        pad = -vocab % self.config.pad_vocab_multiple
        whole = type(self.lm_head) is nn.Linear and type(weight) in (Tensor, nn.Parameter)
        if not (pad and torch.is_grad_enabled() and whole and not hasattr(weight, "ds_id")):
            return None
        if torch.is_autocast_enabled(device := weight.device.type):
            weight = weight.to(torch.get_autocast_dtype(device))
        return F.pad(weight, (0, 0, 0, pad))

"""Document masking of packed batches (`data.document_mask=true`): attention and positions stop at document
boundaries, so a packed window computes what each of its documents computes alone."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from parallama.data import TextDataModule, byte_level, embedded, special_ids
from parallama.data.datasets import PackedDataset
from parallama.errors import ConfigError
from parallama.models.llama import masks
from parallama.models.llama import model as model_module
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama
from parallama.tokenizer import IGNORE_INDEX, SpecialIds

VOCAB, BOT, EOT, PAD = 97, 94, 95, 96
SPECIALS = SpecialIds(bot=BOT, eot=EOT, pad=PAD)


def build(seed=0) -> Llama:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: the masked paths keep enable_gqa
        max_position_embeddings=64,
    )
    return Llama(config).eval()


def stream(lengths, seed=1) -> np.ndarray:
    """Documents [BOT] ids [EOT] of the given content lengths, concatenated (the cache's train.bin)."""
    g = np.random.default_rng(seed)
    docs = [np.concatenate([[BOT], g.integers(0, BOT, n), [EOT]]) for n in lengths]
    return np.concatenate(docs).astype(np.uint16)


def forward(model, item: dict, masked: bool = True) -> torch.Tensor:
    keys = ("position_ids", "document_ids") if masked else ()
    with torch.no_grad():
        return model(item["input_ids"][None], **{k: item[k][None] for k in keys})[0]


# --- the model -----------------------------------------------------------------------------


def test_packed_window_equals_each_document_alone():
    """Row 0 starts at a BOT: one whole document, the start of the next. Row 1 starts inside that one, holds
    three whole documents and the start of a fifth. Each piece computes what it computes alone."""
    tokens = stream([20, 12, 4, 8, 5, 20], seed=2)  # documents at 0, 22, 36, 42, 52, 59; 81 tokens
    data = PackedDataset(tokens, seq_len=32, document_specials=SPECIALS)
    keys = ("input_ids", "position_ids", "document_ids")
    batch = {k: torch.stack([data[0][k], data[1][k]]) for k in keys}
    model = build()
    with torch.no_grad():
        packed = model(
            batch["input_ids"], position_ids=batch["position_ids"], document_ids=batch["document_ids"]
        )
    whole = 0
    for row in range(2):
        ids, docs = batch["input_ids"][row], batch["document_ids"][row]
        for d in docs.unique():
            where = (docs == d).nonzero()[:, 0]
            piece = ids[where]  # a whole document, or the part of one the window holds
            whole += int(piece[0] == BOT and piece[-1] == EOT)
            with torch.no_grad():
                alone = model(piece[None])[0]
            torch.testing.assert_close(packed[row, where], alone, atol=1e-5, rtol=0)
    assert whole == 4
    # Without the mask the same window differs: the test can fail.
    with torch.no_grad():
        unmasked = model(batch["input_ids"])
    assert (unmasked - packed).abs().max() > 1e-3


def test_next_document_does_not_see_the_previous_one():
    tokens = stream([7, 9], seed=3)  # BOT a.. EOT BOT b.. EOT: 9 + 11 tokens
    changed = tokens.copy()
    changed[1:8] = (changed[1:8] + 1) % BOT  # another first document, same length
    model = build()
    a, b = (PackedDataset(t, 19, SPECIALS)[0] for t in (tokens, changed))
    assert a["labels"][8] == IGNORE_INDEX  # EOT -> the next BOT is no prediction to learn
    second = slice(9, 19)  # the second document: its BOT, then its content
    masked = forward(model, a), forward(model, b)
    torch.testing.assert_close(masked[0][second], masked[1][second], atol=1e-6, rtol=0)
    # the first token's loss (its BOT predicts the first content token) is the same number
    loss = [F.cross_entropy(m[9:10], a["labels"][9:10]) for m in masked]
    assert loss[0] == pytest.approx(loss[1].item(), abs=1e-6)
    plain = forward(model, a, masked=False), forward(model, b, masked=False)
    assert (plain[0][second] - plain[1][second]).abs().max() > 1e-3  # unmasked, the change leaks through


def test_position_ids_match_hf_llama():
    """Under the mask RoPE's scores depend on relative positions only, so restarting them at each document
    hardly shows in logits; this checks that the rotation is applied at the given positions, as HF does."""
    transformers = pytest.importorskip("transformers")
    model = build()
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**model.config.to_hf_dict()))
    hf.load_state_dict(
        {f"model.{k}" if k != "lm_head.weight" else k: v for k, v in model.state_dict().items()}
    )
    x = torch.randint(0, BOT, (2, 20), generator=torch.Generator().manual_seed(6))
    positions = torch.tensor([[*range(5), *range(15)], [*range(3, 23)]])
    with torch.no_grad():
        expected = hf.eval()(x, position_ids=positions).logits
        torch.testing.assert_close(model(x, position_ids=positions), expected, atol=1e-5, rtol=0)
        assert (model(x) - expected).abs().max() > 1e-3  # positions 0..T-1 differ: the test can fail


def test_training_loss_is_that_of_each_document_alone():
    """The LightningModule's loss on a window of three whole documents: the mean over the terms of the three
    documents trained alone (the EOT -> next BOT targets are not among them)."""
    from parallama.training.module import CausalLM

    tokens = stream([6, 11, 4], seed=7)  # 8 + 13 + 6 = 27 tokens: inputs 26, the last label is the last EOT
    item = PackedDataset(tokens, 26, SPECIALS)[0]
    config = build().config
    module = CausalLM(model=vars(config), optimizer={}, scheduler={})
    module.configure_model()
    batch = {k: v[None] for k, v in item.items() if k != "index"}
    total, terms = 0.0, 0
    for start, end in ((0, 8), (8, 21), (21, 27)):
        doc = torch.from_numpy(tokens[start:end].astype(np.int64))[None]
        with torch.no_grad():
            logits = module.model(doc[:, :-1])
        total += F.cross_entropy(logits[0], doc[0, 1:], reduction="sum").item()
        terms += end - start - 1
    with torch.no_grad():
        assert module.loss(batch).item() == pytest.approx(total / terms, abs=1e-5)
        unmasked = {k: batch[k] for k in ("input_ids", "labels")}
        assert abs(module.loss(unmasked).item() - total / terms) > 1e-4


def test_unmasked_path_is_bitwise_causal_sdpa():
    """No document_ids: the fast path is untouched, the same bits as attention with SDPA's is_causal=True."""
    model = build()
    x = torch.randint(0, BOT, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        h = model.embed_tokens(x)
        cos, sin = model.rotary_emb.cos[:24], model.rotary_emb.sin[:24]
        for layer in model.layers.values():
            attn, hd = layer.self_attn, layer.self_attn.head_dim
            a = layer.input_layernorm(h)
            q, k, v = (
                p(a).view(2, 24, -1, hd).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj)
            )
            q, k = model_module.apply_rotary(q, cos, sin), model_module.apply_rotary(k, cos, sin)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            h = h + attn.o_proj(y.transpose(1, 2).reshape(2, 24, -1))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        expected = model.lm_head(model.norm(h))
        assert torch.equal(model(x), expected)
        # one document spanning the row, positions 0..T-1: the masked path computes the same to rounding
        one = torch.zeros_like(x)
        torch.testing.assert_close(model(x, document_ids=one), expected, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_attention_block_mask_equals_sdpa_mask():
    """FlexAttention runs on CPU in torch 2.13 (eager here: the mask_mod is what this checks)."""
    from torch.nn.attention.flex_attention import flex_attention

    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(2, 4, 40, 16, generator=g), *torch.randn(2, 2, 2, 40, 16, generator=g)
    documents = torch.tensor([[0] * 7 + [1] * 20 + [2] * 13, [0] * 40])
    mask_mod = masks.within_documents(masks.causal, documents)
    dense = masks.build(mask_mod, 2, 40, 40, "cpu")
    assert dense.shape == (2, 1, 40, 40) and dense.dtype == torch.bool
    expected = F.scaled_dot_product_attention(q, k, v, dense, enable_gqa=True)
    got = flex_attention(
        q, k, v, block_mask=masks.build(mask_mod, 2, 40, 40, "cpu", flex=True), enable_gqa=True
    )
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)


@pytest.mark.slow  # compiles flex_attention for the CPU (~15 s)
def test_model_with_compiled_flex_attention_matches_sdpa(monkeypatch):
    """Forward only: torch 2.13 has no FlexAttention backward on CPU (one reason CPUs use SDPA)."""
    model = build()
    item = PackedDataset(stream([10, 5, 12, 30]), 48, SPECIALS)[0]
    x, pos, doc = (item[k][None] for k in ("input_ids", "position_ids", "document_ids"))
    with torch.no_grad():
        expected = model(x, position_ids=pos, document_ids=doc)
        monkeypatch.setattr(masks, "FLEX_ATTENTION_DEVICES", {"cpu"})
        got = model(x, position_ids=pos, document_ids=doc)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


# --- the dataset and data module -----------------------------------------------------------

# BOT=1, EOT=2: documents [1 3 4 2] [1 5 2] [1 6 7 8 2] [1 9 2]
TOKENS = np.array([1, 3, 4, 2, 1, 5, 2, 1, 6, 7, 8, 2, 1, 9, 2], dtype=np.uint16)
ONE_TWO = SpecialIds(bot=1, eot=2, pad=0)


@pytest.mark.parametrize(
    ("i", "inputs", "labels", "positions", "documents"),
    [
        (0, [1, 3, 4, 2], [3, 4, 2, -100], [0, 1, 2, 3], [0, 0, 0, 0]),  # the stream's start
        (1, [1, 5, 2, 1], [5, 2, -100, 6], [0, 1, 2, 0], [0, 0, 0, 1]),  # a window that starts at a BOT
        (2, [6, 7, 8, 2], [7, 8, 2, -100], [0, 1, 2, 3], [0, 0, 0, 0]),  # starts mid-document, next BOT cut
    ],
)
def test_packed_items_carry_positions_and_documents(i, inputs, labels, positions, documents):
    item = PackedDataset(TOKENS, 4, ONE_TWO)[i]
    assert item["input_ids"].tolist() == inputs and item["labels"].tolist() == labels
    assert item["position_ids"].tolist() == positions and item["document_ids"].tolist() == documents
    assert all(v.dtype == torch.int64 for k, v in item.items())
    plain = PackedDataset(TOKENS, 4)[i]  # without masking: no new keys, the labels of plain packing
    assert set(plain) == {"input_ids", "labels", "index"} and torch.equal(
        plain["input_ids"], item["input_ids"]
    )


def test_one_token_for_bot_and_eot():
    """GPT-2's <|endoftext|> is both: a document starts at it only right after another one."""
    tokens = np.array([1, 3, 4, 1, 1, 5, 1, 1, 6, 1], dtype=np.uint16)
    data = PackedDataset(tokens, 4, SpecialIds(bot=1, eot=1, pad=0))
    first, second = data[0], data[1]
    assert first["labels"].tolist() == [3, 4, 1, -100]  # predicting the EOT stays, the next BOT does not
    assert first["position_ids"].tolist() == [0, 1, 2, 3]
    assert second["input_ids"].tolist() == [1, 5, 1, 1]
    assert second["position_ids"].tolist() == [0, 1, 2, 0] and second["document_ids"].tolist() == [0, 0, 0, 1]
    assert second["labels"].tolist() == [5, 1, -100, 6]


def datamodule(cache, **kwargs) -> TextDataModule:
    source = partial(embedded, corpus="prose", max_documents=6)
    return TextDataModule(source, byte_level, seq_len=64, batch_size=4, cache_dir=str(cache), **kwargs)


def test_datamodule_batches_carry_document_fields(tmp_path):
    dm = datamodule(tmp_path, document_mask=True)
    dm.setup()
    batches = list(dm.train_dataloader())  # one epoch: 6 documents of a few KB hold a few boundaries
    ids, pos, doc, labels = (
        torch.cat([b[k] for b in batches]) for k in ("input_ids", "position_ids", "document_ids", "labels")
    )
    assert ids.shape == pos.shape == doc.shape == (4 * len(batches), 64)
    bot, eot = special_ids(dm.tokenizer)[:2]
    new_document = doc[:, 1:] != doc[:, :-1]
    assert new_document.sum() >= 2
    assert (ids[:, 1:][new_document] == bot).all() and (ids[:, :-1][new_document] == eot).all()
    assert (pos[:, 1:][new_document] == 0).all()
    assert (pos[:, 1:][~new_document] == pos[:, :-1][~new_document] + 1).all()
    assert (labels[:, :-1] == IGNORE_INDEX).sum() == new_document.sum()  # only EOT -> next BOT is dropped


def test_document_mask_needs_packing(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.document_mask=true needs data\.packing=true") as info:
        datamodule(tmp_path, packing=False, document_mask=True)
    assert "\n" not in str(info.value)


# --- training end to end ----------------------------------------------------------------------

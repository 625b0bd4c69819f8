"""Tokenizer factories (Hydra `_target_`s).

Every factory returns a `tokenizers.Tokenizer`, so any kind saves to one Hugging Face
`tokenizer.json` and reloads with `from_pretrained`. Every returned tokenizer can
mark document boundaries and padding: see `special_ids`.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, ClassVar, NamedTuple

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from parallama.errors import ConfigError
from parallama.rules import Rule, key

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger("parallama")

BOT = "[BOT]"  # begin of text: first token of every document
EOT = "[EOT]"  # end of text: last token of every document
PAD = "[PAD]"  # fills per-document samples up to seq_len
UNK = "[UNK]"  # kept for parity with the source article; byte-level never emits it
SPECIALS = [BOT, EOT, PAD, UNK]
IGNORE_INDEX = (
    -100
)  # a label no loss counts (torch.nn.functional.cross_entropy's default): padding, document ends

# Role -> tokens that fill it, ours first. Pretrained tokenizers keep their own
# bos/eos so that their vocabulary (and any pretrained embedding) is unchanged.
_ALIASES = {
    "bot": (BOT, "<|begin_of_text|>", "<s>", "<|endoftext|>"),
    "eot": (EOT, "<|end_of_text|>", "</s>", "<|endoftext|>"),
    "pad": (PAD, "<pad>", "<|pad|>"),
}
_OURS = {"bot": BOT, "eot": EOT, "pad": PAD}
_HUB_ID = re.compile(r"\w[\w.-]*(/\w[\w.-]*)?")  # "gpt2", "meta-llama/Llama-3.2-1B"
# A space or newline right after a non-whitespace character: GPT-2's pre-tokenizer regex never
# matches across it (no pattern continues from a non-space into whitespace, none looks behind).
_SAFE_SPLIT = re.compile(r"(?<=\S)[ \n]")
CHUNK_CHARS = 64 * 1024  # long documents are processed in `chunks` of about this size
BATCH_CHARS = 256 * 1024  # text per encode_batch call: bounds the tokenizer's Encoding objects


class SpecialIds(NamedTuple):
    bot: int
    eot: int
    pad: int


def _byte_level_pipeline(tok: Tokenizer) -> Tokenizer:
    """GPT-2 style bytes <-> printable chars mapping: every UTF-8 string round-trips."""
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def byte_level() -> Tokenizer:
    """Untrained byte tokenizer: ids 0..255 are the ByteLevel alphabet sorted by code
    point, which is GPT-2's byte order; then BOT, EOT, PAD, UNK = 256..259."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.add_special_tokens(SPECIALS)
    return _byte_level_pipeline(tok)


@dataclass
class BPEKeys:
    """`train_bpe`'s keys (`config_keys`: the config check asks the tokenizer `_target_` names for them)."""

    conf: ClassVar[str] = "tokenizer/bpe.yaml"

    vocab_size: int = key(4096, Rule(int, len(SPECIALS) + 256))  # the specials + 256 bytes
    min_frequency: int = key(2, Rule(int, 1))
    train_documents: int | None = key(100000, Rule(int, 1, allow=(None,)))


def train_bpe(
    texts: Iterable[str], vocab_size: int, min_frequency: int = 2, train_documents: int | None = None
) -> Tokenizer:
    """Byte-level BPE as in the source article: specials get ids 0..3, then the 256
    byte symbols, then merges up to `vocab_size`. Deterministic for a given corpus. Trained on the first
    `train_documents` texts (None: all): a sample is enough for the merges, and a web-scale corpus would take
    hours and the trainer's memory grows with the distinct words seen. Long texts are fed in `chunks` (same
    word counts, so the same tokenizer) to bound the trainer's memory."""
    if vocab_size < len(SPECIALS) + 256:
        raise ConfigError(
            f"tokenizer.vocab_size={vocab_size} must be >= {len(SPECIALS) + 256} (specials + 256 bytes)"
        )
    if train_documents is not None and train_documents < 1:
        raise ConfigError(f"tokenizer.train_documents={train_documents} must be >= 1 (or null for all)")
    texts = itertools.islice(texts, train_documents)
    tok = _byte_level_pipeline(Tokenizer(models.BPE(unk_token=UNK)))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((c for text in texts for c in chunks(text, CHUNK_CHARS)), trainer=trainer)
    if (learned := tok.get_vocab_size()) < vocab_size:
        log.warning(
            f"tokenizer: BPE learned {learned} tokens, not the tokenizer.vocab_size={vocab_size} asked: its text "
            f"has no more pairs seen tokenizer.min_frequency={min_frequency} times (a small corpus); more text "
            "(more data, a higher tokenizer.train_documents) or a lower min_frequency learns more"
        )
    return tok


train_bpe.config_keys = BPEKeys


def splits_safely(tok: Tokenizer) -> bool:
    """Whether encoding `chunks(text)` one by one gives the ids of encoding `text` whole: true for
    GPT-2 style pipelines (ours, GPT-2's): no normalizer, a regex ByteLevel pre-tokenizer, BPE, and
    added tokens that do not strip whitespace around them."""
    cfg = json.loads(tok.to_str())
    pre = cfg["pre_tokenizer"] or {}
    return (
        cfg["normalizer"] is None
        and pre.get("type") == "ByteLevel"
        and pre.get("use_regex", True)
        and not pre.get("add_prefix_space")
        and cfg["model"]["type"] == "BPE"
        and not cfg["model"].get("dropout")
        and not any(t["lstrip"] or t["rstrip"] or t["single_word"] for t in cfg["added_tokens"])
    )


def chunks(text: str, size: int) -> Iterator[str]:
    """Consecutive pieces of `text`, each at least `size` characters (but the last), cut only where a
    GPT-2 style pre-tokenizer always cuts; a text without such a place stays whole."""
    start = 0
    while len(text) - start > size and (cut := _SAFE_SPLIT.search(text, start + size)):
        yield text[start : cut.start()]
        start = cut.start()
    yield text[start:]


def from_pretrained(name_or_path: str) -> Tokenizer:
    """Load a `tokenizer.json` file, a folder holding one, or a Hub repo id ("org/name";
    a missing relative path of that shape is tried on the Hub, which then reports it).

    Roles the tokenizer has no token for (see `_ALIASES`) get our BOT/EOT/PAD added as
    new special tokens, which grows the vocabulary by at most 3.
    """
    path = local_tokenizer_file(name_or_path)
    tok = Tokenizer.from_file(path) if path is not None else Tokenizer.from_pretrained(name_or_path)
    missing = [_OURS[role] for role in _ALIASES if _find(tok, role) is None]
    tok.add_special_tokens(missing)
    return tok


def local_tokenizer_file(name_or_path: str) -> str | None:
    """The tokenizer.json that `name_or_path` names on disk; None for a Hub repo id; FileNotFoundError for a path
    that holds none (checked before the run starts: app/checks.py)."""
    path = os.path.expanduser(name_or_path)
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if os.path.isfile(path):
        return path
    if os.path.exists(path) or path.endswith(".json") or not _HUB_ID.fullmatch(name_or_path):
        raise FileNotFoundError(f"tokenizer.name_or_path: no tokenizer file at {path!r}")
    return None


def _find(tok: Tokenizer, role: str) -> int | None:
    return next((i for t in _ALIASES[role] if (i := tok.token_to_id(t)) is not None), None)


def special_ids(tok: Tokenizer) -> SpecialIds:
    """Ids of the document-begin, document-end and padding tokens of `tok`."""
    ids = {role: _find(tok, role) for role in _ALIASES}
    if None in ids.values():
        missing = [role for role, i in ids.items() if i is None]
        raise ConfigError(
            f"tokenizer has no token for {missing}; build it with parallama.tokenizer factories"
        )
    return SpecialIds(**ids)


def _pieces(docs: Iterable[str], size: int | None) -> Iterator[tuple[str, bool, bool]]:
    """(text, first piece of its document, last piece) for every document, cut in `chunks` of `size`."""
    for doc in docs:
        parts = chunks(doc, size) if size else iter((doc,))
        part, first = next(parts), True
        for after in parts:
            yield part, first, False
            part, first = after, False
        yield part, first, True


def encode_documents(
    tok: Tokenizer, docs: Iterable[str], f: BinaryIO, dtype: np.dtype, progress, batch_size: int
) -> list[int]:
    """Write [BOT] + ids + [EOT] of every document to `f`; returns their lengths. Memory does not grow
    with the longest document: long ones are encoded in chunks where that keeps the ids the same
    (`splits_safely`), at most `batch_size` pieces and BATCH_CHARS of text per encode_batch, ids go out as
    numpy arrays. `progress.update(docs, tokens)` is told after each batch."""
    import numpy as np  # start-up time (numpy: the config check imports this module for the tokenizer's keys)

    ids = special_ids(tok)
    bot, eot = np.array([ids.bot], dtype), np.array([ids.eot], dtype)
    size = CHUNK_CHARS if splits_safely(tok) else None
    lengths: list[int] = []
    doc_len = 0  # tokens so far of the document in progress (it may span batches)
    batch: list[tuple[str, bool, bool]] = []
    chars = 0

    def flush() -> None:
        nonlocal doc_len
        arrays, n_tokens, n_docs = [], 0, 0
        for (_, first, last), enc in zip(
            batch, tok.encode_batch([text for text, _, _ in batch], add_special_tokens=False), strict=True
        ):
            arrays += [bot] * first + [encoded := np.array(enc.ids, dtype)] + [eot] * last
            n = len(encoded) + first + last
            doc_len, n_tokens = doc_len + n, n_tokens + n
            if last:
                lengths.append(doc_len)
                doc_len, n_docs = 0, n_docs + 1
        f.write(np.concatenate(arrays).tobytes())
        progress.update(n_docs, n_tokens)
        batch.clear()

    for piece in _pieces(docs, size):
        batch.append(piece)
        chars += len(piece[0])
        if len(batch) >= batch_size or chars >= BATCH_CHARS:
            flush()
            chars = 0
    if batch:
        flush()
    return lengths

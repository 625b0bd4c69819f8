"""Data pipeline: document sources -> tokenizer -> cached token memmaps -> batches."""

from parallama.data.datamodule import TextDataModule
from parallama.data.datasets import PackedDataset, PaddedDataset, ResumableDistributedSampler
from parallama.data.sources import embedded, files, hub
from parallama.data.tokenizer import (
    BOT,
    EOT,
    PAD,
    UNK,
    SpecialIds,
    byte_level,
    from_pretrained,
    special_ids,
    train_bpe,
)

__all__ = [
    "BOT",
    "EOT",
    "PAD",
    "UNK",
    "PackedDataset",
    "PaddedDataset",
    "ResumableDistributedSampler",
    "SpecialIds",
    "TextDataModule",
    "byte_level",
    "embedded",
    "files",
    "from_pretrained",
    "hub",
    "special_ids",
    "train_bpe",
]

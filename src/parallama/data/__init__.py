"""Data pipeline: document sources -> tokenizer -> token cache (shards + index) -> batches.

Names are imported on first use: the tools that only need a tokenizer (parallama-export, -generate) then do
not load Lightning (datamodule) or `datasets` (sources), which take seconds to import.
"""

from importlib import import_module

_WHERE = {
    "TextDataModule": "datamodule",
    **dict.fromkeys(("TokenCache", "CacheEntry"), "cache"),
    "ShardedTokens": "shards",
    **dict.fromkeys(("PackedDataset", "PaddedDataset", "ResumableDistributedSampler"), "datasets"),
    **dict.fromkeys(("embedded", "files", "hub"), "sources"),
    **dict.fromkeys(("EpochIndexSampler", "MixtureDataset"), "mixture"),
    **dict.fromkeys(
        (
            "BOT",
            "EOT",
            "PAD",
            "UNK",
            "SpecialIds",
            "byte_level",
            "from_pretrained",
            "special_ids",
            "train_bpe",
        ),
        "parallama.tokenizer",  # the package's root: models and the toolkit read its conventions too
    ),
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    where = _WHERE[name]
    return getattr(import_module(where if "." in where else f"{__name__}.{where}"), name)

"""An alias of `parallama.tokenizer` under its old path: run configs saved before it moved name
`parallama.data.tokenizer.byte_level` (and `train_bpe`, `from_pretrained`) as their tokenizer's `_target_`."""

from parallama.tokenizer import byte_level, from_pretrained, train_bpe

__all__ = ["byte_level", "from_pretrained", "train_bpe"]

"""The recipe's one loss (conf/loss/): cross-entropy over the labelled tokens, with label smoothing and z-loss.

Every path calls it: a plain forward (`CausalLM.loss`), the pipeline's last stage and context parallel (both sum it
and divide by the batch's labelled tokens themselves), and tensor parallel, where the logits are a DTensor sharded
on the vocabulary inside `loss_parallel()`: each term below is written with ops that DTensor shards that way (no
rank gathers the logits). A loss term of your own: subclass `CrossEntropy` and name it in `loss._target_`
(docs/customize.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from parallama.data.datasets import IGNORE_INDEX
from parallama.errors import ConfigError


@dataclass
class CrossEntropy:
    """label_smoothing: weight of the uniform distribution in the target (0: none); z_loss: coefficient of the
    squared log-partition function per token (PaLM's 1e-4 keeps the logits from drifting; 0: none)."""

    label_smoothing: float = 0.0
    z_loss: float = 0.0

    def __post_init__(self) -> None:
        if not (isinstance(self.label_smoothing, (int, float)) and 0 <= self.label_smoothing < 1):
            raise ConfigError(
                f"loss.label_smoothing={self.label_smoothing!r} is not valid; use a number in [0, 1)"
            )
        if not (isinstance(self.z_loss, (int, float)) and self.z_loss >= 0):
            raise ConfigError(f"loss.z_loss={self.z_loss!r} is not valid; use a number >= 0")

    def __call__(self, logits: Tensor, labels: Tensor, reduction: str = "mean") -> Tensor:
        """`logits` (..., vocab) against `labels` (...), IGNORE_INDEX skipped: the mean over the labelled tokens,
        or with reduction="sum" their sum (the caller divides by a count over more than this batch)."""
        logits, labels = logits.flatten(0, -2).float(), labels.flatten()
        loss = _full(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
        if self.label_smoothing or self.z_loss:
            labelled = labels != IGNORE_INDEX
            # log-sum-exp by hand: torch.logsumexp has no vocab-sharded DTensor rule
            peak = logits.detach().amax(-1, keepdim=True)
            lse = _full((logits - peak).exp().sum(-1).log() + peak.squeeze(-1))
            if self.label_smoothing:  # -mean_c log p_c = lse - mean_c logit_c, per labelled token
                uniform = torch.where(labelled, lse - _full(logits.mean(-1)), 0).sum()
                loss = (1 - self.label_smoothing) * loss + self.label_smoothing * uniform
            if self.z_loss:
                loss = loss + self.z_loss * torch.where(labelled, lse.square(), 0).sum()
        if reduction == "sum":
            return loss
        return loss / (labels != IGNORE_INDEX).sum().clamp(min=1)


def _full(t: Tensor) -> Tensor:
    """A replicated DTensor (a reduction over the sharded vocabulary) as a plain tensor, keeping autograd."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

"""The recipe's one loss (conf/loss/): cross-entropy over the labelled tokens, with label smoothing and z-loss.

Every path calls it: a plain forward (`CausalLM.loss`), the pipeline's last stage and context parallel (both sum it
and divide by the batch's labelled tokens themselves), and tensor parallel, where the logits are a DTensor sharded
on the vocabulary inside `loss_parallel()`: each term below is written with ops that DTensor shards that way (no
rank gathers the logits). A loss term of your own: subclass `CrossEntropy` and name it in `loss._target_`
(docs/customize.md).

`impl="fused"` computes the head's matmul and the loss together, chunk by chunk, so the (tokens, vocab) logits and
their gradient never exist whole (`fused`): the model hands over its final hidden states and its head
(`DecoderModel.head`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from parallama.data.datasets import IGNORE_INDEX
from parallama.errors import ConfigError

IMPLS = ("plain", "fused")


@dataclass
class CrossEntropy:
    """label_smoothing: weight of the uniform distribution in the target (0: none); z_loss: coefficient of the
    squared log-partition function per token (PaLM's 1e-4 keeps the logits from drifting; 0: none).
    impl: "plain" (the head's logits, then the loss) or "fused" (both per chunk of `chunk_size` tokens, in training;
    validation takes the plain path: no gradient memory is at stake there, and `on_validation_logits` reads logits)."""

    label_smoothing: float = 0.0
    z_loss: float = 0.0
    impl: str = "plain"
    chunk_size: int = 1024

    def __post_init__(self) -> None:
        if not (isinstance(self.label_smoothing, (int, float)) and 0 <= self.label_smoothing < 1):
            raise ConfigError(
                f"loss.label_smoothing={self.label_smoothing!r} is not valid; use a number in [0, 1)"
            )
        if not (isinstance(self.z_loss, (int, float)) and self.z_loss >= 0):
            raise ConfigError(f"loss.z_loss={self.z_loss!r} is not valid; use a number >= 0")
        if self.impl not in IMPLS:
            raise ConfigError(f"loss.impl={self.impl!r} is not valid; use one of {', '.join(IMPLS)}")
        if not (
            isinstance(self.chunk_size, int) and not isinstance(self.chunk_size, bool) and self.chunk_size > 0
        ):
            raise ConfigError(
                f"loss.chunk_size={self.chunk_size!r} is not valid; use a number of tokens >= 1"
            )

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
        return _reduced(loss, labels, reduction)

    # --- the fused head and loss (impl="fused") ---------------------------------------------------------

    def fuses(self) -> bool:
        """Whether this step computes the head with the loss: impl="fused" where gradients are taken."""
        return self.impl == "fused" and torch.is_grad_enabled()

    def head_loss(
        self, labels: Tensor, reduction: str = "mean", *, twice: bool = False
    ) -> Callable[[Tensor, nn.Module], Tensor]:
        """What `model.head(hidden, ...)` takes: this loss of `labels` as a function of the final hidden states
        and the head module (`fused`)."""
        return partial(self.fused, labels=labels, reduction=reduction, twice=twice)

    def fused(
        self, hidden: Tensor, head: nn.Module, labels: Tensor, reduction: str = "mean", twice: bool = False
    ) -> Tensor:
        """The loss of `head(hidden)` against `labels` (as `__call__`), without the whole logits.

        torch's `F.linear_cross_entropy` (chunked, its gradients computed in the forward pass) where it applies:
        the installed torch has it, no label smoothing or z-loss, and the head's weight is a plain tensor. Else
        `chunk_size` tokens at a time, each chunk's logits recomputed in backward (torch.utils.checkpoint, as
        torchtitan's chunked loss) through the head module itself: under tensor parallel its logits are a chunk's
        vocab shard, and `__call__`'s log-sum-exp is reduced over the tp ranks (no rank gathers the logits); under
        DeepSpeed's ZeRO-3 the module's hooks gather its weight. `twice`: backward runs through it twice (a
        zero-bubble pipeline schedule's input, then weight gradients), which torch's op allows at the cost of one
        more copy of its gradients."""
        if isinstance(hidden, DTensor):  # sequence parallel: each tp rank's part of the sequence
            hidden = hidden.redistribute(placements=[Replicate()])
        hidden, labels = hidden.flatten(0, -2), labels.flatten()
        if self._torch_fuses(head):
            from torch.nn import LinearCrossEntropyOptions

            weight = head.weight
            dtype = torch.get_autocast_dtype(hidden.device.type) if _autocast(hidden) else weight.dtype
            loss = F.linear_cross_entropy(
                hidden.to(dtype),
                weight.to(dtype),
                labels,
                reduction="sum",
                ignore_index=IGNORE_INDEX,
                options=LinearCrossEntropyOptions(
                    batch_chunk_size=self.chunk_size, chunking_method=None, allow_retain_graph=twice
                ),
            ).float()
        else:
            chunks = zip(hidden.split(self.chunk_size), labels.split(self.chunk_size))
            loss = sum(checkpoint(self._chunk_loss, head, h, y, use_reentrant=False) for h, y in chunks)
        return _reduced(loss, labels, reduction)

    def _chunk_loss(self, head: nn.Module, hidden: Tensor, labels: Tensor) -> Tensor:
        return self(head(hidden), labels, reduction="sum")

    def _torch_fuses(self, head: nn.Module) -> bool:
        """torch's fused op computes plain cross-entropy through a plain `nn.Linear` without bias (not a float8 or
        other module of its own) on a whole weight (not a DTensor, not a ZeRO-3 partition); a subclass's own
        `__call__` (another term) runs on each chunk's logits instead."""
        weight = head.weight
        plain_head = type(head) is nn.Linear and head.bias is None
        plain_weight = (
            plain_head and type(weight) in (torch.Tensor, nn.Parameter) and not hasattr(weight, "ds_id")
        )
        has_op = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyOptions")
        own_terms = type(self).__call__ is not CrossEntropy.__call__
        return has_op and plain_weight and not (self.label_smoothing or self.z_loss or own_terms)


def fuses(loss_fn) -> bool:
    """Whether the recipe's loss (any callable: a loss of the user's own is plain) takes the fused path now."""
    return isinstance(loss_fn, CrossEntropy) and loss_fn.fuses()


def _reduced(loss: Tensor, labels: Tensor, reduction: str) -> Tensor:
    if reduction == "sum":
        return loss
    return loss / (labels != IGNORE_INDEX).sum().clamp(min=1)


def _autocast(t: Tensor) -> bool:
    return torch.is_autocast_enabled(t.device.type)


def _full(t: Tensor) -> Tensor:
    """A replicated DTensor (a reduction over the sharded vocabulary) as a plain tensor, keeping autograd."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

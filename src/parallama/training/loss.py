"""The recipe's one loss (conf/loss/): cross-entropy over the labelled tokens, with label smoothing and z-loss.

Every path calls it: a plain forward (`CausalLM.loss`), the pipeline's last stage and context parallel (both sum it
and divide by the batch's labelled tokens themselves), and tensor parallel, where the logits are a DTensor sharded
on the vocabulary inside `loss_parallel()`: each term below is written with ops that DTensor shards that way (no
rank gathers the logits). The loss is a sum of named terms (`CrossEntropy.terms`): the cross-entropy, which val/loss
and val/ppl report alone (comparable across runs), and each addition, logged as val/<name>. A loss term of your own:
subclass `CrossEntropy`, add it in `terms` and name the class in `loss._target_` (docs/customize.md).

`impl="fused"` computes the head's matmul and the loss together, chunk by chunk, so the (tokens, vocab) logits and
their gradient never exist whole (`fused`): the model hands over its final hidden states and its head
(`DecoderModel.head`). It takes parallama's fused linear cross-entropy (training/fused_cross_entropy.py), whose
gradients are computed in the forward pass, wherever it applies (`fused_path`); torch's `F.linear_cross_entropy`
nowhere (see `fused_path`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.utils.checkpoint import checkpoint

from parallama.errors import ConfigError
from parallama.tokenizer import IGNORE_INDEX
from parallama.training.fused_cross_entropy import linear_cross_entropy, vocab_parallel

log = logging.getLogger("parallama")
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
    chunk_size: int = 4096

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
        return _reduced(sum(self.terms(logits, labels).values()), labels.flatten(), reduction)

    def terms(self, logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
        """The loss's terms, each summed over the labelled tokens, which `__call__` adds up: `cross_entropy` (what
        val/loss and val/ppl report), then what this loss adds to it, each logged as val/<name>: `label_smoothing`
        (its pull toward the uniform target), `z_loss`. A term of your own: override this and return
        `{**super().terms(logits, labels), "<name>": ...}` (docs/customize.md)."""
        logits, labels = logits.flatten(0, -2).float(), labels.flatten()
        cross_entropy = _full(F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum"))
        terms = {"cross_entropy": cross_entropy}
        if self.label_smoothing or self.z_loss:
            labelled = labels != IGNORE_INDEX
            # log-sum-exp by hand: torch.logsumexp has no vocab-sharded DTensor rule
            peak = logits.detach().amax(-1, keepdim=True)
            lse = _full((logits - peak).exp().sum(-1).log() + peak.squeeze(-1))
            if self.label_smoothing:  # -mean_c log p_c = lse - mean_c logit_c, per labelled token
                uniform = torch.where(labelled, lse - _full(logits.mean(-1)), 0).sum()
                terms["label_smoothing"] = self.label_smoothing * (uniform - cross_entropy)
            if self.z_loss:
                terms["z_loss"] = self.z_loss * torch.where(labelled, lse.square(), 0).sum()
        return terms

    # --- the fused head and loss (impl="fused") ---------------------------------------------------------

    def fuses(self) -> bool:
        """Whether this step computes the head with the loss: impl="fused" where gradients are taken."""
        return self.impl == "fused" and torch.is_grad_enabled()

    def head_loss(self, labels: Tensor, reduction: str = "mean") -> Callable[..., Tensor]:
        """What `model.head(hidden, ...)` takes: this loss of `labels` as a function of the final hidden states
        and the head module (`fused`)."""
        return partial(self.fused, labels=labels, reduction=reduction)

    def fused(
        self,
        hidden: Tensor,
        head: nn.Module,
        labels: Tensor,
        reduction: str = "mean",
        valid_vocab: int | None = None,
    ) -> Tensor:
        """The loss of `head(hidden)` against `labels` (as `__call__`), without the whole logits. `valid_vocab`:
        the head's rows that are the true vocabulary (a head padded past it): the others take no probability.

        Where `fused_path` says "parallama": training/fused_cross_entropy.py on the head's weight, each chunk's
        gradients computed in the forward pass (vocab-parallel under tensor parallel). Else "checkpointed":
        `chunk_size` tokens at a time through the head module and `__call__`, each chunk's logits recomputed in
        backward (torch.utils.checkpoint)."""
        path = fused_path(self, head)
        _say_once(path)
        if path == "parallama":
            loss = linear_cross_entropy(
                hidden,
                head.weight,
                labels,
                chunk_size=self.chunk_size,
                label_smoothing=self.label_smoothing,
                z_loss=self.z_loss,
                valid_vocab=valid_vocab,
            )
            return _reduced(loss, labels, reduction)
        if isinstance(hidden, DTensor):  # sequence parallel: each tp rank's part of the sequence
            hidden = hidden.redistribute(placements=[Replicate()])
        hidden, labels = hidden.flatten(0, -2), labels.flatten()
        chunks = zip(hidden.split(self.chunk_size), labels.split(self.chunk_size))
        loss = sum(
            checkpoint(self._chunk_loss, head, h, y, valid_vocab, use_reentrant=False) for h, y in chunks
        )
        return _reduced(loss, labels, reduction)

    def _chunk_loss(self, head: nn.Module, hidden: Tensor, labels: Tensor, valid_vocab: int | None) -> Tensor:
        logits = head(hidden)
        return self(logits if valid_vocab is None else logits[..., :valid_vocab], labels, reduction="sum")


FUSED_PATHS = {
    "parallama": "parallama's fused linear cross-entropy (gradients in the forward pass)",
    "checkpointed": "chunks through the head module, recomputed in backward",
}


def fused_path(loss_fn: CrossEntropy, head: nn.Module) -> str:
    """Which computation `CrossEntropy.fused` takes for `head`: "parallama" on a plain bias-free `nn.Linear`'s
    weight, whole or vocab-parallel. "checkpointed" where the gradient cannot be computed ahead: a subclass's own
    `terms` or `__call__` (a term of its own, run on each chunk's logits), a head module of another kind (its forward is not
    a matmul by the weight), and DeepSpeed's ZeRO-3, whose hooks gather the partitioned weight only when the head
    module itself is called (read outside it, the weight is an empty partition).

    torch's `F.linear_cross_entropy` (torch >= 2.13; the GPU machine's 2.11 lacks it) is not taken: on the 2-core
    CPU it was level with parallama's (0-3% ahead in the head alone, within the VM's noise, the same memory;
    `python -m bench loss`, docs/benchmarks.md), and it has no label smoothing, z-loss, vocab-parallel head or padded
    vocabulary, so one implementation serves every run."""
    weight = head.weight
    plain_head = type(head) is nn.Linear and head.bias is None and not hasattr(weight, "ds_id")
    own_terms = (
        type(loss_fn).__call__ is not CrossEntropy.__call__ or type(loss_fn).terms is not CrossEntropy.terms
    )
    sharded_otherwise = isinstance(weight, DTensor) and not vocab_parallel(weight)
    return "parallama" if plain_head and not (own_terms or sharded_otherwise) else "checkpointed"


_said: set[str] = set()  # the paths this process has logged


def _say_once(path: str) -> None:
    """One line per process and path: the run's log says which one its steps took."""
    if path not in _said:
        _said.add(path)
        log.info(f"loss.impl=fused: {FUSED_PATHS[path]}")


def term_names(loss_fn) -> list[str]:
    """The names of the loss's terms (`CrossEntropy.terms`), `cross_entropy` first; a loss of the user's own that is
    not a `CrossEntropy` is reported as the plain cross-entropy's (`validation_terms`)."""
    return list(validation_terms(loss_fn, torch.zeros(1, 2), torch.zeros(1, dtype=torch.long)))


def validation_terms(loss_fn, logits: Tensor, labels: Tensor) -> dict[str, Tensor]:
    """The terms validation logs (`CausalLM.validation_logits`): the loss's own, or where the loss is some other
    callable the plain cross-entropy, so that val/loss is the cross-entropy on every run."""
    return (loss_fn if isinstance(loss_fn, CrossEntropy) else CrossEntropy()).terms(logits, labels)


def _reduced(loss: Tensor, labels: Tensor, reduction: str) -> Tensor:
    if reduction == "sum":
        return loss
    return loss / (labels != IGNORE_INDEX).sum().clamp(min=1)


def _full(t: Tensor) -> Tensor:
    """A replicated DTensor (a reduction over the sharded vocabulary) as a plain tensor, keeping autograd."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

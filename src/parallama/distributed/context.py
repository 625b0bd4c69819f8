"""Context parallelism (`strategy.cp`): each sample's sequence split over the `cp` ranks, attention run as torch's
ring attention (`torch.distributed.tensor.experimental.context_parallel`), as torchtitan does.

The cp ranks of a data-parallel rank see the same batch. `sharded_batch` gives each its part of the sequence in
torch's load-balanced order (rank r holds chunks r and 2cp-1-r of 2cp, so every rank does the same share of
causal attention), with the absolute `position_ids` of those tokens (the rotary tables are indexed by them, so a
shard rotates its queries and keys by their own positions). Inside it, SDPA on q/k/v of the shard is the ring:
keys and values travel round the cp group. The ring is plain causal: the model builds no mask for the plain
pattern (`Attention.is_causal`), and an attention with a pattern of its own says it cannot run here
(`Attention.layout_refusal`), refused before any rank starts (parallel/layout_checks.py). `mean_loss` makes the
batch's loss (every token counted once) and a gradient that FSDP's average over dp_shard x cp
(`data_parallel_mesh`) turns into the batch's gradient.

On CPU torch's ring has no kernel (it dispatches only CUDA's flash/efficient/cudnn SDPA); parallama registers the
CPU flash kernel as its local op (runtime/compat.py), so the same code path trains on gloo.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental import context_parallel

from parallama.distributed.options import loss_fuses
from parallama.runtime import compat
from parallama.tokenizer import IGNORE_INDEX


def load_balanced_order(seq_len: int, cp: int) -> torch.Tensor:
    """The positions in the order the cp ranks hold them, rank 0's first: the sequence cut into 2cp chunks, rank r
    taking chunks r and 2cp-1-r (torch's head-tail load balancer)."""
    chunks = torch.arange(seq_len).view(2 * cp, -1)
    return torch.cat([torch.cat([chunks[r], chunks[2 * cp - 1 - r]]) for r in range(cp)])


def shard_positions(seq_len: int, cp: int, rank: int) -> torch.Tensor:
    """The absolute positions of the tokens cp rank `rank` holds."""
    return load_balanced_order(seq_len, cp).view(cp, -1)[rank]


def unshard(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The full sequence again from every cp rank's part (in rank order), e.g. gathered logits."""
    joined = torch.cat(parts, dim=dim)
    order = load_balanced_order(joined.shape[dim], len(parts))
    return joined.index_select(dim, torch.argsort(order).to(joined.device))


@contextmanager
def sharded_batch(cp_mesh, batch: dict):
    """This rank's part of `batch` (input_ids, labels and their position_ids), with SDPA running as ring
    attention until the context ends (a backward pass must run inside it too). The batch itself is not
    changed (its token count is what tokens-seen counts)."""
    if cp_mesh.device_type == "cpu":
        compat.enable_cpu_ring_attention()

    input_ids, labels = batch["input_ids"].clone(), batch["labels"].clone()
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None].clone()
    buffers = [input_ids, labels, positions]
    with context_parallel(
        cp_mesh, buffers=buffers, buffer_seq_dims=[1, 1, 1], no_restore_buffers=set(buffers)
    ):
        yield {"input_ids": input_ids, "labels": labels, "position_ids": positions}


def mean_loss(loss_sum: torch.Tensor, count: torch.Tensor, cp_mesh) -> torch.Tensor:
    """From this rank's summed cross-entropy over its `count` labelled tokens: the batch's mean loss (the same
    value on every cp rank), with the gradient of cp x this rank's sum over the batch's count.

    FSDP averages gradients over the dp_shard x cp ranks: the cp factor makes the cp ranks' average the gradient
    of the whole sequence's mean, also when padding leaves the ranks different numbers of labelled tokens."""
    totals = torch.stack([loss_sum.detach().float(), count.float()])
    dist.all_reduce(totals, group=cp_mesh.get_group())
    total = totals[1].clamp(min=1)
    scaled = loss_sum.float() * cp_mesh.size() / total
    return scaled + (totals[0] / total - scaled).detach()


class ContextParallelStep:
    """A training step's loss under context parallelism: the ring-attention context opens with the forward pass
    and closes after the backward (`end`), which runs the ring again; a loss without autograd (validation) closes
    it at once."""

    def __init__(self) -> None:
        self._open = ExitStack()

    def loss(self, module, batch: dict, cp_mesh, loss_context=None) -> torch.Tensor:
        """`module(input_ids, position_ids=...)` gives the logits (a LightningModule's forward), `module.loss_fn`
        their loss (training/loss.py). Padded batches run causal attention alone, which is exact for right padding
        (no real token attends to a later pad)."""
        self.end()  # a step that failed before its backward
        local = self._open.enter_context(sharded_batch(cp_mesh, batch))
        labels = local["labels"].flatten()
        with loss_context or nullcontext():
            if loss_fuses(module.loss_fn):  # loss.impl=fused: the head inside the loss (training/loss.py)
                hidden = module(local["input_ids"], position_ids=local["position_ids"], hidden_states=True)
                loss_sum = module.model.head(hidden, module.loss_fn.head_loss(labels, "sum"))
            else:
                logits = module(local["input_ids"], position_ids=local["position_ids"])
                if not torch.is_grad_enabled():
                    module.validation_logits(logits, local["labels"])
                loss_sum = module.loss_fn(logits, labels, reduction="sum")
        loss = mean_loss(loss_sum, (labels != IGNORE_INDEX).sum(), cp_mesh)
        if not torch.is_grad_enabled():
            self.end()
        return loss

    def end(self) -> None:
        self._open.close()


_flattened: dict[
    int, object
] = {}  # id(root mesh) -> its dp_shard_cp mesh (torch wants it kept, not re-sliced)


def data_parallel_mesh(mesh, dims):
    """The mesh FSDP shards over and averages gradients on: dp_shard, with cp folded in when cp > 1 (the cp ranks
    trained on parts of one batch: torchtitan's `dp_shard_cp`), and dp_replicate in front for HSDP."""
    if dims.cp == 1:
        return mesh[("dp_replicate", "dp_shard")] if dims.dp_replicate > 1 else mesh["dp_shard"]
    if id(mesh) not in _flattened:
        _flattened[id(mesh)] = compat.flatten_mesh(mesh, ("dp_shard", "cp"), "dp_shard_cp")
    return mesh[("dp_replicate", "dp_shard_cp")] if dims.dp_replicate > 1 else _flattened[id(mesh)]

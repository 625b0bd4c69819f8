"""parallama's fused linear cross-entropy (`loss.impl=fused`): the head's matmul and the loss one chunk of tokens at a
time, each chunk's gradients computed in the forward pass, as torchtitan's ChunkedLossWrapper, Liger's and Apple's
cut-cross-entropy do. Backward only scales them, so nothing is recomputed and the (tokens, vocab) logits never exist
whole: a chunk's logits buffer becomes its gradient in place.

Per chunk: the head GEMM in the compute dtype (autocast's, else the weight's; the weight is cast once), the
log-sum-exp, the loss terms and the logits' gradient in one elementwise pass (`chunk_loss_and_grad_`, compiled on
CUDA), then the hidden states' gradient and the weight's, accumulated in fp32 and handed back in the parameter's
dtype (fp32 master weights under autocast, bf16 under FSDP2's bf16 mixed precision). The formulas are
`CrossEntropy.__call__`'s (training/loss.py): label smoothing, z-loss, IGNORE_INDEX labels.

Vocab-parallel (tensor parallel: the head weight a DTensor sharded on the vocabulary): each rank computes its rows'
logits; the max, the sum of exponentials, the target logit and the logits' sum are reduced over the tp group, and
the hidden states' gradient, each rank's part, is summed by DTensor in backward (a reduce-scatter under sequence
parallel, an all-reduce without it).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from parallama.tokenizer import IGNORE_INDEX


@dataclass(frozen=True)
class Chunking:
    """How the Function computes: `chunk_size` tokens at a time in `dtype`; the loss's terms; this rank's columns of
    the vocabulary (`start`, of `vocab` that take probability: the true vocabulary of a padded head) and the tp
    `group` whose ranks hold the others (None: all of them here)."""

    chunk_size: int
    dtype: torch.dtype
    label_smoothing: float
    z_loss: float
    vocab: int
    start: int = 0
    group: dist.ProcessGroup | None = None


def chunk_loss_and_grad_(
    logits: Tensor,
    labels: Tensor,
    label_smoothing: float,
    z_loss: float,
    vocab: int,
    start: int = 0,
    group: dist.ProcessGroup | None = None,
) -> Tensor:
    """The summed loss of `logits` (tokens, this rank's columns `start`...) against `labels`; `logits` becomes its
    gradient, in place. Columns at or past `vocab` get no probability and no gradient. Computed in fp32 whatever
    the logits' dtype; with `group`, the per-token statistics are reduced over its ranks' columns.

    Eager, it works in place on one fp32 copy of the chunk. Compiled, it reads the chunk three times and writes
    it once, in its own dtype: the exponentials are taken again for the gradient rather than kept, and the
    target's term is added through a comparison with the column index rather than scattered (either would make
    inductor hold the whole chunk in fp32, twice over: test_the_compiled_chunk_step_equals_the_eager_one)."""
    compiled = torch.compiler.is_compiling()
    x = logits.float()  # the logits themselves when fp32: worked on in place
    valid = min(max(vocab - start, 0), x.shape[1])  # this rank's columns that take probability
    if valid < x.shape[1]:
        x[:, valid:] = -math.inf
    peak = x.amax(1)
    if group is not None:
        dist.all_reduce(peak, dist.ReduceOp.MAX, group=group)
    labelled = labels != IGNORE_INDEX
    column = labels - start
    mine = labelled & (column >= 0) & (column < valid)  # the target is one of this rank's columns
    column = torch.where(mine, column, 0)
    target = torch.where(mine, x.gather(1, column[:, None]).squeeze(1), 0)
    logit_sum = x[:, :valid].sum(1) if label_smoothing else torch.zeros_like(peak)
    exps = (x - peak[:, None]).exp_() if compiled else x.sub_(peak[:, None]).exp_()
    sums = torch.stack([exps.sum(1), target, logit_sum])
    if group is not None:
        dist.all_reduce(sums, group=group)
    exp_sum, target, logit_sum = sums
    lse = peak + exp_sum.log()
    loss = (1 - label_smoothing) * (lse - target)
    if label_smoothing:  # -mean_c log p_c = lse - mean_c logit_c
        loss = loss + label_smoothing * (lse - logit_sum / vocab)
    if z_loss:
        loss = loss + z_loss * lse.square()
    # d loss / d logit_c = p_c (1 + 2 z lse) - (1 - smoothing) [c = target] - smoothing / vocab; 0 unlabelled
    if compiled:
        x.sub_(peak[:, None]).exp_()
    x.mul_((torch.where(labelled, (1 + 2 * z_loss * lse) / exp_sum, 0))[:, None])
    if label_smoothing:
        x[:, :valid].sub_(torch.where(labelled, label_smoothing / vocab, 0)[:, None])
    at_target = torch.where(mine, label_smoothing - 1, 0.0)[:, None]
    if compiled:
        x.add_(torch.where(torch.arange(x.shape[1], device=x.device) == column[:, None], at_target, 0))
    else:  # eager: no (tokens, vocab) mask
        x.scatter_add_(1, column[:, None], at_target)
    if logits.dtype != torch.float32:
        logits.copy_(x)
    return torch.where(labelled, loss, 0).sum()


@functools.cache
def _compiled():
    return torch.compile(chunk_loss_and_grad_, dynamic=None)


def compiled_chunk_loss_and_grad_(logits: Tensor, labels: Tensor, *args) -> Tensor:
    """`chunk_loss_and_grad_` compiled: one or two kernels over the chunk, not one pass per op. A last, shorter
    chunk of a batch (tokens not a multiple of loss.chunk_size) compiles once more, with the number of tokens
    dynamic from then on (torch.compile's automatic dynamic shapes)."""
    return _compiled()(logits, labels, *args)


def _chunk_step(logits: Tensor, labels: Tensor, how: Chunking) -> Tensor:
    """Compiled on CUDA where no collective sits between its passes; eager on CPU (tests stay fast) and under
    tensor parallel (its all-reduces split the pass in three)."""
    compiled = logits.is_cuda and how.group is None
    step = compiled_chunk_loss_and_grad_ if compiled else chunk_loss_and_grad_
    return step(logits, labels, how.label_smoothing, how.z_loss, how.vocab, how.start, how.group)


@functools.cache
def gemm_adds_into_fp32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch's GEMM on `device` adds a product of `dtype` matrices into an fp32 one in place, and with
    beta=0 overwrites it unread (`addmm`'s `out_dtype`: CUDA only, and what it accepts for the added matrix
    changed across releases)."""
    total, ones = torch.full((2, 2), math.nan, device=device), torch.ones(2, 2, device=device, dtype=dtype)
    try:
        torch.addmm(total, ones, ones, beta=0, out_dtype=torch.float32, out=total)
        overwrites = bool((total == 2).all())
        torch.addmm(total, ones, ones, out_dtype=torch.float32, out=total)
    except (RuntimeError, TypeError):
        return False
    return overwrites and bool((total == 4).all())


def _accumulate_(total: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """total += a @ b (first: total = a @ b, whatever `total` held), with `total` fp32 and a, b perhaps bf16: where
    it can, the bf16 GEMM accumulates into it directly; else through a product in their dtype."""
    beta = 0 if first else 1  # 0: the GEMM does not read `total`
    if total.dtype == a.dtype:
        total.addmm_(a, b, beta=beta)
    elif a.is_cuda and gemm_adds_into_fp32(a.device, a.dtype):
        torch.addmm(total, a, b, beta=beta, out_dtype=total.dtype, out=total)
    elif first:
        total.copy_(a @ b)
    else:
        total.add_(a @ b)


class LinearCrossEntropy(torch.autograd.Function):
    """The summed loss of `hidden @ weight.T` (tokens, hidden) x (vocab, hidden) against `labels` (tokens), its
    gradients computed here in the forward pass. Backward scales them by the loss's gradient, and may run twice (a
    zero-bubble pipeline schedule's input, then weight pass; the first retains the graph)."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, labels: Tensor, how: Chunking) -> Tensor:
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here
            head = weight.to(how.dtype)
            grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
            grad_weight = None
            if ctx.needs_input_grad[1]:  # written whole by the first chunk
                empty = torch.zeros_like if hidden.shape[0] == 0 else torch.empty_like
                grad_weight = empty(weight, dtype=torch.float32)
            loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
            for start in range(0, hidden.shape[0], how.chunk_size):
                rows = slice(start, start + how.chunk_size)
                chunk = hidden[rows].to(how.dtype)
                logits = chunk @ head.T
                loss += _chunk_step(logits, labels[rows], how)  # the logits are their gradient now
                if grad_hidden is not None:
                    grad_hidden[rows] = logits @ head
                if grad_weight is not None:
                    _accumulate_(grad_weight, logits.T, chunk, first=start == 0)
        ctx.save_for_backward(grad_hidden, grad_weight)
        ctx.weight_dtype = weight.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss
        if grad_weight is not None:
            grad_weight = (grad_weight * grad_loss).to(ctx.weight_dtype)
        return grad_hidden, grad_weight, None, None


def vocab_parallel(weight: Tensor) -> bool:
    """A head weight this Function shards as tensor parallel does: a DTensor split on the vocabulary over one
    mesh dimension."""
    return isinstance(weight, DTensor) and weight.device_mesh.ndim == 1 and weight.placements == (Shard(0),)


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    *,
    chunk_size: int,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    valid_vocab: int | None = None,
) -> Tensor:
    """The summed loss of the head `weight` (vocab, hidden) on `hidden` (..., hidden) against `labels` (...),
    IGNORE_INDEX skipped; the rows at or past `valid_vocab` (a head padded beyond the true vocabulary) take no
    probability. `weight` is a plain tensor or, vocab-parallel, a DTensor sharded on its rows (`hidden` then
    replicated over the tp ranks, or a DTensor sharded on the sequence under sequence parallel)."""
    vocab = weight.shape[0] if valid_vocab is None else min(valid_vocab, weight.shape[0])
    start, group = 0, None
    if isinstance(weight, DTensor):
        mesh = weight.device_mesh
        if isinstance(hidden, DTensor):
            hidden = hidden.redistribute(placements=[Replicate()])
        else:
            hidden = DTensor.from_local(hidden, mesh, [Replicate()])
        # each rank's gradient of the hidden states is its rows' part: DTensor sums them in backward
        hidden = hidden.to_local(grad_placements=[Partial()])
        start = mesh.get_local_rank() * -(-weight.shape[0] // mesh.size())  # DTensor's shards: torch.chunk's
        group = mesh.get_group()
        weight = weight.to_local()
    autocast = torch.is_autocast_enabled(hidden.device.type)
    dtype = torch.get_autocast_dtype(hidden.device.type) if autocast else weight.dtype
    how = Chunking(chunk_size, dtype, label_smoothing, z_loss, vocab, start, group)
    return LinearCrossEntropy.apply(hidden.flatten(0, -2), weight, labels.flatten(), how)

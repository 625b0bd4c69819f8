"""Pipeline parallelism with torch.distributed.pipelining: one rank's stages, the schedule that runs forward and
backward over microbatches, and what Lightning's loop needs around it (the loss on every rank, the whole model for
sampling, a checkpoint's share for this rank). Gradient clipping over every stage: strategies/model_parallel.py.

The model family's plan splits the model (models/<family>/parallelize.py `pipeline_split`): the rank keeps the
modules of its stages under their own names, so the LightningModule's `model` holds this rank's parameters as the
whole model names them (what the optimizer, checkpoints and the universal state see), and each stage is a model
that shares those modules. strategy=model_parallel builds a `Pipeline` when its `pp` exceeds 1.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.distributed.pipelining as pipelining
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from parallama.distributed.context import sharded_batch
from parallama.distributed.options import SCHEDULES, SINGLE_STAGE, V_SHAPED, PipelineOptions, loss_fuses
from parallama.runtime.compat import forward_only
from parallama.tokenizer import IGNORE_INDEX

BATCH_KWARGS = (
    "attention_mask",
    "position_ids",
    "document_ids",
)  # given to every stage, sliced like the batch


class Pipeline:
    """This rank's stages (`stages`: (stage index, module) pairs of `num_stages`) under `options.schedule`.

    The loss of a batch is the recipe's loss (`loss_fn`, training/loss.py) averaged over its labelled tokens, as
    `CausalLM.loss`: each microbatch's loss is its sum divided by the labelled tokens of the whole batch, and the
    schedule adds the microbatches up (scale_grads=False). Averaging per-microbatch means instead would weigh
    tokens unequally whenever microbatches hold different numbers of ignored labels.
    """

    def __init__(
        self,
        stages: list[tuple[int, nn.Module]],
        num_stages: int,
        options: PipelineOptions,
        group,
        device,
        loss_fn: Callable[..., Tensor],
        on_validation_logits: Callable[[Tensor, Tensor], None] | None = None,
    ):
        self.group, self.device, self.options, self.loss_fn = group, device, options, loss_fn
        self.on_validation_logits = on_validation_logits  # the module's hook, on the last stage's ranks
        self.stages = [pipelining.PipelineStage(m, i, num_stages, device, group=group) for i, m in stages]
        self.has_first = any(stage.is_first for stage in self.stages)
        self.has_last = any(stage.is_last for stage in self.stages)
        # holds the last stage: its losses go to every rank
        self.last_rank = options.stage_rank(num_stages - 1, dist.get_world_size(group))
        schedule = getattr(pipelining, SCHEDULES[options.schedule])
        kwargs = {"n_microbatches": options.microbatches, "loss_fn": self._loss, "scale_grads": False}
        single = options.schedule in SINGLE_STAGE
        self.schedule = schedule(self.stages[0] if single else self.stages, **kwargs)
        self._denominator: Tensor | float = 1.0
        self._rows: int | None = None  # the batch size the stages' shapes were inferred for
        self._step_grads: list = []  # (parameter, gradient) of the last training step, for `add_grads`
        # loss.impl=fused: the last stage returns hidden states (in validation too, so its output's shape stays)
        self.fused = getattr(loss_fn, "impl", "plain") == "fused"

    def _loss(self, logits: Tensor, labels: Tensor) -> Tensor:
        if self.fused:  # the last stage gave its hidden states: the head runs here, with the loss in training
            head = next(stage.submod for stage in self.stages if stage.is_last).head
            # a zero-bubble schedule runs its backward twice (input, then weight gradients): the fused loss allows it
            if loss_fuses(self.loss_fn):
                return head(logits, self.loss_fn.head_loss(labels, "sum")) / self._denominator
            logits = head(logits)
        if self.on_validation_logits is not None and not torch.is_grad_enabled():
            self.on_validation_logits(logits, labels)
        return self.loss_fn(logits, labels, reduction="sum") / self._denominator

    def loss(self, batch: dict, *, train: bool, accumulate: int = 1, parameters=(), cp_mesh=None) -> Tensor:
        """The batch's mean loss, the same on every rank of the pipeline. Evaluation runs forward only.

        Training runs forward and backward, but Lightning's loop expects the gradients from `backward`, after it
        may have zeroed the earlier ones (the first batch of an accumulation window): the step's gradients, those
        of loss / `accumulate`, are kept aside here and `add_grads` adds them there. `parameters`: this rank's.
        `cp_mesh` (context parallel): the schedule runs on this rank's part of each sequence, see `_run`."""
        if train:
            parameters = list(parameters)
            before = [p.grad for p in parameters]
            for p in parameters:
                p.grad = None
            loss = self._run(batch, accumulate, self.schedule.step, cp_mesh)
            self._step_grads = [(p, p.grad) for p in parameters]
            for p, grad in zip(parameters, before):
                p.grad = grad
            return loss
        # Lightning evaluates under inference mode, whose tensors the stages' buffers must not become.
        with torch.inference_mode(False), torch.no_grad():
            batch = self._padded({k: v.clone() for k, v in batch.items()})
            if self.options.schedule not in V_SHAPED:
                return self._run(batch, 1, self.schedule.eval, cp_mesh)
            # torch 2.13's V-shaped schedules fail in eval() (they hand the skipped backward's gradients between
            # the two stages of a rank): the same schedule runs its forward actions only.
            with forward_only(self.schedule):
                return self._run(batch, 1, self.schedule.eval, cp_mesh)

    def _run(self, batch: dict, accumulate: int, run, cp_mesh=None) -> Tensor:
        """With `cp_mesh` the schedule (forward and backward) runs inside the ring-attention context on this cp
        rank's shard of every sequence, its tokens' absolute positions given to every stage; each microbatch's
        loss is divided by the labelled tokens of the whole batch over cp ranks, times cp (FSDP averages over
        dp_shard x cp, as distributed/context.py's `mean_loss`), and the last stage sums the cp ranks' losses."""
        if self._rows is None:
            self._rows = batch["labels"].shape[0]
        cp = cp_mesh.size() if cp_mesh is not None else 1
        with sharded_batch(cp_mesh, batch) if cp > 1 else nullcontext(batch) as local:
            labels = local["labels"]
            count = (labels != IGNORE_INDEX).sum().float()
            if cp > 1:
                dist.all_reduce(count, group=cp_mesh.get_group())
                # one row of positions per sample: the schedule splits every stage's kwargs into microbatches
                local["position_ids"] = local["position_ids"].expand(labels.shape[0], -1)
            self._denominator = count.clamp(min=1) * accumulate / cp
            kwargs = {k: local[k] for k in BATCH_KWARGS if local.get(k) is not None}
            if "position_ids" not in kwargs:
                # Every stage gets the rotary positions: under sequence parallel a later stage's input is its tp
                # rank's part of the sequence, whose length is not the sample's.
                rows, length = labels.shape
                kwargs["position_ids"] = torch.arange(length, device=labels.device).expand(rows, -1)
            if self.fused:
                kwargs["hidden_states"] = True
            args = (local["input_ids"],) if self.has_first else ()
            losses: list[Tensor] | None = [] if self.has_last else None
            run(*args, target=labels if self.has_last else None, losses=losses, **kwargs)
        if self.has_last:
            loss = torch.stack([_local(x) for x in losses]).sum().detach() * accumulate
            if cp > 1:  # each cp rank holds cp x its share of the batch's mean
                dist.all_reduce(loss, group=cp_mesh.get_group())
                loss = loss / cp
        else:
            loss = torch.zeros((), device=self.device)
        dist.broadcast(loss, group=self.group, group_src=self.last_rank)
        return loss

    def _padded(self, batch: dict) -> dict:
        """A short last evaluation batch filled up to the stages' batch size with copies of its first row whose
        labels are all ignored: the loss (a sum over labelled tokens) is unchanged."""
        rows = batch["labels"].shape[0]
        if self._rows is None or rows == self._rows:
            return batch
        fill = self._rows - rows
        out = {k: torch.cat([v, v[:1].expand(fill, *v.shape[1:])]) for k, v in batch.items()}
        out["labels"][rows:] = IGNORE_INDEX
        return out

    def add_grads(self) -> None:
        """Add the gradients of the last training step's schedule to the parameters' (what backward does)."""
        for p, grad in self._step_grads:
            if grad is not None:
                p.grad = grad if p.grad is None else p.grad.add_(grad)
        self._step_grads = []

    def full_model(self, model: nn.Module) -> nn.Module:
        """The whole model on every rank, for generation: each rank's stages (full tensors, also when sharded)
        gathered over the pp group into a fresh model. Costs a full copy of the weights per rank and one
        all-gather of them: meant for the end-of-run sample, not for serving."""
        local = {}
        for name, tensor in model.state_dict().items():
            if isinstance(tensor, DTensor):
                tensor = tensor.full_tensor()
            local[name] = tensor.detach().cpu()
        parts: list[dict] = [{} for _ in range(dist.get_world_size(self.group))]
        dist.all_gather_object(parts, local, group=self.group)
        full = type(model)(model.config)
        full.load_state_dict({k: v for part in parts for k, v in part.items()}, strict=True)
        return full.to(self.device)


def local_part(state, module: nn.Module):
    """A universal checkpoint state (checkpoint/universal.py) cut to the parameters `module` holds (a pipeline
    rank holds its stages' only); a parameter the checkpoint lacks is left for the strict load to name."""

    names = set(module.state_dict())
    model = {k: v for k, v in state.model.items() if k in names}
    optimizer = state.optimizer
    if optimizer is not None:
        optimizer = {
            "state": {k: v for k, v in optimizer["state"].items() if k in names},
            "param_groups": [
                {**g, "params": [n for n in g["params"] if n in names]} for g in optimizer["param_groups"]
            ],
        }
    return replace(state, model=model, optimizer=optimizer)


def _local(t: Tensor) -> Tensor:
    """A loss computed on vocab-sharded logits (tensor parallel) is a replicated DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t

"""The LightningModule: loss, optimizer, learning-rate schedule and metrics around a plain model of any family
(`models`), built and parallelized as the strategy says (`parallel`)."""

from __future__ import annotations

import logging
from functools import partial

import lightning as L
import torch
from torch.profiler import record_function
from torchmetrics import MeanMetric, Metric

from parallama.checkpoint.formats import INFO_KEY
from parallama.config.parts import instantiate_part
from parallama.distributed.context import ContextParallelStep
from parallama.distributed.options import compile_enabled, loss_fuses
from parallama.errors import ConfigError, TrainingDiverged
from parallama.models import model_spec
from parallama.models.contract import check_model, parameter_count_note
from parallama.parallel.base import OutsideATrainer, Parallelism, data_parallel
from parallama.tokenizer import IGNORE_INDEX
from parallama.training import syncs
from parallama.training.loss import term_names, validation_terms
from parallama.training.muon import mark_hidden_matrices
from parallama.training.optim import (
    modes_refusal,
    optimizer_factory,
    set_modes,
    stacked_warmup,
    with_fused_default,
)
from parallama.training.schedules import apply_configured_lrs, lr_scheduler

log = logging.getLogger("parallama")


def ends_the_run(trainer) -> bool:
    """Whether the batch just trained is the run's last: max_steps reached, or the last batch of the last epoch."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    last_epoch = 0 < (trainer.max_epochs or -1) <= trainer.current_epoch + 1
    return last_epoch and trainer.is_last_batch


class CausalLM(L.LightningModule):
    """Causal language modelling on a model of the family `model["family"]` names, with the recipe's optimizer,
    schedule and loss (conf/optimizer, conf/scheduler, conf/loss: `_target_`s). Arguments are plain dicts so
    checkpoints rebuild the module; a module of your own subclasses this one and is named by `module._target_`."""

    def __init__(
        self,
        model: dict,
        optimizer: dict,
        scheduler: dict,
        loss: dict | None = None,
        compile: bool | str = False,
        activation_checkpointing: bool = False,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.spec = model_spec(model)
        self.config = self.spec.build_config(model)
        self.loss_fn = instantiate_part(loss or {"_target_": "parallama.training.loss.CrossEntropy"}, "loss")
        self.model: torch.nn.Module | None = None
        self.val_loss = MeanMetric()  # the cross-entropy alone: val/loss, val/ppl
        # the loss's other terms (z-loss, label smoothing's, a subclass's own), each logged as val/<name>
        self.val_terms = torch.nn.ModuleDict({name: MeanMetric() for name in term_names(self.loss_fn)[1:]})
        # a subclass's training metrics (torchmetrics), each logged as train/<name> (`on_before_optimizer_step`)
        self.train_metrics = torch.nn.ModuleDict()
        self.tokens_seen = 0  # global count, restored on resume
        self.data_parallel_size = (
            1  # the replicas a step trains on (tokens seen count them), set when fit starts
        )
        self.tokenizer_json: str | None = None  # stored in checkpoints so they are self-contained
        self.auxiliary_metrics: dict = {}  # the model's auxiliary losses' metrics of the last training step
        self.context_parallel = (
            ContextParallelStep()
        )  # the ring-attention context of a step, open until backward
        self.compiled_loss = None  # `loss_fn` under torch.compile, where `compile` is on (configure_model)

    @property
    def parallelism(self) -> Parallelism:
        """The running strategy (parallel/), or outside a Trainer the defaults: plain PyTorch."""
        try:
            strategy = self.trainer.strategy
        except RuntimeError:  # not attached to a Trainer
            strategy = None
        return strategy if isinstance(strategy, Parallelism) else OutsideATrainer()

    def configure_model(self) -> None:
        """Build (and shard) the model here, as the strategy says (parallel/): strategies wrap it as it is
        created (ZeRO-3, the meta device) and parallelize it before the optimizer exists."""
        if self.model is not None:
            return
        strategy = self.parallelism
        with strategy.model_init_context():
            model = self.spec.model(self.config)
        check_model(model, self.spec.family)
        note = parameter_count_note(model, self.spec.family, strategy.param_shape)
        if note and self.global_rank == 0:
            log.warning(note)
        strategy.init_weights(model)
        if self.hparams.init_from:
            strategy.load_pretrained(
                model, partial(self.spec.hf.load_hf_weights, path=self.hparams.init_from)
            )
        compiled = compile_enabled(self.hparams.compile, strategy.root_device.type)
        self.model = strategy.parallelize(
            model,
            self.spec.parallelize,
            compile=compiled,
            activation_checkpointing=self.hparams.activation_checkpointing,
        )
        # The loss too: compiled, the logits' fp32 cast, log-softmax and their backward are two passes over the
        # (tokens, vocab) logits instead of six (at vocab 128256, 2.1 GB of bf16 logits a step on the 1B). Not
        # under tensor parallel, whose loss runs on vocab-sharded DTensors inside `loss_parallel`.
        if compiled and strategy.dims.tp == 1:
            self.compiled_loss = torch.compile(self.loss_fn)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **documents
    ) -> torch.Tensor:
        """`documents`: the `position_ids` and `document_ids` of document-masked packed batches."""
        return self.model(input_ids, attention_mask, **documents)

    def loss(self, batch: dict) -> torch.Tensor:
        """The recipe's loss (`loss_fn`, conf/loss) of the batch's labels under the model: its mean over the
        labelled tokens."""
        documents = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
        inputs = (batch["input_ids"], batch.get("attention_mask"))
        # "parallama.loss": the range a profile names (bench train-gpu: where a step's time goes)
        if loss_fuses(self.loss_fn):  # loss.impl=fused: the head's matmul inside the loss, chunk by chunk
            hidden = self.model(*inputs, hidden_states=True, **documents)
            with record_function("parallama.loss"):
                return self.model.head(hidden, self.loss_fn.head_loss(batch["labels"]))
        logits = self.model(*inputs, **documents)
        if not torch.is_grad_enabled():
            self.validation_logits(logits, batch["labels"])
        training = torch.is_grad_enabled() and self.compiled_loss is not None
        with record_function("parallama.loss"):
            return (self.compiled_loss if training else self.loss_fn)(logits, batch["labels"])

    def auxiliary_loss(self) -> torch.Tensor | float:
        """The model's own training losses of its last forward (a mixture of experts' router losses:
        models/moe.py), collected after it by `step_loss`; kept with their metrics for `training_step` to log.
        0 for a model without them (the contract's optional `auxiliary_loss`) and outside training."""
        if not (torch.is_grad_enabled() and hasattr(self.model, "auxiliary_loss")):
            return 0.0
        loss, self.auxiliary_metrics = self.model.auxiliary_loss()
        return loss

    def validation_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """What every path does with validation's logits (this rank's part of them, see `on_validation_logits`): each
        term of the loss into its metric, the cross-entropy alone into val/loss (so that val/loss and val/ppl
        compare across runs whatever the loss adds), then the hook of a module of your own."""
        terms = validation_terms(self.loss_fn, logits, labels)
        count = (labels != IGNORE_INDEX).sum()
        for name, value in terms.items():
            metric = self.val_loss if name == "cross_entropy" else self.val_terms[name]
            metric.update(value.detach() / count.clamp(min=1), weight=count)
        self.on_validation_logits(logits, labels)

    def on_validation_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """Validation metrics on the logits (B, T, vocab) and their labels (IGNORE_INDEX: not a target): this
        rank's part of them, on every path (a pipeline's last stage, a context-parallel rank's part of each
        sequence, under tensor parallel a DTensor sharded on the vocabulary: `.full_tensor()` it). Update a
        torchmetrics metric here and log it in `on_validation_epoch_end` (docs/customize.md). None by default.
        Under `loss.impl=fused` too: validation takes the plain path (logits, then the loss), as no gradient
        memory is at stake there; only training steps compute the head with the loss."""

    # --- the step: forward, loss and backward, one branch per kind of layout ----------------------------

    def step_loss(self, batch: dict) -> torch.Tensor:
        """The batch's loss under the run's layout. The strategy holds the mesh, the process groups and the
        wrapped model; what each kind of layout adds to forward and backward is here:

        - a pipeline (`strategy.pp` > 1): its schedule runs the forward over microbatches and, in training, the
          backward too (`backward` then adds the gradients it kept); the loss comes back on every rank;
        - context parallel (`strategy.cp` > 1): each rank's part of every sequence under ring attention, whose
          context stays open until `backward` has run back through it;
        - otherwise a forward pass and the recipe's loss; under tensor parallel on vocab-sharded logits
          (`loss_context`: no rank gathers them).

        In training the model's own losses of that forward (`auxiliary_loss`) are added on every path; in a
        pipeline, where no rank forms the whole model's loss, each stage adds its own in backward
        (`auxiliary_loss_in_backward`) and `auxiliary_loss` gives their value."""
        layout = self.parallelism
        if layout.pipeline is not None:
            accumulate = self.trainer.accumulate_grad_batches
            if hasattr(self.model, "auxiliary_loss_in_backward"):  # each stage adds its own in backward
                self.model.auxiliary_loss_in_backward(layout.pipeline.options.microbatches, accumulate)
            with layout.loss_context():
                loss = layout.pipeline.loss(
                    batch,
                    train=self.training,
                    accumulate=accumulate,
                    parameters=self.parameters(),
                    cp_mesh=layout.cp_mesh,
                )
        elif layout.cp_mesh is not None:
            loss = self.context_parallel.loss(self, batch, layout.cp_mesh, layout.loss_context())
        else:
            with layout.loss_context():
                loss = self.loss(batch)
        return loss + self.auxiliary_loss()

    def backward(self, loss: torch.Tensor, *args, **kwargs) -> None:
        """Lightning's hook, called by the precision plugin between its own pre- and post-backward steps."""
        layout = self.parallelism
        if layout.pipeline is not None:  # the schedule ran the backward inside step_loss
            layout.pipeline.add_grads()
            return
        try:
            with layout.loss_context():  # the vocab-parallel loss's backward needs it too
                loss.backward(*args, **kwargs)
        finally:
            if layout.cp_mesh is not None:
                self.context_parallel.end()  # the ring attention's backward ran inside its context

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """Returns this rank's loss, whose gradient backward takes (strategies average gradients over the
        data-parallel ranks); logs the mean over the data-parallel replicas, what one process logs for the global
        batch."""
        loss = self.step_loss(batch)
        metrics = self.auxiliary_metrics  # the model's own (router losses): logged as their replica mean too
        # one all-reduce for the loss and the metrics: their means over the replicas
        values = [loss.detach(), *(m.to(loss.device) for m in metrics.values())]
        means = self.replica_mean(torch.stack([v.float() for v in values]))
        mean = means[0]
        # Reading the loss waits for the GPU, so check on logging steps only (every step on CPU).
        check = syncs.reads_now(self.trainer, self.global_step + 1)
        if check and not torch.isfinite(mean):
            raise TrainingDiverged(
                f"train/loss is {mean.item()} at step {self.global_step}: lower optimizer.lr or raise "
                "scheduler.warmup_steps, and resume from the last good checkpoint"
            )
        self.tokens_seen += batch["input_ids"].numel() * self.data_parallel_size
        # not prog_bar, and CPU tensors: neither waits for a GPU (training/syncs.py)
        self.log("train/loss", mean)
        self.log("train/tokens_seen", torch.tensor(float(self.tokens_seen)))
        for name, value in zip(metrics, means[1:]):
            self.log(f"train/{name}", value)
        return loss

    def optimizer_step(self, *args, **kwargs) -> None:
        """Lightning's hook; then the model's own update after a step (the contract's optional
        `after_optimizer_step`: loss-free expert balancing moves its router biases)."""
        super().optimizer_step(*args, **kwargs)
        if hasattr(self.model, "after_optimizer_step"):
            self.model.after_optimizer_step()
        # An optimizer with modes (schedule-free) is in eval mode outside its steps: whatever reads the weights
        # between two steps (validation, every checkpoint, the sample, downstream evaluation) reads the ones to use
        set_modes(self.trainer.optimizers, train=False)

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        """An optimizer with modes trains in train mode, from its batches' forward passes to its step."""
        set_modes(self.trainer.optimizers, train=True)

    def on_before_optimizer_step(self, optimizer) -> None:
        """Each of `train_metrics` logged as train/<name> on the steps whose row Lightning writes (training/syncs.py):
        computed over the batches since the last such row, synced over the ranks by torchmetrics, then reset. The
        steps between only update it, which reads nothing from the device (docs/customize.md)."""
        if not self.train_metrics or not syncs.logging_step(self.trainer, self.global_step + 1):
            return
        for name, metric in self.train_metrics.items():
            self.log(f"train/{name}", metric.compute())
            metric.reset()

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Lightning's hook: parallama's strategies clip (their gradients may be DTensors on several meshes, or a
        pipeline's stages on other ranks); under a Lightning strategy of its own (bench/, notebooks) Lightning
        clips."""
        if not gradient_clip_val:
            return
        strategy = self.trainer.strategy
        with record_function("parallama.clip_gradients"):
            if isinstance(strategy, Parallelism):
                strategy.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm or "norm")
            else:
                self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def replica_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """The mean of `loss` over the data-parallel replicas: every rank of one replica (its tensor, context and
        pipeline ranks) holds the same value, so the sum over all ranks / world size."""
        world = self.trainer.world_size
        if world == 1:
            return loss.detach()
        total = loss.detach().clone()
        torch.distributed.all_reduce(total)
        return total / world

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """Asking the loop to stop at the run's last batch makes Lightning validate once more, so the final
        val/loss (what sweeps optimize and the report prints) is the trained model's, not a stale one."""
        if ends_the_run(self.trainer):
            self.trainer.should_stop = True

    def on_train_start(self) -> None:
        # the replicas that tokens seen count: read once, not every step
        self.data_parallel_size = data_parallel(self.trainer)[0]
        # Under trainer.inference_mode=true a validate() before fit runs in inference mode (fit's validation does
        # not): a metric reset there (every metric's, yours too) holds inference tensors fit's updates cannot change.
        for metric in self.modules():
            if isinstance(metric, Metric):
                metric.reset()
        self._apply_configured_lr()
        if message := modes_refusal(self.optimizer_class, self.trainer.optimizers):
            raise ConfigError(message)

    def _apply_configured_lr(self) -> None:
        """A resume takes this run's configured LRs, not the checkpoint's (`schedules.apply_configured_lrs`)."""
        lrs = self.configured_lrs
        for config in self.trainer.lr_scheduler_configs:
            saved = apply_configured_lrs(config.scheduler, lrs)
            if saved is not None and self.global_rank == 0:
                log.info(f"resuming with optimizer.lr={lrs[0]:g} (the checkpoint's run had {saved:g})")

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.step_loss(batch)  # each path hands its logits to `validation_logits`, which updates the metrics

    def on_validation_epoch_end(self) -> None:
        for metric in (self.val_loss, *self.val_terms.values()):
            if not metric.update_called:  # a pipeline's earlier stages saw no logits: they count no token
                metric.update(0.0, weight=0)
        loss = self.val_loss.compute()  # synced across ranks by torchmetrics
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)  # identical on every rank
        self.log("val/ppl", torch.exp(loss))
        for name, metric in self.val_terms.items():
            self.log(f"val/{name}", metric.compute())
            metric.reset()

    def param_groups(self) -> list[dict]:
        """The optimizer's parameter groups: matrices (embeddings, projections, head) decay with the optimizer's
        weight_decay, vectors (norm weights) do not. Override it for another rule (docs/customize.md)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        shape = self.parallelism.param_shape  # a ZeRO-3 partition's real shape
        return [
            {"params": [p for p in params if len(shape(p)) >= 2]},
            {"params": [p for p in params if len(shape(p)) < 2], "weight_decay": 0.0},
        ]

    def configure_optimizers(self):
        strategy = self.parallelism
        factory = with_fused_default(
            optimizer_factory(self.hparams.optimizer),
            on_gpu=strategy.root_device.type == "cuda",
            loss_scaled=getattr(strategy.precision_plugin, "scaler", None) is not None,
            clipping=bool(self.trainer.gradient_clip_val),
        )
        groups = self.param_groups()
        if getattr(factory.func, "takes_hidden_matrices", False):  # Muon's (training/muon.py)
            groups = mark_hidden_matrices(groups, self.model)
        optimizer = strategy.build_optimizer(factory, groups)
        self.configured_lrs = [group["lr"] for group in optimizer.param_groups]
        self.optimizer_class = factory.func

        total = int(self.trainer.estimated_stepping_batches)
        scheduler = lr_scheduler(
            self.hparams.scheduler, optimizer, total, fast_dev_run=bool(self.trainer.fast_dev_run)
        )
        if (note := stacked_warmup(optimizer, self.configured_lrs)) and self.global_rank == 0:
            log.warning(note)
        # An explicit name (the configured class's) keeps the logged `lr-AdamW/pg1` (decayed) and `/pg2` (norms)
        # the same under every strategy; LearningRateMonitor would otherwise use the wrapper's class
        # (ZeroRedundancyOptimizer) or DeepSpeed's CPU Adam.
        name = f"lr-{getattr(factory.func, '__name__', 'optimizer')}"
        lr_schedule = {"scheduler": scheduler, "interval": "step", "name": name}
        return {"optimizer": optimizer, "lr_scheduler": lr_schedule}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if isinstance(self.trainer.strategy, Parallelism):  # who wrote it: any strategy can resume it
            checkpoint[INFO_KEY] = self.trainer.strategy.checkpoint_info(self)
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["tokenizer"] = self.tokenizer_json

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self.tokenizer_json = checkpoint.get("tokenizer") or self.tokenizer_json

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """ddp_spawn's main process gets the ranks' trained weights back through this (Lightning's
        `_recover_results_in_main_process`, non-strict) without ever building the model: build it first, so the
        weights land (found: they were dropped, and a ddp_spawn run reported no sample)."""
        if self.model is None and any(key.startswith("model.") for key in state_dict):
            self.model = self.spec.model(self.config)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

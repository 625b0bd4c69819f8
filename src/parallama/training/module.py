"""The LightningModule: loss, optimizer, learning-rate schedule and metrics around a plain model of any family
(`models`), built and parallelized as the strategy says (`parallel`)."""

from __future__ import annotations

import logging
import math
from functools import partial

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric

from parallama.checkpoint.formats import INFO_KEY
from parallama.errors import ConfigError, TrainingDiverged
from parallama.models import model_spec
from parallama.parallel.base import OutsideATrainer, Parallelism, data_parallel

log = logging.getLogger("parallama")


def warmup_cosine(
    step: int, *, warmup_steps: int, total_steps: int, start_factor: float, min_ratio: float
) -> float:
    """LR multiplier: linear from start_factor to 1 over warmup_steps, then cosine down to min_ratio at total_steps."""
    if step < warmup_steps:
        return start_factor + (1.0 - start_factor) * step / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


AUTO_WARMUP_STEPS, AUTO_WARMUP_FRACTION = 60, 0.2


def resolve_warmup(warmup_steps: int | str, total_steps: int) -> int:
    """`auto`: 60 steps, or a fifth of a shorter run, so smoke tests (max_steps=5, fast_dev_run) need no
    extra override. An explicit number must leave room for the decay: it is never silently shortened."""
    if warmup_steps == "auto":
        return min(AUTO_WARMUP_STEPS, int(total_steps * AUTO_WARMUP_FRACTION))
    if warmup_steps >= total_steps:
        raise ConfigError(
            f"scheduler.warmup_steps={warmup_steps} is not below the run's {total_steps} optimizer steps; "
            "lower it, use scheduler.warmup_steps=auto, or train longer (trainer.max_steps)"
        )
    return warmup_steps


def ends_the_run(trainer) -> bool:
    """Whether the batch just trained is the run's last: max_steps reached, or the last batch of the last epoch."""
    if 0 < trainer.max_steps <= trainer.global_step:
        return True
    last_epoch = 0 < (trainer.max_epochs or -1) <= trainer.current_epoch + 1
    return last_epoch and trainer.fit_loop.epoch_loop.batch_progress.is_last_batch


class CausalLM(L.LightningModule):
    """Causal language modelling on a model of the family `model["family"]` names. Arguments are plain dicts so
    checkpoints rebuild the module."""

    def __init__(
        self,
        model: dict,
        optimizer: dict,
        scheduler: dict,
        compile: bool = False,
        activation_checkpointing: bool = False,
        init_from: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.spec = model_spec(model)
        self.config = self.spec.build_config(model)
        self.model: torch.nn.Module | None = None
        self.val_loss = MeanMetric()
        self.tokens_seen = 0  # global count, restored on resume
        self.tokenizer_json: str | None = None  # stored in checkpoints so they are self-contained

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
        strategy.init_weights(model)
        if self.hparams.init_from:
            strategy.load_pretrained(
                model, partial(self.spec.hf.load_hf_weights, path=self.hparams.init_from)
            )
        self.model = strategy.parallelize(
            model,
            self.spec.parallelize,
            compile=self.hparams.compile,
            activation_checkpointing=self.hparams.activation_checkpointing,
        )

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **documents
    ) -> torch.Tensor:
        """`documents`: the `position_ids` and `document_ids` of document-masked packed batches."""
        return self.model(input_ids, attention_mask, **documents)

    def loss(self, batch: dict) -> torch.Tensor:
        """Mean cross-entropy of the batch's labels (-100 ignored) under the model."""
        documents = {k: batch[k] for k in ("position_ids", "document_ids") if k in batch}
        logits = self.model(batch["input_ids"], batch.get("attention_mask"), **documents)
        return F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss = self.parallelism.compute_loss(self, batch)
        # Reading the loss waits for the GPU, so check on logging steps only (every step on CPU).
        check = self.device.type == "cpu" or self.global_step % self.trainer.log_every_n_steps == 0
        if check and not torch.isfinite(loss):
            raise TrainingDiverged(
                f"train/loss is {loss.item()} at step {self.global_step}: lower optimizer.lr or raise "
                "scheduler.warmup_steps, and resume from the last good checkpoint"
            )
        self.tokens_seen += batch["input_ids"].numel() * data_parallel(self.trainer)[0]
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/tokens_seen", float(self.tokens_seen))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        """Asking the loop to stop at the run's last batch makes Lightning validate once more, so the final
        val/loss (what sweeps optimize and the report prints) is the trained model's, not a stale one."""
        if ends_the_run(self.trainer):
            self.trainer.should_stop = True

    def on_train_start(self) -> None:
        self.val_loss.reset()  # a validate() before fit left inference-mode tensors in the metric state
        self._apply_configured_lr()

    def _apply_configured_lr(self) -> None:
        """A resumed scheduler brings back the checkpoint's peak LR; `optimizer.lr` is what this run asks for."""
        lr = self.hparams.optimizer["lr"]
        for config in self.trainer.lr_scheduler_configs:
            scheduler = config.scheduler
            if all(base == lr for base in scheduler.base_lrs):
                continue
            if self.global_rank == 0:
                log.info(
                    f"resuming with optimizer.lr={lr:g} (the checkpoint's run had {scheduler.base_lrs[0]:g})"
                )
            scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
            for group, factor in zip(scheduler.optimizer.param_groups, scheduler.lr_lambdas):
                group["initial_lr"], group["lr"] = lr, lr * factor(scheduler.last_epoch)

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        loss = self.parallelism.compute_loss(self, batch)
        self.val_loss.update(loss, weight=(batch["labels"] != -100).sum())

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # synced across ranks by torchmetrics
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)  # identical on every rank
        self.log("val/ppl", torch.exp(loss))

    def configure_optimizers(self):
        opt = dict(self.hparams.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        strategy = self.parallelism
        decay = [
            p for p in params if len(strategy.param_shape(p)) >= 2
        ]  # matrices decay, norm weights do not
        no_decay = [p for p in params if len(strategy.param_shape(p)) < 2]
        groups = [
            {"params": decay, "weight_decay": opt["weight_decay"]},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        kwargs = {"lr": opt["lr"], "betas": tuple(opt["betas"]), "eps": opt["eps"]}
        optimizer = strategy.make_optimizer(groups, fused=opt.get("fused"), **kwargs)

        sched = self.hparams.scheduler
        total = int(self.trainer.estimated_stepping_batches)
        # fast_dev_run is a smoke test of a config (e.g. an experiment preset with 1000 warmup steps): its one or
        # few steps say nothing about the schedule, so they take `auto` instead of refusing the preset's warmup.
        warmup = resolve_warmup("auto" if self.trainer.fast_dev_run else sched["warmup_steps"], total)
        lr_lambda = partial(
            warmup_cosine,
            warmup_steps=warmup,
            total_steps=total,
            start_factor=sched["warmup_start_factor"],
            min_ratio=sched["min_lr_ratio"],
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        # An explicit name keeps the logged `lr-AdamW/pg1` (decayed) and `/pg2` (norms) the same under every
        # strategy; LearningRateMonitor would otherwise use the wrapper's class (ZeroRedundancyOptimizer).
        lr_schedule = {"scheduler": scheduler, "interval": "step", "name": "lr-AdamW"}
        return {"optimizer": optimizer, "lr_scheduler": lr_schedule}

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if isinstance(self.trainer.strategy, Parallelism):  # who wrote it: any strategy can resume it
            checkpoint[INFO_KEY] = self.trainer.strategy.checkpoint_info(self)
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["tokenizer"] = self.tokenizer_json

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self.tokenizer_json = checkpoint.get("tokenizer") or self.tokenizer_json

"""Downstream scores during training: lm-evaluation-harness tasks on the model being trained, every N optimizer
steps, logged as `eval/<task>/<metric>` to every logger of the run (conf/callbacks/default.yaml:
`callbacks.downstream_eval`, off unless `every_n_steps` is set).

Under a process group the data-parallel ranks split the examples: lm-eval hands each rank its share, each rank
scores it on its own copy of the model, and lm-eval gathers the per-example scores (`harness.ParallamaLM`). Every
rank takes part in every forward pass, whatever its share, so a sharded model (FSDP, DeepSpeed ZeRO-3) gathers
its parameters as in training, with no full copy on any one rank; ranks that hold parts of one replica
(tensor-parallel peers) score the same share. The scores are the same on every rank; rank 0's loggers write them.
"""

from __future__ import annotations

import logging
import time

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from tokenizers import Tokenizer

from parallama.errors import ConfigError

log = logging.getLogger("parallama")


class DownstreamEval(Callback):
    def __init__(
        self,
        tasks: list[str],
        every_n_steps: int | None = None,
        limit: int | float | None = None,
        batch_size: int = 16,
        task_dirs: list[str] = (),
        cache_dir: str = "data/cache",
    ) -> None:
        self.tasks, self.every_n_steps, self.limit = list(tasks), every_n_steps, limit
        self.batch_size, self.task_dirs, self.cache_dir = batch_size, list(task_dirs), cache_dir
        self._evaluated_step: int | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.every_n_steps)

    def setup(self, trainer, pl_module, stage: str) -> None:
        """Unknown tasks are an error before the first step, not at the first evaluation."""
        if self.enabled and stage == "fit":
            if not self.tasks:
                raise ConfigError(
                    "callbacks.downstream_eval.tasks is empty; name tasks, e.g. [parallama_cloze]"
                )
            from parallama.evaluation.harness import task_manager  # start-up time (lm_eval)

            task_manager(self.tasks, self.cache_dir, self.task_dirs)

    def on_train_start(self, trainer, pl_module) -> None:
        if self.enabled and trainer.global_step == 0:  # the untrained model: where the curve starts
            self.evaluate(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if self.enabled and step % self.every_n_steps == 0 and step != self._evaluated_step:
            self.evaluate(trainer, pl_module)

    def evaluate(self, trainer, pl_module) -> dict[str, float]:
        """Scores the model as it is now and logs them at the current step; {"eval/<task>/<metric>": value}."""

        from parallama.evaluation.harness import evaluate  # start-up time (lm_eval)
        from parallama.evaluation.lm import ParallamaLM  # start-up time (lm_eval)

        if trainer.sanity_checking or trainer.fast_dev_run:
            return {}
        self._evaluated_step = trainer.global_step
        model = pl_module.parallelism.inference_model(pl_module.model)
        ranks = None
        if trainer.world_size > 1 and dist.is_available() and dist.is_initialized():
            ranks = dp_ranks(trainer)
        lm = ParallamaLM(
            model,
            Tokenizer.from_str(pl_module.tokenizer_json),
            batch_size=self.batch_size,
            device=pl_module.parallelism.root_device,
            dp_ranks=ranks,
            forward_context=trainer.precision_plugin.forward_context,
        )
        was_training, start = model.training, time.monotonic()
        model.eval()
        try:
            table = evaluate(
                lm, self.tasks, cache_dir=self.cache_dir, task_dirs=self.task_dirs, limit=self.limit
            )
        finally:
            model.train(was_training)
        metrics = {f"eval/{task}/{m}": v for task, scores in table.items() for m, v in scores.items()}
        for logger in trainer.loggers:  # rank 0 writes (Lightning's loggers are rank-zero only)
            logger.log_metrics(metrics, step=trainer.global_step)
        if trainer.is_global_zero:
            shown = " ".join(f"{k}={v:.4f}" for k, v in metrics.items())
            log.info(f"step {trainer.global_step}: {shown} ({time.monotonic() - start:.1f} s)")
        return metrics


def dp_ranks(trainer) -> list[int]:
    """The data-parallel rank of every global rank (ranks of one replica share one)."""
    from parallama.parallel.base import Parallelism  # start-up time (hydra)

    strategy = trainer.strategy
    if isinstance(strategy, Parallelism):
        dims = strategy.dims
        return [dims.dp_rank(rank) for rank in range(trainer.world_size)]
    return list(range(trainer.world_size))

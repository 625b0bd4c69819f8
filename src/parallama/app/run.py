"""One training job, as lightning-hydra-template's `train(cfg)`: build the data module, the model, callbacks,
loggers and the Trainer from a composed config, fit (resuming if asked), then report and sample. The command
line around it is cli/train.py.

Lightning and torch are imported inside `train()`, so a tool that only composes a config does not load them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from omegaconf import DictConfig, OmegaConf

from parallama.app.checks import apply_derived, check_config, check_vocab_fits
from parallama.app.compose import already_checked
from parallama.checkpoint.resume import check_fresh_run, check_resume, owning_run_dir, resolve_ckpt_path
from parallama.config.parts import instantiate_part
from parallama.distributed.dims import processes_per_node
from parallama.distributed.options import ACOptions
from parallama.runtime import faults
from parallama.runtime.compat import check_internals
from parallama.runtime.launch import needs_launch, pinned_cores, start_ranks
from parallama.training.optim import optimizer_factory, peak_lr
from parallama.training.report import (
    generate_sample,
    job_config,
    one_console_for_lightning,
    print_config,
    report,
    run_facts,
    validation_off,
)

log = logging.getLogger("parallama")


def instantiate_dict(node: DictConfig | None) -> list:
    """Instantiate every entry of a keyed config dict (callbacks, loggers); null entries are switched off."""
    return [hydra.utils.instantiate(v) for v in (node or {}).values() if v is not None and "_target_" in v]


def train(cfg: DictConfig) -> tuple[dict, dict]:
    """Run one training job. Returns the final metrics (`val/loss`, ...) and the objects it built (cfg,
    datamodule, model, callbacks, logger, trainer), as lightning-hydra-template's `train` does, so a config
    composed with `hydra.compose(..., return_hydra_config=True)` can be trained from Python (tests, notebooks)."""
    if already_checked(cfg):  # by the command line's preflight: only what it derives is left to do
        apply_derived(cfg)
    else:
        check_config(cfg)
    from parallama.parallel.base import strategy_class  # torch-free module

    strategy = strategy_class(cfg.strategy)
    check_internals(strategy.internals if strategy else ())  # and those the strategy's class relies on

    check_fresh_run(cfg)  # may set ckpt_path=last (a requeued SLURM job)
    with owning_run_dir(cfg.paths.output_dir):  # one live run per directory
        return _fit(cfg)


def _fit(cfg: DictConfig) -> tuple[dict, dict]:
    """`train`'s job in a run directory it owns: build, fit (resuming if asked), report and sample."""
    import lightning as L  # torch-free module
    from lightning.pytorch.callbacks import LearningRateMonitor  # torch-free module

    one_console_for_lightning()

    from parallama.checkpoint.atomic import AtomicCheckpointIO, remove_stale_temps  # torch-free module
    from parallama.parallel.base import Parallelism  # torch-free module
    from parallama.training.callbacks import AtLeastOneValBatch, StepNumbers  # torch-free module
    from parallama.training.loggers import continue_wandb_run  # torch-free module
    from parallama.training.module import CausalLM  # torch-free module
    from parallama.training.preemption import requeue_single_device_jobs  # torch-free module

    # before anything is printed or built: a checkpoint to resume that is missing or corrupt is one line
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg.paths.output_dir)
    print_config(cfg)
    if (off := validation_off(cfg)) is not None:
        log.info(f"validation is off ({off}): no val/loss, no best checkpoint, and no final metrics")
    L.seed_everything(cfg.seed, workers=True, verbose=False)

    datamodule = hydra.utils.instantiate(cfg.data)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    vocab = datamodule.vocab_size
    check_vocab_fits(vocab, model_cfg["vocab_size"])  # a trained or downloaded tokenizer: known only now
    if model_cfg["vocab_size"] is None:
        model_cfg["vocab_size"] = -(-vocab // 64) * 64  # a multiple of 64 keeps matmuls aligned
    module: CausalLM = instantiate_part(
        OmegaConf.to_container(cfg.module),
        "module",
        model=model_cfg,
        optimizer=OmegaConf.to_container(cfg.optimizer, resolve=True),
        scheduler=OmegaConf.to_container(cfg.scheduler, resolve=True),
        loss=OmegaConf.to_container(cfg.loss, resolve=True),
        compile=cfg.compile,
        activation_checkpointing=activation_checkpointing(cfg),
        init_from=cfg.init_from,
        _recursive_=False,  # the recipe's parts stay configs: the module builds them (and checkpoints keep them)
    )
    module.tokenizer_json = datamodule.tokenizer.to_str()
    wandb_callbacks = continue_wandb_run(cfg, ckpt_path)  # before the loggers exist: they read the run's id
    loggers, callbacks = instantiate_dict(cfg.get("logger")), instantiate_dict(cfg.get("callbacks"))
    # not config entries: `callbacks=none` keeps the rows' step numbers and a fraction's meaning
    callbacks += [StepNumbers(), AtLeastOneValBatch(), *wandb_callbacks]
    if not loggers:  # LearningRateMonitor refuses a Trainer without loggers, and would have nothing to log to
        callbacks = [c for c in callbacks if not isinstance(c, LearningRateMonitor)]
    # Single-file checkpoints written atomically beside their target and read weights-only (checkpoint/atomic.py);
    # other plugins (launcher=slurm's SLURMEnvironment) are kept.
    plugins = [*(hydra.utils.instantiate(cfg.trainer.get("plugins")) or []), AtomicCheckpointIO()]
    requeue_single_device_jobs(callbacks, plugins)
    strategy = hydra.utils.instantiate(cfg.strategy)
    if (
        cfg.get("float8") is not None
    ):  # the blocks' linears in float8 (distributed/float8.py), through the plan
        from parallama.training.callbacks import Float8Scales  # torch-free module

        strategy.float8, strategy.float8_filter = cfg.float8, cfg.float8_filter
        callbacks = [*callbacks, Float8Scales()]
    processes = processes_per_node(cfg.trainer.devices, cfg.trainer.accelerator)
    if isinstance(strategy, Parallelism) and strategy.reruns_the_command and needs_launch(processes):
        start_ranks(processes, cfg.trainer.num_nodes)  # after the tokenizer exists: the ranks read it
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer,
        strategy=strategy,
        callbacks=callbacks,
        logger=loggers or False,
        plugins=plugins,
    )
    if trainer.is_global_zero:
        remove_stale_temps(Path(cfg.paths.output_dir) / "checkpoints")  # left by a save that was killed
    output_dir = cfg.paths.output_dir
    for logger in trainer.loggers:
        logger.log_hyperparams(
            {
                "config": job_config(cfg),
                "model/params": module.config.num_params(),
                "model/flops_per_token": module.config.flops_per_token(cfg.data.seq_len),
            }
        )
    if trainer.is_global_zero:
        log.info(run_facts(cfg, trainer, module.config, vocab))
    cores = pinned_cores()
    log.info(
        f"[rank {trainer.global_rank}/{trainer.world_size}, local rank {trainer.local_rank}] "
        f"{module.config.num_params() / 1e6:.2f} M parameters, strategy {type(trainer.strategy).__name__}, "
        f"lr {peak_lr(optimizer_factory(module.hparams.optimizer)):g}"
        + (f", pinned to CPU cores {cores}" if cores else "")
    )
    faults.watch_ranks(trainer, output_dir)
    if ckpt_path is not None:
        check_resume(ckpt_path, model_cfg, datamodule, trainer.max_steps)
    # not under fast_dev_run: its one validation batch comes after its one training batch
    if cfg.validate_before_training and ckpt_path is None and not trainer.fast_dev_run:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)

    sample = generate_sample(module, datamodule, cfg) if cfg.sample.max_new_tokens else None
    report(trainer, output_dir, sample, validation_off(cfg))
    objects = {"cfg": cfg, "datamodule": datamodule, "model": module, "callbacks": callbacks}
    objects.update(logger=loggers, trainer=trainer)
    return dict(trainer.callback_metrics), objects


def activation_checkpointing(cfg: DictConfig) -> str | dict:
    """What the module hands the strategy's plan (distributed/options.py `ACOptions.of`): the mode, and under
    selective its policy (`activation_checkpointing_policy`), as plain values a checkpoint keeps weights-only."""

    mode = ACOptions.of(cfg.activation_checkpointing).mode
    if mode != "selective":
        return mode
    policy = cfg.get("activation_checkpointing_policy") or {}
    return {"mode": mode, "policy": policy.get("mode", "op"), "every_n": policy.get("every_n", 2)}

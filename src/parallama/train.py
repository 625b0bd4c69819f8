"""`parallama-train` (or `python -m parallama.train`): compose the config, build data/model/trainer, fit, report."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from parallama import CONF_DIR, faults
from parallama.checks import check_config, preflight
from parallama.errors import ConfigError, TrainingDiverged
from parallama.launch import patch_ddp_relaunch, resolve_ckpt_path
from parallama.loggers import continue_wandb_run

log = logging.getLogger("parallama")


def instantiate_dict(node: DictConfig | None) -> list:
    """Instantiate every entry of a keyed config dict (callbacks, loggers); null entries are switched off."""
    return [hydra.utils.instantiate(v) for v in (node or {}).values() if v is not None and "_target_" in v]


def train(cfg: DictConfig) -> float | None:
    """Run one training job; returns the final `optimized_metric` (default val/loss), which sweeps optimize."""
    from parallama.module import LlamaLM

    L.seed_everything(cfg.seed, workers=True, verbose=False)
    check_config(cfg)
    faults.check_multi_node(cfg.trainer.num_nodes)
    faults.check_fresh_run(cfg)
    print_config(cfg)

    datamodule = hydra.utils.instantiate(cfg.data)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    vocab = datamodule.vocab_size
    if model_cfg["vocab_size"] is None:
        model_cfg["vocab_size"] = -(-vocab // 64) * 64  # a multiple of 64 keeps matmuls aligned
    elif vocab > model_cfg["vocab_size"]:
        raise ConfigError(
            f"the tokenizer has {vocab} tokens but model.vocab_size={model_cfg['vocab_size']}; "
            f"set model.vocab_size>={vocab} (or null to follow the tokenizer)"
        )
    module = LlamaLM(
        model=model_cfg,
        optimizer=OmegaConf.to_container(cfg.optimizer, resolve=True),
        scheduler=OmegaConf.to_container(cfg.scheduler, resolve=True),
        compile=cfg.compile,
        activation_checkpointing=cfg.activation_checkpointing,
        init_from=cfg.init_from,
    )
    module.tokenizer_json = datamodule.tokenizer.to_str()
    runs_root = str(Path(cfg.paths.log_dir) / cfg.task_name)
    ckpt_path = resolve_ckpt_path(cfg.ckpt_path, cfg.paths.output_dir, runs_root)
    continue_wandb_run(cfg, ckpt_path)  # before the loggers exist: resume the checkpoint's W&B run
    trainer: L.Trainer = hydra.utils.instantiate(
        cfg.trainer,
        strategy=hydra.utils.instantiate(cfg.strategy),
        callbacks=instantiate_dict(cfg.get("callbacks")),
        logger=instantiate_dict(cfg.get("logger")) or False,
    )
    output_dir = cfg.paths.output_dir
    for logger in trainer.loggers:
        logger.log_hyperparams(
            {
                "config": OmegaConf.to_container(cfg, resolve=True),
                "model/params": module.config.num_params(),
                "model/flops_per_token": module.config.flops_per_token(cfg.data.seq_len),
            }
        )
    log.info(
        f"[rank {trainer.global_rank}/{trainer.world_size}, local rank {trainer.local_rank}] "
        f"{module.config.num_params() / 1e6:.2f} M parameters, strategy {type(trainer.strategy).__name__}, "
        f"lr {module.hparams.optimizer['lr']:g}"
    )
    faults.watch_ranks(trainer, output_dir)
    if ckpt_path is not None:
        from parallama.checkpoint import check_resumable

        check_resumable(ckpt_path, model_cfg)
    if cfg.validate_before_training and ckpt_path is None:
        trainer.validate(module, datamodule=datamodule, verbose=False)
    trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path)

    sample = generate_sample(module, datamodule, cfg) if cfg.sample.max_new_tokens else None
    report(trainer, output_dir, sample)
    metric = trainer.callback_metrics.get(cfg.get("optimized_metric", "val/loss"))
    return float(metric) if metric is not None else None


def generate_sample(module, datamodule, cfg: DictConfig) -> str | None:
    """Every rank generates (sharded models need all ranks in each forward); the same seed gives the same text."""
    from parallama.model import generate

    if module.model is None or module.model.embed_tokens.weight.device.type == "meta":
        return None
    tokenizer, ids = datamodule.tokenizer, datamodule.special_ids
    prompt = [ids.bot, *tokenizer.encode(cfg.sample.prompt, add_special_tokens=False).ids]
    device = module.model.embed_tokens.weight.device
    module.model.eval()
    out = generate(
        module.model,
        torch.tensor([prompt], device=device),
        max_new_tokens=cfg.sample.max_new_tokens,
        temperature=cfg.sample.temperature,
        top_k=cfg.sample.top_k,
        eos_id=ids.eot,
        generator=torch.Generator(device=device).manual_seed(cfg.seed),
    )
    return tokenizer.decode(out[0, 1:].tolist(), skip_special_tokens=True)


def last_checkpoint_note(cfg: DictConfig) -> str:
    return faults.last_checkpoint_note(cfg.paths.output_dir)


@rank_zero_only
def print_config(cfg: DictConfig) -> None:
    from rich.console import Console
    from rich.syntax import Syntax

    Console().print(Syntax(OmegaConf.to_yaml(cfg, resolve=True), "yaml", theme="ansi_dark"))
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resolved_config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))


@rank_zero_only
def report(trainer: L.Trainer, output_dir: str, sample: str | None) -> None:
    lines = [f"output dir:      {output_dir}"]
    for ckpt in trainer.checkpoint_callbacks:
        if not isinstance(ckpt, ModelCheckpoint):
            continue
        if ckpt.monitor:
            lines.append(
                f"best checkpoint: {ckpt.best_model_path or '-'} ({ckpt.monitor} {ckpt.best_model_score})"
            )
        if ckpt.last_model_path:
            lines.append(f"last checkpoint: {ckpt.last_model_path}")
    for logger in trainer.loggers:
        lines.append(f"{type(logger).__name__ + ':':<16} {logger.log_dir or logger.save_dir}")
    metrics = {k: f"{float(v):.4f}" for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    lines.append(f"final metrics:   {metrics}")
    if sample is not None:
        lines.append(f"sample:\n{sample}")
    log.info("\n".join(lines))


@hydra.main(config_path=str(CONF_DIR), config_name="train", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> float | None:
    try:
        return train(cfg)
    except (ConfigError, FileNotFoundError) as err:
        log.error(f"error: {err}")
        sys.exit(2)
    except TrainingDiverged as err:
        log.error(f"error: {err} ({last_checkpoint_note(cfg)})")
        sys.exit(3)
    except faults.Preempted as stop:
        log.warning(f"{stop}; resume with ckpt_path=last")
        sys.exit(0)
    except RuntimeError as err:  # gloo's error for a peer rank that is gone: one line naming it
        line = faults.lost_rank(err)
        if line is None:
            raise
        log.error(line)
        sys.exit(faults.EXIT_RANK_DIED)
    finally:
        faults.stop_watching()
        wandb = sys.modules.get("wandb")  # one W&B run per sweep job: close it before the next job starts
        if wandb is not None and wandb.run is not None:
            wandb.finish()


def main() -> None:
    try:
        preflight(CONF_DIR, "train", sys.argv[1:])
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    patch_ddp_relaunch()
    _hydra_main()


if __name__ == "__main__":
    main()

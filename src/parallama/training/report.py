"""What a training job tells its user: the config it runs (printed, and kept as resolved_config.yaml), what
switches validation off, and at the end where its checkpoints and logs are, its final metrics and a sample;
Lightning's console lines once. The job itself is app/run.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.syntax import Syntax

from parallama.distributed.dims import dims_of_config
from parallama.models import DEFAULT_FAMILY

log = logging.getLogger("parallama")


def one_console_for_lightning() -> None:
    """Lightning's INFO lines once: importing `lightning` gives its logger a console handler of its own ("INFO:
    ..."), and its records also reach the root logger, which Hydra's job logging (console and the run's log
    file) configured; so each line was printed twice. Where the root logger has handlers, Lightning's go."""
    root = logging.getLogger()
    if (
        not root.handlers
    ):  # Python without Hydra's logging (a notebook): Lightning's own handler is the console
        return
    for name in ("lightning", "lightning.pytorch", "lightning.fabric"):
        logger = logging.getLogger(name)
        for handler in list(logger.handlers):
            if type(handler) is logging.StreamHandler:  # its console handler, not a file a user added
                logger.removeHandler(handler)
        logger.propagate = True


def generate_sample(module, datamodule, cfg: DictConfig) -> str | None:
    """Every rank generates (sharded models need all ranks in each forward); the same seed gives the same text."""
    import torch  # torch-free module

    from parallama.models.generation import generate  # torch-free module

    if module.model is None:
        return None
    model = module.parallelism.inference_model(module.model)
    if next(model.parameters()).device.type == "meta":
        return None
    device = module.parallelism.root_device  # not the parameters': FSDP2's cpu_offload keeps them on the CPU
    tokenizer, ids = datamodule.tokenizer, datamodule.special_ids
    prompt = [ids.bot, *tokenizer.encode(cfg.sample.prompt, add_special_tokens=False).ids]
    model.eval()
    out = generate(
        model,
        torch.tensor([prompt], device=device),
        max_new_tokens=cfg.sample.max_new_tokens,
        temperature=cfg.sample.temperature,
        top_k=cfg.sample.top_k,
        eos_id=ids.eot,
        generator=torch.Generator(device=device).manual_seed(cfg.seed),
    )
    return tokenizer.decode(out[0, 1:].tolist(), skip_special_tokens=True)


def job_config(cfg: DictConfig) -> dict:
    """The resolved config without Hydra's own node (present when composed with return_hydra_config)."""
    return OmegaConf.to_container(OmegaConf.masked_copy(cfg, [k for k in cfg if k != "hydra"]), resolve=True)


def print_config(cfg: DictConfig) -> None:
    """The whole config goes to the run directory (resolved_config.yaml, beside Hydra's .hydra/config.yaml); the
    console gets the command line's overrides, and the whole config only with `print_config=true` (highlighted on a
    terminal, in full width in a log file): 154 of a default run's 187 lines were the config."""
    from lightning.pytorch.utilities import rank_zero_only  # torch-free module

    if rank_zero_only.rank != 0:
        return
    text = OmegaConf.to_yaml(job_config(cfg))
    out = Path(cfg.paths.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "resolved_config.yaml").write_text(text)
    if not cfg.get("print_config"):
        log.info(
            f"overrides: {' '.join(command_line_overrides()) or 'none'}; the whole config: "
            f"{out / 'resolved_config.yaml'} (print_config=true prints it)"
        )
        return

    console = Console()
    if console.is_terminal:
        console.print(Syntax(text, "yaml", theme="ansi_dark"))
    else:
        print(text, flush=True)


def command_line_overrides() -> list[str]:
    """The overrides of the running Hydra job (none outside Hydra: a config composed in Python)."""
    from hydra.core.hydra_config import HydraConfig  # start-up time (hydra)

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []


def run_facts(cfg: DictConfig, trainer, model_config, tokens: int) -> str:
    """The run in one line: the model, the data and its tokenizer, the steps and their batch, the machine."""

    family = cfg.model.get("family") or DEFAULT_FAMILY
    source = cfg.data.get("source") or {}
    data = (
        str(source.get("_target_", "")).rpartition(".")[2]
        or f"a mixture of {len(cfg.data.get('sources') or {})}"
    )
    batch = cfg.data.batch_size * dims_of_config(cfg).dp_size * trainer.accumulate_grad_batches
    device = type(trainer.accelerator).__name__.removesuffix("Accelerator").lower()  # cpu, cuda
    steps = f"{trainer.max_steps} steps" if trainer.max_steps > 0 else f"{trainer.max_epochs} epochs"
    return (
        f"run: {family} of {model_config.num_hidden_layers} layers x {model_config.hidden_size}, "
        f"vocabulary {model_config.vocab_size} (tokenizer {tokens}); data {data}; {steps} of {batch} x "
        f"{cfg.data.seq_len} tokens; precision {trainer.precision} on {trainer.num_devices} "
        f"{device} device(s) x {trainer.num_nodes} node(s)"
    )


def validation_off(cfg: DictConfig) -> str | None:
    """What switches validation off in this config (the setting, for the user to change), or None."""
    if cfg.data.get("val_fraction", None) == 0:
        return "data.val_fraction=0: no validation split"
    if cfg.trainer.get("limit_val_batches", None) == 0:
        return "trainer.limit_val_batches=0"
    return None


def report(trainer, output_dir: str, sample: str | None, off: str | None = None) -> None:
    from lightning.pytorch.callbacks import ModelCheckpoint  # torch-free module

    from parallama.training.callbacks import LastCheckpoint  # torch-free module

    if trainer.global_rank != 0:
        return
    lines = [f"output dir:      {output_dir}"]
    for ckpt in trainer.checkpoint_callbacks:
        if isinstance(ckpt, ModelCheckpoint) and ckpt.monitor and ckpt.best_model_path:  # none: no line
            lines.append(
                f"best checkpoint: {ckpt.best_model_path or '-'} ({ckpt.monitor} {ckpt.best_model_score})"
            )
        if isinstance(ckpt, ModelCheckpoint) and ckpt.last_model_path:
            lines.append(f"last checkpoint: {ckpt.last_model_path}")
        if isinstance(ckpt, LastCheckpoint) and ckpt.saved_step is not None:
            lines.append(f"last checkpoint: {ckpt.path}")
    for logger in trainer.loggers:
        if where := logger.log_dir or logger.save_dir:  # none: fast_dev_run's DummyLogger
            lines.append(f"{type(logger).__name__ + ':':<16} {where}")
    if trainer.fast_dev_run:
        lines.append(
            "fast_dev_run:    no checkpoints or metrics logged; the output dir holds its config and log"
        )
    metrics = {k: f"{float(v):.4f}" for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    lines.append(f"final metrics:   {metrics}" + (f" (validation was off: {off})" if off else ""))
    if not trainer.fast_dev_run:
        write_final_metrics(output_dir, trainer)
    if sample is not None:
        lines.append(f"sample:\n{sample}")
        (Path(output_dir) / SAMPLE).write_text(sample + "\n")
    log.info("\n".join(lines))


SAMPLE = "sample.txt"  # in the run directory: the text the report prints, whole (other ranks' lines may follow it there)


FINAL_METRICS = (
    "final_metrics.json"  # in the run directory: what a sweep's table shows of its jobs (sweeps/jobs.py)
)


def write_final_metrics(output_dir: str, trainer) -> None:
    """The run's last values of every metric, and the step they were reached at: a sweep's table reads them, and a
    sweep run again with `ckpt_path=last` tells a job that had finished from one that had not."""
    metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
    text = json.dumps({**metrics, "step": trainer.global_step}, indent=1)
    (Path(output_dir) / FINAL_METRICS).write_text(text + "\n")


def final_metrics(run_dir: str | Path) -> dict | None:
    """What `write_final_metrics` wrote in `run_dir` (None: the run has not finished)."""
    try:
        return json.loads((Path(run_dir) / FINAL_METRICS).read_text())
    except (FileNotFoundError, ValueError):
        return None

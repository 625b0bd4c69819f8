"""The checks of the composed config, run before any data is read or any process is started.

Each failure is a `ConfigError` whose one-line message names the key and what would be valid. What one key
accepts is stated once, beside its default, in `schema` or on the part a `_target_` names (`parts`); here
is what relates keys (or reads the machine and the files a run names). The model's fields are checked by its
family's config class itself (`models`). How the config is composed from the command line (and Hydra's own
errors worded) is in `compose`.
"""

from __future__ import annotations

import inspect
import logging
import os

from hydra.utils import get_object
from omegaconf import DictConfig, OmegaConf, open_dict

from parallama.app.parts import (
    LIGHTNING_TRAINERS,
    check_parts,
    check_recipe,
    check_targets,
    check_trainer_keys,
    check_your_trainer,
    part,
    part_nodes,
    trainer_arguments,
)
from parallama.app.run_dir import check_run_dir
from parallama.checkpoint.resume import check_model_matches, missing_ckpt_path
from parallama.config.schema import check_schema
from parallama.distributed.dims import dims_of_config, uses_gpu
from parallama.errors import ConfigError
from parallama.models import model_spec
from parallama.parallel.layout_checks import check_layout
from parallama.runtime.faults import check_multi_node
from parallama.training.wandb_env import wandb_api_key_configured


def check_config(cfg: DictConfig, hardware: bool = True) -> None:
    """`hardware=False` leaves out what depends on this machine (GPUs, cores) and importing the `_target_`s that
    are neither the recipe's parts, the strategy, the data sources nor the tokenizer: for `--cfg`, which only
    prints."""
    _check_values(cfg)  # first: no torch import, so most typos of values answer at once
    if cfg.trainer.get("_target_") in LIGHTNING_TRAINERS:  # read from Lightning's source: no import
        check_trainer_keys(cfg.trainer, trainer_arguments(), "lightning.pytorch.Trainer")
    model, data, trainer = cfg.model, cfg.data, cfg.trainer
    _check_model_shape(model)
    if data.seq_len > model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len={data.seq_len} exceeds model.max_position_embeddings={model.max_position_embeddings}"
        )
    check_recipe(cfg)
    _check_float8(cfg, hardware)
    if hardware:  # a run (not --cfg, which imports no more than it prints)
        check_targets(cfg)
        check_your_trainer(cfg.trainer)
        _check_devices(trainer)
        _check_strategy(cfg)
        apply_derived(cfg)  # before the layout's checks, which read the (derived) micro-batch
        check_layout(cfg, on_gpu=uses_gpu(cfg.trainer.accelerator))
        check_inputs(cfg)  # last: it may read a checkpoint's small client state


def check_inputs(cfg: DictConfig) -> None:
    """The files a run reads, checked before anything is printed or built: a checkpoint to resume exists and
    was trained with this run's model settings, a data source's paths match files, `init_from` is a Hugging
    Face folder of the model's family, from which transformers computes the family's model's logits
    (models/hf_logits.py). (The run checks them again where it reads them.)"""

    ckpt_path = cfg.get("ckpt_path")
    if ckpt_path is not None and ckpt_path != "last":  # `last` is resolved in the run's own directory
        if (line := missing_ckpt_path(ckpt_path)) is not None:
            raise ConfigError(line)
        model = OmegaConf.to_container(cfg.model, resolve=True)
        check_model_matches(ckpt_path, {k: v for k, v in model.items() if v is not None}, strict=False)
    for path, node in part_nodes(cfg):
        if (check := getattr(part(node), "check_inputs", None)) is None:
            continue
        arguments = {
            k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if not k.startswith("_")
        }
        try:
            inspect.signature(check).bind(**arguments)
        except TypeError:  # a keyword missing or unknown: building the part says which
            continue
        try:
            check(**arguments)
        except (ConfigError, FileNotFoundError) as err:  # worded as the data module words it
            where = path.removesuffix(".source")
            raise ConfigError(str(err) if path == "data.source" else f"{where}: {err}") from None
    if cfg.get("init_from"):
        fields = OmegaConf.to_container(cfg.model, resolve=True)
        spec = model_spec(fields)
        if spec.hf_path is not None:
            from parallama.models.hf_logits import check_init_from  # torch-free module

            spec.hf.load_hf_config(cfg.init_from, spec.config)
            if unverified := check_init_from(spec, cfg.init_from, fields):
                logging.getLogger("parallama").warning(unverified)
    _check_tokenizer(cfg)
    check_run_dir(cfg)  # last: the checks above refuse what they refuse whatever the directory holds


def check_vocab_fits(tokens: int, vocab_size: int | None) -> None:
    """The model's embedding holds every id the tokenizer gives (`model.vocab_size` null: it follows the tokenizer)."""
    if vocab_size is not None and tokens > vocab_size:
        raise ConfigError(
            f"the tokenizer has {tokens} tokens but model.vocab_size={vocab_size}; "
            f"set model.vocab_size>={tokens} (or null to follow the tokenizer)"
        )


def _check_tokenizer(cfg: DictConfig) -> None:
    """A tokenizer that needs no training and no download (byte-level, a tokenizer.json on disk) is loaded here,
    so a missing file or a model.vocab_size below it is one line before the run starts; a trained BPE or a Hub
    tokenizer is checked by the run when it has it."""

    from parallama import tokenizer as tokenizers  # start-up time (tokenizers)

    node = OmegaConf.select(cfg, "tokenizer")
    try:  # the factory itself: a saved config may name it by its old path (parallama.tokenizer)
        factory = (
            get_object(node.get("_target_")) if isinstance(node, DictConfig) and "_target_" in node else None
        )
    except Exception:  # a bad _target_ is refused where the tokenizer is built, with the valid ones
        return
    if factory is tokenizers.byte_level:
        tokens = tokenizers.byte_level().get_vocab_size()
    elif factory is tokenizers.from_pretrained:
        try:
            path = tokenizers.local_tokenizer_file(node.name_or_path)
        except FileNotFoundError as err:
            raise ConfigError(str(err)) from None
        if path is None:  # a Hub id: the run downloads it
            return
        tokens = tokenizers.from_pretrained(path).get_vocab_size()
    else:
        return
    check_vocab_fits(tokens, OmegaConf.select(cfg, "model.vocab_size"))


def _check_values(cfg: DictConfig) -> None:
    check_schema(cfg)
    check_parts(cfg)
    _check_wandb(cfg)
    cache = OmegaConf.select(cfg, "paths.cache_dir")
    if isinstance(cache, str) and os.path.exists(cache) and not os.path.isdir(cache):
        raise ConfigError(f"paths.cache_dir={cache} is a file; give a folder (it is created if missing)")


def _check_wandb(cfg: DictConfig) -> None:
    """W&B online without an API key fails inside wandb.init, after the run directory exists (found: a
    UsageError traceback): one line before work. `auto` (the default) picks offline without a key."""
    mode = OmegaConf.select(cfg, "logger.wandb.mode")
    if mode is None or mode == "disabled":
        return
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE", "")
    if mode == "online" and not wandb_api_key_configured():
        raise ConfigError(
            "W&B online (logger.wandb.mode or WANDB_MODE) but no API key is configured: `wandb login` or set "
            "WANDB_API_KEY, or log offline (logger.wandb.mode=offline, or auto with WANDB_MODE unset)"
        )


def _check_float8(cfg: DictConfig, hardware: bool) -> None:
    """float8 (distributed/float8.py): a strategy it runs under, a GPU that computes in float8, aligned linears."""
    from parallama.distributed.float8 import check_float8  # torch-free module

    recipe = cfg.get("float8")
    if recipe is None:
        return
    on_gpu = hardware and uses_gpu(cfg.trainer.accelerator)
    if hardware and not on_gpu and cfg.strategy.get("sequence_parallel") and cfg.strategy.get("tp", 1) > 1:
        raise ConfigError(
            f"float8={recipe} with strategy.sequence_parallel=true needs GPUs: torchao's float8 tensor-parallel "
            "styles all-gather gradients in float8, which gloo (CPU) cannot send; use "
            "strategy.sequence_parallel=false on CPU"
        )
    if cfg.trainer.get("inference_mode"):
        raise ConfigError(
            f"trainer.inference_mode=true cannot run float8={recipe} (torchao's float8 linears fail under "
            "torch.inference_mode); use trainer.inference_mode=false (the default) or float8=null"
        )
    fields = OmegaConf.to_container(cfg.model, resolve=True)
    fields["vocab_size"] = fields.get("vocab_size") or 64  # the head is not converted: any size does
    model, _ = model_spec(fields).shapes(fields)
    check_float8(recipe, on_gpu=on_gpu, model=model, filter=cfg.get("float8_filter", "auto"))


def _check_model_shape(model: DictConfig) -> None:
    fields = OmegaConf.to_container(model, resolve=True)
    if fields.get("vocab_size") is None:
        fields["vocab_size"] = 1  # filled in from the tokenizer later
    model_spec(fields).build_config(fields)


def _check_devices(trainer: DictConfig) -> None:
    import torch  # torch-free module

    accelerator, devices = trainer.accelerator, trainer.devices
    gpus = torch.cuda.device_count()
    if accelerator in ("gpu", "cuda") and gpus == 0:
        raise ConfigError(
            f"trainer.accelerator={accelerator} but no GPU is visible; use trainer.accelerator=cpu or auto"
        )
    if uses_gpu(accelerator) and isinstance(devices, int) and devices > gpus:
        raise ConfigError(f"trainer.devices={devices} but only {gpus} GPU(s) are visible on this node")
    if trainer.num_nodes > 1:
        check_multi_node(trainer.num_nodes)


CPU_PROCESSES_PER_CORE = 2


def _check_strategy(cfg: DictConfig) -> None:
    on_gpu = uses_gpu(cfg.trainer.accelerator)
    backend = cfg.strategy.get("process_group_backend")
    if backend == "nccl" and not on_gpu:
        raise ConfigError(
            "strategy.process_group_backend=nccl needs GPUs; on CPU use gloo (or null to choose)"
        )
    if cfg.strategy.get("mixed_precision") == "fp16" and not on_gpu:
        raise ConfigError("strategy.mixed_precision=fp16 needs GPUs; on CPU use bf16 or null")
    # Two CPU processes per core at most: enough to run a 4-rank layout (e.g. dp_shard=2 x tp=2) on 2 cores.
    most = CPU_PROCESSES_PER_CORE * (os.cpu_count() or 1)
    if not on_gpu and isinstance(cfg.trainer.devices, int) and cfg.trainer.devices > most:
        raise ConfigError(
            f"trainer.devices={cfg.trainer.devices} CPU processes but this machine has {os.cpu_count()} cores "
            f"(at most {most}: {CPU_PROCESSES_PER_CORE} per core)"
        )


def apply_derived(cfg: DictConfig) -> None:
    """What the config's values derive (in the preflight's check and again in the job's own config)."""
    apply_val_check_epochs(cfg)
    apply_global_batch(cfg)
    apply_cpu_precision(cfg)


def apply_cpu_precision(cfg: DictConfig) -> None:
    """fp16 on a CPU runs as bf16 (Lightning falls back, with a warning): the config says what runs, so the run's
    resolved_config.yaml, W&B and a resume see bf16-mixed (found: they said 16-mixed)."""
    trainer = cfg.trainer
    precision = str(trainer.get("precision"))
    if precision in ("16-mixed", "16") and not uses_gpu(trainer.get("accelerator", "auto")):
        logging.getLogger("parallama").info(
            f"trainer.precision={precision} runs as bf16-mixed on CPU (no fp16 autocast there): set so"
        )
        with open_dict(cfg):
            trainer.precision = "bf16-mixed"


def apply_val_check_epochs(cfg: DictConfig) -> None:
    """`trainer.val_check_interval` as a fraction of an epoch (0.5: twice an epoch) needs Lightning's
    `check_val_every_n_epoch`, which parallama leaves null (an interval in batches counts across epochs): a
    fraction sets it to 1 unless it is given."""
    trainer = cfg.trainer
    if (
        isinstance(trainer.get("val_check_interval"), float)
        and trainer.get("check_val_every_n_epoch") is None
    ):
        with open_dict(cfg):
            trainer.check_val_every_n_epoch = 1


def apply_global_batch(cfg: DictConfig) -> None:
    """`global_batch_size`, when set, fixes trainer.accumulate_grad_batches for the run's data-parallel size
    (its data-parallel replicas: devices x nodes, less what tensor, context and pipeline parallelism take).
    `data.batch_size: null` takes the global batch in one micro-batch per replica instead (divided by
    trainer.accumulate_grad_batches where that is set), so one preset feeds one GPU and eight alike
    (conf/experiment/article_180m.yaml)."""

    global_batch = cfg.get("global_batch_size")
    if cfg.data.batch_size is None:
        _derive_batch_size(cfg, global_batch)
    if global_batch is None:
        return
    dims = dims_of_config(cfg)
    per_step = cfg.data.batch_size * dims.dp_size
    if global_batch % per_step:
        of = "devices * nodes" if dims.dp_size == dims.world_size else "its data-parallel replicas"
        raise ConfigError(
            f"global_batch_size={global_batch} is not a multiple of data.batch_size * data-parallel size "
            f"({of}) = {cfg.data.batch_size} * {dims.dp_size} = {per_step}"
        )
    accumulate = cfg.trainer.accumulate_grad_batches
    if accumulate not in (1, global_batch // per_step):
        raise ConfigError(
            f"global_batch_size={global_batch} derives trainer.accumulate_grad_batches, which is also set "
            f"(={accumulate}); set only one of them"
        )
    with open_dict(cfg):
        cfg.trainer.accumulate_grad_batches = global_batch // per_step


def _derive_batch_size(cfg: DictConfig, global_batch: int | None) -> None:
    """data.batch_size = global_batch_size / (data-parallel size x trainer.accumulate_grad_batches)."""
    if global_batch is None:
        raise ConfigError(
            "data.batch_size=null takes its micro-batch from global_batch_size, which is null too; "
            "set global_batch_size or data.batch_size"
        )
    dims, accumulate = dims_of_config(cfg), cfg.trainer.accumulate_grad_batches
    replicas = dims.dp_size * accumulate
    if global_batch % replicas:
        of = "" if accumulate == 1 else f" x trainer.accumulate_grad_batches={accumulate}"
        raise ConfigError(
            f"data.batch_size=null splits global_batch_size={global_batch} over {dims.dp_size} data-parallel "
            f"replica(s){of}, which does not divide it; set data.batch_size or another global_batch_size"
        )
    with open_dict(cfg):
        cfg.data.batch_size = global_batch // replicas

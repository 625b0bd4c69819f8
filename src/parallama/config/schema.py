"""One schema: each key of the training config with its type and valid values, stated once beside its default.

A dataclass per config node (`SCHEMA`, by its path), a field per key: `key(default, Rule(...))`. `check_schema`
checks a composed config against it before any work (`checks.check_config`), each bad value one line naming the
key and what is valid; a key the config does not have is not checked. Each class mirrors one conf file (`conf`):
tests/unit/test_config_schema.py holds every field's default equal to that file's value and every key of the
file to a field, so a renamed or new key cannot go unchecked. The keys of a group whose options are different
parts are not here: each part declares its own (`config_keys`, dataclasses of the same kind: a strategy's class,
parallel/strategies/; a data source, data/sources.py; the BPE tokenizer, tokenizer.py), and `checks` asks the
part that the node's `_target_` names, so a part of yours is checked as a shipped one.

What relates several keys (a batch that divides, a layout that fits the devices) is in `checks`; a model's
fields are checked by its family's config class; the optimizer, schedule and loss check their own keywords.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from omegaconf import DictConfig, ListConfig

from parallama.distributed.options import (
    AC_MODES,
    AC_POLICY_RULES,
    COMPILE_MODES,
    FLOAT8_FILTERS,
    FLOAT8_RECIPES,
)
from parallama.rules import Check, Rule, check_keys, check_value, key, rules


def _devices(value) -> bool:
    """trainer.devices: a count, auto, a list of device ids or their comma-separated string."""
    if isinstance(value, str) and value != "auto":
        ids = [i.strip() for i in value.split(",") if i.strip()]
    elif isinstance(value, (list, ListConfig)):
        ids = [str(i) for i in value]
    else:
        return value == "auto" or (type(value) is int and value >= 1)
    return len(ids) > 0 and all(i.isdigit() for i in ids)


def _betas(value) -> bool:
    return (
        isinstance(value, (list, ListConfig))
        and len(value) == 2
        and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in value)
    )


def _duration(value) -> bool:  # a `_target_` node Hydra builds (datetime.timedelta)
    return value is None or (isinstance(value, (DictConfig, dict)) and "_target_" in value)


POSITIVE, COUNT = Rule(int, 1), Rule(int, 0)
BOOL = Rule(bool)
SOME = Rule(int, 1, allow=(None,))  # a count, or null
PRECISIONS = (
    "32-true",
    "32",
    "bf16-mixed",
    "bf16-true",
    "16-mixed",
    "16-true",
    "64-true",
    "transformer-engine",
)


@dataclass
class Run:
    conf: ClassVar[str] = "train.yaml"

    task_name: str = key("train")
    tags: list = key(["dev"])
    seed: int = key(42, COUNT)
    ckpt_path: str | None = key(None)  # checked as a file in checks.check_inputs
    global_batch_size: int | None = key(None, SOME)
    compile: bool | str = key("auto", Rule(str, choices=COMPILE_MODES, allow=(True, False)))
    activation_checkpointing: str | bool = key("none", Rule(str, choices=AC_MODES, allow=(True, False)))
    float8: str | None = key(None, Rule(str, choices=FLOAT8_RECIPES, allow=(None,)))
    float8_filter: str = key("auto", Rule(str, choices=FLOAT8_FILTERS))
    init_from: str | None = key(None)  # a Hugging Face folder, read in checks.check_inputs
    validate_before_training: bool = key(True, BOOL)
    print_config: bool = key(False, BOOL)  # the console shows the overrides; the run dir has the whole config


@dataclass
class ACPolicy:
    conf: ClassVar[str] = "train.yaml:activation_checkpointing_policy"

    mode: str = key("op", AC_POLICY_RULES["mode"])
    every_n: int = key(2, AC_POLICY_RULES["every_n"])


@dataclass
class Sample:
    conf: ClassVar[str] = "train.yaml:sample"

    prompt: str = key("The ", Rule(str))
    max_new_tokens: int = key(120, COUNT)
    temperature: float = key(0.8, Rule(float, 0))
    top_k: int | None = key(40, SOME)


@dataclass
class Data:
    conf: ClassVar[str] = "data/default.yaml"

    tokenizer: Any = key("${tokenizer}")
    seq_len: int = key(256, POSITIVE)
    batch_size: int | None = key(16, SOME)  # null: global_batch_size / data-parallel size
    packing: bool = key(True, BOOL)
    document_mask: bool = key(False, BOOL)
    val_fraction: float = key(0.05, Rule(float, 0, 1, open="high"))
    num_workers: int = key(0, COUNT)
    cache_dir: str = key("${paths.cache_dir}")
    seed: int = key("${seed}")
    index_log: str | None = key(None, Rule(str, allow=(None,)))


@dataclass
class Trainer:
    """Lightning's Trainer arguments that parallama's config sets; any other argument of it may be added
    (`+trainer.<key>`, checked against Lightning's signature in checks)."""

    conf: ClassVar[str] = "trainer/default.yaml"

    default_root_dir: str = key("${paths.output_dir}")
    accelerator: str = key("auto", Rule(str, choices=("auto", "cpu", "gpu", "cuda")))
    devices: int | str | list = key(
        1, Check(_devices, "a count (e.g. 2), auto, or device ids ([0,1] or '0,1')")
    )
    num_nodes: int = key(1, POSITIVE)
    precision: str = key("${auto_precision:}", Rule(str, choices=PRECISIONS))
    max_steps: int = key(500, Rule(int, 1, allow=(-1,)))
    max_epochs: int | None = key(-1, Rule(int, 1, allow=(-1, None)))
    val_check_interval: int | float | None = key(100, Rule(float, 0, open="low", allow=(None,)))
    check_val_every_n_epoch: int | None = key(None, SOME)
    limit_val_batches: int | float | None = key(20, Rule(float, 0, allow=(None,)))
    limit_train_batches: int | float | None = key(None, Rule(float, 0, open="low", allow=(None,)))
    fast_dev_run: bool | int = key(False, Rule(int, 0, allow=(True, False)))  # or a number of batches
    overfit_batches: int | float = key(0.0, Rule(float, 0))
    num_sanity_val_steps: int = key(0, Rule(int, -1))
    inference_mode: bool = key(False, Rule(bool))
    log_every_n_steps: int = key(10, POSITIVE)
    gradient_clip_val: float | None = key(1.0, Rule(float, 0, allow=(None,)))
    accumulate_grad_batches: int = key(1, POSITIVE)
    deterministic: bool | str = key(False, Rule(bool, allow=("warn",)))
    benchmark: bool | None = key(False, Rule(bool, allow=(None,)))
    profiler: Any = key(None)  # a Lightning profiler or its name (debug=profiler)


@dataclass
class Optimizer:
    """AdamW's keys; another optimizer's are checked where it has the same key (lr, weight_decay, ...), the rest
    by its own signature."""

    conf: ClassVar[str] = "optimizer/adamw.yaml"

    lr: float = key(3e-3, Rule(float, 0, 1, open="low"))
    betas: list = key([0.9, 0.99], Check(_betas, "two numbers in [0, 1), e.g. [0.9, 0.95]"))
    eps: float = key(1e-8, Rule(float, 0, open="low"))
    weight_decay: float = key(0.1, Rule(float, 0))
    fused: bool | None = key(None, Rule(bool, allow=(None,)))


@dataclass
class LastCheckpoint:
    conf: ClassVar[str] = "callbacks/default.yaml:last_checkpoint"

    dirpath: str = key("${paths.output_dir}/checkpoints")
    every_n_train_steps: int | None = key(100, SOME)
    train_time_interval: Any = key(
        {"_target_": "datetime.timedelta", "minutes": 30},
        Check(_duration, "null or a duration, e.g. {_target_:datetime.timedelta,minutes:30}"),
    )


@dataclass
class DownstreamEval:
    conf: ClassVar[str] = "callbacks/default.yaml:downstream_eval"

    tasks: list = key(["parallama_cloze", "parallama_choice"])
    every_n_steps: int | None = key(None, SOME)
    limit: int | float | None = key(100, Rule(float, 0, open="low", allow=(None,)))
    batch_size: int = key(16, POSITIVE)
    task_dirs: list = key([])
    cache_dir: str = key("${paths.cache_dir}")


@dataclass
class WandbLogger:
    conf: ClassVar[str] = "logger/wandb.yaml:wandb"

    project: str = key("parallama")
    entity: str | None = key(None)
    group: str = key("${task_name}")
    name: str | None = key(None)
    tags: list = key("${tags}")
    id: str | None = key(None)
    save_dir: str = key("${paths.output_dir}")
    mode: str = key("auto", Rule(str, choices=("auto", "online", "offline", "disabled")))
    log_model: bool | str = key(False, Rule(bool, allow=("all",)))


# Where each class applies: the config node at that path.
SCHEMA: dict[str, type] = {
    "": Run,
    "activation_checkpointing_policy": ACPolicy,
    "sample": Sample,
    "data": Data,
    "trainer": Trainer,
    "optimizer": Optimizer,
    "callbacks.last_checkpoint": LastCheckpoint,
    "callbacks.downstream_eval": DownstreamEval,
    "logger.wandb": WandbLogger,
}


def train_rules(*prefixes: str) -> dict[str, Rule]:
    """The rules of the training config by dotted key, for the tools that read part of it (parallama-prepare:
    seed, data.); a part's keys are its own (`app.parts.check_parts`)."""
    found: dict[str, Rule] = {}
    for path, schema in SCHEMA.items():
        for name, rule in rules(schema).items():
            dotted = f"{path}.{name}" if path else name
            if dotted.startswith(prefixes):
                found[dotted] = rule
    return found


def check_schema(cfg: DictConfig) -> None:
    """The composed training config against `SCHEMA`: each key it has, in one line naming the first bad one."""
    for path, schema in SCHEMA.items():
        check_keys(cfg, schema, path)


def check_arguments(path: str, schema: type, **values) -> None:
    """The arguments of a class the config node at `path` builds, by its schema's rules: what the config check
    does, for a caller from Python (the same rule, the same line)."""
    for name, rule in rules(schema).items():
        if name in values:
            check_value(f"{path}.{name}", values[name], rule)

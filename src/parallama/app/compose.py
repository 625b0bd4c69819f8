"""From a command line to a composed config, outside `@hydra.main`: every tool's preflight (the overrides
composed as Hydra will, a sweep job by job, each then checked by the tool's check, by default
`checks.check_config`), Hydra's errors in one line with a "did you mean", and the `${auto_precision:}` resolver
that the configs use.

Separate from `checks`: this is how a config is obtained and Hydra's complaints about it worded; `checks` is
what a composed config must satisfy.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import hydra
from hydra import initialize_config_dir
from hydra._internal.utils import get_args_parser
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import ValueType
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from parallama import CONF_DIR
from parallama.app.checks import check_config
from parallama.errors import ConfigError
from parallama.runtime.launch import CHECKED_ENV


def auto_precision() -> str:
    """`trainer.precision: ${auto_precision:}`: bf16 mixed precision where the GPU supports it, else fp32."""
    import torch  # torch-free module: --help and typos answer before torch is loaded

    cuda_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return "bf16-mixed" if cuda_bf16 else "32-true"


OmegaConf.register_new_resolver("auto_precision", auto_precision, replace=True)


@dataclass(frozen=True)
class ConfiguredMode:
    """A config's `hydra.mode`: RUN, MULTIRUN (a preset's sweep), or None (unset: Hydra runs as the flags say)."""

    value: RunMode | None


# The jobs (their override lists) that `preflight` checked in this process: a tool need not check them again.
_CHECKED: set[tuple[str, ...]] = set()


def already_checked(cfg: DictConfig) -> bool:
    """Whether the running Hydra job's config was checked: by `preflight` in this process (a job whose values a
    sweeper draws as it starts, e.g. Optuna's, was not), or by the rank that started this one."""

    if os.environ.get(CHECKED_ENV):
        return True
    if not HydraConfig.initialized():
        return False
    return tuple(HydraConfig.get().overrides.task) in _CHECKED


def preflight(
    conf_dir: Path,
    config_name: str,
    argv: list[str],
    check: Callable[[DictConfig, bool], None] = lambda cfg, hardware: check_config(cfg, hardware=hardware),
    list_keys: bool = False,
) -> ConfiguredMode | None:
    """Compose the config as Hydra will and check it, so a typo costs one line and starts no process.

    A sweep (`-m a=1,2`) is checked job by job: each value of each swept key once, with the other keys at
    their first value. `--cfg` only prints: the config may still lack required values or name GPUs that this
    machine does not have (`check(cfg, hardware=False)`). `--config-dir DIR` searches DIR too, as Hydra does.
    The ranks a run starts itself are not checked again (`CHECKED_ENV`).

    Returns the `hydra.mode` the composed config has, as Hydra's main would compose it to read it (`get_mode`),
    where that is known: not under `-m` (composed here with hydra.mode=MULTIRUN), not with one of Hydra's own
    groups chosen (`hydra/launcher=...`, not composed here), nor where nothing was composed (`--help`, `--cfg`).
    """
    if os.environ.get(CHECKED_ENV):  # a rank's command (launch.job_command) sets hydra.mode=RUN last
        modes = [arg for arg in argv if arg.startswith("hydra.mode=")]
        return ConfiguredMode(RunMode.RUN) if modes[-1:] == ["hydra.mode=RUN"] else None
    # Hydra's own flags, by the parser @hydra.main runs (in hydra._internal only; `--version` answers and exits in
    # it, as in Hydra). Where Hydra answers by itself (help, completion, info, a flag's bad value) or reads another
    # config tree (--config-path, --experimental-rerun), nothing is checked; -m and --cfg are set aside.
    parser = get_args_parser()
    parser.exit_on_error = False
    try:
        flags, rest = parser.parse_known_args(argv)
    except argparse.ArgumentError:
        return None
    if flags.help or flags.hydra_help or flags.shell_completion or flags.info:
        return None
    if flags.config_path is not None or flags.experimental_rerun is not None:
        return None
    printing, config_name, extra = flags.cfg is not None, flags.config_name or config_name, []
    if flags.config_dir is not None:
        if not flags.config_dir:
            raise ConfigError("--config-dir needs a directory")
        extra.append(f"hydra.searchpath=[file://{Path(flags.config_dir).resolve()}]")
    overrides, run = [], []
    for arg in [*flags.overrides, *rest]:  # rest: overrides after a flag, and what is not a flag of Hydra's
        key = arg.split("=", 1)[0]
        if key in ("hydra.run.dir", "hydra.sweep.dir") and not printing:
            _check_creatable(key, arg.split("=", 1)[1])
            run.append(arg)  # the job's directory, which the checks of the files a run reads look into
        elif key == "hydra.mode":
            run.append(arg)
        elif not arg.startswith(("hydra.", "hydra/", "+hydra", "~hydra")):
            overrides.append(arg)
    extra += [*run, "hydra.mode=MULTIRUN"] if flags.multirun else run
    # Hydra's own config groups (`hydra/launcher=...`) are not composed here: one of them might set the mode
    hydra_groups = [a for a in [*flags.overrides, *rest] if a.startswith(("hydra/", "+hydra/", "~hydra/"))]
    mode_known = not (flags.multirun or printing or hydra_groups)

    mode = None
    with initialize_config_dir(str(conf_dir), version_base="1.3"):
        for number, (job, label) in enumerate(_sweep_jobs(overrides)):
            where = f" (in the sweep job with {label})" if label else ""
            try:
                cfg = compose_job(config_name, [*job, *extra], list_keys)
            except ConfigError as err:
                raise ConfigError(f"{err}{where}") from None
            if number == 0:
                if mode_known:
                    mode = ConfiguredMode(HydraConfig.get().mode)
                if not flags.multirun:  # before a job's values: -m may be all that is wrong
                    _check_sweep_allowed(overrides, printing)
            try:
                missing = sorted(OmegaConf.missing_keys(cfg))
                if missing and not printing:
                    raise ConfigError(f"{missing[0]} is required but not set: add {missing[0]}=...")
                if not missing:
                    check(cfg, not printing)
                    if not printing:
                        _CHECKED.add(tuple(job))
            except ConfigError as err:
                raise ConfigError(f"{err}{where}") from None
    return mode


def _check_creatable(key: str, path: str) -> None:
    """A run directory Hydra could not create is one line here (found: `hydra.run.dir=/proc/x`, a traceback
    printed twice): a folder is made and removed in its nearest existing parent. Interpolations are left to Hydra."""

    if "${" in path:
        return
    parent = Path(path).expanduser().absolute()
    while not parent.exists():
        parent = parent.parent
    try:
        if not parent.is_dir():
            raise NotADirectoryError(f"{parent} is a file")
        os.rmdir(tempfile.mkdtemp(dir=parent))
    except OSError as err:
        raise ConfigError(f"{key}={path} cannot be created ({err}); choose a folder you can write") from None


def _check_sweep_allowed(overrides: list[str], printing: bool) -> None:
    """A sweep's values (`key=a,b`) without `-m` are refused by Hydra in 6 lines and exit status 1 unless the
    config itself asks for a sweep (a preset's `hydra.mode: MULTIRUN`): here in one line, suggesting `-m`.
    Called right after a job of the sweep composed, so HydraConfig holds the mode the config asks for. `--cfg`
    prints one config, so there a sweep is refused whatever the mode."""

    if HydraConfig.get().mode == RunMode.MULTIRUN and not printing:
        return
    for override in OverridesParser.create().parse_overrides(overrides):
        if override.is_sweep_override():
            line = override.input_line
            key, _, value = line.partition("=")
            if printing:
                raise ConfigError(f"{line} is a sweep but --cfg prints one config: give {key} one value")
            if override.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
                raise ConfigError(
                    f"{line} is a sweep over several values: add -m to run one job per value "
                    f"(or write {key}=[{value}] for a list, {key}='{value}' for a string)"
                )
            raise ConfigError(f"{line} is a sweep: add -m to run one job per value")


def compose_tool(config_name: str, overrides: list[str], list_keys: bool = False) -> DictConfig:
    """A tool's config for `overrides`, as its Hydra app composes it (for calling a tool from Python)."""

    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        cfg = compose_job(config_name, overrides, list_keys)
    if missing := sorted(OmegaConf.missing_keys(cfg)):
        raise ConfigError(f"{missing[0]} is required but not set: add {missing[0]}=...")
    return cfg


def _sweep_jobs(overrides: list[str]) -> list[tuple[list[str], str]]:
    """The jobs to check: the overrides themselves, or for a sweep one job per swept value (label: that value).
    Values a sweeper draws at run time (Optuna's interval(...)) are checked when their job starts."""

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as err:
        if bare := [arg for arg in overrides if "=" not in arg and not arg.startswith("~")]:
            raise ConfigError(f"argument {bare[0]!r} is not key=value (e.g. {bare[0]}=...)") from None
        raise ConfigError(" ".join(str(err).split())) from None
    base, swept = [], []
    for override in parsed:
        if not override.is_sweep_override():
            base.append(override.input_line)
            continue
        key = override.get_key_element()
        try:
            values = [f"{key}={value}" for value in override.sweep_string_iterator()]
        except Exception:  # not enumerable here
            continue
        swept.append((len(base), values))
        base.append(values[0])
    if not swept:
        return [(base, "")]
    return [
        ([*base[:position], value, *base[position + 1 :]], value)
        for position, values in swept
        for value in values
    ]


def compose_job(config_name: str, overrides: list[str], list_keys: bool = False) -> DictConfig:
    """The job config Hydra composes for `overrides` (inside `initialize_config_dir`), its `hydra` node set aside
    once ${hydra:...} can resolve; Hydra's error in one line otherwise. `list_keys`: an unknown key is answered
    with the config's keys (tools with a few top-level keys) instead of a suggestion to add it with `+key=`."""
    try:
        cfg = hydra.compose(config_name, overrides=overrides, return_hydra_config=True)
    except (HydraException, OmegaConfBaseException) as err:
        message = f"{err}\n{err.__cause__ or ''}"
        raise ConfigError(_one_line(message, lambda: hydra.compose(config_name), list_keys)) from None
    # the job's directory (paths.output_dir), as Hydra's run_job sets it
    if cfg.hydra.mode != RunMode.MULTIRUN:
        cfg.hydra.runtime.output_dir = os.path.abspath(str(cfg.hydra.run.dir))
    HydraConfig.instance().set_config(cfg)  # lets ${hydra:...} interpolations resolve
    with open_dict(cfg):
        del cfg["hydra"]
    return cfg


def _one_line(message: str, compose_defaults: Callable[[], DictConfig], list_keys: bool = False) -> str:
    """Hydra's error in one line. `compose_defaults` gives the config without overrides, for "did you mean";
    it is called only for an unknown key, an override error, so the config files themselves compose."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if (match := re.match(r"Could not override '([^']+)'", lines[0])) and "not in struct" in message:
        key = match.group(1)
        suggestion = _did_you_mean(key, compose_defaults())
        if list_keys:
            defaults = OmegaConf.to_container(compose_defaults(), resolve=False)
            keys = [f"{k}.*" if isinstance(v, dict) else str(k) for k, v in defaults.items() if k != "hydra"]
            return f"unknown or invalid key '{key}'{suggestion}; valid keys: {', '.join(keys)}"
        if options := _options_with(key):  # strategy.ep under strategy=auto: the option that has it
            group = key.partition(".")[0]
            choices = " or ".join(f"{group}={o}" for o in options)
            return f"unknown config key '{key}' for this {group}; it is a key of {choices} (a new key: +{key}=...)"
        return f"unknown config key '{key}'{suggestion}; to add a new key write +{key}=..."
    if match := re.search(r"Could not find '([^']+)'", lines[0]):
        group, _, option = match.group(1).rpartition("/")
        start = next((i for i, line in enumerate(lines) if line.startswith("Available options")), None)
        options = []
        if start is not None:
            options = [
                line
                for line in lines[start + 1 :]
                if not line.startswith(("Config search path", "provider="))
            ]
        return f"{group}={option} is not an option of config group '{group}'; valid: {', '.join(options)}"
    return " ".join(lines[:3])


def _options_with(key: str) -> list[str]:
    """The options of a config group (conf/<group>/*.yaml) that have `key`'s leaf, for `<group>.<leaf>`."""

    group, _, leaf = key.partition(".")
    folder = Path(CONF_DIR, group)
    if not leaf or "." in leaf or not folder.is_dir():
        return []
    return sorted(p.stem for p in folder.glob("*.yaml") if leaf in (OmegaConf.load(p) or {}))


def _did_you_mean(key: str, defaults: DictConfig) -> str:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(defaults, parent) if parent else defaults
    if not isinstance(node, DictConfig):
        return ""
    close = difflib.get_close_matches(leaf, [str(k) for k in node.keys() if k != leaf], n=1)
    return f" (did you mean '{parent + '.' if parent else ''}{close[0]}'?)" if close else ""

"""The front door of every tool (`parallama-<tool>`), so that they all behave alike:

- the command line is Hydra's (`key=value`, `group=option`, `+key=`, `--help`, `--cfg job`, `--config-dir`, and
  `-m` where a tool sweeps), composed from conf/<tool>.yaml;
- before any work, the config is composed as Hydra will compose it and checked (`check`), a sweep job by job:
  a typo or a bad value is one `error:` line and exit status 2, before any job starts;
- the tool then runs as a Hydra app (its run directory, logging and sweeps as its config says);
- anything that goes wrong that the user can act on is one line and an exit status (errors.py `exit_status`),
  said here and nowhere else.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
from collections.abc import Callable, Iterator
from typing import Any

import hydra
from hydra._internal.hydra import Hydra
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from parallama import CONF_DIR
from parallama.app.compose import ConfiguredMode, compose_tool, preflight
from parallama.errors import exit_status
from parallama.runtime.launch import SweepJobEnded, hand_to_sweep
from parallama.runtime.quiet import quiet_known_warnings

log = logging.getLogger("parallama")


def run(
    config_name: str,
    task: Callable[[DictConfig], Any],
    argv: list[str] | None = None,
    *,
    check: Callable[[DictConfig, bool], None] | None = None,
    subcommand: str | None = None,
    log_errors: bool = False,
    list_keys: bool = False,
    rewrite: Callable[[list[str]], list[str]] | None = None,
    setup: Callable[[], None] | None = None,
) -> None:
    """Check, then run `task` as the Hydra app of conf/<config_name>.yaml.

    check(cfg, hardware): raises ConfigError for a bad config (`hardware=False` under `--cfg`, which only
    prints). subcommand: an optional first word (`parallama-ckpt convert ...`). log_errors: report errors
    through the tool's logging (train, prepare: their log file keeps them too), else on stderr. list_keys: an
    unknown key is answered with the tool's keys (tools with a few of them). rewrite: older spellings of
    arguments in today's (may raise ConfigError). setup: what to do once the config passed, before the app.
    """
    quiet_known_warnings()
    args = list(sys.argv[1:] if argv is None else argv)
    if subcommand is not None and args[:1] == [subcommand]:
        args = args[1:]
    try:
        args = rewrite(args) if rewrite is not None else args
        mode = preflight(CONF_DIR, config_name, args, check or (lambda cfg, hardware: None), list_keys)
    except Exception as err:  # a file a check reads, a part it builds: what the user can act on is one line
        status, line = exit_status(err)
        if status is None:
            raise
        print(line, file=sys.stderr)
        sys.exit(status)
    if setup is not None:
        setup()

    GlobalHydra.instance().clear()  # the tool may run twice in one process (tests, notebooks)
    app = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(
        guarded(task, log_errors)
    )
    saved, sys.argv = sys.argv, [sys.argv[0], *args]
    try:
        with _mode_known(mode):
            app()
    finally:
        sys.argv = saved
        GlobalHydra.instance().clear()


@contextlib.contextmanager
def _mode_known(mode: ConfiguredMode | None) -> Iterator[None]:
    """Hydra's main composes the whole config once more only to read `hydra.mode` (`Hydra.get_mode`), a tenth of
    a tiny run's CPU time and of every rank's start (tests/unit/test_cli_app.py counts the compositions); the
    preflight has just composed it and found the mode."""
    if mode is None:
        yield
        return
    get_mode = Hydra.get_mode
    Hydra.get_mode = lambda self, config_name, overrides: mode.value
    try:
        yield
    finally:
        Hydra.get_mode = get_mode


def compose(
    config_name: str,
    argv: list[str],
    check: Callable[[DictConfig, bool], None] | None = None,
    list_keys: bool = False,
) -> DictConfig:
    """The config a tool's command line gives, checked, without running the tool (tests, notebooks)."""
    cfg = compose_tool(config_name, argv, list_keys)
    if check is not None:
        check(cfg, True)
    return cfg


def guarded(task: Callable[[DictConfig], Any], log_errors: bool) -> Callable[[DictConfig], Any]:
    """`task` with its errors reported as one line and an exit status (`exit_status`)."""

    @functools.wraps(task)
    def wrapper(cfg: DictConfig) -> Any:
        try:
            return task(cfg)
        except Exception as err:
            status, line = exit_status(err)
            if status is None:
                raise  # a bug: the whole traceback
            if status == 0:
                if not getattr(err, "said", False):
                    log.warning(line)
            elif log_errors:
                log.error(line)
            else:
                print(line, file=sys.stderr)
            if hand_to_sweep(status):  # launcher=slurm: the sweep's process says it, in one line
                raise SweepJobEnded.of(
                    str(err) if status == 0 else line.removeprefix("error: "), status
                ) from None
            sys.exit(status)

    return wrapper

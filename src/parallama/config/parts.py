"""The recipe's parts named by `_target_` (conf/optimizer, conf/scheduler, conf/loss, `module`): built by Hydra, with
what goes wrong worded in one line naming the group, as every other bad input is."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping

from parallama.errors import ConfigError


def locate(target: str):
    """The class or function a `_target_` names ("package.module.Name"), importing its module. Not Hydra's
    `get_object`/`get_class`, which log their own multi-line report before raising
    (test_library_gaps.py test_hydras_get_object_logs_an_error_and_raises_three_lines)."""
    module, _, name = str(target).rpartition(".")
    if not module:
        raise ImportError(f"{target!r} is not a dotted path (package.module.Name)")
    return getattr(importlib.import_module(module), name)


def locate_target(target: str, key: str):
    """`locate(target)`, or one line: `<key>=<target> cannot be imported (why)`."""
    try:
        return locate(target)
    except Exception as err:  # ImportError, AttributeError, or what the module raised when imported
        raise ConfigError(f"{key}={target} cannot be imported ({' '.join(str(err).split())})") from None


def targets(node, path: str = "") -> Iterator[tuple[str, str]]:
    """(key, `_target_`) of every node of a plain config (nested dicts and lists) that names one."""
    if isinstance(node, Mapping):
        if isinstance(node.get("_target_"), str):
            yield path, node["_target_"]
        for key, value in node.items():
            yield from targets(value, f"{path}.{key}" if path else str(key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from targets(value, f"{path}[{i}]")


def instantiate_part(config: Mapping, group: str, **kwargs):
    """`hydra.utils.instantiate(config, **kwargs)`; a part's own ConfigError (its keys check themselves) comes out
    as it is, an unknown class or keyword as one line naming `group`."""
    import hydra  # start-up time (hydra)
    from hydra.errors import InstantiationException  # start-up time (hydra)

    if "_target_" not in config:
        raise ConfigError(f"{group} has no _target_; name the class to build (see conf/{group}/)")
    try:
        return hydra.utils.instantiate(dict(config), _convert_="all", **kwargs)  # plain lists and dicts
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, ImportError):  # Hydra's words about it span lines: its own cause is the one
            reason = f"cannot be imported ({cause.__cause__ or cause})"
        else:  # a wrong keyword (TypeError), or what the class itself raised
            reason = str(cause or err).strip().replace("\n", " ")
        raise ConfigError(f"{group}._target_={config['_target_']}: {reason}") from None

"""The recipe's parts named by `_target_` (conf/optimizer, conf/scheduler, conf/loss, `module`): built by Hydra, with
what goes wrong worded in one line naming the group, as every other bad input is."""

from __future__ import annotations

from collections.abc import Mapping

from parallama.errors import ConfigError


def instantiate_part(config: Mapping, group: str, **kwargs):
    """`hydra.utils.instantiate(config, **kwargs)`; a part's own ConfigError (its keys check themselves) comes out
    as it is, an unknown class or keyword as one line naming `group`."""
    import hydra
    from hydra.errors import InstantiationException

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

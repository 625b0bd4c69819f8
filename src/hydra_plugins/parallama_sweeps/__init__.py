"""Hydra instantiates launchers and sweepers only from the `hydra_plugins` namespace; parallama's live in
parallama.sweeps and are named here (conf/hydra/launcher/devices.yaml, conf/hydra/sweeper/grid.yaml,
conf/hydra/sweeper/optuna_pruning.yaml)."""

from hydra.core.plugins import Plugins

from parallama.sweeps import grid, launcher, optuna_sweeper


class DeviceLauncher(launcher.DeviceLauncher):
    __doc__ = launcher.DeviceLauncher.__doc__


class OptunaPruningSweeper(optuna_sweeper.OptunaPruningSweeper):
    __doc__ = optuna_sweeper.OptunaPruningSweeper.__doc__


class GridSweeper(grid.GridSweeper):
    __doc__ = grid.GridSweeper.__doc__


def register() -> None:
    """Hydra finds launchers and sweepers by scanning the `hydra_plugins` namespace, a scan that does not see
    packages installed in editable mode (`pip install -e`): parallama's are registered by hand as well."""
    for plugin in (DeviceLauncher, GridSweeper, OptunaPruningSweeper):
        Plugins.instance().register(plugin)

"""Sweeps on one machine: jobs spread over its devices (launcher.py), a grid (grid.py) and Optuna that prunes and
resumes (optuna_sweeper.py), how a sweep ends (jobs.py: a table, a line per job that did not finish), and the
callback through which a trial reports to its study (pruning.py)."""


def register_plugins() -> None:
    """Hydra finds launchers and sweepers by scanning the `hydra_plugins` namespace, a scan that does not see
    packages installed in editable mode (`pip install -e`): parallama's are registered by hand as well."""
    from hydra.core.plugins import Plugins  # start-up time (hydra)

    import hydra_plugins.parallama_sweeps as plugins  # start-up time (hydra)

    for plugin in (plugins.DeviceLauncher, plugins.GridSweeper, plugins.OptunaPruningSweeper):
        Plugins.instance().register(plugin)

"""Sweeps on one machine: jobs spread over its devices (launcher.py), a grid (grid.py) and Optuna that prunes and
resumes (optuna_sweeper.py), how a sweep ends (jobs.py: a table, a line per job that did not finish), and the
callback through which a trial reports to its study (pruning.py). Hydra takes them from
hydra_plugins.parallama_sweeps, which names them (and registers them by hand: `register`)."""

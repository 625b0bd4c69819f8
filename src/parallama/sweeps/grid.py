"""The grid sweeper of every `-m` sweep (`hydra/sweeper: grid`, the default): Hydra's basic sweeper (every
combination of the swept values, in batches), ending as parallama's sweeps end (jobs.py): the table of its jobs,
and where one failed or stopped (a job killed, Ctrl-C or SIGTERM to the sweep) a line per job and exit status 2,
where Hydra raised the first failed job's error as a traceback and left the other jobs unsaid."""

from __future__ import annotations

from pathlib import Path

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import OmegaConf

from parallama.sweeps import jobs


class GridSweeper(BasicSweeper):
    """Hydra's basic sweeper (Hydra 1.3 has it in hydra._internal only; its plugin name is `basic`), with
    parallama's ending."""

    @jobs.one_line_errors
    def sweep(self, arguments: list[str]) -> list:
        """BasicSweeper.sweep, except that a job's failure is reported with the others once the sweep has ended."""
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        overrides = parser.parse_overrides([*self._parse_config(), *arguments])
        self.overrides = self.split_arguments(overrides, self.max_batch_size)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        returns, found, interrupted = [], [], False
        while not self.is_done():
            batch = self.get_job_batch()
            self.validate_batch_is_legal(batch)
            try:
                results = self.launcher.launch(batch, initial_job_idx=len(found))
            except jobs.SweepInterrupted as stop:  # the jobs under way saved and ended: say where each stands
                found, interrupted = found + jobs.outcomes(stop.results, len(found)), True
                break
            found += jobs.outcomes(results, len(found))
            returns.append(results)
        resume = jobs.resume_command(self.config, f"hydra.sweep.dir={sweep_dir}", "ckpt_path=last")
        jobs.end(found, sweep_dir, resume, interrupted)
        return returns

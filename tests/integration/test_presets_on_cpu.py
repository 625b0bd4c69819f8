"""No preset forces a GPU: every option of every conf/ group composes with the accelerator left to `auto` (or
CPU) unless the option is `trainer=gpu` itself, and every experiment preset runs `debug=fdr` on this CPU."""

from __future__ import annotations

import pytest
from conftest import run_cli
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from parallama import CONF_DIR

GROUPS = [
    "model", "optimizer", "scheduler", "loss", "tokenizer", "data", "data/source", "paths", "strategy", "trainer", "callbacks", "logger", "launcher",
    "experiment", "experiment/plan", "debug", "hparams_search", "pruner",
]  # fmt: skip


def options() -> list[str]:
    """`group=option`; a group inside a group's folder (experiment/plan) is an option of that group (e.g.
    `experiment=plan/llama3_70b_nd`)."""
    found = []
    for g in GROUPS:
        group, option = (g.split("/", 1) + [""])[:2] if g.startswith("experiment/") else (g, "")
        found += [
            f"{group}={option + '/' if option else ''}{p.stem}" for p in sorted((CONF_DIR / g).glob("*.yaml"))
        ]
    return found


def test_every_group_is_listed():
    """A new conf/ group is checked here too: add it to GROUPS."""
    groups = {str(p.parent.relative_to(CONF_DIR)) for p in CONF_DIR.rglob("*.yaml") if p.parent != CONF_DIR}
    assert groups - {"hydra", "hydra/launcher", "hydra/sweeper"} == set(GROUPS)


def test_no_preset_forces_a_gpu():
    """Composed in one Hydra context, each option of each group (a few seconds in all)."""
    forced = {}
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        for option in options():
            overrides = [option]
            if option == "launcher=slurm":
                overrides += ["trainer.num_nodes=2", "trainer.devices=8"]
            if option.startswith("pruner="):
                overrides.insert(0, "hparams_search=lr_optuna")  # the presets that add the group
            cfg = compose("train", overrides=overrides, return_hydra_config=True)
            trainer = (cfg.trainer.accelerator, OmegaConf.select(cfg, "trainer.precision"))
            if trainer != ("auto", "32-true"):  # auto precision: fp32 with no GPU
                forced[option] = trainer
    assert forced == {"trainer=gpu": ("gpu", "bf16-mixed"), "trainer=cpu": ("cpu", "32-true"),
                      "trainer=ddp_sim": ("cpu", "32-true")}  # fmt: skip


# Each experiment preset, shrunk only where a CPU test must be (the data source: FineWeb needs the hub; the
# article's micro-batch and sequence), its model and tokenizer kept: the 180M Llama, a 50k BPE.
EXPERIMENTS = {
    "article_180m": [
        "data/source=embedded",
        "data.batch_size=1",
        "data.seq_len=64",
        "sample.max_new_tokens=4",
    ],
    "lr_width_sweep": ["hydra.mode=RUN"],  # one trial's run, outside a sweep (its pruning callback is off)
    "mixture": ["data.sources.code.source.max_documents=10"],
}


def test_every_experiment_preset_runs_here():
    """Each option of `experiment` is in EXPERIMENTS, so `experiment=glob(*)` smoke-tests on a CPU; presets that
    need the hardware they were planned for (nodes, 8 GPUs, a gated tokenizer) are `experiment=plan/<name>`."""
    assert sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")) == sorted(EXPERIMENTS)
    assert sorted(p.stem for p in (CONF_DIR / "experiment" / "plan").glob("*.yaml")) == [
        "llama3_70b_nd",
        "llama3_8b_tp",
    ]


@pytest.mark.parametrize("experiment", sorted(EXPERIMENTS))
def test_experiment_presets_run_fdr_on_cpu(tmp_path, data_cache, experiment):
    args = [
        f"experiment={experiment}",
        "debug=fdr",
        f"paths.cache_dir={data_cache}",
        *EXPERIMENTS[experiment],
    ]
    proc = run_cli(
        "parallama.cli.train", *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, timeout=600
    )
    output = proc.stdout + proc.stderr
    assert "GPU available: False, used: False" in output and "\nsample:\n" in output
    if experiment == "article_180m":
        assert "179.45 M parameters" in output

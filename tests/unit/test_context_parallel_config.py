"""strategy.cp's config checks: each bad setting is one line naming the keys, before any work."""

from __future__ import annotations

import pytest

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.distributed.dims import ParallelDims
from parallama.errors import ConfigError
from parallama.parallel import layout_checks

CP = ["strategy=model_parallel", "trainer.accelerator=cpu", "trainer.devices=2", "strategy.cp=2"]
BAD = [
    (["data.seq_len=66"], "strategy.cp=2 needs data.seq_len divisible by 2 x cp = 4"),
    (["data.document_mask=true"], "strategy.cp > 1 runs causal ring attention, which takes no document mask"),
    (["strategy.cp=3"], "the layout dp_shard=-1 x cp=3 needs a multiple of 3 ranks, but the world size is 2"),
    (["strategy.cp=-1"], "strategy.cp=-1"),
]


@pytest.mark.parametrize("overrides, message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_a_bad_cp_setting_is_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(CONF_DIR, "train", [*CP, *overrides])
    assert message in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_sequence_parallel_splits_each_cp_ranks_tokens():
    """cp=2 x tp=4 (8 ranks, more than this machine starts): 12 tokens divide by 2 x cp and by tp, but each cp
    rank's 6 do not divide by tp."""
    seen = []
    overrides = [*CP, "strategy.sequence_parallel=true", "data.seq_len=12"]
    preflight(CONF_DIR, "train", overrides, check=lambda cfg, hardware: seen.append(cfg))
    with pytest.raises(
        ConfigError, match="splits each cp rank's 6 tokens over strategy.tp=4: make data.seq_len"
    ):
        layout_checks._check_context_parallel(seen[0], ParallelDims(cp=2, tp=4))


def test_a_good_cp_setting_passes():
    preflight(CONF_DIR, "train", [*CP, "data.seq_len=64", "strategy.dp_shard=1"])
    # with a pipeline too: each stage's attention runs the ring (tests/distributed/test_context_parallel.py)
    preflight(CONF_DIR, "train", [*CP, "trainer.devices=4", "strategy.pp=2", "strategy.dp_shard=1"])

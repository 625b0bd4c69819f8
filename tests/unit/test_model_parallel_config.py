"""strategy=model_parallel's config: every bad layout is refused before any work, in one line naming the keys;
the global batch counts data-parallel replicas, not ranks. In-process, through `preflight` as parallama-train
runs it (the command line's one line and exit 2: tests/integration/test_bad_config_cli.py; training itself:
tests/distributed/test_model_parallel.py)."""

from __future__ import annotations

import pytest

from parallama import CONF_DIR
from parallama.app.checks import check_config
from parallama.app.compose import preflight
from parallama.errors import ConfigError

MP = ["strategy=model_parallel", "trainer.accelerator=cpu"]
THREE_HEADS = ["model.hidden_size=96", "model.num_attention_heads=3", "model.num_key_value_heads=3"]
BAD_LAYOUTS = [  # (overrides, what the one line must say); the tiny model has 4 heads and 2 key/value heads
    (
        ["trainer.devices=2", "strategy.tp=3"],
        "the layout dp_shard=-1 x tp=3 needs a multiple of 3 ranks, but the world size is 2",
    ),
    (
        ["trainer.devices=4", "strategy.dp_shard=1", "strategy.tp=2"],
        "the layout tp=2 is 2 ranks, but the world size is 4",
    ),
    (
        ["trainer.devices=4", "strategy.dp_replicate=3"],
        "needs a multiple of 3 ranks, but the world size is 4",
    ),
    (
        ["trainer.devices=2", "strategy.dp_replicate=-1"],
        "strategy.dp_replicate and strategy.dp_shard are both -1",
    ),
    (["trainer.devices=2", "strategy.tp=0"], "strategy.tp=0 is not valid; use an integer >= 1"),
    (
        ["trainer.devices=2", "strategy.dp_shard=-2"],
        "strategy.dp_shard=-2 is not valid; use an integer >= 1 or -1",
    ),
    (
        ["trainer.devices=2", "strategy.sequence_parallel=yes"],
        "strategy.sequence_parallel='yes' is not valid",
    ),
    (["trainer.devices=2", "strategy.pp_schedule=zigzag"], "strategy.pp_schedule='zigzag' is not valid"),
    (["trainer.devices=4", "strategy.tp=4"], "strategy.tp=4 must divide model.num_key_value_heads=2"),
    (
        ["trainer.devices=2", "strategy.tp=2", *THREE_HEADS],
        "strategy.tp=2 must divide model.num_attention_heads=3",
    ),
    (
        ["trainer.devices=2", "strategy.tp=2", "model.intermediate_size=129"],
        "strategy.tp=2 must divide model.intermediate_size=129",
    ),
    (
        ["trainer.devices=2", "strategy.tp=2", "model.vocab_size=1001"],
        "strategy.tp=2 must divide model.vocab_size=1001",
    ),
    (
        ["trainer.devices=3", "strategy.tp=3", *THREE_HEADS],
        "model.vocab_size=null is the tokenizer's size rounded up to a multiple of 64; set model.vocab_size to a multiple of 3",
    ),
    (
        ["trainer.devices=2", "strategy.tp=2", "compile=true"],
        "compile=true with strategy.tp > 1 computes wrong",
    ),
    (
        ["trainer.devices=2", "strategy.sequence_parallel=true"],
        "strategy.sequence_parallel=true needs strategy.tp > 1",
    ),
    (
        ["trainer.devices=2", "strategy.tp=2", "strategy.sequence_parallel=true", "data.seq_len=63"],
        "strategy.tp=2 must divide data.seq_len=63",
    ),
    (
        ["trainer.devices=2", "strategy.tp=2", "global_batch_size=6", "data.batch_size=4"],
        "global_batch_size=6 is not a multiple of data.batch_size * data-parallel size (its data-parallel replicas) = 4 * 1 = 4",
    ),
]


@pytest.mark.parametrize("overrides, message", BAD_LAYOUTS, ids=[" ".join(o) for o, _ in BAD_LAYOUTS])
def test_a_bad_layout_is_one_line_naming_the_keys(overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(CONF_DIR, "train", [*MP, *overrides])
    assert message in str(err.value) and "\n" not in str(err.value)


def composed(overrides: list[str]):
    seen = []

    def check(cfg, hardware):
        check_config(cfg, hardware=hardware)
        seen.append(cfg)

    preflight(CONF_DIR, "train", [*MP, *overrides], check=check)
    return seen[0]


@pytest.mark.parametrize(
    "overrides, accumulate",
    [
        (["trainer.devices=2", "strategy.tp=2"], 4),  # 1 replica x 4
        (["trainer.devices=4", "strategy.dp_shard=2", "strategy.tp=2"], 2),  # 2 replicas x 4
        (["trainer.devices=4", "strategy.dp_replicate=2", "strategy.dp_shard=-1"], 1),  # HSDP: 4 replicas x 4
    ],
)
def test_the_global_batch_counts_data_parallel_replicas(overrides, accumulate):
    cfg = composed([*overrides, "global_batch_size=16", "data.batch_size=4"])
    assert cfg.trainer.accumulate_grad_batches == accumulate

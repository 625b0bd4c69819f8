"""Pipeline stages of the Llama (models/llama/parallelize.py): the split by layer with balanced parameter counts,
stages that share the model's modules under their own names and chain to the whole model's logits, and the bad
pipeline settings refused in one line before any work (parallel/layout_checks.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from parallama import CONF_DIR
from parallama.app.compose import preflight
from parallama.distributed.options import PipelineOptions
from parallama.distributed.stages import pipeline_split, stage_layers
from parallama.errors import ConfigError
from parallama.models.llama.config import LlamaConfig
from parallama.models.llama.model import Llama


def tiny(layers: int, vocab: int = 64, **kw) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        **kw,
    )
    return Llama(config)


def stage_sizes(model: Llama, split: list[list[str]]) -> list[int]:
    sizes = [sum(p.numel() for k in keys for p in model.layers[k].parameters()) for keys in split]
    sizes[0] += model.embed_tokens.weight.numel()
    sizes[-1] += model.norm.weight.numel() + model.lm_head.weight.numel()
    return sizes


@pytest.mark.parametrize(
    "layers,stages,vocab", [(6, 2, 64), (6, 3, 2048), (8, 4, 4096), (5, 5, 64), (7, 2, 8192)]
)
def test_the_split_is_contiguous_and_its_largest_stage_is_as_small_as_any_split_allows(layers, stages, vocab):
    model = tiny(layers, vocab)
    split = stage_layers(model, stages)
    assert [k for keys in split for k in keys] == [str(i) for i in range(layers)]
    assert all(split), "every stage holds a layer"
    best = min(  # every way to cut the layers into `stages` non-empty runs
        max(stage_sizes(model, [[str(i) for i in range(a, b)] for a, b in zip((0, *cuts), (*cuts, layers))]))
        for cuts in itertools.combinations(range(1, layers), stages - 1)
    )
    assert max(stage_sizes(model, split)) == best


def test_a_heavy_embedding_and_head_leave_the_end_stages_fewer_layers():
    split = stage_layers(tiny(8, vocab=8192), 3)
    assert len(split[0]) < len(split[1]) and len(split[2]) < len(split[1])


def test_stages_share_the_models_modules_under_their_names_and_chain_to_its_logits():
    full = tiny(4)
    x = torch.randint(0, 64, (2, 16))
    want = full(x)
    ranks = []  # what each of 2 pp ranks keeps with 2 stages each (interleaved: stages r and r + 2)
    for stage_ids in ([0, 2], [1, 3]):
        model = tiny(4)
        stages = pipeline_split(model, stage_ids, 4)
        ranks.append((model, dict(zip(stage_ids, stages))))
        for stage in stages:  # shared, not copied: the optimizer and checkpoints see these very tensors
            own = {id(p) for p in model.parameters()}
            assert all(id(p) in own for p in stage.parameters())
    names = [set(model.state_dict()) for model, _ in ranks]
    assert names[0].isdisjoint(names[1]) and names[0] | names[1] == set(full.state_dict())
    assert (
        "embed_tokens.weight" in names[0]
        and "lm_head.weight" in names[1]
        and "layers.3.mlp.up_proj.weight" in names[1]
    )
    stages = {i: stage for _, by_id in ranks for i, stage in by_id.items()}
    h = x
    for i in range(4):
        h = stages[i](h)
    torch.testing.assert_close(h, want, rtol=0, atol=0)


def test_too_few_layers_or_tied_embeddings_are_one_line():
    with pytest.raises(
        ConfigError,
        match=r"^strategy.pp x strategy.pp_stages_per_rank = 4 pipeline stages, but the model has 3 layers",
    ):
        stage_layers(tiny(3), 4)
    with pytest.raises(ConfigError, match="tie_word_embeddings=true cannot be split"):
        pipeline_split(tiny(2, tie_word_embeddings=True), [0], 2)


PP = ["strategy=model_parallel", "trainer.devices=2", "strategy.pp=2", "data.batch_size=8"]
BAD = [  # (overrides, the one line)
    (
        ["strategy.pp_schedule=zero_bubble"],
        "strategy.pp_schedule='zero_bubble' is not valid; use one of 'gpipe', '1f1b', 'interleaved_1f1b'",
    ),
    (
        ["model.num_hidden_layers=6", "strategy.pp_schedule=zbv", "strategy.pp_stages_per_rank=3"],
        "strategy.pp_schedule=zbv places exactly 2 stages on each rank (a V), but strategy.pp_stages_per_rank=3",
    ),
    (
        [
            "strategy.pp_schedule=dualpipev",
            "model.num_hidden_layers=4",
            "strategy.pp_microbatches=2",
        ],
        "strategy.pp_microbatches=2: strategy.pp_schedule=dualpipev needs at least 4 (the stages) microbatches",
    ),
    (
        ["strategy.pp_stages_per_rank=2"],
        "strategy.pp_schedule=1f1b runs one stage per rank, but strategy.pp_stages_per_rank=2; set it to 1 or use",
    ),
    (
        ["strategy.pp_schedule=interleaved_1f1b", "strategy.pp_stages_per_rank=1"],
        "strategy.pp_schedule=interleaved_1f1b needs strategy.pp_stages_per_rank >= 2 (it is 1; null is 2 for it)",
    ),
    (
        ["strategy.pp_schedule=zbv", "strategy.pp_stages_per_rank=1"],
        "strategy.pp_schedule=zbv places exactly 2 stages on each rank (a V), but strategy.pp_stages_per_rank=1",
    ),
    (["strategy.pp_stages_per_rank=0"], "strategy.pp_stages_per_rank=0 is not valid"),
    (
        ["model.num_hidden_layers=3", "strategy.pp_schedule=looped_bfs"],  # null: 2 stages per rank
        "strategy.pp=2 x strategy.pp_stages_per_rank=2 = 4 pipeline stages, but model.num_hidden_layers=3",
    ),
    (["strategy.pp_microbatches=3"], "strategy.pp_microbatches=3 must divide data.batch_size=8"),
    (["data.batch_size=3"], "strategy.pp_microbatches=2 (the default) must divide data.batch_size=3"),
    (
        ["strategy.pp_microbatches=1"],
        "strategy.pp_microbatches=1: strategy.pp_schedule=1f1b needs at least strategy.pp=2",
    ),
    (
        [
            "strategy.pp_schedule=interleaved_1f1b",
            "strategy.pp_stages_per_rank=2",
            "model.num_hidden_layers=4",
            "strategy.pp_microbatches=5",
            "data.batch_size=10",
        ],
        "strategy.pp_microbatches=5: strategy.pp_schedule=interleaved_1f1b needs a multiple of 2 microbatches",
    ),
    (["model.tie_word_embeddings=true"], "model.tie_word_embeddings=true shares the embedding"),
    (
        ["strategy.save_distributed_checkpoint=false"],
        "strategy.save_distributed_checkpoint=false writes one file",
    ),
    (["strategy.pp=3"], "the layout dp_shard=-1 x pp=3 needs a multiple of 3 ranks, but the world size is 2"),
    (["strategy.pp=0"], "strategy.pp=0 is not valid; use an integer >= 1"),
]


@pytest.mark.parametrize("overrides,message", BAD, ids=[" ".join(o) for o, _ in BAD])
def test_bad_pipeline_settings_are_one_line_before_any_work(overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(CONF_DIR, "train", [*PP, *overrides])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_good_pipeline_settings_pass():
    preflight(CONF_DIR, "train", PP)
    preflight(
        CONF_DIR,
        "train",
        [
            *PP,
            "model.num_hidden_layers=4",
            "strategy.pp_schedule=looped_bfs",
            "strategy.pp_stages_per_rank=2",
            "strategy.pp_microbatches=4",
        ],
    )
    # V-shaped: no rounds of pp microbatches (5 microbatches of 2 rows on 2 ranks)
    v = [*PP, "model.num_hidden_layers=4", "strategy.pp_stages_per_rank=2", "strategy.pp_microbatches=5"]
    preflight(CONF_DIR, "train", [*v, "strategy.pp_schedule=zbv", "data.batch_size=10"])


@pytest.mark.parametrize(
    "schedule,per_rank,want",
    [
        ("1f1b", 1, {0: [0], 1: [1], 2: [2]}),
        ("interleaved_zb", 2, {0: [0, 3], 1: [1, 4], 2: [2, 5]}),  # looped
        ("zbv", 2, {0: [0, 5], 1: [1, 4], 2: [2, 3]}),  # a V: the first and the last stage on rank 0
        ("dualpipev", 2, {0: [0, 5], 1: [1, 4], 2: [2, 3]}),
    ],
)
def test_each_schedule_places_its_stages_on_the_ranks_torch_expects(schedule, per_rank, want):
    from torch.distributed.pipelining.schedules import generate_stage_to_rank_mapping

    options = PipelineOptions(schedule, 6, per_rank)
    assert {r: options.stage_ids(r, 3) for r in range(3)} == want
    style = "v" if schedule in ("zbv", "dualpipev") else "loop"
    torch_ranks = generate_stage_to_rank_mapping(3, 3 * per_rank, style=style)
    assert {s: options.stage_rank(s, 3) for s in range(3 * per_rank)} == torch_ranks

"""Pipeline stages of any family's model (models/contract.py): the blocks (`layers`) split into contiguous runs,
the input modules on the first stage, the output modules on the last, shared modules on every one. Each stage is a
model of the same class sharing the original's modules, so parameters keep their storage and their names (what
checkpoints and the optimizer see). distributed/pipeline.py runs the stages under a schedule.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from parallama.distributed.options import ZERO_BUBBLE, ParallelizeOptions
from parallama.errors import ConfigError


def _numel(modules) -> int:
    return sum(p.numel() for m in modules if m is not None for p in m.parameters())


def _ends(model: nn.Module) -> tuple[list, list]:
    """The model's input and output modules (None where a stage does not hold them)."""
    return [getattr(model, n) for n in model.input_modules], [getattr(model, n) for n in model.output_modules]


def stage_layers(model: nn.Module, num_stages: int) -> list[list[str]]:
    """The blocks (keys of `model.layers`) of each of `num_stages` pipeline stages: contiguous runs of at least
    one block, the input modules counted on the first stage and the output modules on the last, split so that the
    largest stage holds as few parameters as possible (a small dynamic program over the cut points)."""
    keys = list(model.layers)
    if num_stages > len(keys):
        raise ConfigError(
            f"strategy.pp x strategy.pp_stages_per_rank = {num_stages} pipeline stages, but the model has "
            f"{len(keys)} layers (model.num_hidden_layers); each stage needs at least one"
        )
    sizes = [_numel([model.layers[k]]) for k in keys]
    inputs, outputs = _ends(model)
    first, last = _numel(inputs), _numel(outputs)
    prefix = [0]
    for size in sizes:
        prefix.append(prefix[-1] + size)

    def cost(stage: int, begin: int, end: int) -> int:  # layers [begin, end) on `stage`
        extra = (first if stage == 0 else 0) + (last if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[begin] + extra

    n = len(keys)
    # best[s][e]: the smallest largest-stage size for layers [0, e) on stages 0..s; cut[s][e]: where stage s begins
    best = [[float("inf")] * (n + 1) for _ in range(num_stages)]
    cut = [[0] * (n + 1) for _ in range(num_stages)]
    for e in range(1, n + 1):
        best[0][e] = cost(0, 0, e)
    for s in range(1, num_stages):
        for e in range(s + 1, n + 1):
            for b in range(s, e):
                worst = max(best[s - 1][b], cost(s, b, e))
                if worst < best[s][e]:
                    best[s][e], cut[s][e] = worst, b
    bounds, end = [], n
    for s in range(num_stages - 1, 0, -1):
        bounds.append((cut[s][end], end))
        end = cut[s][end]
    bounds.append((0, end))
    return [keys[b:e] for b, e in reversed(bounds)]


def pipeline_stage(model: nn.Module, layers: list[str], *, first: bool, last: bool) -> nn.Module:
    """One stage of `model`: its own modules (shared, not copied) for `layers`, the input modules if it is the
    first stage, the output modules if it is the last, the shared ones always. Its forward takes token ids or the
    previous stage's hidden states and returns hidden states or logits (the contract's `forward`)."""
    with torch.device("meta"):  # the skeleton only: every module is replaced by the model's own
        stage = type(model)(model.config)
    stage.layers = nn.ModuleDict({k: model.layers[k] for k in layers})
    for names, kept in (
        (model.input_modules, first),
        (model.output_modules, last),
        (model.shared_modules, True),
    ):
        for name in names:
            setattr(stage, name, getattr(model, name) if kept else None)
    return stage


def parallelize_pipeline(
    model: nn.Module,
    options: ParallelizeOptions,
    parallelize_stage: Callable[[nn.Module, ParallelizeOptions], None],
) -> nn.Module:
    """Split `model` into this pp rank's stages (the rank's coordinate on the mesh's `pp` dimension), then apply
    the rest of the family's plan (`parallelize_stage`) to each stage, as torchtitan's `pipeline_llm` does. Returns
    `model` pruned to the rank's stages, with `pipeline_stages`: [(stage index, stage module)] for
    parallel.pipeline.Pipeline.

    A zero-bubble schedule computes a stage's weight gradients after its input gradients, against the parameters
    its forward used: FSDP keeps them gathered from forward to backward there (reshard_after_forward=False, as
    torchtitan does under any pipeline); resharded, the stage's root parameters would get no gradient."""
    pipeline, pp = options.pipeline, options.dims.pp
    ids = pipeline.stage_ids(options.mesh["pp"].get_local_rank(), pp)
    stages = pipeline_split(model, ids, pp * pipeline.stages_per_rank)
    stage_options = replace(options, pipeline=None)
    if options.fsdp is not None and pipeline.schedule in ZERO_BUBBLE:
        stage_options = replace(stage_options, fsdp=replace(options.fsdp, reshard_after_forward=False))
    for stage in stages:
        parallelize_stage(stage, stage_options)
    model.pipeline_stages = list(zip(ids, stages))
    return model


def pipeline_split(model: nn.Module, stage_ids: list[int], num_stages: int) -> list[nn.Module]:
    """This rank's stages (`stage_ids` of `num_stages`), and `model` pruned in place to what they hold: the
    rank's model then names each parameter as the whole model does (what checkpoints and the optimizer see)."""
    if (tied := model.config.tied_parameters()) and num_stages > 1:
        pairs = ", ".join(f"{a} = {b}" for a, b in tied.items())
        raise ConfigError(
            f"model.tie_word_embeddings=true cannot be split into pipeline stages ({pairs} would be on two "
            "stages); set it false"
        )
    layers = stage_layers(model, num_stages)
    stages = [pipeline_stage(model, layers[i], first=i == 0, last=i == num_stages - 1) for i in stage_ids]
    kept = {k for i in stage_ids for k in layers[i]}
    for key in [k for k in model.layers if k not in kept]:
        del model.layers[key]
    for names, kept_end in (
        (model.input_modules, 0 in stage_ids),
        (model.output_modules, num_stages - 1 in stage_ids),
    ):
        if not kept_end:
            for name in names:
                setattr(model, name, None)
    return stages

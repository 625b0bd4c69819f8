"""The Llama's parallelize plan (torchtitan's `parallelize_llama`): `parallelize(model, options)` applies what
the strategy asks (`parallel.ParallelizeOptions`) in a fixed order, each step an `apply_*` function with explicit
arguments.

The model in model.py stays plain PyTorch; every decoder block is the unit of checkpointing, compilation and
sharding: checkpointing wraps the block's forward, compile traces the block, FSDP shards the block and finally
the root (embedding, final norm, lm_head). No Lightning here: bench/gpu.py and tests call the functions on a
bare model.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallama.errors import ConfigError
from parallama.models.llama.model import Llama
from parallama.parallel.options import ParallelizeOptions

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: Llama, options: ParallelizeOptions) -> Llama:
    """Activation checkpointing, then compile, then FSDP (sharding wraps what runs); with pipeline stages, the
    split comes first and the rest applies to each stage."""
    if options.pipeline is not None:
        return parallelize_pipeline(model, options)
    if options.activation_checkpointing:
        apply_ac(model)
    if options.compile:
        apply_compile(model)
    if options.fsdp is not None:
        fsdp = options.fsdp
        apply_fsdp(
            model,
            options.mesh["dp_shard"],
            reshard_after_forward=fsdp.reshard_after_forward,
            mixed_precision=fsdp.mixed_precision,
            cpu_offload=fsdp.cpu_offload,
        )
    return model


def apply_ac(model: Llama) -> None:
    """Activation checkpointing: each block recomputes its activations in backward instead of storing them."""
    for block in model.layers.values():
        _checkpoint_forward(block)


def apply_compile(model: Llama) -> None:
    """torch.compile each block, in place: parameter names (and so checkpoints) stay the same."""
    for block in model.layers.values():
        block.compile()


def apply_fsdp(
    model: Llama,
    mesh,
    *,
    reshard_after_forward: bool = True,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
) -> None:
    """FSDP2: `fully_shard` each block over `mesh` (a 1-D data-parallel DeviceMesh), then the root.

    mixed_precision: None (compute in the parameters' dtype), "bf16" or "fp16": compute in that dtype, reduce
    gradients in fp32, keep fp32 master weights. cpu_offload: sharded parameters, gradients and optimizer
    state live in CPU memory.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": mesh}
    if mixed_precision is not None:
        dtype = MIXED_PRECISION_DTYPES[mixed_precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for i, block in enumerate(model.layers.values()):
        # The last block's parameters are needed again right away by backward: keep them gathered.
        reshard = reshard_after_forward and i < len(model.layers) - 1
        fully_shard(block, reshard_after_forward=reshard, **kwargs)
    fully_shard(model, reshard_after_forward=reshard_after_forward, **kwargs)


def _checkpoint_forward(block: nn.Module) -> None:
    """Recompute the block in backward instead of storing its activations. Keeps state-dict keys unchanged."""
    forward = block.forward

    @functools.wraps(forward)
    def checkpointed(*args, **kwargs):
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = checkpointed


# --- pipeline parallelism: the model split by layer into stages ------------------------------------------


def stage_layers(model: Llama, num_stages: int) -> list[list[str]]:
    """The decoder layers (keys of `model.layers`) of each of `num_stages` pipeline stages: contiguous runs of at
    least one layer, the embedding counted on the first stage and the final norm + lm_head on the last, split so
    that the largest stage holds as few parameters as possible (a small dynamic program over the cut points)."""
    keys = list(model.layers)
    if num_stages > len(keys):
        raise ConfigError(
            f"strategy.pp x strategy.pp_stages_per_rank = {num_stages} pipeline stages, but the model has "
            f"{len(keys)} layers (model.num_hidden_layers); each stage needs at least one"
        )
    sizes = [_numel(model.layers[k]) for k in keys]
    first, last = _numel(model.embed_tokens), _numel(model.norm) + _numel(model.lm_head)
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


def pipeline_stage(model: Llama, layers: list[str], *, first: bool, last: bool) -> Llama:
    """One stage of `model`: its own modules (shared, not copied: parameters keep their storage and names) for
    `layers`, the embedding if it is the first stage, the final norm and lm_head if it is the last. Its forward
    takes token ids or the previous stage's hidden states and returns hidden states or logits (model.py)."""
    with torch.device("meta"):  # the skeleton only: every module is replaced by the model's own
        stage = type(model)(model.config)
    stage.layers = nn.ModuleDict({k: model.layers[k] for k in layers})
    stage.embed_tokens = model.embed_tokens if first else None
    stage.norm, stage.lm_head = (model.norm, model.lm_head) if last else (None, None)
    stage.rotary_emb = model.rotary_emb
    return stage


def parallelize_pipeline(model: Llama, options: ParallelizeOptions) -> Llama:
    """Split `model` into this pp rank's stages (the rank's coordinate on the mesh's `pp` dimension), then apply
    the rest of the plan to each stage, as torchtitan's `pipeline_llm` does. Returns `model` pruned to the rank's
    stages, with `pipeline_stages`: [(stage index, stage module)] for parallel.pipeline.Pipeline."""
    pipeline, pp = options.pipeline, options.dims.pp
    ids = pipeline.stage_ids(options.mesh["pp"].get_local_rank(), pp)
    stages = pipeline_split(model, ids, pp * pipeline.stages_per_rank)
    for stage in stages:
        parallelize(stage, replace(options, pipeline=None))
    model.pipeline_stages = list(zip(ids, stages))
    return model


def pipeline_split(model: Llama, stage_ids: list[int], num_stages: int) -> list[Llama]:
    """This rank's stages (`stage_ids` of `num_stages`), and `model` pruned in place to what they hold: the
    rank's model then names each parameter as the whole model does (what checkpoints and the optimizer see)."""
    if model.config.tie_word_embeddings and num_stages > 1:
        raise ConfigError("model.tie_word_embeddings=true cannot be split into pipeline stages; set it false")
    layers = stage_layers(model, num_stages)
    stages = [pipeline_stage(model, layers[i], first=i == 0, last=i == num_stages - 1) for i in stage_ids]
    kept = {k for i in stage_ids for k in layers[i]}
    for key in [k for k in model.layers if k not in kept]:
        del model.layers[key]
    if 0 not in stage_ids:
        model.embed_tokens = None
    if num_stages - 1 not in stage_ids:
        model.norm = model.lm_head = None
    return stages


def _numel(module: nn.Module | None) -> int:
    return 0 if module is None else sum(p.numel() for p in module.parameters())

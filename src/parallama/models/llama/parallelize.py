"""The Llama's parallelize plan (torchtitan's `parallelize_llama`): `parallelize(model, options)` applies what
the strategy asks (`parallel.ParallelizeOptions`) in a fixed order, each step an `apply_*` function with explicit
arguments:

1. tensor parallel (`apply_tp`, on the mesh's `tp` dimension): weights become DTensors split across tp ranks,
   optionally with sequence parallel between the blocks;
2. activation checkpointing (`apply_ac`): each block's forward, including its TP communication, is recomputed;
3. compile (`apply_compile`): each block, TP's DTensor ops traced with it;
4. FSDP2 (`apply_fsdp`) on the data-parallel mesh: `dp_shard` (FSDP), or (dp_replicate, dp_shard) (HSDP: shard
   within a group, replicate across groups); a TP weight becomes a 2-D DTensor (dp_shard, tp).
Sharding wraps what runs, so FSDP comes last (it gathers what TP and compile expect to see).

The model in model.py stays plain PyTorch; every decoder block is the unit of checkpointing, compilation and
sharding: checkpointing wraps the block's forward, compile traces the block, FSDP shards the block and finally
the root (embedding, final norm, lm_head). No Lightning here: bench/gpu.py and tests call the functions on a
bare model.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from parallama.errors import ConfigError
from parallama.models.llama.model import Llama
from parallama.parallel.options import ZERO_BUBBLE, ParallelizeOptions

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def parallelize(model: Llama, options: ParallelizeOptions, *, block_plan: BlockPlan | None = None) -> Llama:
    """Pipeline stages first (the split; the rest then applies to each stage), then tensor parallel, then
    activation checkpointing, then compile, then FSDP (sharding wraps what runs). `block_plan`: a family's
    tensor-parallel plan of one block (default `tp_block_plan`; models/qwen3 adds its q/k norms)."""
    if options.pipeline is not None:
        return parallelize_pipeline(model, options, block_plan=block_plan)
    if options.dims.tp > 1:
        apply_tp(
            model,
            options.mesh["tp"],
            sequence_parallel=options.sequence_parallel,
            loss_parallel=options.loss_parallel,
            block_plan=block_plan or tp_block_plan,
        )
    if options.activation_checkpointing:
        apply_ac(model)
    if options.compile:
        apply_compile(model)
    if options.fsdp is not None:
        fsdp = options.fsdp
        apply_fsdp(
            model,
            data_parallel_mesh(options),
            reshard_after_forward=fsdp.reshard_after_forward,
            mixed_precision=fsdp.mixed_precision,
            cpu_offload=fsdp.cpu_offload,
        )
    return model


def data_parallel_mesh(options: ParallelizeOptions):
    """The mesh FSDP shards over: `dp_shard`, or the 2-D (dp_replicate, dp_shard) of HSDP; with context parallel
    the cp ranks are folded into dp_shard (they average their gradients too: parallel/context.py)."""
    from parallama.parallel.context import data_parallel_mesh as with_cp

    return with_cp(options.mesh, options.dims)


# A plan's value for a module whose parameters stay plain tensors, whole on every tp rank: only correct where its
# input is whole on every rank too (the norms between blocks without sequence parallel), so that every rank
# computes the same gradient.
REPLICATED = "replicated"
# A family's plan of one block: (sequence_parallel=, between=) -> {module name in the block: style or REPLICATED}
BlockPlan = Callable[..., dict]


def tp_block_plan(*, sequence_parallel: bool, between) -> dict:
    """The Llama block's tensor-parallel plan (see `apply_tp`); `between`: the residual stream's layout between
    blocks (Shard(1) under sequence parallel, else Replicate())."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan = {
        "input_layernorm": REPLICATED,
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=between),
        "post_attention_layernorm": REPLICATED,
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=between),
    }
    if sequence_parallel:
        # attention(x, cos, sin, mask, kv_cache, input_pos): only x is split, and gathered on entry.
        rest = (None,) * 5
        plan["input_layernorm"] = SequenceParallel()
        plan["self_attn"] = PrepareModuleInput(
            input_layouts=(Shard(1), *rest),
            desired_input_layouts=(Replicate(), *rest),
            use_local_output=True,
        )
        plan["post_attention_layernorm"] = SequenceParallel()
        plan["mlp"] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    return plan


def apply_tp(
    model: Llama,
    mesh,
    *,
    sequence_parallel: bool = False,
    loss_parallel: bool = False,
    block_plan: BlockPlan = tp_block_plan,
) -> None:
    """Megatron-style tensor parallelism over `mesh` (1-D, the tp ranks), torchtitan's plan for Llama.

    Per block: q/k/v and gate/up column-wise (each rank computes its share of the heads and of the MLP's width,
    no communication), o and down row-wise (one all-reduce each, or a reduce-scatter under sequence parallel).
    The embedding is vocab-parallel (row-wise: each rank looks up its share of the vocabulary, partial sums
    reduced), the head column-wise: with `loss_parallel` its logits stay sharded on the vocabulary (the loss
    runs under `torch.distributed.tensor.parallel.loss_parallel`, never gathering them), else gathered.

    `sequence_parallel`: the norms run on 1/tp of the sequence and the residual stream between blocks stays
    split on it (activation memory / tp); attention and MLP gather it at their input (all-gather) and
    reduce-scatter at their output. Needs the sequence length to divide by tp (training and validation; not
    token-by-token decoding, see ModelParallel.inference_model).

    `block_plan` gives each block's plan (a family's own: models/qwen3). Every parameter must then be a DTensor
    on `mesh` or one the plan keeps `REPLICATED`: one it does not cover is refused (`check_tp_plan_covers`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    between = Shard(1) if sequence_parallel else Replicate()  # the residual stream's layout between blocks
    root = {
        "embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=between),
        "lm_head": ColwiseParallel(
            input_layouts=between,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    root["norm"] = SequenceParallel() if sequence_parallel else REPLICATED
    replicated = {name for name, style in root.items() if style is REPLICATED}
    parallelize_module(model, mesh, {k: v for k, v in root.items() if k not in replicated})
    if model.config.tie_word_embeddings:  # both are Shard(0) on the vocabulary: one parameter again
        model.lm_head.weight = model.embed_tokens.weight
    for key, block in model.layers.items():
        plan = block_plan(sequence_parallel=sequence_parallel, between=between)
        replicated |= {f"layers.{key}.{name}" for name, style in plan.items() if style is REPLICATED}
        parallelize_module(block, mesh, {k: v for k, v in plan.items() if v is not REPLICATED})
    check_tp_plan_covers(model, mesh, replicated, f"{block_plan.__module__}.{block_plan.__qualname__}")


def check_tp_plan_covers(model: nn.Module, mesh, replicated: set[str], plan: str = "") -> None:
    """Every parameter is a DTensor on the tp `mesh` or belongs to a module the plan keeps `REPLICATED`: a
    parameter the plan missed would be a plain tensor that each rank updates from its own share of the
    activations (a model that is not the one-process model, silently), so it is one line naming it."""
    from torch.distributed.tensor import DTensor

    for name, param in model.named_parameters():
        covered = isinstance(param, DTensor) and param.device_mesh == mesh
        if not covered and name.rpartition(".")[0] not in replicated:
            raise ConfigError(
                f"strategy.tp={mesh.size()}: the model's {name} is not covered by the tensor-parallel plan "
                f"{plan} (each rank would train its own copy from its share of the activations); add its module "
                "to the family's block plan (its SPEC's parallelize) or use strategy.tp=1"
            )


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
    """FSDP2: `fully_shard` each block over `mesh`, then the root. A 1-D mesh shards (FSDP); a 2-D one
    (dp_replicate, dp_shard) shards on its second dimension and replicates on its first (HSDP).

    mixed_precision: None (compute in the parameters' dtype), "bf16" or "fp16": compute in that dtype, reduce
    gradients in fp32, keep fp32 master weights. cpu_offload: sharded parameters, gradients and optimizer
    state live in CPU memory.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": mesh}
    if mixed_precision is not None:
        dtype = MIXED_PRECISION_DTYPES[mixed_precision]
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    if cpu_offload:  # pinned host memory (faster copies) needs an accelerator; on CPU the shards stay put
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=mesh.device_type != "cpu")
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


def parallelize_pipeline(
    model: Llama, options: ParallelizeOptions, *, block_plan: BlockPlan | None = None
) -> Llama:
    """Split `model` into this pp rank's stages (the rank's coordinate on the mesh's `pp` dimension), then apply
    the rest of the plan to each stage, as torchtitan's `pipeline_llm` does. Returns `model` pruned to the rank's
    stages, with `pipeline_stages`: [(stage index, stage module)] for parallel.pipeline.Pipeline.

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
        parallelize(stage, stage_options, block_plan=block_plan)
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

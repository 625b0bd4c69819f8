"""N-D parallelism (`strategy=model_parallel`): data parallel (replicated x sharded), tensor, pipeline and context
parallel over one named device mesh (`ParallelDims`, torchtitan's order pp, dp_replicate, dp_shard, cp, tp).

The model's own plan (models/<family>/parallelize.py) applies what `parallelize_options` asks: tensor parallel
(+ sequence parallel) on the `tp` sub-mesh, then FSDP2 on `dp_shard` (HSDP on (dp_replicate, dp_shard)).
Every parameter is a DTensor, so checkpoints are DCP folders keyed by parameter name as strategy=fsdp's: DCP
reshards them into any other layout, and parallama-export / the universal path read them in one process.

What the pipeline and context dimensions add to a step: `pipeline` (the schedule), `cp_mesh` and `loss_context`,
which `CausalLM.step_loss` and `backward` use; `inference_model` and `parallelize_options`.
"""

from __future__ import annotations

import math
from contextlib import nullcontext
from dataclasses import dataclass, replace
from typing import ClassVar, Literal

import torch
import torch.distributed as dist
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_info
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from parallama.config.schema import BOOL, SOME
from parallama.distributed.dims import DP_SIZE, SIZE
from parallama.distributed.options import SCHEDULES as PIPELINE_SCHEDULES
from parallama.distributed.options import ZERO_BUBBLE, ParallelizeOptions, PipelineOptions, stages_per_rank
from parallama.distributed.pipeline import Pipeline, local_part
from parallama.parallel.plan import MemoryProfile
from parallama.parallel.strategies.fsdp import FSDP2, FSDPKeys
from parallama.rules import Rule, key


@dataclass
class ModelParallelKeys(FSDPKeys):
    conf: ClassVar[str] = "strategy/model_parallel.yaml"

    dp_replicate: int = key(1, DP_SIZE)
    dp_shard: int = key(-1, DP_SIZE)
    tp: int = key(1, SIZE)
    pp: int = key(1, SIZE)
    cp: int = key(1, SIZE)
    ep: int = key(1, SIZE)  # expert parallelism: ranks borrowed from dp_shard (distributed/dims.py)
    sequence_parallel: bool = key(False, BOOL)
    pp_schedule: str = key("1f1b", Rule(str, choices=tuple(PIPELINE_SCHEDULES)))
    pp_microbatches: int | None = key(None, SOME)
    pp_stages_per_rank: int | None = key(None, SOME)


class ModelParallel(FSDP2):
    """FSDP2's settings (reshard_after_forward, mixed_precision, cpu_offload, meta_init,
    save_distributed_checkpoint) plus the mesh's sizes:

    dp_replicate, dp_shard: data-parallel replicas; > 1 on both is HSDP (shard within a group, replicate across).
        One of them may be -1: the rest of the world size.
    tp: tensor-parallel size (heads, the MLP's width and the vocabulary split across tp ranks).
    sequence_parallel: with tp > 1, the norms and the activations between blocks are split on the sequence.
    pp, pp_schedule, pp_microbatches, pp_stages_per_rank: pipeline stages and their schedule.
    cp: context parallel (each sample's sequence split across ranks).
    ep: expert parallel (a mixture of experts' experts split across ep of the dp_shard ranks: models/moe_parallel.py).
    """

    name = "model_parallel"
    config_keys = ModelParallelKeys
    # parallama-plan searches its sizes (parallel/layouts.py); FSDP2's engine and working set, as strategy=fsdp
    memory_profiles = (
        MemoryProfile(
            "model_parallel",
            "strategy=model_parallel",
            "fsdp",
            "pgo",
            gathered="working",
            guide="model parallel",
            layouts=True,
        ),
    )

    def __init__(
        self,
        dp_replicate: int = 1,
        dp_shard: int = -1,
        tp: int = 1,
        pp: int = 1,
        cp: int = 1,
        ep: int = 1,
        sequence_parallel: bool = False,
        pp_schedule: str = "1f1b",
        pp_microbatches: int | None = None,
        pp_stages_per_rank: int | None = None,
        reshard_after_forward: bool = True,
        mixed_precision: Literal["bf16", "fp16"] | None = None,
        cpu_offload: bool = False,
        meta_init: bool = False,
        save_distributed_checkpoint: bool = True,
        **kwargs,
    ) -> None:
        super().__init__(
            reshard_after_forward=reshard_after_forward,
            mixed_precision=mixed_precision,
            cpu_offload=cpu_offload,
            meta_init=meta_init,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.sizes = {
            "dp_replicate": dp_replicate,
            "dp_shard": dp_shard,
            "tp": tp,
            "pp": pp,
            "cp": cp,
            "ep": ep,
        }
        self.sequence_parallel = sequence_parallel
        self.pp_schedule, self.pp_microbatches, self.pp_stages_per_rank = (
            pp_schedule,
            pp_microbatches,
            stages_per_rank(pp_schedule, pp_stages_per_rank),
        )
        self.pipeline = None  # parallel.pipeline.Pipeline, built with the model when pp > 1

    def layout(self) -> dict[str, int]:
        return dict(self.sizes)

    # --- the model --------------------------------------------------------------------------------------

    def parallelize_options(self, **kwargs) -> ParallelizeOptions:
        """TP (and SP) on the `tp` sub-mesh, FSDP2 on the data-parallel one (also at size 1, so every parameter
        is a DTensor and every layout checkpoints alike); the loss is computed on vocab-sharded logits."""
        options = super().parallelize_options(**kwargs)
        return replace(
            options,
            sequence_parallel=self.sequence_parallel,
            loss_parallel=self.dims.tp > 1,
            pipeline=self.pipeline_options(),
        )

    def pipeline_options(self) -> PipelineOptions | None:
        """With pp > 1: the schedule, and its microbatches (default: one per stage of the pipeline)."""
        if self.dims.pp == 1:
            return None
        stages = self.dims.pp * self.pp_stages_per_rank
        return PipelineOptions(self.pp_schedule, self.pp_microbatches or stages, self.pp_stages_per_rank)

    def parallelize(self, model, plan, **kwargs):
        """With pp > 1 the plan returns this rank's part of the model and its stages (`pipeline_stages`), which
        the schedule runs."""
        model = super().parallelize(model, plan, **kwargs)
        if self.dims.pp > 1:
            options, pp_group = self.pipeline_options(), self.mesh["pp"].get_group()
            if options.schedule in ZERO_BUBBLE and self.reshard_after_forward:
                rank_zero_info(
                    f"strategy.pp_schedule={options.schedule} defers weight gradients: each stage's parameters "
                    "stay gathered from forward to backward (strategy.reshard_after_forward is taken as false)"
                )
            stages = self.dims.pp * options.stages_per_rank
            module = self.lightning_module
            self.pipeline = Pipeline(
                model.pipeline_stages,
                stages,
                options,
                pp_group,
                self.root_device,
                module.loss_fn,
                module.validation_logits,
            )
        return model

    @property
    def cp_mesh(self):
        return self.mesh["cp"] if self.dims.cp > 1 else None

    def loss_context(self):
        """Cross-entropy on the vocab-sharded logits: no rank gathers the full (batch, seq, vocab) tensor."""
        if self.dims.tp == 1:
            return nullcontext()

        return loss_parallel()

    def inference_model(self, model):
        """The model generation runs on, with full logits (sampling needs the whole vocabulary on every rank).

        Under sequence parallel a forward pass needs a sequence that divides by tp, which token-by-token decoding
        is not: generation then runs on a full copy of the weights on every rank."""
        if self.pipeline is not None:
            return self.pipeline.full_model(model)
        if self.dims.tp == 1:
            return model
        if self.sequence_parallel:
            return full_copy(model, self.lightning_module.spec.model, self.root_device)
        return FullLogits(model)

    # --- gradient clipping ------------------------------------------------------------------------------

    def clip_gradients(self, optimizer, clip_val: float, algorithm) -> None:
        """By norm: torch's clip_grad_norm_ cannot add up norms of DTensors that live on different meshes (TP's 2-D
        weights, FSDP's 1-D norms), and a pipeline's stages are on other ranks: ours does both."""

        if GradClipAlgorithmType(algorithm) != GradClipAlgorithmType.NORM:
            return super().clip_gradients(optimizer, clip_val, algorithm)
        pp_group = self.mesh["pp"].get_group() if self.dims.pp > 1 else None
        clip_grad_norm_(self.precision_plugin.main_params(optimizer), clip_val, group=pp_group)

    # --- checkpoints ------------------------------------------------------------------------------------

    def load_universal(self, state) -> None:
        """A pipeline rank loads its stages' share of the full state (under the same names)."""
        if self.dims.pp > 1:
            state = local_part(state, self.lightning_module)
        super().load_universal(state)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0, group=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ for DTensor gradients on several meshes and placements: the norm of each
    group of gradients that share a mesh and placements, made global (`full_tensor`), then the norm of those.
    `group`: the ranks that hold the other parameters (pipeline stages), over which the norms add up."""

    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            key = (p.grad.device_mesh, p.grad.placements) if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = [
        _full_tensor(torch.nn.utils.get_total_norm([p.grad for p in group], norm_type))
        for group in groups.values()
    ]
    total = torch.nn.utils.get_total_norm(norms, norm_type)
    if group is not None:
        if math.isinf(norm_type):
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
        else:
            total = total**norm_type
            dist.all_reduce(total, group=group)
            total = total ** (1.0 / norm_type)
    for group in groups.values():  # scaled group by group: one op cannot mix meshes
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


class FullLogits(torch.nn.Module):
    """A tensor-parallel model whose vocab-sharded logits are gathered (generation samples from all of them)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        self.config = model.config

    def new_kv_cache(self, *args, **kwargs):
        return self.model.new_kv_cache(*args, **kwargs)

    def forward(self, *args, **kwargs):
        return _full_tensor(self.model(*args, **kwargs))


def full_copy(model: torch.nn.Module, build, device: torch.device) -> torch.nn.Module:
    """A plain model (`build(config)`) with `model`'s weights on `device`, on every rank (all ranks take part in the
    gather)."""

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    with torch.device("meta"):
        copy = build(model.config)
    copy.to_empty(device=device)
    copy.init_weights()  # the buffers that the state dict does not hold (rope tables)
    copy.load_state_dict(state)
    return copy


def _full_tensor(t):
    """A DTensor (the parallel loss, vocab-sharded logits, a partial norm) as a plain full tensor, keeping
    autograd; a plain tensor as it is."""

    return t.full_tensor() if isinstance(t, DTensor) else t

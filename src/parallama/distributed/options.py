"""What a strategy asks of a model family's parallelize plan (models/<family>/parallelize.py): the plan applies
these to the plain model, in its documented order, and the strategy never touches the model's structure."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from parallama.distributed.dims import ParallelDims
from parallama.errors import ConfigError
from parallama.rules import Rule, check_value


@dataclass(frozen=True)
class FSDPOptions:
    """FSDP2 (`fully_shard`) over the mesh's dp_shard dimension.

    reshard_after_forward: free gathered parameters after each block's forward (ZeRO-3) or keep them until
        backward (False: ZeRO-2, more memory, less communication).
    mixed_precision: None (compute in the parameters' dtype), "bf16" or "fp16": compute in that dtype, reduce
        gradients in fp32, keep fp32 master weights.
    cpu_offload: sharded parameters, gradients and optimizer state live in CPU memory.
    """

    reshard_after_forward: bool = True
    mixed_precision: str | None = None
    cpu_offload: bool = False


# strategy.pp_schedule -> torch.distributed.pipelining's schedule class. Single-stage schedules run one stage per
# rank; the others run strategy.pp_stages_per_rank >= 2: stage s on pp rank s % pp (looped), or for the V-shaped
# ones exactly 2 per rank, rank r holding stages r and 2 pp - 1 - r (the first and the last stage on rank 0).
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved_1f1b": "ScheduleInterleaved1F1B",
    "looped_bfs": "ScheduleLoopedBFS",
    "interleaved_zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
SINGLE_STAGE = ("gpipe", "1f1b")
# Schedules that run every microbatch's forward before the first backward (what a mixture of experts' global-batch
# load balancing needs under a pipeline: models/moe_losses.py `StageLosses`)
FORWARDS_FIRST = ("gpipe",)
V_SHAPED = ("zbv", "dualpipev")
# Zero-bubble schedules split each backward into the input gradients (sent upstream at once) and the weight
# gradients (computed later, filling the bubble). torch computes those against the parameters the forward used,
# so the plan keeps each stage's FSDP parameters gathered from forward to backward (models/*/parallelize.py).
ZERO_BUBBLE = ("interleaved_zb", "zbv", "dualpipev")


def stages_per_rank(schedule: str, configured: int | None) -> int:
    """strategy.pp_stages_per_rank, where null is the schedule's own: 1 for gpipe and 1f1b, 2 for the others."""
    if configured is not None:
        return configured
    return 1 if schedule in SINGLE_STAGE else 2


@dataclass(frozen=True)
class PipelineOptions:
    """Pipeline parallelism over the mesh's `pp` dimension (distributed/pipeline.py runs the schedule).

    schedule: a key of SCHEDULES.
    microbatches: how many slices of the rank's batch go through the pipeline per step.
    stages_per_rank: model chunks per pp rank (1 for the single-stage schedules, 2 for the V-shaped ones, 2 or more
        for the others).
    """

    schedule: str = "1f1b"
    microbatches: int = 2
    stages_per_rank: int = 1

    def stage_ids(self, pp_rank: int, pp: int) -> list[int]:
        """The stages a pp rank holds: round-robin, rank r has r, r + pp, r + 2 pp, ...; V-shaped, r and
        2 pp - 1 - r."""
        if self.schedule in V_SHAPED:
            return [pp_rank, 2 * pp - 1 - pp_rank]
        return [pp_rank + s * pp for s in range(self.stages_per_rank)]

    def stage_rank(self, stage: int, pp: int) -> int:
        """The pp rank that holds `stage`."""
        return next(r for r in range(pp) if stage in self.stage_ids(r, pp))


# activation_checkpointing: what each block keeps for backward. none: everything; full: only its input (the whole
# block recomputed in backward); selective: `policy` op (per-op, torchtitan's: the matmuls' and attention's outputs
# kept, the cheap ops between them recomputed) or every_n (every n-th block fully checkpointed, the others not).
AC_MODES = ("none", "full", "selective")
AC_POLICIES = ("op", "every_n")
# activation_checkpointing_policy's keys (config/schema.py `ACPolicy` states them with these)
AC_POLICY_RULES = {"mode": Rule(str, choices=AC_POLICIES), "every_n": Rule(int, 1)}


@dataclass(frozen=True)
class ACOptions:
    """Activation checkpointing (distributed/blocks.py `apply_ac`). `mode`: one of AC_MODES; under selective,
    `policy` (one of AC_POLICIES) and, for every_n, `every_n` (>= 1: blocks n-1, 2n-1, ... are checkpointed)."""

    mode: str = "none"
    policy: str = "op"
    every_n: int = 2

    def __post_init__(self):
        """Checked by the keys' rules also when built from Python, not from a config."""
        if self.mode not in AC_MODES:  # the config key also takes true/false, which `of` turns into a mode
            raise ConfigError(
                f"activation_checkpointing={self.mode!r} is not valid; use one of {', '.join(AC_MODES)}"
            )
        check_value("activation_checkpointing_policy.mode", self.policy, AC_POLICY_RULES["mode"])
        check_value("activation_checkpointing_policy.every_n", self.every_n, AC_POLICY_RULES["every_n"])

    @classmethod
    def of(cls, value) -> ACOptions:
        """From what a config or a checkpoint's hyperparameters hold: a bool (true: full, false: none), None
        (none), a mode, or a mapping {mode, policy, every_n} (what parallama-train hands the module)."""
        if isinstance(value, cls):
            return value
        if value is None or isinstance(value, bool):
            return cls("full" if value else "none")
        if isinstance(value, str):
            return cls(value)
        return cls(**dict(value))

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def __bool__(self) -> bool:
        return self.enabled


FLOAT8_RECIPES = ("tensorwise", "rowwise")  # torchao's recipe names (distributed/float8.py)
FLOAT8_FILTERS = (
    "auto",
    "all",
)  # which block linears float8 converts (distributed/float8.py `converted_linears`)
COMPILE_MODES = ("auto",)  # besides true and false


def loss_fuses(loss_fn) -> bool:
    """Whether the recipe's loss computes the head's matmul with it in this step (`loss.impl=fused`,
    training/loss.py): the loss object says so (`fuses()`); any other callable is a plain loss."""
    return bool(getattr(loss_fn, "fuses", lambda: False)())


def compile_enabled(setting: bool | str, device_type: str) -> bool:
    """`compile: auto` (conf/train.yaml) is on where the model trains on CUDA and off elsewhere: on one H100 it
    bought 1.22x (Llama-3.2-1B) to 1.44x (the 180M) tokens/s (docs/benchmarks.md, train-gpu), while on CPU the
    first compile costs ~10 s per model and needs a C++ compiler. An explicit true or false wins."""
    return device_type == "cuda" if setting == "auto" else bool(setting)


@dataclass(frozen=True)
class Float8Options:
    """float8 training of the blocks' linears (distributed/float8.py): `recipe` tensorwise or rowwise; `emulate`
    where the device has no float8 matmul (CPU)."""

    recipe: str = "tensorwise"
    emulate: bool = False
    filter: str = "auto"  # FLOAT8_FILTERS


@dataclass(frozen=True)
class ParallelizeOptions:
    """sequence_parallel: with dims.tp > 1, norms and the activations between blocks split on the sequence.
    loss_parallel: with dims.tp > 1, the head's logits stay sharded on the vocabulary (the strategy computes
    the loss under `torch.distributed.tensor.parallel.loss_parallel`); False gathers them."""

    dims: ParallelDims
    mesh: Any = None  # torch DeviceMesh over parallel.dims.DIMS; None where the strategy shards by itself
    activation_checkpointing: ACOptions = ACOptions()  # a bool or a mode is read as ACOptions.of does
    compile: bool = False
    fsdp: FSDPOptions | None = None
    sequence_parallel: bool = False
    loss_parallel: bool = False
    pipeline: PipelineOptions | None = None  # set when dims.pp > 1: the plan splits the model into stages
    float8: Float8Options | None = None  # the blocks' linears in float8, converted first (before TP)

    def __post_init__(self):
        object.__setattr__(self, "activation_checkpointing", ACOptions.of(self.activation_checkpointing))

"""The planner behind parallama-plan: where each strategy keeps model states (`MemoryProfile`, declared by the
strategy classes), every profile's peak bytes per GPU (`estimate`, from memory.py's terms), and the first
configuration of the guide in docs/strategies.md that fits (`recommend`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from omegaconf import OmegaConf

from parallama import CONF_DIR
from parallama.config.parts import locate_target
from parallama.errors import ConfigError
from parallama.parallel.memory import (
    FP32,
    FUSED_LOSS_CHUNK,
    Estimate,
    activation_bytes,
    float8_gathered,
    moe_activation_bytes,
    optimizer_state_bytes,
    state_bytes,
    with_layers,
)

GUIDE = ("ddp", "sharded", "fully sharded", "model parallel", "offload")  # docs/strategies.md's order


@dataclass(frozen=True)
class MemoryProfile:
    """Where one configuration of a strategy keeps model states, for parallama-plan.

    `shard` (1/n each) and `offload` (to CPU) name them by letter: p(arams) g(rads) o(ptimizer state);
    `gathered`: none, "working" (root + 2 blocks) or "all" parameters held unsharded at once. `engine`:
    "autocast" (Lightning's mixed precision), "deepspeed" or "fsdp" (their own). `guide`: the step of the
    guide in docs/strategies.md where it is tried (ddp, sharded, fully sharded, model parallel, offload), in
    `order`. `layouts`: its sizes (dp_replicate, dp_shard, tp, pp, cp) are searched (parallel/layouts.py).
    """

    name: str
    overrides: str
    engine: str
    shard: str = ""
    offload: str = ""
    gathered: str = "none"
    guide: str = "ddp"
    order: int = 0
    layouts: bool = False


def profiles(conf_dirs: list[Path] | None = None) -> dict[str, MemoryProfile]:
    """What every strategy of the `strategy` group declares (also under `conf_dirs`), in the guide's order."""
    return memory_profiles([*(conf_dirs or []), CONF_DIR])


def declared_strategies(conf_dirs: list[Path]) -> dict[str, type]:
    """conf/strategy/<name>.yaml -> its class, for every config whose `_target_` is a Parallelism class
    (the first directory that has a name wins, as in Hydra's search path)."""

    from parallama.parallel.base import Parallelism  # torch-free module

    found: dict[str, type[Parallelism]] = {}
    for conf_dir in conf_dirs:
        for path in sorted(Path(conf_dir, "strategy").glob("*.yaml")):
            target = OmegaConf.load(path).get("_target_")
            if path.stem in found or not target:
                continue
            obj = locate_target(target, f"{path}: _target_")
            if isinstance(obj, type) and issubclass(obj, Parallelism):
                found[path.stem] = obj
    return found


def memory_profiles(conf_dirs: list[Path]) -> dict[str, MemoryProfile]:
    """Every declared strategy's profiles, in the guide's order."""
    profiles = [p for cls in declared_strategies(conf_dirs).values() for p in cls.memory_profiles]
    for p in profiles:
        if p.guide not in GUIDE:
            raise ConfigError(f"memory profile {p.name}: guide={p.guide!r} is not one of {', '.join(GUIDE)}")
    profiles.sort(key=lambda p: (GUIDE.index(p.guide), p.order))
    return {p.name: p for p in profiles}


def _gathered_params(c, how: str) -> int:
    """Parameters unsharded at once: all, or the root (embedding, lm_head, final norm) plus two blocks."""
    if how == "all":
        return c.num_params()
    layer = with_layers(c, 2).num_params() - with_layers(c, 1).num_params()
    return c.num_params() - max(c.num_hidden_layers - 2, 0) * layer


def estimate(
    config,
    *,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    precision: str,
    activation_checkpointing,
    strategies: dict[str, MemoryProfile] | None = None,
    float8: str | None = None,
    float8_share: float = 1.0,
    optimizer: str = "adamw",
    loss_impl: str = "plain",
    loss_chunk: int = FUSED_LOSS_CHUNK,
) -> dict[str, Estimate]:
    """Per-GPU peak memory of every strategy profile of a fixed layout (see the module docstring for the
    accounting; those with `layouts` are searched by parallel/layouts.py). `float8`: see `float8_gathered`;
    `optimizer`: `optimizer_state_bytes`; `loss_impl`, `loss_chunk` (loss.chunk_size): `loss_bytes` and
    `loss_fixed_bytes`."""
    n, psi = world_size, config.num_params()
    out = {}
    for name, s in (strategies or profiles()).items():
        if s.layouts:
            continue
        per = state_bytes(precision, s.engine)
        totals = psi * per[0], psi * per[1], optimizer_state_bytes(config, per[2], optimizer)
        states = [
            0 if k in s.offload else -(-total // n) if k in s.shard else total
            for total, k in zip(totals, "pgo", strict=True)
        ]
        if s.gathered == "none":
            gathered = psi * per[3]  # autocast's bf16 copies (0 in fp32 and for DeepSpeed)
        else:
            gathered = _gathered_params(config, s.gathered) * (per[3] or per[0])
            if s.engine == "fsdp" and n > 1:
                gathered -= float8_gathered(
                    config, s.gathered, per[3] or per[0], float8, float8_share=float8_share
                )
        e = 4 if precision in FP32 else 2
        e_res = 4 if s.engine == "autocast" else e  # autocast keeps the residual stream in fp32
        acts = activation_bytes(
            config,
            seq_len * micro_batch,
            e,
            e_res,
            activation_checkpointing,
            loss_impl=loss_impl,
            loss_chunk=loss_chunk,
        )
        acts += moe_activation_bytes(config, seq_len * micro_batch, e, activation_checkpointing)
        out[name] = Estimate(*states, gathered=gathered, activations=acts)
    return out


WHY = {
    "ddp": "a full replica fits: plain DDP is the simplest and fastest (ddp_spawn only where the script "
    "cannot be re-run, e.g. notebooks: it is no memory saving)",
    "sharded": "a full replica's model states do not fit; sharding the optimizer state (and gradients) does",
    "fully sharded": "even ZeRO-1/2 does not fit; sharding the parameters too (ZeRO-3 / FSDP) does",
    "model parallel": "FSDP alone does not fit; splitting each layer (tensor parallel, within a node), then the "
    "sequence (context parallel) or the layers (pipeline) does",
    "offload": "nothing fits in GPU memory alone; CPU offload (the last resort: slower) does",
}


def recommend(
    plans: dict[bool, dict[str, Estimate]],
    gpu_memory_gb: float,
    strategies: dict[str, MemoryProfile],
    searched: dict[str, bool] | None = None,
) -> tuple[str, bool, str] | None:
    """First (strategy, activation_checkpointing, why) in the guide's order that fits; `plans` holds the
    estimates without (unless the user asked for it), with selective (per-op: recomputes the cheap ops only, so
    it is tried before full) and with full activation checkpointing (False, "selective", True). The data-parallel
    steps (ddp, sharded, fully sharded) are tried without checkpointing before any of them with it: sharding
    costs communication, which overlaps with compute, where recomputing adds compute. Model parallel, then
    offload, each without, selective and full, come after; the searched N-D profiles (`searched`: name -> its
    layout's checkpointing) after every fixed one."""
    ckpts = (False, "selective", True)
    steps = [(stage, c) for c in ckpts for stage in GUIDE[:3]]
    steps += [("model parallel", c) for c in ckpts] + [("offload", c) for c in ckpts]
    for stage, c in steps:
        for name in [n for n, p in strategies.items() if p.guide == stage]:
            if strategies[name].layouts:
                fits = name in (searched or {}) and searched[name] == c
            else:
                fits = c in plans and plans[c][name].fits(gpu_memory_gb)
            if fits:
                kind = (
                    "selective activation checkpointing" if c == "selective" else "activation checkpointing"
                )
                more = f"; activations were the problem: with {kind}" if c and False in plans else ""
                if not c and stage in GUIDE[1:3] and len(plans) > 1:
                    more = " (without activation checkpointing, which is tried after sharding)"
                return name, c, WHY[stage] + more
    return None


WHY_EP = (
    "a mixture of experts whose states must be sharded: expert parallelism holds E/ep of each block's experts "
    "and moves tokens (all-to-all), where FSDP alone would all-gather every expert twice a step"
)


def prefer_expert_parallel(
    rec: tuple[str, bool, str] | None,
    strategies: dict[str, MemoryProfile],
    searched: dict[str, bool],
    ep_sizes: dict[str, int],
) -> tuple[str, bool, str] | None:
    """For a mixture of experts, where `recommend` reaches fully sharded data parallel, a searched layout with
    ep > 1 (`ep_sizes`: searched name -> its ep) that fits at the same activation checkpointing instead."""
    if rec is None or strategies[rec[0]].guide != "fully sharded":
        return rec
    for name, ep in ep_sizes.items():
        if ep > 1 and searched.get(name) == rec[1]:
            return name, rec[1], WHY_EP
    return rec

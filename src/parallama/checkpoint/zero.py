"""DeepSpeed ZeRO (stages 1-3, any world size, fp32 or bf16, with or without optimizer offload) to and from the
universal state that every strategy resumes from.

Universal state: `model` = {LightningModule parameter name: full fp32 CPU tensor}; `optimizer` = the layout of
torch's `get_optimizer_state_dict(..., StateDictOptions(full_state_dict=True))`: `{"state": {name: {"exp_avg",
"exp_avg_sq", "step"}}, "param_groups": [{<hyper-parameters>, "params": [names]}]}`, full fp32 CPU tensors.

DeepSpeed keeps one flat fp32 tensor per (sub-)group and rank: the master weights and, laid out exactly like
them, the AdamW moments. Offline, the moments are merged with DeepSpeed's own fp32 merge (zero_to_fp32); on a
running engine, single parameters are read and written through DeepSpeed's tensor-fragment API.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from parallama.checkpoint.formats import client_state, deepspeed_tag, detect
from parallama.checkpoint.untrusted import deepspeed_types, load_weights_only, weights_only_loads
from parallama.errors import ConfigError
from parallama.runtime import compat

MOMENTS = ("exp_avg", "exp_avg_sq")
# Param-group keys that choose the running optimizer's implementation (a GPU run's fused kernels), not its state.
NOT_HYPER_PARAMETERS = ("params", "foreach", "fused", "capturable", "differentiable")


# --- offline: a checkpoint folder -> universal state ---------------------------------------------------------


def read_zero_checkpoint(path: str | os.PathLike) -> tuple[dict, dict, dict]:
    """A DeepSpeed checkpoint folder (as Lightning writes it; ZeRO 1-3, any world size) -> (model, optimizer,
    client): the universal state and Lightning's client state (global_step, loops, lr_schedulers, callbacks,
    hyper_parameters, the datamodule's state, tokens_seen, tokenizer, ...). On CPU, in this process, without a
    process group; every pickle is read weights-only."""
    path = str(path)
    if detect(path) != "deepspeed":
        raise ConfigError(f"{path} is not a DeepSpeed checkpoint (no 'latest' file)")
    folder = str(deepspeed_tag(path))
    allowed = deepspeed_types()
    client = client_state(path)
    with (
        contextlib.redirect_stdout(sys.stderr),
        weights_only_loads(allowed),
    ):  # zero_to_fp32 prints and unpickles
        from deepspeed.utils import zero_to_fp32  # start-up time (deepspeed)

        try:
            model_states = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(folder))
            files = zero_to_fp32.get_optim_files(folder)
        except (FileNotFoundError, ValueError) as err:
            raise ConfigError(f"checkpoint {path} is incomplete or not a ZeRO checkpoint ({err})") from None
        shards = [load_weights_only(f, mmap=True, allowed=allowed)["optimizer_state_dict"] for f in files]
        model, optimizer = _merge_shards(path, zero_to_fp32, shards, model_states)
    return model, optimizer, client


def _merge_shards(path: str, zero_to_fp32, shards: list[dict], model_states: list) -> tuple[dict, dict]:
    first = shards[0]
    if "zero_stage" not in first:
        raise ConfigError(
            f"checkpoint {path} is not a ZeRO checkpoint (its optimizer files have no zero_stage)"
        )
    stage, world = int(first["zero_stage"]), first["partition_count"]
    world = max(world) if isinstance(world, list) else world
    if len(shards) != world:
        raise ConfigError(
            f"checkpoint {path} was written by {world} ranks but has {len(shards)} optimizer files"
        )
    if stage <= 2:
        flats = [s["single_partition_of_fp32_groups"] for s in shards]
        base = [s["base_optimizer_state"] for s in shards]
    else:
        flats = [s["fp32_flat_groups"] for s in shards]
        base = [s["optimizer_state_dict"] for s in shards]
    if not isinstance(base[0], dict):
        raise ConfigError(
            f"checkpoint {path} was written with zero_optimization.elastic_checkpoint, which is not supported"
        )
    # The base optimizer's state is keyed by flat partition; its param groups list them in partition order.
    groups = base[0]["param_groups"]
    ids = [i for group in groups for i in group["params"]]
    group_of = {i: g for g, group in enumerate(groups) for i in group["params"]}
    if len(ids) != len(flats[0]) or len(model_states[0].param_shapes) != len(ids):
        raise compat.deepspeed_changed("the flat groups of a ZeRO checkpoint")
    paddings = first.get("param_alignment_paddings")

    model = compat.zero_merge(zero_to_fp32, stage, world, flats, model_states, paddings, include_frozen=True)
    names = [[name for name in shapes] for shapes in model_states[0].param_shapes]
    frozen = list(model_states[0].frozen_param_shapes or {})
    model = {name: model[name].float().clone() for name in [n for group in names for n in group] + frozen}

    state: dict[str, dict] = {name: {} for group in names for name in group}
    has_state = all(base[r]["state"].get(i) for r in range(world) for i in ids)
    if has_state:
        for key in MOMENTS:
            moment = [
                [base[r]["state"][i][key].flatten()[: flats[r][k].numel()] for k, i in enumerate(ids)]
                for r in range(world)
            ]  # ZeRO-1/2 store moments with the alignment padding their fp32 partitions drop
            merged = compat.zero_merge(
                zero_to_fp32, stage, world, moment, model_states, paddings, include_frozen=False
            )
            for name in state:
                state[name][key] = merged[name].float().clone()
        for k, i in enumerate(ids):
            step = base[0]["state"][i]["step"]
            for name in names[k]:
                state[name]["step"] = torch.tensor(float(step), dtype=torch.float32)
    param_groups = [{key: value for key, value in group.items() if key != "params"} for group in groups]
    for group in param_groups:
        group["params"] = []
    for k, i in enumerate(ids):
        param_groups[group_of[i]]["params"] += names[k]
    return model, {"state": state if has_state else {}, "param_groups": param_groups}


# --- a running engine ----------------------------------------------------------------------------------------


def _engine_and_names(strategy_or_engine, lightning_module):
    engine = getattr(strategy_or_engine, "deepspeed_engine", None) or strategy_or_engine
    zero = getattr(engine, "optimizer", None)
    if zero is None or not hasattr(zero, "optimizer"):
        raise ConfigError("the DeepSpeed engine has no ZeRO optimizer yet: call this after Lightning's setup")
    names = {id(p): name for name, p in lightning_module.named_parameters()}
    return zero, names


def _has_state(zero, parts) -> bool:
    return all(zero.optimizer.state.get(flat) for _, flat, _ in parts)


def _link_moments(zero, parts) -> None:
    """ZeRO-1/2 read and write a parameter's moments through views into the flat state. DeepSpeed makes them
    once, after stepping the first param group only, so every later group's views are empty: make them all."""
    from deepspeed.utils import lazy_init_hp_params_optimizer_state  # start-up time (deepspeed)

    if not hasattr(zero, "fp32_partitioned_groups_flat"):  # ZeRO-3 reads the flat state directly
        for _, flat, params in parts:
            lazy_init_hp_params_optimizer_state(params, flat, zero.optimizer.state)


def gather_from_deepspeed(strategy_or_engine, lightning_module) -> tuple[dict, dict]:
    """The running engine's universal (model, optimizer), on CPU, on every rank. Collective: every rank calls it
    (one all-reduce or all-gather per parameter and tensor). Before the first step `optimizer["state"]` is {}."""
    # start-up time (deepspeed)
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero, names = _engine_and_names(strategy_or_engine, lightning_module)
    parts = compat.zero_partitions(zero)
    has_state = _has_state(zero, parts)
    if has_state:
        _link_moments(zero, parts)
    model, state = {}, {}
    for name, param in lightning_module.named_parameters():
        model[name] = safe_get_full_fp32_param(param).float().cpu().clone()
        if has_state:
            state[name] = {
                key: safe_get_full_optimizer_state(param, key).float().cpu().clone() for key in MOMENTS
            }
    groups = [
        {k: v for k, v in group.items() if k != "params"} | {"params": []}
        for group in zero.optimizer.param_groups
    ]
    for g, flat, params in parts:
        groups[g]["params"] += [names[id(p)] for p in params]
        if has_state:
            step = torch.tensor(float(zero.optimizer.state[flat]["step"]), dtype=torch.float32)
            for p in params:
                state[names[id(p)]]["step"] = step.clone()
    return model, {"state": state, "param_groups": groups}


def load_into_deepspeed(strategy_or_engine, lightning_module, model: dict, optimizer: dict) -> None:
    """Put a universal state into a running engine (after Lightning's setup; ZeRO 1-3, any world size, offload
    too): fp32 master weights, the module's (possibly bf16) working weights, AdamW moments, step count and the
    param groups' hyper-parameters, so that training on continues the run that wrote the state. Collective:
    every rank calls it with the same full state (under ZeRO-3 each parameter is gathered once)."""
    import deepspeed  # start-up time (deepspeed)

    # start-up time (deepspeed)
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    zero, names = _engine_and_names(strategy_or_engine, lightning_module)
    if missing := sorted(set(names.values()) - set(model)):
        raise ConfigError(f"the universal state has no weights for {missing[0]} (a different model?)")
    parts = compat.zero_partitions(zero)
    base, state = zero.optimizer, optimizer.get("state") or {}
    if state and not _has_state(zero, parts):  # AdamW creates its state at the first step: create it now
        torch_optimizer = type(base).__module__.startswith("torch.optim")
        for _, flat, _ in parts:
            base.state[flat].update(
                {key: torch.zeros_like(flat) for key in MOMENTS},
                step=torch.tensor(0.0) if torch_optimizer else 0,  # DeepSpeedCPUAdam counts in an int
            )
    if state:
        _link_moments(zero, parts)

    for name, param in lightning_module.named_parameters():
        value = model[name].to(torch.float32)
        safe_set_full_fp32_param(param, value.to(param.device))
        if state:
            for key in MOMENTS:
                safe_set_full_optimizer_state(param, state[name][key].to(param.device, torch.float32), key)
        with (
            deepspeed.zero.GatheredParameters([param], modifier_rank=0)
            if hasattr(param, "ds_id")
            else contextlib.nullcontext()
        ):
            with torch.no_grad():
                param.data.copy_(value.view_as(param.data))

    for g, flat, params in parts:
        group_names = {names[id(p)] for p in params}
        source = next((s for s in optimizer["param_groups"] if group_names <= set(s["params"])), None)
        if source is None:
            raise ConfigError(f"the universal state has no param group holding {sorted(group_names)[0]}")
        target = base.param_groups[g]
        target.update({k: v for k, v in source.items() if k in target and k not in NOT_HYPER_PARAMETERS})
        if state:
            steps = {float(state[n]["step"]) for n in group_names}
            if len(steps) != 1:
                raise ConfigError(
                    f"the universal state has different step counts in one param group: {sorted(steps)}"
                )
            old = base.state[flat]["step"]
            step = steps.pop()
            base.state[flat]["step"] = (
                torch.tensor(step, dtype=old.dtype, device=old.device) if torch.is_tensor(old) else int(step)
            )

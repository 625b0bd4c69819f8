"""The universal checkpoint: any strategy's checkpoint, at any world size, as one strategy-free state.

Every strategy writes its own format (a Lightning file, a DeepSpeed folder, a DCP folder) and reads it back
natively when nothing changed. Otherwise (another strategy, another world size where the format cannot
reshard) the checkpoint is read into a `UniversalState`: full fp32 tensors keyed by the LightningModule's
parameter names, the optimizer state in the layout torch's `get_optimizer_state_dict(full_state_dict=True)`
uses ({"state": {name: {exp_avg, exp_avg_sq, step}}, "param_groups": [{..., "params": [names]}]}), and the
rest of Lightning's checkpoint (loops, LR schedulers, callbacks, data position, W&B run id). The running
strategy's class then puts it in place (`Parallelism.load_universal`). `parallama-ckpt convert` writes one
to a file or DCP folder offline, and the tools (export, eval, generate: checkpoint/read.py) read its weights
alone (`read(path, optimizer=False)`): this module is the one reader of every format.

Every rank reads the whole state into host memory: fine up to models whose fp32 weights and moments fit
in a node's RAM several times over; bigger runs keep their strategy and world size (the native path).
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from parallama.checkpoint.formats import INFO_KEY, client_state, deepspeed_tag, detect
from parallama.checkpoint.integrity import checksum_folder, verify
from parallama.checkpoint.untrusted import (
    deepspeed_types,
    load_weights_only,
    safe_dcp_reader,
    verify_dcp,
    verify_deepspeed,
    weights_only_loads,
)
from parallama.checkpoint.zero import read_zero_checkpoint
from parallama.errors import ConfigError


@dataclass
class UniversalState:
    model: dict[str, Tensor]
    optimizer: dict | None  # None: the checkpoint holds weights only
    client: dict


def writer_info(path: str | os.PathLike) -> dict:
    """Who wrote the checkpoint; checkpoints that predate the record give only their format."""
    return {"format": detect(path), **(client_state(path).get(INFO_KEY) or {})}


def read(path: str | os.PathLike, *, optimizer: bool = True) -> UniversalState:
    """Any checkpoint as a UniversalState, the one reader of resumes and tools. `optimizer=False` (export, eval,
    generate): the weights only, read without the optimizer's tensors (a third of the memory)."""
    path = str(path)
    fmt = detect(path)
    verify(path)  # before a byte of it is used
    return READERS[fmt](path, optimizer)


def _read_file(path: str, optimizer: bool) -> UniversalState:
    ckpt = load_weights_only(path)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        raise ConfigError(f"checkpoint {path} is not a Lightning checkpoint (no state_dict)")
    model, optimizers = ckpt.pop("state_dict"), ckpt.pop("optimizer_states", None)
    names = (ckpt.get(INFO_KEY) or {}).get("optimizer_keys")
    state = None
    if optimizer and optimizers:
        if names is None:
            raise ConfigError(
                f"ckpt_path={path} predates universal checkpoints (it does not name its optimizer's tensors); "
                "resume it with the strategy that wrote it"
            )
        state = keyed_by_name(optimizers[0], names)
    return UniversalState(model, state, ckpt)


def _read_deepspeed(path: str, optimizer: bool) -> UniversalState:
    """With the optimizer: the ZeRO partitions merged with their AdamW moments (checkpoint/zero.py). Without: the
    fp32 weights merged by DeepSpeed's own zero_to_fp32."""
    if optimizer:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout
            return UniversalState(*read_zero_checkpoint(path))
    tag = deepspeed_tag(path)
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO<=2, ZeRO-3
    if not any((tag / name).is_file() for name in names):
        raise ConfigError(f"checkpoint {tag} has none of {names}; the DeepSpeed checkpoint is incomplete")
    verify_deepspeed(path)
    try:
        with contextlib.redirect_stdout(sys.stderr), weights_only_loads(deepspeed_types()):
            # start-up time (deepspeed)
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            model = get_fp32_state_dict_from_zero_checkpoint(path, tag.name)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({err})") from None
    return UniversalState(model, None, client_state(path))


def _read_dcp(path: str, optimizer: bool) -> UniversalState:
    """A DCP folder (FSDP2's, or parallama-ckpt's) in one process: everything in it (without the optimizer: the
    model's tensors only), nested as it was saved.

    The keys come from its `.metadata` (read safely), so DCP's own loader fills every one of them; the
    metadata's `planner_data` says where each flat key sat in the nested state that was saved."""

    metadata = verify_dcp(path)
    flat = {
        key: torch.empty(item.size, dtype=item.properties.dtype)
        if isinstance(item, TensorStorageMetadata)
        else None
        for key, item in metadata.state_dict_metadata.items()
        if optimizer or key.startswith("state_dict.")
    }  # None: a pickled value, which the loader puts in its place
    planner = DefaultLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False)
    try:
        with warnings.catch_warnings(), weights_only_loads([]):
            warnings.simplefilter("ignore", UserWarning)  # "loading in a single process": it is
            dcp.load(flat, storage_reader=safe_dcp_reader(path), planner=planner, no_dist=True)
    except Exception as err:
        raise ConfigError(f"checkpoint {path} is truncated or corrupt ({str(err).splitlines()[0]})") from None
    state = _nested(flat, metadata.planner_data or {})
    return UniversalState(state["state_dict"], state.get("optimizer_0"), client_state(path))


READERS = {"file": _read_file, "deepspeed": _read_deepspeed, "dcp": _read_dcp}  # every format, mapped once


def _nested(flat: dict, paths: dict) -> dict:
    """DCP's flat keys back in place: `paths[key]` is the key's path (dict keys and list indices) when saved."""
    out: dict = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        node = out
        for part, following in zip(path, path[1:]):
            node = _child(node, part, [] if isinstance(following, int) else {})
        if isinstance(node, list):
            node.extend([None] * (path[-1] + 1 - len(node)))
        node[path[-1]] = value
    return out


def _child(node, part, empty):
    if isinstance(node, list):
        node.extend([None] * (part + 1 - len(node)))
        if node[part] is None:
            node[part] = empty
        return node[part]
    return node.setdefault(part, empty)


# --- optimizer state: tensor index <-> parameter name ----------------------------------------------------


def keyed_by_name(state_dict: dict, names: list[str]) -> dict:
    """A torch optimizer state dict (tensors numbered as `names` lists them) keyed by parameter name."""
    return {
        "state": {names[i]: dict(s) for i, s in state_dict["state"].items()},
        "param_groups": [
            {**g, "params": [names[i] for i in g["params"]]} for g in state_dict["param_groups"]
        ],
    }


def keyed_by_index(universal: dict, param_groups: list[dict], name_of: dict[int, str]) -> dict:
    """The torch optimizer state dict for an optimizer whose `param_groups` hold the parameters named by
    `name_of` (id(param) -> name), numbered in group order as `Optimizer.state_dict` numbers them.

    Hyper-parameters come from the universal group that holds the group's first parameter."""
    group_of = {n: g for g in universal["param_groups"] for n in g["params"]}
    state, groups, index = {}, [], 0
    for group in param_groups:
        names = [name_of[id(p)] for p in group["params"]]
        missing = [n for n in names if n not in group_of]
        if missing:
            raise ConfigError(
                f"the checkpoint's optimizer has no state for {missing[0]} (architecture differs)"
            )
        saved = group_of[names[0]]
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": []})
        for name in names:
            if name in universal["state"]:
                state[index] = universal["state"][name]
            groups[-1]["params"].append(index)
            index += 1
    return {"state": state, "param_groups": groups}


def names_in_group_order(optimizer, module: torch.nn.Module) -> list[str]:
    """The names of an optimizer's parameters as `state_dict()` numbers them (group by group)."""
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [name_of[id(p)] for g in optimizer.param_groups for p in g["params"]]


# --- writing (parallama-ckpt convert) --------------------------------------------------------------------


def write(state: UniversalState, out: str | os.PathLike, fmt: str) -> None:
    """As a Lightning file (any strategy resumes it, ddp/ddp_sharded/auto natively) or a DCP folder, with their
    checksums."""
    out = Path(out)
    if out.exists():
        raise ConfigError(f"{out} exists; give a new path")
    info = {"strategy": "converted", "format": fmt}
    if fmt == "file":
        names = [n for g in (state.optimizer or {}).get("param_groups", []) for n in g["params"]]
        ckpt = {**state.client, "state_dict": state.model, INFO_KEY: {**info, "optimizer_keys": names}}
        if state.optimizer is not None:
            index = {n: i for i, n in enumerate(names)}
            ckpt["optimizer_states"] = [
                {
                    "state": {index[n]: s for n, s in state.optimizer["state"].items()},
                    "param_groups": [
                        {**g, "params": [index[n] for n in g["params"]]}
                        for g in state.optimizer["param_groups"]
                    ],
                }
            ]
        from parallama.checkpoint.atomic import save_file  # start-up time (lightning)

        save_file(ckpt, out)  # with its checksum, as a run writes it
    elif fmt == "dcp":
        tensors = {"state_dict": state.model}
        if state.optimizer is not None:
            tensors["optimizer_0"] = state.optimizer
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(tensors, checkpoint_id=str(out), no_dist=True)
        torch.save({**state.client, INFO_KEY: info}, out / "meta.pt")
        checksum_folder(out)
    else:
        raise ConfigError(f"format={fmt} is not one of file, dcp")

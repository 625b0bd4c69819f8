"""`parallama-plan`: per-GPU memory of every strategy for a training config, and which one to use (the memory
model is parallel/plan.py and memory.py)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import ClassVar

from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console
from rich.table import Column, Table

from parallama.app.checks import apply_global_batch
from parallama.app.compose import compose_tool
from parallama.cli import app
from parallama.distributed.dims import dims_of_config, processes_per_node
from parallama.distributed.options import ACOptions, stages_per_rank
from parallama.errors import ConfigError
from parallama.models import model_spec
from parallama.parallel.layout_checks import check_layout
from parallama.parallel.layouts import Layout, estimate_layout, search
from parallama.parallel.memory import FP32, FUSED_LOSS_CHUNK, GIB, HEADROOM, MIXED, OVERHEAD_GIB, optimizer_of
from parallama.parallel.plan import MemoryProfile, estimate, prefer_expert_parallel, profiles, recommend
from parallama.rules import Rule, check_keys, key


def plan(cfg, gpu_memory_gb: float, overrides: list[str], conf_dirs: list[Path] | None = None) -> dict:
    """Estimates and recommendation for a composed training config, as a JSON-able dict."""

    strategies = profiles(conf_dirs)
    notes, model = [], OmegaConf.to_container(cfg.model, resolve=True)
    if model["vocab_size"] is None:
        if "name_or_path" in cfg.tokenizer:
            raise ConfigError("model.vocab_size=null with a pretrained tokenizer: give model.vocab_size")
        n = cfg.tokenizer.get("vocab_size", 260)  # the byte tokenizer: 256 bytes + 4 specials
        model["vocab_size"] = -(-n // 64) * 64  # as parallama-train rounds it
        notes.append(
            f"model.vocab_size=null: assuming the tokenizer's {n} tokens, rounded up to {model['vocab_size']}"
        )
    config = model_spec(model).build_config(model)
    precision = OmegaConf.to_container(cfg.trainer)["precision"]
    if precision == "${auto_precision:}":
        precision = "bf16-mixed"
        notes.append("trainer.precision unset: planning for bf16-mixed (what a bf16-capable GPU gets)")
    elif precision in FP32 and cfg.strategy.get("mixed_precision") in ("bf16", "fp16"):
        precision = (
            "bf16-mixed"  # FSDP's own mixed precision: fp32 states, 16-bit compute, as planned for fsdp
        )
        notes.append(f"strategy.mixed_precision={cfg.strategy.mixed_precision}: planning 16-bit activations")
    # The run's activation checkpointing: False (none), True (full) or "selective" (its policy: `ac`); the
    # recommendation is searched among the run's, selective (per-op unless the run names a policy) and full.
    policy = cfg.get("activation_checkpointing_policy") or {}
    ac = ACOptions.of(cfg.activation_checkpointing)
    if ac.mode == "selective":
        ac = ACOptions("selective", policy.get("mode", "op"), policy.get("every_n", 2))
    ckpt = {"none": False, "full": True}.get(ac.mode, "selective")
    if ckpt == "selective":
        notes.append(f"activation_checkpointing=selective ({ac.policy}): the table's estimates")
    selective = ac if ckpt == "selective" else ACOptions("selective")
    levels = sorted({ckpt, "selective", True}, key=[False, "selective", True].index)  # least recompute first

    def how(c):
        return selective if c == "selective" else c

    from parallama.distributed.float8 import converted_share  # torch-free module

    float8 = cfg.get("float8")
    terms = dict(
        float8=float8,  # tensorwise: FSDP2 gathers the blocks' converted weights in float8 (float8_gathered)
        float8_share=converted_share(
            model_spec(model).shapes(model)[0], float8, cfg.get("float8_filter", "auto")
        )
        if float8
        else 1.0,
        optimizer=optimizer_of(cfg.optimizer.get("_target_", "")),  # muon: one buffer (optimizer_state_bytes)
        loss_impl=OmegaConf.select(cfg, "loss.impl", default="plain"),  # what the loss keeps (loss_bytes)
        # the fused loss's tokens in flight (loss_fixed_bytes)
        loss_chunk=OmegaConf.select(cfg, "loss.chunk_size", default=FUSED_LOSS_CHUNK),
    )
    if terms["optimizer"] == "muon":
        notes.append("optimizer=muon: one momentum buffer for the blocks' matrices, AdamW's two for the rest")
    if terms["loss_impl"] == "fused":
        notes.append("loss.impl=fused: no logits or their gradient over the whole batch, one chunk at a time")

    if cfg.data.batch_size is None:
        apply_global_batch(cfg)
        notes.append(
            f"data.batch_size=null: {cfg.data.batch_size} per data-parallel replica (global_batch_size over this "
            "config's layout), in every layout compared"
        )
    nodes, per_node = cfg.trainer.num_nodes, processes_per_node(cfg.trainer.devices)
    shape = dict(world_size=nodes * per_node, seq_len=cfg.data.seq_len, micro_batch=cfg.data.batch_size)
    plans = {
        c: estimate(
            config,
            precision=precision,
            activation_checkpointing=how(c),
            strategies=strategies,
            **shape,
            **terms,
        )
        for c in levels
    }
    # N-D profiles: the first layout that fits (or none), and the layout the config asks for, if it is one
    layouts, searched = {}, {}
    mesh = dict(
        nodes=nodes, gpus_per_node=per_node, seq_len=shape["seq_len"], micro_batch=shape["micro_batch"]
    )
    for name in [n for n, p in strategies.items() if p.layouts]:
        layout, with_ckpt, _ = search(
            config,
            **mesh,
            precision=precision,
            gpu_memory_gb=gpu_memory_gb,
            checkpointing=tuple(how(c) for c in levels),
            **terms,
        )
        if layout is None:
            notes.append(f"{name}: no layout of {nodes} x {per_node} GPUs fits")
            continue
        layouts[name], searched[name] = layout, next(c for c in levels if how(c) is with_ckpt)
    if _is_model_parallel(cfg.strategy):
        check_layout(cfg, on_gpu=True)  # as parallama-train refuses it (e.g. ep not dividing num_experts)
        layouts["model_parallel (as configured)"] = configured_layout(cfg)
    for name, layout in layouts.items():
        for c in plans:
            plans[c][name] = estimate_layout(
                config,
                layout,
                seq_len=shape["seq_len"],
                micro_batch=shape["micro_batch"],
                precision=precision,
                activation_checkpointing=how(c),
                **terms,
            )
    rows = {
        c: {k: {**asdict(e), "total": e.total, "fits": e.fits(gpu_memory_gb)} for k, e in p.items()}
        for c, p in plans.items()
    }
    for c in rows:
        for name, layout in layouts.items():
            rows[c][name]["layout"] = layout.describe()
    result = dict(num_params=config.num_params(), **shape, precision=precision, gpu_memory_gb=gpu_memory_gb)
    if hasattr(config, "active_params"):  # a mixture of experts: what one token runs through
        result["active_params"] = config.active_params()
    result["flops_per_token"] = config.flops_per_token(shape["seq_len"])  # MFU's (active parameters)
    result.update(activation_checkpointing=ckpt, notes=notes, estimates=rows[ckpt])
    result.update(estimates_selective=rows["selective"], estimates_checkpointing=rows[True])
    result["recommendation"] = None
    rec = recommend(plans, gpu_memory_gb, strategies, searched)
    rec = prefer_expert_parallel(rec, strategies, searched, {n: layouts[n].dims.ep for n in searched})
    if rec:
        name, with_ckpt, why = rec
        layout = layouts.get(name)
        planned = layout.overrides() if layout else None
        line = command(strategies[name], with_ckpt, precision, shape["world_size"], overrides, planned)
        result["recommendation"] = dict(
            strategy=name, activation_checkpointing=with_ckpt, why=why, command=line
        )
        if layout:
            result["recommendation"]["layout"] = dict(
                layout.dims.sizes(), sequence_parallel=layout.sequence_parallel
            )
            result["recommendation"]["why"] += f": {layout.describe()}"
    return result


def _is_model_parallel(strategy: DictConfig) -> bool:
    """Whether the configured strategy is model_parallel's class or a subclass of it (its keys give a layout)."""
    from parallama.parallel.base import strategy_class  # torch-free module
    from parallama.parallel.strategies.model_parallel import ModelParallel  # torch-free module

    configured = strategy_class(strategy)
    return configured is not None and issubclass(configured, ModelParallel)


def configured_layout(cfg) -> Layout:
    """The layout a strategy=model_parallel config asks for."""
    s = cfg.strategy
    return Layout(
        dims_of_config(cfg),
        sequence_parallel=bool(s.get("sequence_parallel")),
        pp_schedule=s.get("pp_schedule", "1f1b"),
        pp_microbatches=s.get("pp_microbatches"),
        pp_stages_per_rank=stages_per_rank(s.get("pp_schedule", "1f1b"), s.get("pp_stages_per_rank")),
    )


def command(
    profile: MemoryProfile,
    ckpt: bool,
    precision: str,
    world_size: int,
    overrides: list[str],
    planned: list[str] | None = None,
) -> str:
    """The `parallama-train` line: the user's overrides, minus those the plan sets, plus the plan's (`planned`:
    a searched layout's overrides instead of the profile's)."""
    one_device = profile.guide == "ddp" and world_size == 1
    planned = ["strategy=auto"] if one_device else planned or profile.overrides.split()
    if profile.engine == "fsdp" and precision in MIXED:
        planned += ["strategy.mixed_precision=bf16", "trainer.precision=32-true"]  # FSDP's own, not autocast
    planned += [f"activation_checkpointing={'selective' if ckpt == 'selective' else 'true'}"] if ckpt else []
    ours = {_key(o) for o in planned} | {"activation_checkpointing"}
    kept = [o for o in overrides if _key(o) not in ours and _key(o).split(".")[0] != "strategy"]
    return " ".join(["parallama-train", *kept, *planned])


def _key(override: str) -> str:
    return override.lstrip("+~").split("=")[0]


def compose(overrides: list[str], conf_dirs: list[Path] | None = None) -> DictConfig:
    """The training config for these overrides (`conf_dirs`: searched too, as parallama-train's --config-dir),
    for planning from Python."""
    search = (
        [f"hydra.searchpath=[{','.join(f'file://{Path(d).resolve()}' for d in conf_dirs)}]"]
        if conf_dirs
        else []
    )
    return compose_tool("train", [*overrides, *search])


def show(result: dict) -> None:
    """The table (GiB) and the recommendation, with rich."""

    console, ckpt = Console(width=max(Console().width, 150)), result["activation_checkpointing"]
    more = [k for k, c in (("selective", "selective"), ("checkpointing", True)) if c != ckpt]
    columns = ["params", "grads", "optim", "gathered", "activations", "total", "fits"]
    for k in more:
        columns += ["total w/ " + ("sel. ckpt" if k == "selective" else "ckpt"), "fits"]
    title = f"Per-GPU memory (GiB), {result['num_params'] / 1e9:.3g} B parameters"
    if "active_params" in result:
        title += f" ({result['active_params'] / 1e9:.3g} B active per token)"
    table = Table("strategy", *(Column(c, justify="right") for c in columns), title=title)
    for name, e in result["estimates"].items():
        label = f"{name}\n  {e['layout']}" if "layout" in e else name
        cells = [f"{e[k] / GIB:.1f}" for k in ("params", "grads", "optim", "gathered", "activations")]
        for r in [e, *(result[f"estimates_{k}"][name] for k in more)]:
            cells += [f"{r['total'] / GIB:.1f}", "yes" if r["fits"] else "no"]
        table.add_row(label, *cells)
    console.print(table)
    console.print(
        f"world size {result['world_size']}, micro-batch (per data-parallel replica) {result['micro_batch']} x {result['seq_len']} tokens, "
        f"{result['precision']}, {OVERHEAD_GIB} GiB overhead each; fits: total <= {HEADROOM:.0%} of "
        f"{result['gpu_memory_gb']:g} GiB"
    )
    what = "active " if "active_params" in result else ""
    console.print(
        f"training FLOPs per token (MFU's): {result['flops_per_token'] / 1e9:.3g} G "
        f"(6 x {what}non-embedding parameters + attention)"
    )
    for note in result["notes"]:
        console.print(f"note: {note}", highlight=False)
    if (rec := result["recommendation"]) is None:
        console.print(
            "[bold red]Nothing fits.[/] Add GPUs (trainer.devices, trainer.num_nodes), or lower data.batch_size "
            "(raising trainer.accumulate_grad_batches keeps the global batch) or data.seq_len."
        )
        return
    console.print(f"[bold]Recommendation: {rec['strategy']}[/] - {rec['why']}.")
    console.print(rec["command"], markup=False, highlight=False, soft_wrap=True)


@dataclass
class Plan:
    """The tool's own keys (the rest is the training config), their defaults and valid values (rules.py
    `key`)."""

    conf: ClassVar[str] = "plan.yaml"

    gpu_memory_gb: float = key(80, Rule(float, 0, open="low"))
    json: bool = key(False, Rule(bool))


def check(cfg: DictConfig, hardware: bool = True) -> None:
    check_keys(cfg, Plan)
    devices = cfg.trainer.devices
    if not isinstance(devices, int) or isinstance(devices, bool) or devices < 1:
        raise ConfigError(
            f"trainer.devices={devices}: give the number of GPUs per node, e.g. trainer.devices=8"
        )


def _task(cfg: DictConfig) -> None:
    hc = HydraConfig.get()
    overrides = [o for o in hc.overrides.task if _key(o) not in ("gpu_memory_gb", "json")]
    conf_dirs = [Path(s.path) for s in hc.runtime.config_sources if s.provider == "command-line"]
    result = plan(cfg, cfg.gpu_memory_gb, overrides, conf_dirs)
    if cfg.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)


def main(argv: list[str] | None = None) -> None:
    """`parallama-plan [--config-dir DIR] [gpu_memory_gb=80] [json=true] <parallama-train overrides>`."""
    app.run("plan", _task, argv, check=check)


if __name__ == "__main__":
    main()

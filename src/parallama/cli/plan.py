"""`parallama-plan`: per-GPU memory of every strategy for a training config, and which one to use.

Bytes per parameter (the table in docs/strategies.md): fp32 params 4 + grads 4 + AdamW moments 8 everywhere;
in mixed precision DeepSpeed holds 2 + 2 + 12 (the ZeRO paper's), while ddp/ddp_sharded (Lightning autocast)
hold 4 + 4 + 8 plus bf16 weight copies, and FSDP is planned with its own bf16 policy (4 + 4 + 8 sharded,
bf16 gathered blocks). Activations: Korthikanti et al. adapted to a Llama block (`activation_bytes`).
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from parallama import CONF_DIR
from parallama.errors import ConfigError
from parallama.models import model_spec
from parallama.parallel import GUIDE, MemoryProfile, memory_profiles

GIB = 2**30
OVERHEAD_GIB = 1.5
HEADROOM = 0.9  # a plan fits when its total is at most 90% of the GPU's memory
MIXED, FP32 = ("bf16-mixed", "16-mixed"), ("32-true", "32")


def profiles(conf_dirs: list[Path] | None = None) -> dict[str, MemoryProfile]:
    """What every strategy of the `strategy` group declares (parallama.parallel), in the guide's order."""
    return memory_profiles([*(conf_dirs or []), CONF_DIR])


@dataclass(frozen=True)
class Estimate:
    """Peak bytes on one GPU."""

    params: int
    grads: int
    optim: int
    gathered: int  # transient unsharded/low-precision parameter copies
    activations: int
    overhead: int = int(OVERHEAD_GIB * GIB)

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim + self.gathered + self.activations + self.overhead

    def fits(self, gpu_memory_gb: float) -> bool:
        return self.total <= HEADROOM * gpu_memory_gb * GIB


def state_bytes(precision: str, engine: str) -> tuple[int, int, int, int]:
    """Bytes per parameter: params, grads, optimizer state, compute copy (0: computes on the params)."""
    if precision in FP32:
        return 4, 4, 8, 0
    if precision not in MIXED:
        raise ConfigError(
            f"trainer.precision={precision} is not planned; use one of {', '.join(MIXED + FP32)}"
        )
    return {"autocast": (4, 4, 8, 2), "deepspeed": (2, 2, 12, 0), "fsdp": (4, 4, 8, 2)}[engine]


def activation_bytes(c, tokens: int, e: int, e_res: int, checkpointing: bool) -> int:
    """Saved activations of one micro-batch of `tokens` tokens; e / e_res: bytes of a compute / residual element.

    Per layer and token, Korthikanti et al.'s 34h (GPT, 16-bit, with dropout) becomes, for a Llama block with
    fused (flash) attention, no dropout and a SwiGLU MLP of width i:
    2 norm inputs (residual stream) + q/k/v-projection input h, rotated q h and k kv, v kv, attention output
    h, MLP input h, gate, silu(gate), up and their product 4i. No s^2 term: fused attention saves only the
    log-sum-exp (ignored). With checkpointing only each block's input is kept, plus one block recomputing.
    The loss adds the logits (compute dtype), their fp32 copy and the fp32 log-softmax: vocab per token.
    """
    h, kv, i, v = c.hidden_size, c.num_key_value_heads * c.head_dim, c.intermediate_size, c.vocab_size
    block = 2 * h * e_res + (4 * h + 2 * kv + 4 * i) * e
    layers = c.num_hidden_layers * (h * e_res) + block if checkpointing else c.num_hidden_layers * block
    head = h * (e_res + e) + v * (e + 4 + (4 if e != 4 else 0))
    return tokens * (layers + head)


def _gathered_params(c, how: str) -> int:
    """Parameters unsharded at once: all, or the root (embedding, lm_head, final norm) plus two blocks."""
    if how == "all":
        return c.num_params()
    layer = replace(c, num_hidden_layers=2).num_params() - replace(c, num_hidden_layers=1).num_params()
    return c.num_params() - max(c.num_hidden_layers - 2, 0) * layer


def estimate(
    config,
    *,
    world_size: int,
    seq_len: int,
    micro_batch: int,
    precision: str,
    activation_checkpointing: bool,
    strategies: dict[str, MemoryProfile] | None = None,
) -> dict[str, Estimate]:
    """Per-GPU peak memory of every strategy profile (see the module docstring for the accounting)."""
    n, psi = world_size, config.num_params()
    out = {}
    for name, s in (strategies or profiles()).items():
        per = state_bytes(precision, s.engine)
        states = [
            0 if k in s.offload else -(-psi * b // n) if k in s.shard else psi * b
            for b, k in zip(per[:3], "pgo", strict=True)
        ]
        if s.gathered == "none":
            gathered = psi * per[3]  # autocast's bf16 copies (0 in fp32 and for DeepSpeed)
        else:
            gathered = _gathered_params(config, s.gathered) * (per[3] or per[0])
        e = 4 if precision in FP32 else 2
        e_res = 4 if s.engine == "autocast" else e  # autocast keeps the residual stream in fp32
        acts = activation_bytes(config, seq_len * micro_batch, e, e_res, activation_checkpointing)
        out[name] = Estimate(*states, gathered=gathered, activations=acts)
    return out


WHY = {
    "ddp": "a full replica fits: plain DDP is the simplest and fastest (ddp_spawn only where the script "
    "cannot be re-run, e.g. notebooks: it is no memory saving)",
    "sharded": "a full replica's model states do not fit; sharding the optimizer state (and gradients) does",
    "fully sharded": "even ZeRO-1/2 does not fit; sharding the parameters too (ZeRO-3 / FSDP) does",
    "offload": "nothing fits in GPU memory alone; CPU offload (the last resort: slower) does",
}


def recommend(
    plans: dict[bool, dict[str, Estimate]], gpu_memory_gb: float, strategies: dict[str, MemoryProfile]
) -> tuple[str, bool, str] | None:
    """First (strategy, activation_checkpointing, why) in the guide's order that fits; `plans` holds the
    estimates without (unless the user asked for it) and with activation checkpointing."""
    steps = [(stage, c) for c in (False, True) for stage in GUIDE[:3]] + [
        ("offload", False),
        ("offload", True),
    ]
    for stage, c in steps:
        for name in [n for n, p in strategies.items() if p.guide == stage]:
            if c in plans and plans[c][name].fits(gpu_memory_gb):
                more = (
                    "; activations were the problem: with activation checkpointing"
                    if c and False in plans
                    else ""
                )
                return name, c, WHY[stage] + more
    return None


def plan(cfg, gpu_memory_gb: float, overrides: list[str], conf_dirs: list[Path] | None = None) -> dict:
    """Estimates and recommendation for a composed training config, as a JSON-able dict."""
    from omegaconf import OmegaConf

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
    devices, ckpt = cfg.trainer.devices, bool(cfg.activation_checkpointing)
    if not isinstance(devices, int) or devices < 1:
        raise ConfigError(
            f"trainer.devices={devices}: give the number of GPUs per node, e.g. trainer.devices=8"
        )
    shape = dict(
        world_size=devices * cfg.trainer.num_nodes, seq_len=cfg.data.seq_len, micro_batch=cfg.data.batch_size
    )
    plans = {
        c: estimate(config, precision=precision, activation_checkpointing=c, strategies=strategies, **shape)
        for c in {ckpt, True}
    }
    rows = {
        c: {k: {**asdict(e), "total": e.total, "fits": e.fits(gpu_memory_gb)} for k, e in p.items()}
        for c, p in plans.items()
    }
    result = dict(num_params=config.num_params(), **shape, precision=precision, gpu_memory_gb=gpu_memory_gb)
    result.update(
        activation_checkpointing=ckpt, notes=notes, estimates=rows[ckpt], estimates_checkpointing=rows[True]
    )
    result["recommendation"] = None
    if rec := recommend(plans, gpu_memory_gb, strategies):
        name, with_ckpt, why = rec
        line = command(strategies[name], with_ckpt, precision, shape["world_size"], overrides)
        result["recommendation"] = dict(
            strategy=name, activation_checkpointing=with_ckpt, why=why, command=line
        )
    return result


def command(profile: MemoryProfile, ckpt: bool, precision: str, world_size: int, overrides: list[str]) -> str:
    """The `parallama-train` line: the user's overrides, minus those the plan sets, plus the plan's."""
    one_device = profile.guide == "ddp" and world_size == 1
    planned = ["strategy=auto"] if one_device else profile.overrides.split()
    if profile.engine == "fsdp" and precision in MIXED:
        planned += ["strategy.mixed_precision=bf16", "trainer.precision=32-true"]  # FSDP's own, not autocast
    planned += ["activation_checkpointing=true"] if ckpt else []
    ours = {_key(o) for o in planned} | {"activation_checkpointing"}
    kept = [o for o in overrides if _key(o) not in ours and _key(o).split(".")[0] != "strategy"]
    return " ".join(["parallama-train", *kept, *planned])


def _key(override: str) -> str:
    return override.lstrip("+~").split("=")[0]


def compose(overrides: list[str], conf_dirs: list[Path] | None = None):
    """The training config for these overrides (`conf_dirs`: searched too, as parallama-train's --config-dir);
    Hydra's complaints become parallama-train's one-line errors."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from parallama.config.compose import _one_line

    if conf_dirs:
        overrides = [
            *overrides,
            f"hydra.searchpath=[{','.join(f'file://{Path(d).resolve()}' for d in conf_dirs)}]",
        ]
    with initialize_config_dir(str(CONF_DIR), version_base="1.3"):
        try:
            return compose("train", overrides=overrides)
        except (HydraException, OmegaConfBaseException) as err:
            message = f"{err}\n{err.__cause__ or ''}"
            raise ConfigError(_one_line(message, lambda: compose("train"))) from None


def show(result: dict) -> None:
    """The table (GiB) and the recommendation, with rich."""
    from rich.console import Console
    from rich.table import Column, Table

    console, ckpt = Console(width=max(Console().width, 120)), result["activation_checkpointing"]
    columns = ["params", "grads", "optim", "gathered", "activations", "total", "fits"]
    columns += [] if ckpt else ["total w/ ckpt", "fits"]
    title = f"Per-GPU memory (GiB), {result['num_params'] / 1e9:.3g} B parameters"
    table = Table("strategy", *(Column(c, justify="right") for c in columns), title=title)
    for name, e in result["estimates"].items():
        cells = [f"{e[k] / GIB:.1f}" for k in ("params", "grads", "optim", "gathered", "activations")]
        for r in [e] if ckpt else [e, result["estimates_checkpointing"][name]]:
            cells += [f"{r['total'] / GIB:.1f}", "yes" if r["fits"] else "no"]
        table.add_row(name, *cells)
    console.print(table)
    console.print(
        f"world size {result['world_size']}, micro-batch {result['micro_batch']} x {result['seq_len']} tokens, "
        f"{result['precision']}, {OVERHEAD_GIB} GiB overhead each; fits: total <= {HEADROOM:.0%} of "
        f"{result['gpu_memory_gb']:g} GiB"
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


USAGE = """parallama-plan [--config-dir DIR] [gpu_memory_gb=80] [json=false] <parallama-train overrides>
  e.g. parallama-plan model=llama3_8b trainer.devices=8 gpu_memory_gb=80 data.seq_len=8192

Per-GPU memory of every strategy for the training config these overrides compose (any parallama-train
override works), and the first option of the guide in docs/strategies.md that fits in 90% of
gpu_memory_gb (GiB), with the parallama-train line to run. json=true prints the numbers as JSON.
The strategies are those conf/strategy declares (and --config-dir DIR/strategy, as for parallama-train)."""


def main(argv: list[str] | None = None) -> None:
    """`parallama-plan [gpu_memory_gb=80] [json=true] <parallama-train overrides>`."""
    gpu_memory_gb, as_json, overrides, conf_dirs = 80.0, False, [], []
    args = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(args):
        print(USAGE)
        sys.exit(0)
    while "--config-dir" in args:  # more strategy (and other) configs, as parallama-train --config-dir
        i = args.index("--config-dir")
        conf_dirs.append(Path(args.pop(i + 1)) if i + 1 < len(args) else None)
        args.pop(i)
    try:
        if None in conf_dirs:
            raise ConfigError("--config-dir needs a directory")
        for arg in args:
            key, _, value = arg.lstrip("+").partition("=")
            if key == "gpu_memory_gb":
                try:
                    gpu_memory_gb = float(value)
                except ValueError:
                    raise ConfigError(f"gpu_memory_gb={value} must be a number (GiB per GPU)") from None
            elif key in ("json", "--json"):
                as_json = value.lower() in ("", "true", "1")
            else:
                overrides.append(arg)
        result = plan(compose(overrides, conf_dirs), gpu_memory_gb, overrides, conf_dirs)
    except ConfigError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    if as_json:
        print(json.dumps(result, indent=2))
    else:
        show(result)


if __name__ == "__main__":
    main()

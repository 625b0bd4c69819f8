"""`gpu`: tokens/s, MFU and peak memory on one CUDA GPU; exits 0 with a message where there is none.

1. tokens/s and MFU of the tiny, llama_180m (seq 512) and llama3_2_1b (seq 2048) presets in the baseline
   setup (bf16-mixed, fused AdamW, SDPA's default backend). MFU = flops_per_token(seq_len) x tokens/s / the
   device's dense bf16 peak (Lightning's table). Timed: a plain training loop on random tokens, so that the
   figures are the model's; `python -m bench overhead` measures what the Lightning path adds.
2. Ablation on llama_180m: each row changes one thing from the baseline.
3. Peak `torch.cuda.max_memory_allocated` of `parallama-train` on 1 device for every memory profile the strategy
   classes declare (the configurations `parallama-plan` weighs), next to `parallama.cli.plan.estimate` for it.
4. With 2 or more GPUs, the N-D layouts of `python -m bench nd` (NCCL, bf16 FSDP mixed precision) on all of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F

from bench.common import ROOT, machine, median, preset, print_machine, quiet, save, sync
from bench.step_time import UNPROFILED, clip_and_step, profile_step

# seq_len, batch; the 180M's batch is the article's global batch as one micro-batch (at 16, an H100 waits on launches)
PRESETS = {"tiny": (256, 64), "llama_180m": (512, 64), "llama3_2_1b": (2048, 4)}
BASELINE = {
    "precision": "bf16-mixed",
    "compile": False,
    "fused": True,
    "sdpa": None,
    "ckpt": False,
    "batch": 1,
}
ABLATIONS = {
    "baseline (bf16-mixed, fused AdamW)": {},
    "bf16-true": {"precision": "bf16-true"},
    "torch.compile per block": {"compile": True},
    "foreach AdamW (not fused)": {"fused": False},
    "SDPA flash only": {"sdpa": "FLASH_ATTENTION"},
    "SDPA math only": {"sdpa": "MATH"},
    "activation checkpointing": {"ckpt": True},
    "batch x2": {"batch": 2},
}
PEAKS = {"h100": 989e12, "h200": 989e12}  # dense bf16, for names Lightning's table misses


def peak_flops(device: torch.device) -> float | None:
    from lightning.fabric.utilities.throughput import get_available_flops

    name = torch.cuda.get_device_name(device).lower()
    return get_available_flops(device, torch.bfloat16) or next(
        (v for k, v in PEAKS.items() if k in name), None
    )


def measure(
    cfg: dict, seq_len: int, batch: int, variant: dict, device: torch.device, args, profile: bool = False
) -> tuple[list, int, dict | None]:
    """Tokens/s of `args.repeats` consecutive windows of `args.steps` training steps on random tokens
    after `args.warmup` untimed ones (compilation happens there), the peak allocated bytes, and with `profile`
    where one more step's time goes (bench/step_time.py `profile_step`)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from parallama.distributed.blocks import apply_ac, apply_compile
    from parallama.models.llama.config import LlamaConfig
    from parallama.models.llama.model import Llama

    v = {**BASELINE, **variant}
    batch *= v["batch"]
    torch.manual_seed(0)
    with device:  # initialized where it trains: seconds less for the 1B model than on the CPU
        model = Llama(LlamaConfig(**cfg))
    if v["precision"] == "bf16-true":
        model.to(torch.bfloat16)
    if v["ckpt"]:
        apply_ac(model)
    if v["compile"]:
        apply_compile(model)
    opt = torch.optim.AdamW(
        model.parameters(), lr=1e-4, weight_decay=0.1, fused=v["fused"], foreach=not v["fused"]
    )
    autocast = (
        torch.autocast(device.type, torch.bfloat16) if v["precision"] == "bf16-mixed" else nullcontext()
    )
    backend = partial(sdpa_kernel, getattr(SDPBackend, v["sdpa"])) if v["sdpa"] else nullcontext
    tokens = torch.randint(0, cfg["vocab_size"], (batch, seq_len + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def train_step(parts=UNPROFILED) -> None:
        with backend():
            with autocast:
                loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            parts.close("head+loss")
            loss.backward()
        clip_and_step(parts, model, opt)
        opt.zero_grad(set_to_none=True)

    rates, t0 = [], 0.0
    for step in range(args.warmup + args.steps * args.repeats + 1):
        if step >= args.warmup and (step - args.warmup) % args.steps == 0:
            sync(device)
            if step > args.warmup:
                rates.append(args.steps * batch * seq_len / (time.perf_counter() - t0))
            if len(rates) == args.repeats:
                break
            t0 = time.perf_counter()
        train_step()
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return rates, peak, profile_step(train_step, model, opt) if profile else None


class PeakMemory(L.Callback):
    """Added to parallama-train runs (`+callbacks.peak_memory`): writes the peak allocated bytes at the end."""

    def __init__(self, path: str):
        self.path = path

    def on_train_end(self, trainer, pl_module):
        if trainer.is_global_zero:
            Path(self.path).write_text(json.dumps({"peak_bytes": torch.cuda.max_memory_allocated()}))


def strategy_profiles() -> dict[str, list[str]]:
    """name -> parallama-train overrides: every declared memory profile, as parallama-plan lists them."""
    from parallama.parallel.plan import profiles

    return {name: p.overrides.split() for name, p in profiles().items()}


def strategy_peak(name: str, overrides: list[str], args) -> int | None:
    """Peak bytes of llama_180m under a strategy profile's overrides on 1 GPU; None where the run failed."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "peak.json"
        command = [
            sys.executable, "-m", "parallama.cli.train", *overrides, "trainer.devices=1", "model=llama_180m",
            "data.seq_len=512", f"data.batch_size={PRESETS['llama_180m'][1]}", "trainer.max_steps=10",
            "scheduler.warmup_steps=2", "trainer.limit_val_batches=0", "validate_before_training=false",
            "sample.max_new_tokens=0", "callbacks=none", "logger=none", "+trainer.enable_checkpointing=false",
            f"+callbacks.peak_memory._target_={__name__}.PeakMemory", f"+callbacks.peak_memory.path={out}",
            f"paths.cache_dir={Path(args.cache_dir).resolve()}", f"hydra.run.dir={tmp}",
        ]  # fmt: skip
        try:
            proc = subprocess.run(
                command, cwd=ROOT, capture_output=True, text=True, timeout=args.strategy_timeout
            )
        except subprocess.TimeoutExpired:
            print(f"  {name}: timed out after {args.strategy_timeout} s")
            return None
        if proc.returncode or not out.exists():
            print(f"  {name}: failed (exit {proc.returncode}): {(proc.stderr or proc.stdout)[-500:]}")
            return None
        return json.loads(out.read_text())["peak_bytes"]


def plan_estimates(cfg: dict, seq_len: int, batch: int) -> dict[str, int]:
    """`parallama.cli.plan.estimate` totals (bytes) of every profile, in the runs' bf16-mixed."""
    from parallama.models.llama.config import LlamaConfig
    from parallama.parallel.plan import estimate

    plans = estimate(
        LlamaConfig(**cfg),
        world_size=1,
        seq_len=seq_len,
        micro_batch=batch,
        precision="bf16-mixed",
        activation_checkpointing=False,
    )
    return {name: plan.total for name, plan in plans.items()}


def _gib(n: float | None) -> str:
    return f"{n / 2**30:.2f}" if n else "-"


def run(args) -> dict:
    from parallama.data import byte_level

    quiet()
    info = machine()
    print_machine(info)
    if not torch.cuda.is_available():
        print("gpu: no CUDA device here; nothing measured. Run `python -m bench gpu` on a GPU machine.")
        return {}
    device = torch.device("cuda")
    peak = peak_flops(device)
    print(
        f"# bf16 dense peak: {peak / 1e12:.0f} TFLOP/s" if peak else "# bf16 peak unknown: MFU not reported"
    )
    results: dict = {
        "config": vars(args),
        "peak_flops": peak,
        "presets": {},
        "ablation": {},
        "strategies": {},
    }

    def row(label, cfg, seq_len, batch, variant):
        from parallama.models.llama.config import LlamaConfig

        try:
            rates, mem, _ = measure(cfg, seq_len, batch, variant, device, args)
        except RuntimeError as err:  # e.g. out of memory, or no kernel for a forced SDPA backend: go on
            print(f"{label:<36} failed: {str(err).splitlines()[0][:200]}")
            torch.cuda.empty_cache()
            return {"error": str(err)[:1000]}
        rate = median(rates)
        mfu = LlamaConfig(**cfg).flops_per_token(seq_len) * rate / peak if peak else float("nan")
        print(f"{label:<36} {rate:>12,.0f} {mfu:>6.1%} {mem / 2**30:>8.2f}")
        torch.cuda.empty_cache()
        return {"tokens_per_s": rate, "mfu": mfu, "peak_bytes": mem}

    header = f"{'':<36} {'tokens/s':>12} {'MFU':>6} {'peak GiB':>8}"
    print(f"\npresets (baseline setup, median of {args.repeats} windows)\n{header}")
    for name in args.presets:
        seq_len, batch = PRESETS[name]
        label = f"{name} seq {seq_len} batch {batch}"
        results["presets"][name] = row(label, preset(name, byte_level().get_vocab_size()), seq_len, batch, {})
    save(args.out, "gpu", info, results)  # after each section: a run cut short keeps what it measured
    seq_len, batch = PRESETS["llama_180m"]
    print(f"\nablation: llama_180m, seq {seq_len}, batch {batch}\n{header}")
    for label, variant in ABLATIONS.items():
        results["ablation"][label] = row(label, preset("llama_180m", 0), seq_len, batch, variant)
    save(args.out, "gpu", info, results)
    print(f"\npeak memory of parallama-train, llama_180m seq {seq_len} batch {batch}, 1 device")
    print(f"{'profile':<20} {'measured GiB':>12} {'plan GiB':>9}  overrides")
    plans = plan_estimates(preset("llama_180m", 0), seq_len, batch)
    for name, overrides in strategy_profiles().items():
        measured, estimated = strategy_peak(name, overrides, args), plans.get(name)
        results["strategies"][name] = {
            "overrides": overrides,
            "peak_bytes": measured,
            "plan_estimate_bytes": estimated,
        }
        print(f"{name:<20} {_gib(measured):>12} {_gib(estimated):>9}  {' '.join(overrides)}")
        save(args.out, "gpu", info, results)
    if torch.cuda.device_count() >= 2:
        from types import SimpleNamespace

        from bench import nd

        world = 4 if torch.cuda.device_count() >= 4 else 2
        print(f"\nN-D layouts on {world} GPUs (python -m bench nd --device cuda --world {world})")
        nd_args = SimpleNamespace(
            model="llama3_2_1b", world=world, device="cuda", layouts=list(nd.LAYOUTS), global_batch=4 * world,
            seq_len=2048, warmup=3, steps=10, repeats=3, pp_schedule="1f1b", pp_microbatches=None, out=None,
        )  # fmt: skip
        results["nd"] = nd.run(nd_args)
    else:
        print("\nN-D layouts: one GPU here; `python -m bench nd --device cuda --world N` needs N >= 2 GPUs")
    save(args.out, "gpu", info, results)
    return results


def add_arguments(p) -> None:
    p.add_argument("--presets", nargs="+", default=list(PRESETS), choices=list(PRESETS))
    p.add_argument("--warmup", type=int, default=5, help="untimed steps (compile happens here)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--repeats", type=int, default=3, help="timed windows per row (median)")
    p.add_argument("--strategy-timeout", type=int, default=300, help="seconds per parallama-train run")

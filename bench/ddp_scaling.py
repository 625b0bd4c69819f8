"""`ddp-scaling` (CPU): tokens/s of 1 vs 2 single-threaded processes, plain DDP and parallama's path.

Plain: a torch.distributed DDP loop (gloo, ranks started with torch.multiprocessing's spawn) with the
overhead benchmark's training loop and a DistributedSampler over the same token cache; 1 process runs the
model without DDP. parallama: `parallama-train trainer.devices=1` vs `strategy=ddp trainer.devices=2`, as
subprocesses. Both read rank 0's clock at the end of step `--warmup` and of the last step (`StepClock` is
added to the parallama run's callbacks), so both figures come from one instrument. Every process runs one
thread (OMP_NUM_THREADS=1 for the subprocesses, torch.set_num_threads(1) in the plain ranks) on the same
per-rank micro-batch. Runs alternate (plain 1, plain 2, parallama 1, parallama 2) for `--repeats` rounds;
ratios are medians of the per-round ratios.

On a shared VM the load other tenants put on the host changes over minutes, and two single-threaded ranks
on two cores have no core to spare: a run's tokens/s can move by 10-20% from one run to the next (the median
step time moved with it when tried, so the stalls are not short bursts). Read the per-round scalings printed
with the medians, and use several rounds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

from bench.common import ROOT, datamodule, machine, median, preset, print_machine, quiet, save, spawn_ranks
from bench.overhead import train_loop

GOAL = 1.85


class StepClock(Callback):
    """Steps/s from the end of optimizer step `warmup` to the end of training, read as the plain loop reads
    it; rank 0 writes it to `path`."""

    def __init__(self, path: str, warmup: int) -> None:
        self.path, self.warmup, self.t0 = path, warmup, None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.warmup:
            self.t0 = time.perf_counter()
        elif trainer.global_step == trainer.max_steps and trainer.global_rank == 0:
            steps = trainer.global_step - self.warmup
            Path(self.path).write_text(json.dumps(steps / (time.perf_counter() - self.t0)))


def _plain_rank(rank: int, world: int, port: int, args, queue) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    from parallama.models.llama.config import LlamaConfig
    from parallama.models.llama.model import Llama

    torch.set_num_threads(1)
    dm = datamodule(args.cache_dir, args.seq_len, args.batch)
    dataset = dm.datasets["train"]
    sampler = DistributedSampler(dataset, world, rank, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch, sampler=sampler, drop_last=True)
    torch.manual_seed(0)
    model = Llama(LlamaConfig(**preset(args.model, dm.vocab_size)))
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        model = DistributedDataParallel(model)
    steps_per_s, _ = train_loop(model, loader, args, torch.device("cpu"))
    if rank == 0:
        queue.put(steps_per_s)
    if world > 1:
        dist.destroy_process_group()


def plain(args, world: int) -> float:
    """Total tokens/s of `world` single-threaded ranks."""
    (steps_per_s,) = spawn_ranks(_plain_rank, world, args)  # rank 0 reports
    return steps_per_s * args.batch * args.seq_len * world


def parallama(args, world: int) -> float:
    """Total tokens/s of `parallama-train` on `world` single-threaded CPU ranks."""
    with tempfile.TemporaryDirectory() as tmp:
        clock_file = Path(tmp) / "clock.json"
        command = [
            sys.executable,
            "-m",
            "parallama.cli.train",
            *(["strategy=ddp"] if world > 1 else []),
            f"trainer.devices={world}",
            "trainer.accelerator=cpu",
            "trainer.precision=32-true",
            f"trainer.max_steps={args.warmup + args.steps}",
            "trainer.limit_val_batches=0",
            "+trainer.enable_checkpointing=false",
            "+trainer.enable_progress_bar=false",
            "+trainer.enable_model_summary=false",
            "callbacks=none",  # no checkpoint writes in the timed steps; the throughput monitor as users run it
            "+callbacks.throughput._target_=parallama.training.monitors.TokenThroughputMonitor",
            "+callbacks.clock._target_=bench.ddp_scaling.StepClock",
            f"+callbacks.clock.path={clock_file}",
            f"+callbacks.clock.warmup={args.warmup}",
            f"model={args.model}",
            f"data.batch_size={args.batch}",
            f"data.seq_len={args.seq_len}",
            f"scheduler.warmup_steps={max(1, (args.warmup + args.steps) // 10)}",
            "validate_before_training=false",
            "sample.max_new_tokens=0",
            f"paths.cache_dir={Path(args.cache_dir).resolve()}",
            f"hydra.run.dir={tmp}",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode:
            raise RuntimeError(f"{' '.join(command)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        steps_per_s = json.loads(clock_file.read_text())
    return steps_per_s * args.batch * args.seq_len * world


def run(args) -> dict:
    quiet()
    info = machine()
    print_machine(info)
    datamodule(args.cache_dir, args.seq_len, args.batch)  # build the cache once, before any rank reads it
    print(
        f"# ddp-scaling: model={args.model} per-rank batch={args.batch} seq_len={args.seq_len}, "
        f"{args.warmup} warmup + {args.steps} timed steps, 1 thread per process, {args.repeats} rounds"
    )
    arms = {"plain": plain, "parallama": parallama}
    rates = {f"{name} x{w}": [] for name in arms for w in (1, 2)}
    for r in range(args.repeats):
        for name, fn in arms.items():
            for w in (1, 2):
                rates[f"{name} x{w}"].append(fn(args, w))
        print(f"round {r + 1}: " + "  ".join(f"{k} {v[-1]:,.0f}" for k, v in rates.items()) + " tokens/s")

    def ratios(a: str, b: str) -> list[float]:
        return [x / y for x, y in zip(rates[a], rates[b], strict=True)]

    per_round = {name: ratios(f"{name} x2", f"{name} x1") for name in arms}
    scaling = {name: median(r) for name, r in per_round.items()}
    results = {
        "config": vars(args),
        "tokens_per_s": rates,
        "scaling": scaling,
        "scaling_per_round": per_round,
    }
    results["parallama_over_plain"] = {
        f"x{w}": median(ratios(f"parallama x{w}", f"plain x{w}")) for w in (1, 2)
    }
    print(f"\n{'path':<12} {'1 proc tok/s':>13} {'2 procs tok/s':>14} {'scaling':>8}  per round")
    for name in arms:
        one, two = median(rates[f"{name} x1"]), median(rates[f"{name} x2"])
        rounds = ", ".join(f"{x:.2f}" for x in per_round[name])
        print(f"{name:<12} {one:>13,.0f} {two:>14,.0f} {scaling[name]:>7.2f}x  {rounds}")
    po = results["parallama_over_plain"]
    print(f"\nparallama / plain tokens/s: 1 process {po['x1']:.3f}, 2 processes {po['x2']:.3f}")
    met = "met" if scaling["parallama"] >= GOAL else "NOT met"
    print(f"parallama 2-process scaling {scaling['parallama']:.2f}x: goal >= {GOAL}x {met}")
    save(args.out, "ddp-scaling", info, results)
    return results


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="a conf/model preset")
    p.add_argument("--batch", type=int, default=16, help="per-rank micro-batch")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per run (>= 1)")
    p.add_argument("--steps", type=int, default=60, help="timed steps per run")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    p.set_defaults(precision="32-true")  # read by the shared training loop

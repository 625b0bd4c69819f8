"""`overhead`: the cost of parallama's Lightning path over a plain PyTorch loop doing the same work.

Both arms train the same model from the same weights on the same batches in the same order, with the same
AdamW parameter groups, warmup+cosine LambdaLR stepped per batch and gradient clipping. Steps/s is timed
from the end of step `warmup` to the end of the last step; arms alternate round by round so that drifts
in machine load hit both, and the reported ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import tempfile
import time
from contextlib import nullcontext
from functools import partial
from itertools import count

import torch
import torch.nn.functional as F

from bench.common import ROOT, datamodule, machine, median, preset, print_machine, quiet, save, sync

OPTIMIZER = {
    "_target_": "torch.optim.AdamW",
    "lr": 3e-3,
    "betas": [0.9, 0.99],
    "eps": 1e-8,
    "weight_decay": 0.1,
    "fused": None,
}
CLIP = 1.0


def scheduler(args) -> dict:
    """Warmup over the first tenth of the run, then cosine: the LR changes every step in both arms."""
    return {
        "_target_": "parallama.training.schedules.WarmupCosine",
        "warmup_steps": max(1, (args.warmup + args.steps) // 10),
        "warmup_start_factor": 0.1,
        "min_lr_ratio": 0.1,
    }


def adamw(model, device: torch.device, **kw) -> torch.optim.AdamW:
    """AdamW with parallama's parameter groups: weight decay on matrices only."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": OPTIMIZER["weight_decay"]},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    fused = device.type == "cuda" or None
    return torch.optim.AdamW(
        groups, lr=OPTIMIZER["lr"], betas=OPTIMIZER["betas"], eps=OPTIMIZER["eps"], fused=fused, **kw
    )


def train_loop(model, loader, args, device: torch.device) -> tuple[float, float]:
    """The source article's loop: forward, loss, backward, clip_grad_norm_, step, LambdaLR step, zero_grad.
    Returns (steps/s after `args.warmup` steps, final loss)."""
    from parallama.training.schedules import warmup_cosine

    opt, total, s = adamw(model, device), args.warmup + args.steps, scheduler(args)
    lr_lambda = partial(
        warmup_cosine,
        warmup_steps=s["warmup_steps"],
        total_steps=total,
        start_factor=s["warmup_start_factor"],
        min_ratio=s["min_lr_ratio"],
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
    autocast = (
        torch.autocast(device.type, torch.bfloat16) if args.precision == "bf16-mixed" else nullcontext()
    )
    step, t0 = 0, 0.0
    for epoch in count():
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with autocast:
                logits = model(batch["input_ids"], batch.get("attention_mask"))
            loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
            loss.backward()
            # The optimizer's parameter order, as Lightning clips: the norm's summation order is then the same.
            torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], CLIP)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step == args.warmup:
                sync(device)
                t0 = time.perf_counter()
            if step == total:
                sync(device)
                return args.steps / (time.perf_counter() - t0), loss.item()
    raise AssertionError("unreachable")


def plain(cfg: dict, init: dict, dm, args, device: torch.device) -> tuple[float, float]:
    from parallama.models.llama.config import LlamaConfig
    from parallama.models.llama.model import Llama

    model = Llama(LlamaConfig(**cfg))
    model.load_state_dict(init)
    return train_loop(model.to(device).train(), dm.train_dataloader(), args, device)


def lightning(cfg: dict, init: dict, dm, args, device: torch.device, defaults: bool) -> tuple[float, float]:
    """`CausalLM` + `Trainer` as parallama-train builds them, minus validation; `defaults`: all of
    conf/callbacks/default.yaml, else only the throughput monitor (progress bar and checkpoints off)."""
    import hydra
    import lightning as L
    from lightning.pytorch.loggers import CSVLogger
    from omegaconf import OmegaConf

    from parallama.training.module import CausalLM
    from parallama.training.monitors import TokenThroughputMonitor

    class Timer(L.Callback):
        def __init__(self):
            self.t0 = self.rate = self.loss = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == args.warmup:
                sync(device)
                self.t0 = time.perf_counter()
            elif trainer.global_step == args.warmup + args.steps:
                sync(device)
                self.rate = args.steps / (time.perf_counter() - self.t0)
                self.loss = outputs["loss"].item()

    module = CausalLM(model=cfg, optimizer=OPTIMIZER, scheduler=scheduler(args))
    module.configure_model()  # the model parallama builds (parallelize() included), then the shared weights
    module.model.load_state_dict(init)
    timer = Timer()
    with tempfile.TemporaryDirectory() as tmp:
        if defaults:
            conf = OmegaConf.create({"paths": {"output_dir": tmp, "cache_dir": args.cache_dir}})
            conf.callbacks = OmegaConf.load(ROOT / "conf" / "callbacks" / "default.yaml")
            callbacks = [hydra.utils.instantiate(c) for c in conf.callbacks.values()]
        else:
            callbacks = [TokenThroughputMonitor(window_size=20)]
        trainer = L.Trainer(
            accelerator="auto",
            devices=1,
            precision=args.precision,
            max_steps=args.warmup + args.steps,
            max_epochs=-1,
            logger=CSVLogger(tmp, name="csv", version=""),
            callbacks=[*callbacks, timer],
            enable_progress_bar=defaults,
            enable_checkpointing=defaults,
            enable_model_summary=defaults,
            gradient_clip_val=CLIP,
            limit_val_batches=0,
            num_sanity_val_steps=0,
            log_every_n_steps=10,
            default_root_dir=tmp,
        )
        trainer.fit(module, datamodule=dm)
    return timer.rate, timer.loss


def run(args) -> dict:
    from parallama.models.llama.config import LlamaConfig
    from parallama.models.llama.model import Llama

    quiet()
    if args.threads:
        torch.set_num_threads(args.threads)
    info = machine()
    print_machine(info)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dm = datamodule(args.cache_dir, args.seq_len, args.batch)
    cfg = preset(args.model, dm.vocab_size)
    torch.manual_seed(0)
    init = {k: v.clone() for k, v in Llama(LlamaConfig(**cfg)).state_dict().items()}
    arms = {"plain": partial(plain, cfg, init, dm, args, device)}
    arms["lightning"] = partial(lightning, cfg, init, dm, args, device, False)
    if not args.no_defaults:
        arms["lightning+default_callbacks"] = partial(lightning, cfg, init, dm, args, device, True)
    print(
        f"# overhead: model={args.model} ({LlamaConfig(**cfg).num_params() / 1e6:.2f} M params) batch={args.batch} "
        f"seq_len={args.seq_len} precision={args.precision} device={device.type}; {args.warmup} warmup + "
        f"{args.steps} timed steps per trial, {args.repeats} alternating rounds"
    )
    rates: dict[str, list[float]] = {name: [] for name in arms}
    losses: dict[str, float] = {}
    for r in range(args.repeats):
        for name, arm in arms.items():
            rate, losses[name] = arm()
            rates[name].append(rate)
        print(f"round {r + 1}: " + "  ".join(f"{n} {v[-1]:.2f} steps/s" for n, v in rates.items()))
    results = {"config": vars(args), "steps_per_s": rates, "final_loss": losses, "arms": {}}
    tol = 1e-5 if args.precision == "32-true" and device.type == "cpu" else 1e-2
    print(
        f"\n{'arm':<28} {'median steps/s':>14} {'ratio to plain':>15} {'final loss':>11}  same loss (tol {tol:g})"
    )
    for name, values in rates.items():
        ratio = median([a / b for a, b in zip(values, rates["plain"], strict=True)])
        same = abs(losses[name] - losses["plain"]) <= tol
        results["arms"][name] = {
            "median_steps_per_s": median(values),
            "median_ratio": ratio,
            "same_loss": same,
        }
        print(
            f"{name:<28} {median(values):>14.2f} {ratio:>15.3f} {losses[name]:>11.6f}  {'yes' if same else 'NO'}"
        )
    overhead = 1 - results["arms"]["lightning"]["median_ratio"]
    print(f"\nLightning path overhead: {overhead:+.1%} of plain steps/s (goal <= 3%)")
    save(args.out, "overhead", info, results)
    return results


def add_arguments(p) -> None:
    p.add_argument("--model", default="tiny", help="a conf/model preset")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--warmup", type=int, default=10, help="untimed steps per trial (>= 1)")
    p.add_argument("--steps", type=int, default=50, help="timed steps per trial")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    p.add_argument("--precision", default="32-true", choices=["32-true", "bf16-mixed"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-defaults", action="store_true", help="skip the arm with conf/callbacks/default.yaml")

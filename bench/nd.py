"""`nd`: N-D parallel layouts side by side: step time and bytes communicated per optimizer step, as ratios to FSDP.

Each layout trains the same model on the same global batch for `--warmup` + `--steps` steps in `--world` ranks
(gloo on CPU, NCCL on GPUs; started once with torch.multiprocessing's spawn, every layout and round in them)
through its family's own plan (the Llama's `models/llama/parallelize.parallelize`, with `ParallelizeOptions`, as `strategy=model_parallel` applies it):
a data-parallel rank trains global batch / dp samples, the tp and pp ranks of a batch share it. Pipeline layouts
split the model into pp stages in the plan and train through `parallel.pipeline.Pipeline` (the schedule's
forward and backward over microbatches, the loss on the last stage), as the strategy does. Layouts alternate for
`--repeats` rounds; ratios are medians of the per-round ratios.

A mixture of experts (`--model qwen3_moe_tiny`) adds
its routers' losses to the step and the `ep` layouts; its tokens' all-to-alls are counted apart as dispatch and
combine (`expert_bytes`).

Bytes: one profiled step after the timed ones, what a rank hands to the communication backend (the input of
every `gloo:*` / `nccl:*` call, DTensor's, FSDP2's and the pipeline's alike), averaged over the ranks (pipeline
stages differ: the first holds the embedding, the last the head): an all-reduce its whole tensor, an all-gather
its own shard, a send its tensor (a stage's activations forward, their gradients backward); a recv is counted at
its sender. Gloo has no reduce-scatter: FSDP2 all-reduces the full gradients there (NCCL reduce-scatters them),
so on CPU FSDP's figure is its all-gathers plus full-size gradient all-reduces. It is not what the wire carries (a
ring all-reduce sends 2(n-1)/n of its tensor per rank), but it compares layouts on one backend.
"""

from __future__ import annotations

import os
import statistics
import time

import torch

from bench.common import ROOT, machine, median, preset, print_machine, quiet, save, spawn_ranks
from parallama.distributed.dims import ParallelDims
from parallama.distributed.options import SINGLE_STAGE

LAYOUTS = {  # name: ParallelDims sizes (and sequence parallel), for the world sizes that fit them
    "fsdp": dict(dp_shard=-1),
    "replicate": dict(dp_replicate=-1, dp_shard=1),
    "tp": dict(dp_shard=-1, tp=2),
    "tp+sp": dict(dp_shard=-1, tp=2, sequence_parallel=True),
    "fsdp x tp": dict(dp_shard=2, tp=2),
    "hsdp": dict(dp_replicate=2, dp_shard=2),
    "pp": dict(dp_shard=-1, pp=2),  # at 4 ranks: pp=2 x dp_shard=2 (FSDP inside each stage)
    "pp x tp": dict(dp_shard=1, pp=2, tp=2),
    # zero-bubble, V-shaped: 2 stages per rank (rank 0 the first and the last), weight gradients deferred
    "pp zbv": dict(dp_shard=-1, pp=2, pp_schedule="zbv"),
    # a mixture of experts (--model qwen3_moe_tiny): experts over 2 ranks (at 4: FSDP over the other 2), and x tp
    "ep": dict(dp_shard=-1, ep=2),
    "ep x tp": dict(dp_shard=-1, ep=2, tp=2),
}
OPTIONS = ("sequence_parallel", "pp_schedule")  # layout keys that are not mesh sizes
BYTES = {"float": 4, "double": 8, "c10::BFloat16": 2, "c10::Half": 2, "long int": 8, "int": 4, "bool": 1}


def model_config(name: str):
    """A conf/model preset's family spec and config (`vocab_size: null`: 256)."""
    from omegaconf import OmegaConf

    from parallama.models import model_spec

    fields = {**preset(name, 256), "family": OmegaConf.load(ROOT / "conf" / "model" / f"{name}.yaml").family}
    spec = model_spec(fields)
    return spec, spec.build_config(fields)


def mesh_sizes(layout: dict) -> dict:
    return {k: v for k, v in layout.items() if k not in OPTIONS}


def pipeline_options(layout: dict, dims: ParallelDims, args):
    """As strategy=model_parallel: the layout's schedule (else --pp-schedule), one stage per pp rank for the
    single-stage schedules and two for the others, by default one microbatch per stage; None without pp."""
    from parallama.distributed.options import PipelineOptions, stages_per_rank

    if dims.pp == 1:
        return None
    schedule = layout.get("pp_schedule", args.pp_schedule)
    per_rank = stages_per_rank(schedule, None)
    return PipelineOptions(schedule, args.pp_microbatches or dims.pp * per_rank, per_rank)


def _input_bytes(event) -> int:
    return sum(
        BYTES.get(dtype, 4) * torch.Size(shape).numel()
        for shape, dtype in zip(event.input_shapes, event.input_dtypes)
        if shape
    )


def collective_bytes(prof) -> dict[str, int]:
    """Per collective kind, the bytes a rank hands to the communication backend in a profile (see the module
    docstring): the input of every `gloo:*` / `nccl:*` call but a recv's (its sender's send counts them); the
    tokens' all-to-alls of expert parallelism apart (`expert_bytes`), leaving `all_to_all` the counts'."""
    total: dict[str, int] = {}
    for event in prof.events():
        backend, _, kind = event.name.partition(":")
        if backend not in ("gloo", "nccl") or kind == "recv" or not event.input_shapes:
            continue
        total[kind] = total.get(kind, 0) + _input_bytes(event)
    if tokens := expert_bytes(prof):
        total["all_to_all"] -= sum(tokens.values())
        total.update(tokens)
    return total


def expert_bytes(prof) -> dict[str, int]:
    """The bytes of the tokens' all-to-alls (models/moe_parallel.py's `_AllToAll`, whose forward and backward the
    profiler records by name), by part: in each sparse block's forward the dispatch runs before the combine;
    backward runs them in reverse, the combine's first. Each part: forward and its backward. {} without ep."""
    out = {}
    for name, parts in (
        ("_AllToAll", ("dispatch", "combine")),
        ("_AllToAllBackward", ("combine", "dispatch")),
    ):
        events = sorted((e for e in prof.events() if e.name == name), key=lambda e: e.time_range.start)
        for i, event in enumerate(events):
            key = f"all_to_all {parts[i % 2]}"
            out[key] = out.get(key, 0) + _input_bytes(event)
    return out


def _rank(rank: int, world: int, port: int, schedule: list[tuple[int, str]], args, queue) -> None:
    """One rank of the whole run: every (round, layout) of `schedule` in order, in one process group, so that the
    ranks start (and import torch) once, not once per layout and round."""
    import torch.distributed as dist

    cuda = args.device == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    backend = "nccl" if cuda else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for r, name in schedule:
        result = _measure_here(rank, world, LAYOUTS[name], args, device)
        queue.put({"round": r, "layout": name, "rank": rank, **result})
        if cuda:
            torch.cuda.empty_cache()
    dist.destroy_process_group()


def _measure_here(rank: int, world: int, layout: dict, args, device: torch.device) -> dict:
    """This rank's median step time and the bytes it handed to the backend in one profiled step, for one layout
    (its own mesh, model and optimizer, built from the same seed as every other layout's)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel
    from torch.profiler import ProfilerActivity, profile

    from parallama.distributed.options import FSDPOptions, ParallelizeOptions
    from parallama.distributed.pipeline import Pipeline
    from parallama.parallel.strategies.model_parallel import clip_grad_norm_
    from parallama.training.loss import CrossEntropy

    cuda = device.type == "cuda"
    dims = ParallelDims.resolve(world, **mesh_sizes(layout))
    mesh = dims.build_mesh(device.type)
    tp = dims.tp > 1
    pp_options = pipeline_options(layout, dims, args)
    torch.manual_seed(0)
    spec, config = model_config(args.model)
    with device:
        model = spec.model(config)
    options = ParallelizeOptions(
        dims=dims,
        mesh=mesh,
        fsdp=FSDPOptions(mixed_precision="bf16" if cuda else None),
        sequence_parallel=layout.get("sequence_parallel", False),
        loss_parallel=tp,
        pipeline=pp_options,
    )
    model = spec.parallelize(model, options)  # with pp: this rank's stages, and the model pruned to them
    pp_group = mesh["pp"].get_group() if pp_options else None
    loss_fn = CrossEntropy()  # the recipe's default loss
    if pp_options:
        stages = dims.pp * pp_options.stages_per_rank
        pipeline = Pipeline(model.pipeline_stages, stages, pp_options, pp_group, device, loss_fn)
    else:
        pipeline = None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    per_rank = args.global_batch // dims.dp_size
    generator = torch.Generator().manual_seed(dims.dp_rank(rank))  # the pp and tp ranks of a batch: one seed
    vocab = model.config.vocab_size

    def step() -> None:
        ids = torch.randint(0, vocab, (per_rank, args.seq_len + 1), generator=generator).to(device)
        with loss_parallel() if tp else torch.enable_grad():
            if pipeline:  # the schedule runs forward and backward; its loss comes back on every stage
                batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
                loss = pipeline.loss(batch, train=True, parameters=model.parameters())
                pipeline.add_grads()
            else:
                logits = model(ids[:, :-1])
                loss = loss_fn(logits, ids[:, 1:])
                if hasattr(
                    model, "auxiliary_loss"
                ):  # a mixture of experts: its routers' losses, as the recipe
                    loss = loss + model.auxiliary_loss()[0]
                loss.backward()
        clip_grad_norm_(model.parameters(), 1.0, group=pp_group)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        loss.item()  # waits for the device

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        dist.barrier()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return {"step_s": statistics.median(times), "bytes": collective_bytes(prof)}


def measure_all(schedule: list[tuple[int, str]], args) -> dict[tuple[int, str], dict]:
    """Each (round, layout)'s rank-0 median step time and bytes per step averaged over the ranks."""
    by_run: dict[tuple[int, str], list[dict]] = {}
    for result in spawn_ranks(_rank, args.world, schedule, args):
        by_run.setdefault((result["round"], result["layout"]), []).append(result)
    out = {}
    for (r, name), ranks in by_run.items():
        ranks.sort(key=lambda x: x["rank"])
        kinds = {kind for x in ranks for kind in x["bytes"]}
        volume = {kind: sum(x["bytes"].get(kind, 0) for x in ranks) / len(ranks) for kind in sorted(kinds)}
        dims = ParallelDims.resolve(args.world, **mesh_sizes(LAYOUTS[name]))
        out[r, name] = {"step_s": ranks[0]["step_s"], "bytes": volume, "dims": dims.sizes()}
    return out


def fits(layout: dict, world: int) -> bool:
    from parallama.errors import ConfigError

    try:
        ParallelDims.resolve(world, **mesh_sizes(layout))
    except ConfigError:
        return False
    return True


def run(args) -> dict:
    quiet()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # the profiler's start/stop lines on every rank
    info = machine()
    print_machine(info)
    if args.device == "cuda" and torch.cuda.device_count() < args.world:
        print(f"nd: {args.world} ranks need {args.world} GPUs, this machine has {torch.cuda.device_count()}")
        return {}
    names = ["fsdp", *(n for n in args.layouts if n != "fsdp")]  # the ratios' base always runs
    experts = hasattr(model_config(args.model)[1], "num_experts")
    layouts, skipped = {}, []
    for n in names:
        sizes = mesh_sizes(LAYOUTS[n])
        if sizes.get("ep", 1) > 1 and not experts or sizes.get("pp", 1) > 1 and experts:
            skipped.append(n)
        elif fits(LAYOUTS[n], args.world):
            layouts[n] = LAYOUTS[n]
    if skipped:  # ep needs experts; a mixture of experts' pipeline adds its router losses per stage, not here
        kind = "a mixture of experts: no pipeline here" if experts else "no experts to shard (ep)"
        print(f"nd: skipping {', '.join(skipped)} with model={args.model} ({kind})")
    for name, layout in layouts.items():
        dims = ParallelDims.resolve(args.world, **mesh_sizes(layout))
        rows, pipeline = args.global_batch // dims.dp_size, pipeline_options(layout, dims, args)
        if pipeline and rows % pipeline.microbatches:
            raise SystemExit(
                f"nd: {name}'s {rows} rows per rank do not split into {pipeline.microbatches} microbatches"
            )
    print(
        f"# nd: model={args.model} seq_len={args.seq_len} global batch={args.global_batch}, {args.world} ranks "
        f"on {args.device}, {args.warmup} warmup + {args.steps} timed steps, {args.repeats} rounds; "
        f"layouts: {', '.join(layouts)}"
        + (f"; pp schedule {args.pp_schedule}" if any("pp" in layout for layout in layouts.values()) else "")
    )
    schedule = [(r, name) for r in range(args.repeats) for name in layouts]
    measured = measure_all(schedule, args)
    rounds: dict[str, list[dict]] = {
        name: [measured[r, name] for r in range(args.repeats)] for name in layouts
    }
    for r in range(args.repeats):
        print(f"round {r + 1}: " + "  ".join(f"{n} {v[r]['step_s'] * 1e3:.0f} ms" for n, v in rounds.items()))
    base = "fsdp"
    results: dict = {"config": vars(args), "layouts": {}}
    print(
        f"\n{'layout':<12} {'step ms':>8} {'/ fsdp':>7} {'MB per step':>12} {'/ fsdp':>7}  collectives (MB)"
    )
    for name, runs in rounds.items():
        step_ratio = median([a["step_s"] / b["step_s"] for a, b in zip(runs, rounds[base])])
        volume = {kind: n / 1e6 for kind, n in runs[-1]["bytes"].items()}
        total = sum(volume.values())
        base_total = sum(rounds[base][-1]["bytes"].values()) / 1e6
        results["layouts"][name] = {
            "dims": runs[-1]["dims"],
            "sequence_parallel": LAYOUTS[name].get("sequence_parallel", False),
            "step_s": [x["step_s"] for x in runs],
            "step_ratio_to_fsdp": step_ratio,
            "collective_mb_per_step": volume,
            "bytes_ratio_to_fsdp": total / base_total if base_total else None,
        }
        kinds = ", ".join(f"{k} {v:.2f}" for k, v in sorted(volume.items()))
        print(
            f"{name:<12} {median([x['step_s'] for x in runs]) * 1e3:>8.0f} {step_ratio:>6.2f}x "
            f"{total:>12.2f} {total / base_total if base_total else float('nan'):>6.2f}x  {kinds}"
        )
    save(args.out, "nd", info, results)
    return results


def add_arguments(p) -> None:
    p.add_argument(
        "--model",
        default="tiny",
        help="a conf/model preset (heads must divide by 2 for tp; qwen3_moe_tiny: the ep layouts)",
    )
    p.add_argument("--world", type=int, default=2, help="ranks (4 adds fsdp x tp, hsdp and pp x tp)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--layouts",
        nargs="+",
        default=list(LAYOUTS),
        choices=list(LAYOUTS),
        help="fsdp (the base) always runs",
    )
    p.add_argument(
        "--global-batch", type=int, default=8, help="samples per optimizer step, all ranks together"
    )
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run")
    p.add_argument("--steps", type=int, default=10, help="timed steps per run (median step time)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds")
    p.add_argument("--pp-schedule", default="1f1b", choices=SINGLE_STAGE, help="the pp layouts' schedule")
    p.add_argument(
        "--pp-microbatches", type=int, default=None, help="per step and pp rank (default: one per stage)"
    )

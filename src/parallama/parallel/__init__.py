"""Parallelism in one place (as torchtitan keeps it): one class per strategy of the Hydra `strategy` group.

    dims.py        ParallelDims: the mesh's sizes (pp, dp_replicate, dp_shard, cp, tp), the data-parallel rank
    options.py     ParallelizeOptions: what a strategy asks of the model family's parallelize plan
    base.py        Parallelism: what a strategy declares (layout, model building, loss, optimizer, checkpoints)
    plan.py        the memory model of parallama-plan (MemoryProfile per strategy, estimates, the guide)
    layouts.py     the planner's search over N-D layouts (pp x dp_replicate x dp_shard x cp x tp)
    layout_checks.py  what each dimension of a layout needs of the model, data and schedule (before any work)
    pipeline.py    pipeline stages and schedules (gpipe, 1f1b, interleaved_1f1b, looped_bfs)
    context.py     context parallelism: the load-balanced sequence shards, ring attention, the loss over cp
    strategies/    ddp.py (auto, ddp, ddp_spawn, ddp_sharded), deepspeed.py (ZeRO 1/2/3, offload; CPU-capable),
                   fsdp.py (FSDP2)

How a model is sharded is the model's own plan (models/<family>/parallelize.py); how any checkpoint resumes under
any strategy is checkpoint/universal.py. A strategy is found through its config: every conf/strategy/<name>.yaml
whose `_target_` is a Parallelism class is one (`declared_strategies`). Adding a strategy = one class + one
config file.
"""

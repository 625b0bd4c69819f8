"""The strategies: one Lightning strategy class per entry of the Hydra `strategy` group, and the planner. The
toolkit they and the model families call (dims, options, blocks, float8, stages, pipeline, context) is
distributed/.

    base.py        Parallelism: what a strategy declares (layout, model building, loss, optimizer, checkpoints)
    plan.py        the planner of parallama-plan (MemoryProfile per strategy, estimates, the guide)
    memory.py      its memory model: the bytes of states, activations and the loss, term by term
    layouts.py     the planner's search over N-D layouts (pp x dp_replicate x dp_shard x cp x tp)
    layout_checks.py  what each dimension of a layout needs of the model, data and schedule (before any work)
    strategies/    ddp.py (auto, ddp, ddp_spawn, ddp_sharded), deepspeed.py (ZeRO 1/2/3, offload; CPU-capable),
                   fsdp.py (FSDP2)

How a model is sharded is the model's own plan (models/<family>/parallelize.py); how any checkpoint resumes under
any strategy is checkpoint/universal.py. A strategy is found through its config: every conf/strategy/<name>.yaml
whose `_target_` is a Parallelism class is one (`declared_strategies`). Adding a strategy = one class + one
config file.
"""

"""The parallel toolkit a model family's plan calls (as torchtitan's `distributed/`), below the models and free of
Lightning: the mesh's sizes (`dims`), what a plan applies (`options`), activation checkpointing, compile and FSDP2
per block (`blocks`), float8 (`float8`), the pipeline split (`stages`) and schedules (`pipeline`), context
parallelism (`context`). The Lightning strategies that use it, and the planner, are parallel/."""

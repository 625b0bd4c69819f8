"""Parallelism in one place (as torchtitan keeps it): one class per strategy of the Hydra `strategy` group.

    base.py        Parallelism: what a strategy declares (mesh, model building, optimizer, checkpoints,
                   memory profile for parallama-plan)
    strategies/    ddp.py (auto, ddp, ddp_spawn, ddp_sharded), deepspeed.py (ZeRO 1/2/3, offload; CPU-capable),
                   fsdp.py (FSDP2)

How a model is sharded is the model's own plan (models/<family>/parallelize.py); how any checkpoint resumes under
any strategy is checkpoint/universal.py. A strategy is found through its config: every conf/strategy/<name>.yaml
whose `_target_` is a Parallelism class is one (`declared_strategies`). Adding a strategy = one class + one
config file.
"""

from __future__ import annotations

from pathlib import Path

from parallama.errors import ConfigError
from parallama.parallel.base import MemoryProfile, Parallelism, data_parallel

GUIDE = ("ddp", "sharded", "fully sharded", "offload")  # docs/strategies.md's order of what to try

__all__ = ["GUIDE", "MemoryProfile", "Parallelism", "data_parallel", "declared_strategies", "memory_profiles"]


def declared_strategies(conf_dirs: list[Path]) -> dict[str, type[Parallelism]]:
    """conf/strategy/<name>.yaml -> its class, for every config whose `_target_` is a Parallelism class
    (the first directory that has a name wins, as in Hydra's search path)."""
    import hydra.utils
    from omegaconf import OmegaConf

    found: dict[str, type[Parallelism]] = {}
    for conf_dir in conf_dirs:
        for path in sorted(Path(conf_dir, "strategy").glob("*.yaml")):
            target = OmegaConf.load(path).get("_target_")
            if path.stem in found or not target:
                continue
            try:
                obj = hydra.utils.get_object(target)
            except Exception as err:
                raise ConfigError(f"{path}: _target_={target} cannot be imported ({err})") from None
            if isinstance(obj, type) and issubclass(obj, Parallelism):
                found[path.stem] = obj
    return found


def memory_profiles(conf_dirs: list[Path]) -> dict[str, MemoryProfile]:
    """Every declared strategy's profiles, in the guide's order."""
    profiles = [p for cls in declared_strategies(conf_dirs).values() for p in cls.memory_profiles]
    for p in profiles:
        if p.guide not in GUIDE:
            raise ConfigError(f"memory profile {p.name}: guide={p.guide!r} is not one of {', '.join(GUIDE)}")
    profiles.sort(key=lambda p: (GUIDE.index(p.guide), p.order))
    return {p.name: p for p in profiles}

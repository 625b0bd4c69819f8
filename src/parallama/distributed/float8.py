"""float8 training through torchao (`float8: tensorwise | rowwise`, conf/train.yaml): the blocks' linears become
torchao `Float8Linear`s (the output head and the embedding stay as they are, as torchtitan keeps them), applied
by the family's plan first, before tensor parallel, checkpointing, compile and FSDP (torchtitan's order).

- Which linears: `float8_filter: auto` (the default) converts those that torchao's filter for the recipe says
  gain (`_auto_filter_for_recipe`, thresholds measured on H100s: tensorwise keeps a linear of K <= 4096 inputs
  and N <= 1024 outputs in the high precision, rowwise any of N <= 2048 or K <= 1024), as torchtitan's
  `auto_filter_small_kn` does: the cast of a small matmul costs more than float8 saves (Llama-3.2-1B's k/v
  projections, 2048 -> 512). `all` converts every block linear (the CPU parity tests, whose models are tiny).
  A model too small to gain is said in one line (`float8_note`) rather than quietly slowed.

- On a GPU of compute capability >= 8.9 (Ada, Hopper and later) the matmuls run in float8 (`torch._scaled_mm`);
  on CPU torchao emulates them (`Float8LinearConfig(emulate=True)`: the same float8 rounding, computed in the
  high precision). An older GPU is refused in one line before work.
- Every converted linear's in and out features must be multiples of 16 (float8 matmuls' alignment): one that is
  not is refused in one line naming it (`check_dimensions`, run on the meta device when the config is checked).
- With FSDP2 and the tensorwise recipe the weights are all-gathered in float8
  (`enable_fsdp_float8_all_gather`), and their scales are precomputed for the next step after each optimizer
  step (`precompute_scales`, the `Float8Scales` callback of training/callbacks.py).
- Under tensor parallel the block's plan uses torchao's `Float8ColwiseParallel` / `Float8RowwiseParallel`
  (`float8_tp_style`).
- `Float8Linear` keeps `weight` a plain parameter of the same name: checkpoints and parallama-export's HF folders
  hold plain weights (export builds the plain model).

No Lightning here; torchao is imported only when float8 is on.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from parallama.distributed.options import FLOAT8_FILTERS as FILTERS
from parallama.distributed.options import FLOAT8_RECIPES as RECIPES
from parallama.errors import ConfigError

ALIGN = 16
GAINS_FROM_HIDDEN = 2048  # below it float8 lost on one H100 (the 180M: 0.58x tensorwise; docs/benchmarks.md)
log = logging.getLogger("parallama")


def _float8_linears(model: nn.Module):
    """(name, linear) of every nn.Linear inside the blocks (`model.layers`), named as in the model."""
    for key, block in model.layers.items():
        for name, module in block.named_modules():
            if isinstance(module, nn.Linear):
                yield f"layers.{key}.{name}", module


def converted_linears(model: nn.Module, recipe: str, filter: str = "auto") -> list[tuple[str, nn.Linear]]:
    """(name, linear) of the block linears `apply_float8` converts: all, or those torchao's filter for the
    recipe keeps (`auto`)."""
    if filter not in FILTERS:
        raise ValueError(f"float8_filter={filter!r}")
    linears = list(_float8_linears(model))
    if filter == "all":
        return linears
    # start-up time (torchao); in torchao.float8's __all__, as torchtitan uses it
    from torchao.float8 import _auto_filter_for_recipe

    gains = _auto_filter_for_recipe(recipe, filter_fqns=[])
    return [(name, linear) for name, linear in linears if gains(linear, name)]


def converted_share(model: nn.Module, recipe: str, filter: str) -> float:
    """The share of the blocks' matmul parameters that float8 converts (parallama-plan: the weights FSDP2 gathers
    in float8), from the model (on the meta device: its shapes): a filter's choice, and a mixture's experts (not
    `nn.Linear`s), are what it keeps in the high precision."""
    converted = sum(linear.weight.numel() for _, linear in converted_linears(model, recipe, filter))
    return converted / (model.config.num_hidden_layers * model.config.block_params()[0])


def float8_note(model: nn.Module, recipe: str, filter: str, hidden_size: int) -> str | None:
    """One line where float8 cannot speed this model up: too small a width, or no linear the filter keeps."""
    converted, total = len(converted_linears(model, recipe, filter)), len(list(_float8_linears(model)))
    if filter == "all" and hidden_size >= GAINS_FROM_HIDDEN:
        return None
    if filter == "auto" and converted == 0:
        return (
            f"float8={recipe}: torchao's filter keeps none of the {total} block linears (all too small to gain), so "
            "float8 changes nothing here; use float8=null, or float8_filter=all to convert them anyway"
        )
    if hidden_size < GAINS_FROM_HIDDEN:
        return (
            f"float8={recipe}: model.hidden_size={hidden_size} < {GAINS_FROM_HIDDEN} is too small for float8 to gain "
            f"(the 180M ran 0.58x bf16's tokens/s on an H100); {converted} of {total} block linears converted "
            f"(float8_filter={filter}); float8=null is likely faster"
        )
    return None


def check_dimensions(model: nn.Module, recipe: str, filter: str = "all") -> None:
    """One line naming the first converted block linear whose shape is not a multiple of 16 on both sides
    (torchao's filter already skips those)."""
    for name, linear in converted_linears(model, recipe, filter):
        if linear.in_features % ALIGN or linear.out_features % ALIGN:
            raise ConfigError(
                f"float8={recipe}: {name} is {linear.in_features} -> {linear.out_features}, float8 matmuls need "
                f"both multiples of {ALIGN}; change the model's sizes (hidden_size, intermediate_size, heads x "
                "head_dim) or use float8=null"
            )


def apply_float8(
    model: nn.Module, recipe: str, *, emulate: bool, fsdp_all_gather: bool = False, filter: str = "auto"
) -> None:
    """Convert the blocks' linears (`converted_linears`: all, or those torchao's filter keeps) to torchao's
    Float8Linear, in place (parameter names unchanged).

    `recipe`: tensorwise (one scale per tensor) or rowwise (one per row: more accurate, slower). `emulate`: on
    CPU (no float8 matmul). `fsdp_all_gather`: tensorwise only, FSDP2 gathers the weights in float8."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training  # start-up time (torchao)

    if recipe not in RECIPES:
        raise ValueError(f"float8={recipe!r}")
    check_dimensions(model, recipe, filter)
    config = dataclasses.replace(
        Float8LinearConfig.from_recipe_name(recipe),
        emulate=emulate,
        enable_fsdp_float8_all_gather=fsdp_all_gather and recipe == "tensorwise",
    )
    blocks = {id(linear) for _, linear in converted_linears(model, recipe, filter)}
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: id(m) in blocks)


def float8_tp_style(style):
    """A block plan's ColwiseParallel / RowwiseParallel as torchao's float8 one with the same layouts (the
    input cast to float8 before its all-gather or after its reduce); other styles as they are."""
    # start-up time (torchao)
    from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel, Float8RowwiseParallel

    for plain, float8 in ((ColwiseParallel, Float8ColwiseParallel), (RowwiseParallel, Float8RowwiseParallel)):
        if type(style) is plain:
            return float8(
                input_layouts=style.input_layouts[0],
                output_layouts=style.output_layouts[0],
                use_local_output=style.use_local_output,
            )
    return style


def precompute_scales(model: nn.Module) -> None:
    """After an optimizer step, under FSDP2's float8 all-gather: every float8 weight's scale for the next
    all-gather, in one all-reduce (torchao's `precompute_float8_dynamic_scale_for_fsdp`; nothing otherwise)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp  # start-up time (torchao)

    precompute_float8_dynamic_scale_for_fsdp(model)


def plain_tensors(state):
    """A state dict (model or optimizer, nested) with FSDP2's float8 all-gather weights as plain tensors: torchao
    wraps each such weight (and the optimizer state made like it, e.g. AdamW's moments) in its own tensor class,
    which checkpoints would otherwise pickle (and weights-only readers refuse). Loading a plain tensor back
    copies into the wrapped one. Values of other kinds are returned as they are."""

    if isinstance(state, dict):
        return {k: plain_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [plain_tensors(v) for v in state]
    if not isinstance(state, torch.Tensor):
        return state
    if _is_dtensor(state):
        if not _wrapped(state.to_local()):
            return state
        local = torch.mul(state.to_local(), 1)  # an op torchao does not keep wrapped: a plain copy
        return DTensor.from_local(
            local,
            state.device_mesh,
            state.placements,
            run_check=False,
            shape=state.shape,
            stride=state.stride(),
        )
    return torch.mul(state, 1) if _wrapped(state) else state


def _is_dtensor(t) -> bool:
    return isinstance(t, DTensor)


def _wrapped(t) -> bool:
    return type(t).__module__.startswith("torchao.float8")


def check_float8(
    recipe: str | None, *, on_gpu: bool, model: nn.Module | None = None, filter: str = "auto"
) -> None:
    """Before work: a GPU that can compute in float8 (SM 8.9+); of `model` (on the meta device: its shapes), block
    linears of aligned sizes and one line (`float8_note`) where it is too small to gain."""
    if recipe is None:
        return
    if on_gpu:
        if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 9):
            major, minor = torch.cuda.get_device_capability()
            raise ConfigError(
                f"float8={recipe} needs a GPU of compute capability >= 8.9 (Ada, Hopper or later); this one is "
                f"{major}.{minor}: use float8=null"
            )
    if model is not None:
        check_dimensions(model, recipe, filter)
        if note := float8_note(model, recipe, filter, model.config.hidden_size):
            log.warning(note)

"""Whether transformers computes what a parallama model computes, from a Hugging Face folder: the check after
`parallama-export` writes one (cli/export.py) and before `init_from` trains from one (app/checks.py).

Every tensor name can match while the computation differs: an attention pattern the folder's architecture does
not have (a sliding window exported as a plain `LlamaForCausalLM`) gives the same logits for the first positions
and others after. So the logits are compared, on a probe of random tokens as long as the model's context
(`max_position_embeddings`, capped at `PROBE_TOKENS` for CPU time), which crosses any window shorter than that.
transformers is an optional dependency (`pip install 'parallama[export]'`): without it the check says so in one
line and passes.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from pathlib import Path

import torch

from parallama.errors import ConfigError

PROBE_TOKENS = 1024  # the probe's length where the context is longer: a forward pass of each model on CPU
TOLERANCE = 1e-3  # of the largest logit: float32's differences of another operation order are ~1e-6 of it


def transformers_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None


def probe_ids(config, seed: int = 0) -> torch.Tensor:
    """(1, T) random token ids, T the model's context up to `PROBE_TOKENS`."""
    length = min(config.max_position_embeddings, PROBE_TOKENS)
    return torch.randint(0, config.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))


def free_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not Linux
        return None


def unverifiable(model: torch.nn.Module, what: str) -> str | None:
    """The one line saying why `check_logits` cannot run here (transformers is not installed, or its copy of the
    model would not fit in memory), else None."""
    if not transformers_installed():
        return (
            f"{what}: not verified: transformers is not installed, so the folder's logits were not compared with "
            "the model's (pip install 'parallama[export]')"
        )
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())
    free = free_memory_bytes()
    if free is not None and fp32_bytes > free:
        return (
            f"{what}: not verified: transformers' float32 copy of the model ({fp32_bytes / 2**30:.1f} GiB) does not "
            f"fit in this machine's free memory ({free / 2**30:.1f} GiB)"
        )
    return None


@torch.no_grad()
def check_logits(model: torch.nn.Module, folder: str | os.PathLike, family: str, what: str) -> str:
    """`model` (weights loaded, on CPU) against transformers' `AutoModelForCausalLM` from `folder`: a ConfigError
    naming the family and the largest difference where they differ beyond `TOLERANCE`, else the one line that
    says what was checked. Where it cannot run, that line (`unverifiable`)."""
    if reason := unverifiable(model, what):
        return reason
    import transformers  # optional dependency (transformers)

    # quiet: its load report and progress bar (the folder's tensors are checked by name already)
    verbosity, bars = transformers.logging.get_verbosity(), transformers.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        theirs = transformers.AutoModelForCausalLM.from_pretrained(Path(folder), dtype=torch.float32).eval()
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.logging.enable_progress_bar()
    ids = probe_ids(model.config)
    expected, architecture = theirs(ids).logits.float(), type(theirs).__name__
    del theirs
    ours = model.eval()(ids).float()
    difference = (ours - expected).abs().amax().item()
    tolerance = TOLERANCE * max(1.0, ours.abs().amax().item())
    tokens = ids.shape[1]
    if not difference <= tolerance:  # NaN too
        raise ConfigError(
            f"{what}: transformers' {architecture} computes other logits than model.family={family} (largest "
            f"difference {difference:.3g} over {tokens} tokens, tolerance {tolerance:.2g}): that Hugging Face "
            "architecture is not this model"
        )
    return f"{what}: transformers' logits equal the model's over {tokens} tokens (largest difference {difference:.1g})"


_init_from_checked: dict[str, str | None] = {}  # a sweep checks each job's config: the folder and model once


def check_init_from(spec, path: str | os.PathLike, fields: dict) -> str | None:
    """`init_from`: the model the run's `fields` (conf/model; null: the folder's) describe, filled by the family's
    reader from the folder (`load_hf_weights`), against transformers on the same folder (`check_logits`). None
    where they agree, else the line saying why it could not be checked."""
    key = json.dumps([str(path), spec.family, fields], sort_keys=True, default=str)
    if key not in _init_from_checked:
        folder = spec.hf.load_hf_config(path, spec.config)
        given = {k: v for k, v in fields.items() if v is not None and k != "family"}
        model = spec.model(dataclasses.replace(folder, **given))
        what = f"init_from={path}"
        if (reason := unverifiable(model, what)) is None:
            spec.hf.load_hf_weights(model, path)
            check_logits(model, path, spec.family, what)
        _init_from_checked[key] = reason
    return _init_from_checked[key]

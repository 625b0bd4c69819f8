"""`parallama-export ckpt_path=<checkpoint> out_dir=<folder>`: any strategy's checkpoint -> a Hugging Face folder
of its model family (config.json, model.safetensors, tokenizer files) for transformers, vLLM, llama.cpp, ...
A Hydra app (conf/export.yaml).

The folder is written beside `out_dir` as `<out_dir>.partial`, then transformers loads it and its logits are
compared with the exported model's (models/hf_logits.py); only a folder that computes the model is moved into
place, so a refused export leaves nothing that looks valid."""

from __future__ import annotations

import shutil
from pathlib import Path

from omegaconf import DictConfig

from parallama.checkpoint.integrity import checksum_folder
from parallama.cli import app


def export(cfg: DictConfig) -> None:
    from parallama.checkpoint.read import load_checkpoint, load_state_into  # torch-free module
    from parallama.models.hf_logits import check_logits  # torch-free module

    ckpt = load_checkpoint(cfg.ckpt_path)  # checked against its checksums first
    out = Path(cfg.out_dir).absolute()
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a killed export's
    try:
        ckpt.spec.hf.save_hf_folder(partial, ckpt.state_dict, ckpt.config, ckpt.tokenizer_json)
        model = ckpt.spec.model(ckpt.config)
        load_state_into(model, ckpt.state_dict, source=f"checkpoint {cfg.ckpt_path}")
        verified = check_logits(model, partial, ckpt.spec.family, "export")
        checksum_folder(partial)  # checksums.json: parallama-eval/-generate model_dir= check it
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    move_into(partial, out)
    note = "" if ckpt.tokenizer_json else " (no tokenizer: the checkpoint predates embedded tokenizers)"
    print(f"exported {cfg.ckpt_path} (step {ckpt.meta.get('global_step', '?')}) to {cfg.out_dir}{note}")
    print(verified)


def move_into(partial: Path, out: Path) -> None:
    """The checked folder at `out`: renamed there, or its files moved into a folder that exists (an earlier
    export's files replaced, anything else left as it is)."""
    if not out.exists():
        partial.rename(out)
        return
    for file in partial.iterdir():
        file.replace(out / file.name)
    partial.rmdir()


def main(argv: list[str] | None = None) -> None:
    app.run("export", export, argv, list_keys=True)


if __name__ == "__main__":
    main()

"""`parallama-export ckpt_path=<checkpoint> out_dir=<folder>`: any strategy's checkpoint -> a Hugging Face folder
of its model family (config.json, model.safetensors, tokenizer files) for transformers, vLLM, llama.cpp, ...
A Hydra app (conf/export.yaml)."""

from __future__ import annotations

from omegaconf import DictConfig

from parallama.cli import app


def export(cfg: DictConfig) -> None:
    from parallama.checkpoint.integrity import checksum_folder
    from parallama.checkpoint.read import load_checkpoint

    ckpt = load_checkpoint(cfg.ckpt_path)  # checked against its checksums first
    ckpt.spec.hf.save_hf_folder(cfg.out_dir, ckpt.state_dict, ckpt.config, ckpt.tokenizer_json)
    checksum_folder(cfg.out_dir)  # checksums.json: parallama-eval/-generate model_dir= check it
    note = "" if ckpt.tokenizer_json else " (no tokenizer: the checkpoint predates embedded tokenizers)"
    print(f"exported {cfg.ckpt_path} (step {ckpt.meta.get('global_step', '?')}) to {cfg.out_dir}{note}")


def main(argv: list[str] | None = None) -> None:
    app.run("export", export, argv, list_keys=True)


if __name__ == "__main__":
    main()

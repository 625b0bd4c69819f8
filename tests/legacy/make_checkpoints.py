"""Write the checkpoints that tests/integration/test_legacy_checkpoints.py resumes with today's code.

They come from the code of LEGACY_COMMIT, the last commit before the package was reshaped by concept (issue 19):
a single file (one process), an FSDP DCP folder (2 ranks), a DeepSpeed ZeRO-2 folder (2 ranks) and a single file
of a vocabulary of 300 (the head's matmul is padded to 320 today). For each, the old code also resumes its own
checkpoint for two more steps: the weights, per-step losses (and, since vocab300, validation losses) and tokens
seen of that old resume are what the new code's resume must reproduce exactly.

    .venv/bin/python tests/legacy/make_checkpoints.py [format ...]     # rewrites tests/legacy/<format>/ (all)

The old package runs from a `git archive` of LEGACY_COMMIT on PYTHONPATH, in this venv (its pins are the same).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

LEGACY_COMMIT = "4ff57f2"  # "convert.py: wrap the module docstring", the parent of "Reshape step 1"
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]

# A small run whose every step is reproducible: TINY's model and data (tests/conftest.py), fp32, no sample.
RUN = [
    "trainer.accelerator=cpu",
    "trainer.val_check_interval=2",
    "trainer.limit_val_batches=2",
    "trainer.log_every_n_steps=1",
    "trainer.precision=32-true",
    "data.batch_size=4",
    "data.seq_len=64",
    "data.source.max_documents=12",
    "model.hidden_size=64",
    "model.intermediate_size=128",
    "model.num_hidden_layers=2",
    "sample.max_new_tokens=0",
    "seed=7",
]
WRITTEN_AT, RESUMED_TO = 2, 4
FORMATS = {  # folder: the overrides (strategy, ...) of the run that writes it
    "file": ["strategy=auto", "trainer.devices=1"],
    "fsdp": ["strategy=fsdp", "trainer.devices=2"],
    "deepspeed": ["strategy=deepspeed", "strategy.stage=2", "trainer.devices=2"],
    # A vocabulary that is not a multiple of 64, from before the head's matmul was padded (Llama.logits)
    "vocab300": ["strategy=auto", "trainer.devices=1", "model.vocab_size=300"],
}


def run(module: str, *args: str, cwd: Path, pythonpath: Path | None) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "LOCAL_RANK", "WORLD_SIZE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    if pythonpath is not None:
        env["PYTHONPATH"] = str(pythonpath)
    proc = subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        sys.exit(f"{module} {' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def losses_and_tokens(metrics: Path) -> dict:
    """Per-step train/loss and val/loss and the last train/tokens_seen of a CSV log, as the test reads them."""
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    train = [r for r in rows if r.get("train/loss")]
    return {
        "train_loss": {r["step"]: float(r["train/loss"]) for r in train},
        "val_loss": {r["step"]: float(r["val/loss"]) for r in rows if r.get("val/loss")},
        "tokens_seen": float(train[-1]["train/tokens_seen"]),
    }


def main(names: list[str]) -> None:
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        archive = subprocess.run(
            ["git", "archive", LEGACY_COMMIT, "src", "conf"], cwd=REPO, capture_output=True, check=True
        ).stdout
        tarfile.open(fileobj=BytesIO(archive)).extractall(tmp / "old", filter="data")
        old_src, cache = tmp / "old" / "src", tmp / "cache"
        for name in names or FORMATS:
            strategy = FORMATS[name]
            out = HERE / name
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
            common = [*RUN, *strategy, f"paths.cache_dir={cache}"]
            write_dir, resume_dir = tmp / name / "write", tmp / name / "resume"
            run(
                "parallama.train",
                *common,
                f"trainer.max_steps={WRITTEN_AT}",
                f"hydra.run.dir={write_dir}",
                cwd=tmp,
                pythonpath=old_src,
            )
            written = write_dir / "checkpoints" / "last.ckpt"
            # The old code continues its own checkpoint: the reference the new code must equal.
            run(
                "parallama.train",
                *common,
                f"trainer.max_steps={RESUMED_TO}",
                f"ckpt_path={written}",
                f"hydra.run.dir={resume_dir}",
                cwd=tmp,
                pythonpath=old_src,
            )
            run(
                "parallama.export",
                f"ckpt_path={resume_dir / 'checkpoints' / 'last.ckpt'}",
                f"out_dir={tmp / name / 'hf'}",
                cwd=tmp,
                pythonpath=old_src,
            )
            copy = shutil.copytree if written.is_dir() else shutil.copy2
            copy(written, out / "last.ckpt")
            shutil.copy2(tmp / name / "hf" / "model.safetensors", out / "resumed.safetensors")
            reference = {
                "commit": LEGACY_COMMIT,
                "overrides": [*RUN, *strategy],
                "written_at": WRITTEN_AT,
                "resumed_to": RESUMED_TO,
                **losses_and_tokens(resume_dir / "csv" / "metrics.csv"),
            }
            (out / "reference.json").write_text(json.dumps(reference, indent=1) + "\n")
            print(f"wrote {out.relative_to(REPO)}")


if __name__ == "__main__":
    main(sys.argv[1:])

#!/usr/bin/env bash
# Downloads (here, with internet) the wheels that `bench/gpu_run.sh` installs offline on the GPU machines, into
# .whl/ (in .gitignore; carried to the machine: `carry: [".whl"]`, 64 MiB at most). The GPU image has torch
# 2.11+cu130, lightning 2.6.6, transformers 5.17, triton 3.6 and Python 3.12 (/work/.library/device/KINDS.md), but
# not parallama's Hydra, nor torchao, nor torchtitan and the pure packages torchtitan imports. Every wheel is
# fetched with --no-deps, so the list below is the whole set: one version of each.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
mkdir -p "$OUT"

PLATFORM=(--python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
          --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
WHEELS=(
  # parallama-train itself (what the image lacks)
  hydra-core==1.3.8 omegaconf==2.3.1
  torchao==0.18.0                      # float8
  # torchtitan 0.2.2 (the release cut against the GPU image's torch 2.11; 0.3 needs a newer torch) and what
  # `torchtitan.models.llama3` imports: its data loader's datasets and torchdata, its config's tyro
  torchtitan==0.2.2 torchdata==0.11.0 tyro==1.0.17 docstring_parser==0.18.0 typeguard==4.4.4
  datasets==4.7.0 dill==0.4.0 multiprocess==0.70.18
)
"$PY" -m pip download -q --no-deps --only-binary=:all: "${PLATFORM[@]}" -d "$OUT" "${WHEELS[@]}"
# antlr4 (Hydra's parser) is published as a source archive only: build its pure wheel here
if ! ls "$OUT"/antlr4_python3_runtime-4.9.3-*.whl >/dev/null 2>&1; then
  "$PY" -m pip wheel -q --no-deps -w "$OUT" antlr4-python3-runtime==4.9.3
fi
ls -l "$OUT"
du -ch "$OUT"/*.whl | tail -1

#!/usr/bin/env bash
# One call on a GPU machine (/work/.library/device/README.md), after bench/gpu_wheels.sh here:
#   run(command="bash bench/gpu_run.sh", carry=[".whl"], timeout_s=600)
# Installs .whl/ offline (no internet there), then `python -m bench train-gpu`, whose arms stop starting after
# --budget-s 480 (8 minutes: the install takes seconds, the whole call stays under 9 minutes). The JSON is written
# to bench/results/train_gpu.json after every arm (a call cut short keeps what it measured) and copied to $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "error: installing .whl/ failed (run bench/gpu_wheels.sh first and carry .whl)"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD/src:$PWD" PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
python3 -c "import torch, lightning, hydra, torchao; print('torch', torch.__version__, torch.cuda.get_device_name())"
python3 -m bench train-gpu --budget-s 480 --cache-dir /tmp/cache --out bench/results/train_gpu.json
status=$?
if [ -n "${OUT:-}" ] && [ -f bench/results/train_gpu.json ]; then cp bench/results/train_gpu.json "$OUT"/; fi
echo "gpu_run.sh: $(( $(date +%s) - start )) s, exit $status"
exit $status

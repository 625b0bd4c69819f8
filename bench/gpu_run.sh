#!/usr/bin/env bash
# The GPU checks and benchmarks, in two calls of one lease (/work/.library/device/README.md), after
# bench/gpu_wheels.sh here:
#   run(command="bash bench/gpu_run.sh 1", carry=[".whl"], timeout_s=560)
#   run(command="bash bench/gpu_run.sh 2", carry=[".whl"], timeout_s=<what is left>)   # at once: still warm
# Each call installs .whl/ offline (no internet there; seconds), then runs its part; every benchmark writes its
# JSON under bench/results/ as it goes (a call cut short keeps what it measured) and the script copies them to
# $OUT. TORCHINDUCTOR_CACHE_DIR keeps the compiled kernels for the arms' later rounds and for call 2.
#   1: train-gpu's goal arms: Llama-3.2-1B (the user's command, the fused loss, float8, both, torchtitan 0.2.2's
#      best), the 8B-shaped model (bf16, float8) and the 180M; 2 interleaved rounds where the budget allows.
#   2: the loss and the optimizer step alone (bench loss, bench optim-step), then train-gpu's Muon against
#      AdamW at 16 micro-batches a step, the old default (compile=false), the 180M's padding off, torchtitan
#      without float8 and the 1B at batch 8, as far as the budget goes.
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
call=${1:-1}
budget=${2:-470}  # seconds of arms; the call's timeout leaves a minute beyond it
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || { echo "error: installing .whl/ failed (run bench/gpu_wheels.sh first and carry .whl)"; exit 1; }
export PYTHONPATH="/tmp/site:$PWD/src:$PWD" PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor
python3 -c "import torch, lightning, hydra, torchao; print('torch', torch.__version__, torch.cuda.get_device_name())"
mkdir -p bench/results
status=0
case "$call" in
  1)
    python3 -m bench train-gpu --models llama3_2_1b llama3_8b_4l llama_180m --budget-s "$budget" \
      --cache-dir /tmp/cache --arms llama3_2_1b:default 'llama3_2_1b:titan best' llama3_2_1b:loss.impl=fused \
      llama3_2_1b:float8=tensorwise llama3_2_1b:best llama3_8b_4l:default llama3_8b_4l:float8=tensorwise \
      llama_180m:default --out bench/results/train_gpu.json || status=$?
    ;;
  2)
    timeout 70 python3 -m bench loss --device cuda --out bench/results/loss_gpu.json || status=$?
    timeout 50 python3 -m bench optim-step --out bench/results/optim_step_gpu.json || status=$?
    left=$(( budget - ($(date +%s) - start) ))
    python3 -m bench train-gpu --models llama3_2_1b llama_180m --budget-s "$left" --cache-dir /tmp/cache \
      --arms 'llama3_2_1b:optimizer=muon accumulate=16' llama3_2_1b:accumulate=16 llama3_2_1b:compile=false \
      llama_180m:pad_vocab_multiple=1 'llama3_2_1b:titan compile' llama3_2_1b:data.batch_size=8 \
      --out bench/results/train_gpu_2.json || status=$?
    ;;
  *) echo "usage: bash bench/gpu_run.sh 1|2 [budget seconds]"; exit 2 ;;
esac
if [ -n "${OUT:-}" ]; then cp bench/results/*gpu*.json bench/results/optim_step*.json "$OUT"/ 2>/dev/null; fi
echo "gpu_run.sh $call: $(( $(date +%s) - start )) s, exit $status"
exit $status

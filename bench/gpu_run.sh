#!/usr/bin/env bash
# The GPU checks and benchmarks, in two calls of one lease (/work/.library/device/README.md), after
# bench/gpu_wheels.sh here:
#   run(command="bash bench/gpu_run.sh 1", carry=[".whl"], timeout_s=560)
#   run(command="bash bench/gpu_run.sh 2", carry=[".whl"], timeout_s=<what is left>)   # at once: still warm
# Each call installs .whl/ offline (no internet there; seconds), then runs its part; every benchmark writes its
# JSON under bench/results/ as it goes (a call cut short keeps what it measured) and the script copies them to
# $OUT. TORCHINDUCTOR_CACHE_DIR keeps the compiled kernels for the arms' later rounds and for call 2.
# What the 2026-11-27 leases measured is in bench/results/*_h100*.json and *_h200*.json (docs/benchmarks.md,
# "train-gpu"). Each call runs its arms in 2 interleaved rounds of 3 windows, as far as its budget goes (round 1
# whole, round 2 for what is left); the arms' runs fork from a process with the imports done
# (bench/forked.py):
#   1: issue #37's goals, every arm they are stated in, in one call: the 1B's default against torchtitan 0.2.2's
#      best, float8, the fused loss in training, AdamW and Muon at 16 micro-batches (128k tokens) a step; the
#      180M's default; the 8B shape in bf16 and float8.
#   2: a candidate lever (bench/levers.py: the residual stream in bf16) against the default, alone and with float8
#      (what the best setting would be were it adopted), side by side; then the loss alone (bench loss: the fused
#      loss's compiled elementwise step without fp32 copies, and chunks of 4096, are new since any GPU ran it).
#   3: the rest: the optimizer step alone (bench optim-step), the 1B at batch 8, Muon standard at 16
#      micro-batches, the 180M padded.
# A lease (15 minutes, a minute of it the start) holds calls 1 and 2. The H200 lease of 19:40 UTC ran Muon, the
# 1B and the 180M; the H200 lease of 13:46 and the H100 lease of 04:59 ran earlier groupings of these arms. Next,
# on either GPU: calls 1 and 2.
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
  1)  # issue #37's goals in one call: the 1B against torchtitan's best, float8, the fused loss, AdamW and Muon at
      # 128k tokens a step; the 180M; the 8B shape
    python3 -m bench train-gpu --models llama3_2_1b llama_180m llama3_8b_4l --budget-s "$budget" \
      --cache-dir /tmp/cache --arms llama3_2_1b:default 'llama3_2_1b:titan best' llama3_2_1b:float8=tensorwise \
      llama3_2_1b:loss.impl=fused llama3_2_1b:accumulate=16 'llama3_2_1b:optimizer=muon accumulate=16' \
      llama_180m:default llama3_8b_4l:default llama3_8b_4l:float8=tensorwise \
      --out bench/results/train_gpu.json || status=$?
    ;;
  2)  # the residual stream in bf16 against the default, alone and with float8; then the loss alone
    left=$(( budget - 70 ))  # the loss's minute after it
    python3 -m bench train-gpu --models llama3_2_1b --budget-s "$left" --cache-dir /tmp/cache \
      --arms default residual=bf16 float8=tensorwise 'float8=tensorwise residual=bf16' \
      --out bench/results/train_gpu_2.json || status=$?
    timeout 60 python3 -m bench loss --device cuda --out bench/results/loss_gpu.json || status=$?
    ;;
  3)  # the rest: the optimizer step alone, the 1B at batch 8, Muon standard, the 180M's head padded
    timeout 120 python3 -m bench optim-step --out bench/results/optim_step_gpu.json || status=$?
    left=$(( budget - ($(date +%s) - start) ))
    python3 -m bench train-gpu --models llama3_2_1b llama_180m --budget-s "$left" --cache-dir /tmp/cache \
      --arms llama3_2_1b:default llama3_2_1b:data.batch_size=8 'llama3_2_1b:muon standard accumulate=16' \
      llama_180m:default llama_180m:pad_vocab_multiple=64 --out bench/results/train_gpu_3.json || status=$?
    ;;
  *) echo "usage: bash bench/gpu_run.sh 1|2|3 [budget seconds]"; exit 2 ;;
esac
written=(bench/results/train_gpu.json bench/results/train_gpu_2.json bench/results/train_gpu_3.json
         bench/results/loss_gpu.json bench/results/optim_step_gpu.json)  # this call's (not the committed ones)
if [ -n "${OUT:-}" ]; then for f in "${written[@]}"; do [ -f "$f" ] && cp "$f" "$OUT"/; done; fi
echo "gpu_run.sh $call: $(( $(date +%s) - start )) s, exit $status"
exit $status

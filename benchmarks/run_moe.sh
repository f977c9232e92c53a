#!/usr/bin/env bash
# The MoE measurements of docs/scaling.md on one GPU, in one go: GPU exactness tests, the planner's
# calibration on the MoE block, then megatrain on an MoE model over several tokens per step (with
# a Chrome trace of the largest) beside a dense model of similar size in the same run.
# Usage: benchmarks/run_moe.sh MOE_MODEL DENSE_MODEL OUT_DIR [SEQ_LEN] [MICRO_BATCH] [TOKENS]
set -euo pipefail
moe=$1 dense=$2 out=$3 seq=${4:-4096} micro=${5:-4} tokens=${6:-32768,65536,131072}
mkdir -p "$out"
export PYTHONPATH=packages/store/src:packages/optim/src:packages/sched/src:packages/templates/src:packages/zoo/src:packages/megatrain/src:${PYTHONPATH:-}
export MEGATRAIN_CACHE="$out/cache"
python -m megatrain.cli plan --calibrate --set model.preset="$moe" --set data.seq_len="$seq" \
  --set train.batch_size=$((${tokens##*,} / seq)) --set train.micro_batch_size="$micro" --set train.grad_clip=0 \
  --set precision.compute_dtype=bfloat16 | tee "$out/plan-$moe.txt"
python benchmarks/throughput.py --models "$moe" --seq-len "$seq" --tokens "$tokens" --micro-batch "$micro" \
  --steps 2 --warmup 1 --lr 1e-4 --baseline none --trace-dir "$out" --out "$out/moe-$moe.json"
if [ "$dense" != none ]; then
  python benchmarks/throughput.py --models "$dense" --seq-len "$seq" --tokens "${tokens##*,}" --micro-batch "$micro" \
    --steps 2 --warmup 1 --baseline none --out "$out/dense-$dense.json"
fi

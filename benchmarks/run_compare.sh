#!/usr/bin/env bash
# megatrain, plain PyTorch and DeepSpeed ZeRO-3 offload on one model, in turn, on this machine.
# Usage: benchmarks/run_compare.sh MODEL TOKENS OUT_DIR [MICRO_BATCH] [DEEPSPEED_MICRO_BATCH]
# (DeepSpeed's best micro-batch is larger than megatrain's: it re-fetches every layer per micro-batch.)
# DeepSpeed must be importable (see benchmarks/README.md for the offline install).
set -euo pipefail
model=$1 tokens=$2 out=$3 micro=${4:-8} ds_micro=${5:-16}
mkdir -p "$out"
python benchmarks/throughput.py --models "$model" --tokens "$tokens" --steps 3 --baseline-max-b 100 \
  --micro-batch "$micro" --out "$out/throughput-$model.json"
python benchmarks/baselines/deepspeed_zero3.py --model "$model" --tokens "${tokens##*,}" --micro-batch "$ds_micro" \
  --steps 2 --out "$out/deepspeed-$model.json" || echo "deepspeed run failed (see above)"
python benchmarks/compare.py "$out/compare-$model.json" "$out/throughput-$model.json" \
  $(ls "$out/deepspeed-$model.json" 2>/dev/null)

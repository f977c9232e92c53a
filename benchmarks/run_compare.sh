#!/usr/bin/env bash
# megatrain, plain PyTorch and DeepSpeed ZeRO-3 offload on one model, in turn, on this machine, all clipping at
# GRAD_CLIP (default 1.0, as real runs do) with sequences of SEQ_LEN (default 2048).
# Usage: [SEQ_LEN=1024] [GRAD_CLIP=1.0] benchmarks/run_compare.sh MODEL TOKENS OUT_DIR [MICRO_BATCH] [DEEPSPEED_MICRO_BATCH]
# TOKENS: tokens per step, comma-separated (DeepSpeed runs one process per point).
# (DeepSpeed's best micro-batch is larger than megatrain's: it re-fetches every layer per micro-batch.)
# DeepSpeed must be importable (see benchmarks/README.md for the offline install).
set -euo pipefail
model=$1 tokens=$2 out=$3 micro=${4:-8} ds_micro=${5:-16}
seq=${SEQ_LEN:-2048} clip=${GRAD_CLIP:-1.0}
mkdir -p "$out"
python benchmarks/throughput.py --models "$model" --tokens "$tokens" --seq-len "$seq" --grad-clip "$clip" --steps 3 \
  --baseline-max-b 100 --micro-batch "$micro" --out "$out/throughput-$model.json"
deepspeed_rows=()
for point in ${tokens//,/ }; do
  row="$out/deepspeed-$model-$point.json"
  python benchmarks/baselines/deepspeed_zero3.py --model "$model" --tokens "$point" --seq-len "$seq" \
    --grad-clip "$clip" --micro-batch "$ds_micro" --steps 2 --out "$row" && deepspeed_rows+=("$row") \
    || echo "deepspeed at $point tokens failed (see above)"
done
python benchmarks/compare.py "$out/compare-$model.json" "$out/throughput-$model.json" ${deepspeed_rows[@]+"${deepspeed_rows[@]}"}

#!/usr/bin/env bash
# Issue 64's measurements (speed as users run it: clipping at 1.0) on one H200, one group per device call (each
# fits a 10-minute call with a fresh machine's rate measurements and compiling):
#   benchmarks/run_clipping.sh OUT dense-7b    # Qwen2.5-7B at 8k, 32k and 128k tokens a step, clipped and not
#   benchmarks/run_clipping.sh OUT moe         # OLMoE-1B-7B at 128k, Qwen3-30B-A3B's first 8 layers at 64k
#   benchmarks/run_clipping.sh OUT layers      # Qwen3.5-27B's first 8 layers at 64k (its rate measurement's time)
#   benchmarks/run_clipping.sh OUT generic     # Qwen2.5-7B through transformers' own layers at 32k
#   benchmarks/run_clipping.sh OUT deepspeed   # Qwen2.5-3B against DeepSpeed and plain PyTorch (run_compare.sh)
#   benchmarks/run_clipping.sh OUT host        # the host's AdamW, megatrain's kernel against torch's (host_adamw.py)
# Sequences of 4096 (1024 for deepspeed); rows to OUT/NAME.json. TRACE=DIR adds throughput.py's --trace-dir DIR.
set -uo pipefail
export PYTHONPATH=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')${PYTHONPATH:-}  # (the packages, uninstalled)
out=$1
group=$2
mkdir -p "$out"
bench() {  # NAME ARGS...: one throughput.py process, its rows to OUT/NAME.json
    local name=$1
    shift
    python benchmarks/throughput.py --seq-len 4096 --warmup 1 --baseline none "$@" ${TRACE:+--trace-dir "$TRACE"} \
        --out "$out/$name.json" || echo "run_clipping.sh: $name failed (above)" >&2
}
case $group in
dense-7b)
    for clip in 1.0 0; do
        bench "clip$clip-8k" --models qwen2.5-7b --micro-batch 2 --steps 3 --tokens 8192 --grad-clip $clip
        bench "clip$clip" --models qwen2.5-7b --micro-batch 4 --steps 3 --tokens 32768,131072 --grad-clip $clip
    done ;;
moe)  # (micro-batches as large as run fastest: each expert's GEMMs get more rows; docs/scaling.md#mixtures-of-experts)
    bench olmoe --models olmoe-1b-7b --micro-batch 8 --steps 3 --tokens 131072
    bench qwen3-moe --models qwen3-30b-a3b --layers 8 --micro-batch 16 --steps 3 --tokens 65536 ;;
layers) bench qwen35 --models qwen3.5-27b --layers 8 --micro-batch 4 --steps 2 --tokens 65536 ;;
generic) bench generic --models qwen2.5-7b --implementation transformers --micro-batch 4 --steps 3 --tokens 32768 ;;
deepspeed) SEQ_LEN=1024 exec benchmarks/run_compare.sh qwen2.5-3b 32768,131072 "$out" 16 32 ;;
host) python benchmarks/host_adamw.py --out "$out/host-adamw.json" ;;
*) echo "run_clipping.sh: unknown group $group; give dense-7b, moe, layers, generic, deepspeed or host" >&2 && exit 2 ;;
esac

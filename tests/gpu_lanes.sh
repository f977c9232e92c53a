#!/usr/bin/env bash
# Runs the GPU test groups (noxfile.GPU_GROUPS) in lanes side by side on one GPU, so that the whole suite fits one
# 10-minute device call: each argument is a lane, its groups run one after another; each group writes LOGS/GROUP.log.
#   tests/gpu_lanes.sh "engine lora" "moe quant" "dense generic" "objectives kernels" "recurrence chunk-kernels decoding"   # (the default)
# The tests check exactness, not time, so lanes sharing the GPU and the cores change no result; OMP threads are split.
# Each group's minutes on one H200: docs/benchmarks.md#exactness-on-the-gpu; `quant` needs bitsandbytes installed.
set -u
[ $# -gt 0 ] || set -- "engine lora" "moe quant" "dense generic" "objectives kernels" "recurrence chunk-kernels decoding"
logs=${LOGS:-${OUT:-.}/gpu-logs}
mkdir -p "$logs"
export PYTHONPATH=$(ls -d "$PWD"/packages/*/src | tr '\n' ':')${PYTHONPATH:-}
export OMP_NUM_THREADS=$(( $(nproc) / $# > 0 ? $(nproc) / $# : 1 )) PYTHONUNBUFFERED=1
files_of() {
    python - "$1" <<'PY'
import ast, sys
tree = ast.parse(open("noxfile.py").read())
assigned = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
print(" ".join(ast.literal_eval(assigned["GPU_GROUPS"])[sys.argv[1]]))
PY
}
run_lane() {
    for group in $1; do
        start=$SECONDS
        files=$(files_of "$group") || { echo "$group: not a group of noxfile.GPU_GROUPS"; continue; }
        python -m pytest -q -m "gpu and not two_gpus" -p no:cacheprovider $files > "$logs/$group.log" 2>&1
        echo "$group: rc=$? $((SECONDS - start)) s: $(tail -1 "$logs/$group.log")"
    done
}
for lane in "$@"; do run_lane "$lane" & done
wait

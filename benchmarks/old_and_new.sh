#!/usr/bin/env bash
# An older engine and this one, alternating, in one call: is a change free of cost? Qwen2.5-7B by default;
# MODEL_ARGS names another model and its micro-batch (and --layers), e.g. "--models olmoe-1b-7b --micro-batch 8".
# Usage (here): mkdir old_engine && git archive OLD_COMMIT packages benchmarks | tar -x -C old_engine
#        (on the GPU machine, old_engine/ carried along): [MODEL_ARGS=...] benchmarks/old_and_new.sh [TOKENS...]
# GRAD_CLIP (default 1.0) sets both runs' clipping: 0.1 makes every step of a fresh model clip (its norms are ~0.3).
# Each engine runs its own benchmarks/throughput.py with its own packages (ahead of an inherited PYTHONPATH: installed
# wheels); both read one rate cache (outside $OUT: the device tool brings back 8 files), so that they plan from the
# same measured rates. Rows: $OUT/{new,old}-TOKENS.json; progress: $OUT/progress.txt; the runs' logs: $OUT/logs.tgz.
set -u
here=$PWD out=${OUT:-/tmp/out} model_args=${MODEL_ARGS:---models qwen2.5-7b --micro-batch 4}
mkdir -p "$out/logs"
export MEGATRAIN_CACHE=${MEGATRAIN_CACHE:-$(mktemp -d)}
new_path=$(ls -d "$here"/packages/*/src | tr '\n' ':')
old_path=$(ls -d "$here"/old_engine/packages/*/src | tr '\n' ':')
run() {  # NAME PYTHONPATH DIRECTORY TOKENS STEPS
  # shellcheck disable=SC2086 # (MODEL_ARGS: words)
  (cd "$3" && PYTHONPATH=$2${PYTHONPATH:+:$PYTHONPATH} timeout 300 python benchmarks/throughput.py $model_args --seq-len 4096 \
    --tokens "$4" --steps "$5" --warmup 1 --grad-clip "${GRAD_CLIP:-1.0}" --baseline none --out "$out/$1.json") \
    > "$out/logs/$1.log" 2>&1
  echo "$1 rc=$? $(date +%T) $(grep -ho '"model_tflops": [0-9.]*' "$out/$1.json" 2>/dev/null)" >> "$out/progress.txt"
}
[ $# -gt 0 ] || set -- 32768 131072
for tokens in "$@"; do
  steps=$((tokens > 65536 ? 2 : 3))
  run "new-$tokens" "$new_path" "$here" "$tokens" "$steps"
  run "old-$tokens" "$old_path" "$here/old_engine" "$tokens" "$steps"
done
tar -C "$out" -czf "$out/logs.tgz" logs && rm -r "$out/logs"

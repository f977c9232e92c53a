"""The README's first command, `megatrain train` (the built-in default job), as a new user runs it: in an empty
directory with empty megatrain, Inductor and Triton caches, timed whole; the row holds its steps' median time (steps
11 on, from metrics.jsonl) beside the plan's prediction (placement.json) and the whole command's seconds.

    taskset -c 0,1 python benchmarks/default_job.py --out benchmarks/results/default-job-cpu.json   # two cores
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import base_row, machine, write_results  # noqa: E402

from megatrain.config import load_config, model_config_of  # noqa: E402
from megatrain_zoo import flops_per_token  # noqa: E402

FIRST_TIMED_STEP = 11  # (the first steps compile and warm caches)


def run_default_job(directory: Path) -> float:
    """Seconds of `python -m megatrain train` in `directory`, with caches of its own (a fresh machine's)."""
    caches = {name: str(directory / "cache" / name) for name in ("MEGATRAIN_CACHE", "TORCHINDUCTOR_CACHE_DIR")}
    caches["TRITON_CACHE_DIR"] = str(directory / "cache" / "triton")
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "megatrain", "train"], cwd=directory, env=os.environ | caches, check=True)
    return time.perf_counter() - start


def default_job_row(run_dir: Path, seconds: float) -> dict:
    """The row of the run in `run_dir` (runs/default) that took `seconds` whole."""
    config = load_config(run_dir / "config.json", [])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_times = [r["step_time_s"] for r in records if r.get("step", 0) >= FIRST_TIMED_STEP and "step_time_s" in r]
    step = statistics.median(step_times)
    predicted = json.loads((run_dir / "placement.json").read_text())["predicted"]["step_s"]
    batch, micro = config.train.batch_size, config.train.micro_batch_size
    model = model_config_of(config)
    row = base_row("megatrain", config.model.preset, model, config.data.seq_len, batch, micro, step)
    tflops = flops_per_token(model, config.data.seq_len) * row["tokens_per_step"] / step / 1e12
    row |= {
        "step_time_s": round(step, 4),
        "model_tflops": round(tflops, 4),  # (a tiny model's: base_row's one decimal reads 0.0)
        "predicted_step_s": predicted,
        "prediction_error": round(predicted / step - 1, 3),
        "grad_clip": config.train.grad_clip,
        "scope": f"the built-in default job, whole command {seconds:.1f} s ({len(records)} steps)",
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        seconds = run_default_job(Path(directory))
        row = default_job_row(Path(directory) / "runs" / "default", seconds)
    print(json.dumps(row, indent=1))
    benchmark = "The README's first command (`megatrain train`, the built-in default job) on a fresh machine"
    payload = {"benchmark": benchmark, "machine": machine(), "commands": [" ".join(sys.argv)], "notes": []}
    write_results(Path(args.out), payload | {"results": [row]})


if __name__ == "__main__":
    main()

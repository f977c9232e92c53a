"""One JSON comparing megatrain with its baselines, from the rows the benchmark scripts wrote:
each baseline row gets megatrain's ratio at the same model and tokens per step.

    python benchmarks/compare.py OUT.json throughput.json deepspeed-*.json
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write_results  # noqa: E402


def main():
    out, *inputs = sys.argv[1:]
    rows, machine = [], None
    for path in inputs:
        payload = json.loads(Path(path).read_text())
        machine = machine or payload.get("machine")
        rows += payload["results"]
    ours = {(r["model"], r["tokens_per_step"]): r for r in rows if r["system"] == "megatrain"}
    for row in rows:
        match = ours.get((row["model"], row.get("tokens_per_step")))
        if row["system"] != "megatrain" and match and row.get("tokens_per_s"):
            row["megatrain_speedup"] = round(match["tokens_per_s"] / row["tokens_per_s"], 2)
    write_results(Path(out), {"benchmark": "megatrain vs baselines", "machine": machine, "results": rows})
    print(
        table(
            rows,
            [
                "system",
                "model",
                "tokens_per_step",
                "micro_batch_seqs",
                "step_time_s",
                "tokens_per_s",
                "model_tflops",
                "peak_gpu_gib",
                "megatrain_speedup",
            ],
        )
    )


if __name__ == "__main__":
    main()

"""What one H200 would fine-tune with LoRA against full training, from the planner: for hosts of 125 GiB (the box
lent to us), 256 GiB, 512 GiB and 1 TiB, each candidate preset planned four ways (full training with fp32 masters and
moments; LoRA r=16 on every linear layer over a base held in bf16, in int8 or in nf4, QLoRA's), clipping at 1.0, 32k
tokens a step, and whether the host holds it.

    python benchmarks/lora_plans.py   # -> benchmarks/results/lora-plans.json and a table

Plans only (no run), on the rates `megatrain plan` defaults to (`RATES`: an H100 machine's calibration; on the H200
they predicted Qwen2.5-7B's LoRA step 13% short of the measured one, lora-qwen2.5-7b-h200.json); a LoRA step's block
time counts no weight gradient of the base (6 FLOPs a parameter with its recompute, not 8).
"""

from pathlib import Path

from common import planned_row, table, write_results

from megatrain_plan import Rates

RATES = Rates()  # `megatrain plan`'s defaults, which its source names
CANDIDATES = [
    "qwen2.5-7b", "qwen2.5-32b", "llama3.1-70b", "qwen2.5-72b", "dense-120b", "mixtral-8x22b", "llama3.1-405b",
]  # fmt: skip
MODES = {  # the mode's words -> model.adapter.base_dtype (None: full training, no adapter)
    "full training": None,
    "LoRA r=16 over a bf16 base": "bfloat16",
    "LoRA r=16 over an int8 base": "int8",
    "LoRA r=16 over an nf4 base": "nf4",
}
HOSTS_GIB = (125, 256, 512, 1024)
SEQ, TOKENS = 4096, 32768


def plan_row(preset: str, host_gib: int, mode: str) -> dict:
    """The planned step of `preset` on a host of `host_gib` GiB with one H200 in `mode` (`MODES`), and whether the
    host holds it."""
    base = MODES[mode]
    lora = [
        "model.adapter.type=lora",
        "model.adapter.r=16",
        "model.adapter.alpha=32",
        f"model.adapter.base_dtype={base}",
    ]
    overrides = [
        f"model.preset={preset}",
        f"data.seq_len={SEQ}",
        f"train.batch_size={TOKENS // SEQ}",
        "train.micro_batch_size=1",
        "precision.compute_dtype=bfloat16",
        "device=cpu",
    ] + (lora if base else [])
    return {"mode": mode} | planned_row(overrides, RATES, host_gib)


def main() -> None:
    rows = [plan_row(p, host, mode) for host in HOSTS_GIB for p in CANDIDATES for mode in MODES]
    columns = ["host_size_gib", "model", "mode", "params_b", "host_memory_gib", "host_holds_it", "step_time_s"]
    print(table(rows, columns))
    write_results(
        Path(__file__).parent / "results" / "lora-plans.json",
        {
            "benchmark": "What one H200 fine-tunes with LoRA against full training, host by host (plans)",
            "commands": ["python benchmarks/lora_plans.py"],
            "notes": [
                "Plans only: one H200 (139.8 GiB), 32k tokens a step of sequences of 4096, clipping at 1.0; LoRA r=16, "
                "alpha 32, on every linear layer, the base held once in bf16, or its layers' matrices in row-wise "
                "int8 or in NF4 with double quantization (QLoRA's); full training with fp32 masters and "
                "moments and the gradients held for clipping (16 B/param). host_holds_it: the host's budget holds the "
                "plan (refusal: the planner's words where it does not). Model TFLOPS of LoRA rows count 4 FLOPs a "
                "frozen parameter.",
            ],
            "rates": RATES.__dict__,
            "candidates": CANDIDATES,
            "results": rows,
        },
    )


if __name__ == "__main__":
    main()

"""DPO's speed on one GPU: the policy step against an SFT step of the same tokens (same trainer, same placement),
and the reference pass (forward only, the weights streamed once for several steps' pairs). Random weights and
pairs (prompts of half a row, completions the rest); results JSON and a table.

    python benchmarks/dpo.py --model qwen2.5-7b --seq-len 2048 --pairs 64 --micro-pairs 2 --out $OUT/dpo.json
"""

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import base_row, machine, table, timed, write_results  # noqa: E402
from throughput import BenchTrainer  # noqa: E402

from megatrain.config import Config, DataSection, ModelSection, PrecisionSection, TrainSection  # noqa: E402
from megatrain.reference import PASS_STEPS  # noqa: E402
from megatrain.step import StepBatch
from megatrain_templates import Sequences  # noqa: E402
from megatrain_zoo import preset  # noqa: E402


def random_pairs(n_pairs: int, seq_len: int, vocab: int):
    """Rows 2i / 2i + 1: a shared prompt of half the row, then completions of their own (trained)."""
    ids = torch.randint(0, vocab, (2 * n_pairs, seq_len))
    ids[1::2, : seq_len // 2] = ids[0::2, : seq_len // 2]
    labels = torch.full_like(ids, -100)
    labels[:, seq_len // 2 - 1 : -1] = ids[:, seq_len // 2 :]
    return ids, labels


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="qwen2.5-7b")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--pairs", type=int, default=64, help="pairs per optimizer step")
    parser.add_argument("--micro-pairs", type=int, default=2, help="pairs per micro-batch")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default="benchmarks/results/dpo.json")
    parser.add_argument("--device", default="cuda", help="cuda (a CPU run checks the script only)")
    return parser


def _trainer(args, model) -> BenchTrainer:
    train = TrainSection(
        steps=10**6, batch_size=args.pairs, micro_batch_size=args.micro_pairs, lr=1e-6, grad_clip=0.0,
        warmup_steps=0, schedule="constant", objective="dpo",
    )  # fmt: skip
    config = Config(
        model=ModelSection(preset=args.model),
        data=DataSection(seq_len=args.seq_len),
        train=train,
        precision=PrecisionSection("bfloat16" if args.device == "cuda" else "float32"),
        device=args.device,
        output_dir=tempfile.mkdtemp(),
    )
    return BenchTrainer(config, model)


def _timings(trainer: BenchTrainer, args, model) -> tuple[float, float, float]:
    """(the reference pass over PASS_STEPS steps' pairs, a DPO step, an SFT step of the same tokens), seconds."""
    ids, labels = random_pairs(args.pairs, args.seq_len, model.vocab_size)
    pass_ids, pass_labels = random_pairs(PASS_STEPS * args.pairs, args.seq_len, model.vocab_size)
    trainer.sequence_logps(
        StepBatch(pass_ids[: 2 * args.micro_pairs], pass_labels[: 2 * args.micro_pairs])
    )  # (compile)
    pass_s = timed(lambda: trainer.sequence_logps(StepBatch(pass_ids, pass_labels)), 1)
    reference = Sequences(-torch.rand(2 * args.pairs, dtype=torch.float64) * 100, (labels != -100).sum(-1).double())

    def dpo_step():
        trainer.train_step(StepBatch(ids, labels, extras=reference))
        trainer.finish_updates()

    dpo_step()  # (placed for this size, the objective's path compiled)
    dpo_s = timed(dpo_step, args.steps)
    trainer.objective = trainer.pipeline.objective = None  # the same trainer and placement as SFT

    def sft_step():
        trainer.train_step(StepBatch(ids, labels))
        trainer.finish_updates()

    sft_step()
    return pass_s, dpo_s, timed(sft_step, args.steps)


def main():
    args = _parser().parse_args()
    model = preset(args.model)
    trainer = _trainer(args, model)
    pass_s, dpo_s, sft_s = _timings(trainer, args, model)
    report = trainer.store.memory_report()
    n_seqs = 2 * args.pairs
    common = {"host_bytes_per_param": round(report.bytes_per_param, 2), "micro_batch_pairs": args.micro_pairs}

    def row(n_rows: int, seconds: float, scope: str, **more) -> dict:
        base = base_row("megatrain", args.model, model, args.seq_len, n_rows, 2 * args.micro_pairs, seconds)
        return base | common | {"scope": scope, **more}

    rows = [
        row(n_seqs, dpo_s, "DPO step (sigmoid), policy", relative_to_sft=round(sft_s / dpo_s, 3)),
        row(n_seqs, sft_s, "SFT step of the same tokens"),
        row(
            PASS_STEPS * n_seqs,
            pass_s,
            "DPO reference pass (forward only)",
            relative_to_training_tokens_per_s=round(dpo_s * PASS_STEPS / pass_s, 2),
        ),
    ]
    rows[2]["model_tflops"] = None  # (a forward pass: the 6 x parameters count of a training step does not apply)
    trainer.close()
    payload = {
        "benchmark": f"DPO on one GPU: {args.model}, pairs of 2 x {args.seq_len} tokens, {args.pairs} pairs a step",
        "machine": machine(),
        "commands": [" ".join(["python", *sys.argv])],
        "notes": [
            "relative_to_sft: SFT step time / DPO step time, same trainer, placement and tokens; "
            "relative_to_training_tokens_per_s: the reference pass's tokens/s over the DPO step's"
        ],
        "results": rows,
    }
    write_results(Path(args.out), payload)
    print(table(rows, ["scope", "tokens_per_step", "step_time_s", "tokens_per_s", "model_tflops"]))


if __name__ == "__main__":
    main()

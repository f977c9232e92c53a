"""Aux-loss-free load balancing (`train.router_bias_update_rate`), measured: a small Moonlight-shaped
model (DeepSeek-V3's architecture: latent attention, sigmoid router with a correction bias, a shared
expert) pre-trained from scratch on a text file once per rate, on the same batches. Per step:
the worst MoE layer's MaxVio (max expert load / mean load - 1, over the step's tokens), the loss and
the step time. Writes the rows as JSON and the two curves as a PNG.

    cat $(python -c "import sysconfig; print(sysconfig.get_paths()['stdlib'])")/*.py > stdlib.txt  # ~8M tokens
    python benchmarks/load_balance.py --text stdlib.txt --rates 0 0.001 0.01 --steps 300
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from megatrain import Trainer
from megatrain.config import Config, DataSection, ModelSection, PrecisionSection, TrainSection
from megatrain.step import StepBatch
from megatrain_data import TokenWindows, load_token_array
from megatrain_zoo import preset


def model(args):
    """Moonlight-16B-A3B's shape (64 experts, 6 per token, 2 shared, first layer dense) made small."""
    return preset("moonlight-16b-a3b").with_changes(
        vocab_size=args.vocab,
        d_model=args.d_model,
        n_layers=args.layers,
        n_heads=args.d_model // 128,
        n_kv_heads=args.d_model // 128,
        d_ff=4 * args.d_model,
        max_seq_len=max(args.seq_len, 256),
        moe_d_ff=args.d_model // 2,
        shared_expert_d_ff=args.d_model,
        kv_lora_rank=args.d_model // 4,
    )


def train(args, rate: float, workdir: Path) -> dict:
    train_section = TrainSection(
        steps=args.steps,
        batch_size=args.batch_size,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        warmup_steps=args.steps // 10,
        schedule="cosine",
        weight_decay=0.1,
        grad_clip=1.0,
        seed=0,
        router_bias_update_rate=rate,
        router_seq_aux_loss_coef=args.seq_aux_coef,
    )
    config = Config(
        model=ModelSection(preset="moonlight-16b-a3b"),  # (replaced by `model(args)`)
        data=DataSection(seq_len=args.seq_len, text=args.text),
        train=train_section,
        precision=PrecisionSection(args.precision),
        device=args.device,
        output_dir=str(workdir / f"rate-{rate}"),
    )
    trainer = Trainer(config, model(args))
    tokens, _ = load_token_array(config.data, trainer.model_config.vocab_size, workdir / "cache", None)
    windows = TokenWindows(tokens, args.seq_len, args.batch_size, shuffle=True, seed=0)
    rows = []
    for step in range(args.steps):
        batch = windows.batch(step)
        metrics = trainer.train_step(StepBatch(batch.input_ids, batch.labels))
        rows.append(
            {
                "step": metrics.step,
                "loss": round(metrics.loss, 5),
                "max_violation": round(metrics.router_max_violation, 4),
                "step_time_s": round(metrics.step_time_s, 4),
            }
        )
        if step % 50 == 0 or step == args.steps - 1:
            print(f"rate {rate}: step {metrics.step} loss {metrics.loss:.4f} maxvio {metrics.router_max_violation:.3f}")
    biases = [w for name, w in trainer.named_weights().items() if name.endswith("e_score_correction_bias")]
    trainer.close()
    tail = rows[-args.steps // 5 :]
    return {
        "router_bias_update_rate": rate,
        "router_seq_aux_loss_coef": args.seq_aux_coef,
        "params": trainer.model_config.n_params,
        "active_params": trainer.model_config.active_params,
        "final_loss_mean_last_fifth": round(sum(r["loss"] for r in tail) / len(tail), 4),
        "max_violation_mean_last_fifth": round(sum(r["max_violation"] for r in tail) / len(tail), 4),
        "bias_spread": round(max(float(b.max() - b.min()) for b in biases), 4),
        "rows": rows,
    }


def plot(runs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (vio, loss) = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        steps = [r["step"] for r in run["rows"]]
        label = f"rate {run['router_bias_update_rate']:g}"
        vio.plot(steps, [r["max_violation"] for r in run["rows"]], label=label, linewidth=1)
        loss.plot(steps, [r["loss"] for r in run["rows"]], label=label, linewidth=1)
    vio.set(xlabel="step", ylabel="worst layer's max load / mean load - 1", title="expert load (MaxVio)")
    vio.set_yscale("log")
    loss.set(xlabel="step", ylabel="training loss", title="loss")
    for ax in (vio, loss):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", type=float, nargs="+", default=[0.0, 0.001, 0.01])
    parser.add_argument("--seq-aux-coef", type=float, default=0.0, help="train.router_seq_aux_loss_coef of every run")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument("--d-model", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--text", help="a text file to train on (default: the shipped corpus, which 300 steps repeat)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--workdir", type=Path, default=Path("runs/load-balance"))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/load-balance.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/load-balance.png"))
    args = parser.parse_args()
    start = time.time()
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    settings = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"command": " ".join(sys.argv), "device": device, "args": settings, "runs": []}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for rate in args.rates:  # written after each run: a long one cut short keeps the others
        result["runs"].append(train(args, rate, args.workdir))
        result["wall_s"] = round(time.time() - start, 1)
        args.out.write_text(json.dumps(result, indent=1))
    runs = result["runs"]
    plot(runs, args.plot)
    for run in runs:
        print(
            f"rate {run['router_bias_update_rate']:g}: MaxVio {run['max_violation_mean_last_fifth']}, "
            f"loss {run['final_loss_mean_last_fifth']} (means of the last fifth), bias spread {run['bias_spread']}"
        )


if __name__ == "__main__":
    main()

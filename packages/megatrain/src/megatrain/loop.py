"""`megatrain train`: data in, a progress bar and metrics.jsonl while it runs, a model directory out."""

import json
import math
import os
import signal
import sys
from pathlib import Path

import torch.distributed as dist
from tqdm import tqdm

from megatrain_store import atomic_write_text
from megatrain_zoo import ModelConfig

from .checkpoint import load_checkpoint, save_checkpoint
from .config import Config, ConfigError, model_config_of, resolve_device
from .data import TokenData, TokenWindows, load_token_data
from .distributed import Ranks, init_ranks, leave_ranks
from .trainer import NonFiniteError, Trainer


def write_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def plot_loss(metrics_path: Path, out_path: Path) -> bool:
    """Loss curve PNG from metrics.jsonl, beside the experts' load balance for a MoE run; False when
    matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in records if "loss" in r and not r.get("skipped")]
    evals = [r for r in records if "val_loss" in r]
    balance = [r for r in rows if "router_max_violation" in r]
    fig, axes = plt.subplots(1, 2 if balance else 1, figsize=(12 if balance else 7, 4), squeeze=False)
    ax = axes[0][0]
    if balance:
        vio = axes[0][1]
        vio.plot([r["step"] for r in balance], [r["router_max_violation"] for r in balance])
        vio.set_xlabel("optimizer step")
        vio.set_ylabel("worst layer's max expert load / mean - 1")
        vio.set_title("expert load balance (MaxVio; 0: even)")
        vio.grid(alpha=0.3)
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="training")
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "o-", label="validation")
        ax.legend()
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title("megatrain loss")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return True


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps (then it checkpoints and stops)."""

    def __init__(self):
        self.signal = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.signal = signal.Signals(signum).name

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def tensorboard_writer(config: Config, out: Path):
    if not config.train.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ConfigError("train.tensorboard: true needs the tensorboard package: pip install tensorboard") from error
    return SummaryWriter(str(out / "tensorboard"))


def evaluate(trainer: Trainer, windows: TokenWindows, max_batches: int | None = None, leave: bool = False) -> dict:
    """Validation loss and perplexity of the trainer's current weights over every window (or the first
    `max_batches` batches of train.batch_size rows), forward only."""
    total_loss, total_targets = 0.0, 0
    n_batches = -(-windows.n_windows // trainer.config.train.batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    batches = windows.in_order(trainer.config.train.batch_size)
    bar = tqdm(total=n_batches, desc="eval", unit="batch", leave=leave, disable=not trainer.is_main, file=sys.stderr)
    for _, batch in zip(range(n_batches), batches):
        loss_sum, n_targets = trainer.evaluate(batch.input_ids, batch.labels, batch.position_ids, batch.valid)
        total_loss += loss_sum
        total_targets += n_targets
        bar.update(1)
    bar.close()
    if total_targets == 0:
        raise ConfigError("the validation data has no target tokens; check data.validation and the loss mask")
    loss = total_loss / total_targets
    return {
        "val_loss": round(loss, 6),
        "val_perplexity": round(math.exp(min(loss, 700.0)), 4),
        "val_tokens": total_targets,
    }


def load_data(config: Config, model: ModelConfig, out: Path, ranks: Ranks | None = None) -> TokenData:
    """The run's tokens. With several ranks rank 0 tokenizes and fills the cache, then the others read it."""
    model_dir = Path(config.model.hf_dir) if config.model.hf_dir else None

    def load():
        cache = out / "cache"
        return load_token_data(config.data, model.vocab_size, cache, model_dir, model.eos_token_id, config.train.seed)

    data = load() if ranks is None or ranks.is_main else None
    if ranks is not None:
        dist.barrier()
    return data if data is not None else load()


def train(config: Config, resume: Path | None = None) -> Path:
    """Run training as configured (continuing from a checkpoint with `resume`); returns the output directory."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model_config_of(config)
    ranks = init_ranks(resolve_device(config.device).type, config.engine.shard_across_hosts)
    try:
        # the data is read first: a bad record stops the run before any host memory is allocated
        data = load_data(config, model, out, ranks)
        trainer = Trainer(config, model, ranks=ranks)
    except BaseException:
        leave_ranks()  # (the Trainer leaves them on close; without one, this does)
        raise
    if resume is not None:
        manifest = load_checkpoint(trainer, resume)
        print(f"megatrain: resumed from step {manifest['step']} ({resume})", file=sys.stderr)
    main = trainer.is_main
    tokenizer = data.tokenizer
    windows = TokenWindows(
        data.train, config.data.seq_len, config.train.batch_size, config.data.shuffle, config.train.seed
    )
    validation = None
    if data.validation is not None:
        validation = TokenWindows(data.validation, config.data.seq_len, 1, shuffle=False, seed=0)
    metrics_path = out / "metrics.jsonl"
    if main:
        (out / "config.json").write_text(json.dumps(config.as_dict(), indent=2))
        atomic_write_text(out / "placement.json", json.dumps(trainer.plan.record(), indent=2))
        kept = []
        if resume is not None and metrics_path.exists():  # the steps the checkpoint already contains
            kept = [
                line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= trainer.step_index
            ]
        metrics_path.write_text("".join(line + "\n" for line in kept))
        for line in data.report:
            print(f"megatrain: {line}", file=sys.stderr)
        host_bytes = trainer.host_bytes()
        ranks = "" if trainer.ranks is None else f" x {trainer.ranks.world_size} ranks"
        if trainer.store_is_split:
            ranks += f", the state split over {trainer.ranks.n_nodes} hosts"
        print(
            f"megatrain: {trainer.model_config.arch} {trainer.model_config.n_params / 1e6:.1f}M params on "
            f"{trainer.device}{ranks} ({str(trainer.compute_dtype).removeprefix('torch.')} compute, fp32 master), host "
            f"{host_bytes / 2**30:.2f} GiB per host ({host_bytes / trainer.model_config.n_params:.1f} B/param), "
            f"{windows.n_windows} windows of {config.data.seq_len} tokens",
            file=sys.stderr,
        )
        print(f"megatrain: {trainer.plan.summary()} (placement.json)", file=sys.stderr)
        if trainer.warm_up_s:
            print(f"megatrain: kernels compiled and warmed up in {trainer.warm_up_s:.1f} s", file=sys.stderr)
        if model.router_bias and config.model.preset and resume is None:
            if not config.train.router_bias_update_rate:  # (fine-tuning keeps the published bias, as transformers)
                print(
                    "megatrain: warning: pre-training a MoE with its routers' correction bias fixed: they "
                    "collapse onto a few experts (watch maxvio); DeepSeek-V3 balanced them with "
                    "train.router_bias_update_rate: 0.001",
                    file=sys.stderr,
                )
    bar = tqdm(
        disable=not main,
        total=config.train.steps,
        initial=trainer.step_index,
        desc="train",
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
    )
    checkpoints = out / "checkpoints"
    writer = tensorboard_writer(config, out) if main else None
    stop = StopRequested()
    last_eval: dict = {}

    def run_eval():
        last_eval.update(evaluate(trainer, validation))
        if main:
            write_jsonl(metrics_path, {"step": trainer.step_index, **last_eval})
        if writer is not None:
            writer.add_scalar("val/loss", last_eval["val_loss"], trainer.step_index)

    try:
        stop.__enter__()
        for step in range(trainer.step_index, config.train.steps):
            batch = windows.batch(step)
            metrics = trainer.train_step(batch.input_ids, batch.labels, batch.position_ids, batch.valid)
            if main:
                write_jsonl(metrics_path, metrics.as_dict())
            if writer is not None:
                for key, value in metrics.as_dict().items():  # (the MoE router losses and balance where on)
                    if key not in ("step", "skipped", "tokens"):
                        writer.add_scalar(f"train/{key}", value, metrics.step)
            postfix = {
                "loss": f"{metrics.loss:.4f}",
                "tok_s": f"{metrics.tokens_per_s:,.0f}",
                "tflops": f"{metrics.tflops:.3g}",
            }
            if metrics.router_aux_loss is not None:  # expert balance: n_experts * sum f_e P_e, top_k when even
                postfix["aux"] = f"{metrics.router_aux_loss:.3f}"
            if metrics.router_max_violation is not None:  # the worst layer's max expert load / mean - 1
                postfix["maxvio"] = f"{metrics.router_max_violation:.2f}"
            every = config.train.eval_every
            if validation is not None and (
                (every and trainer.step_index % every == 0) or trainer.step_index == config.train.steps
            ):
                run_eval()
            if last_eval:
                postfix["val"] = f"{last_eval['val_loss']:.4f}"
            bar.set_postfix(**postfix)
            bar.update(1)
            if metrics.skipped and main:
                tqdm.write(
                    f"step {metrics.step}: non-finite loss or gradient (loss={metrics.loss}, "
                    f"grad_norm={metrics.grad_norm}); step skipped, weights unchanged",
                    file=sys.stderr,
                )
            if metrics.skipped and trainer.bad_steps >= config.train.max_bad_steps:  # the same on every rank
                save_checkpoint(trainer, checkpoints, config.train.keep_last)
                raise NonFiniteError(
                    f"{trainer.bad_steps} non-finite steps in a row; stopping. The weights are those of the last "
                    "good step, saved in checkpoints/. Lower train.lr, raise train.warmup_steps or turn on "
                    "train.grad_clip."
                )
            if config.train.save_every and trainer.step_index % config.train.save_every == 0:
                save_checkpoint(trainer, checkpoints, config.train.keep_last)
            stopping = stop.signal is not None
            if trainer.sync is not None:  # a signal seen by one rank stops all of them at the same step
                stopping = trainer.sync.any(stopping)
            if stopping:
                path = save_checkpoint(trainer, checkpoints, config.train.keep_last)
                bar.close()
                if main:
                    print(
                        f"megatrain: {stop.signal or 'a stop'} received; checkpoint {path} written. Continue with "
                        f"`megatrain train --config ... --resume {out}`",
                        file=sys.stderr,
                    )
                return out
        bar.close()
        if config.engine.trace:
            suffix = "" if trainer.ranks is None else f"-rank{trainer.ranks.rank}"
            trainer.timeline.write_chrome_trace(out / f"trace{suffix}.json")
        final = trainer.export(out / "final", tokenizer)  # every rank: hosts holding parts of the state send them
        if main:
            if plot_loss(metrics_path, out / "loss.png"):
                print(f"loss curve: {out / 'loss.png'}", file=sys.stderr)
            print(f"model written to {final}", file=sys.stderr)
    finally:
        stop.__exit__()
        if writer is not None:
            writer.close()
        bar.close()
        trainer.close()
    return out

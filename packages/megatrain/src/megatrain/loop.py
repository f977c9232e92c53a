"""`megatrain train`: data in, a progress bar and metrics.jsonl while it runs, a model directory out."""

import json
import os
import signal
import sys
from pathlib import Path

from tqdm import tqdm

from .checkpoint import load_checkpoint, save_checkpoint
from .config import Config, ConfigError
from .data import TokenWindows, load_token_data
from .trainer import NonFiniteError, Trainer


def write_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as handle:
        handle.write(json.dumps(record) + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def plot_loss(metrics_path: Path, out_path: Path) -> bool:
    """Loss curve PNG from metrics.jsonl; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    rows = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if not r.get("skipped")]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss (nats/token)")
    ax.set_title("megatrain training loss")
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


def train(config: Config, resume: Path | None = None) -> Path:
    """Run training as configured (continuing from a checkpoint with `resume`); returns the output directory."""
    out = Path(config.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    trainer = Trainer(config)
    if resume is not None:
        manifest = load_checkpoint(trainer, resume)
        print(f"megatrain: resumed from step {manifest['step']} ({resume})", file=sys.stderr)
    model_dir = Path(config.model.hf_dir) if config.model.hf_dir else None

    def load_data():
        return load_token_data(
            config.data, trainer.model_config.vocab_size, out / "cache", model_dir, trainer.model_config.eos_token_id
        )

    main = trainer.is_main
    if main:
        data = load_data()
    if trainer.sync is not None:
        trainer.sync.barrier()  # rank 0 has tokenized and filled the cache; the others read it
    if not main:
        data = load_data()
    tokenizer = data.tokenizer
    windows = TokenWindows(
        data.tokens,
        config.data.seq_len,
        config.train.batch_size,
        config.data.shuffle,
        config.train.seed,
        data.loss_mask,
    )
    metrics_path = out / "metrics.jsonl"
    if main:
        (out / "config.json").write_text(json.dumps(config.as_dict(), indent=2))
        kept = []
        if resume is not None and metrics_path.exists():  # the steps the checkpoint already contains
            kept = [
                line for line in metrics_path.read_text().splitlines() if json.loads(line)["step"] <= trainer.step_index
            ]
        metrics_path.write_text("".join(line + "\n" for line in kept))
        host_bytes = trainer.host_bytes()
        ranks = "" if trainer.ranks is None else f" x {trainer.ranks.world_size} ranks"
        print(
            f"megatrain: {trainer.model_config.arch} {trainer.model_config.n_params / 1e6:.1f}M params on "
            f"{trainer.device}{ranks} ({str(trainer.compute_dtype).removeprefix('torch.')} compute, fp32 master), host "
            f"{host_bytes / 2**30:.2f} GiB per host ({host_bytes / trainer.model_config.n_params:.1f} B/param), "
            f"{windows.n_windows} windows of {config.data.seq_len} tokens",
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
    try:
        stop.__enter__()
        for step in range(trainer.step_index, config.train.steps):
            input_ids, labels = windows.batch(step)
            metrics = trainer.train_step(input_ids, labels)
            if main:
                write_jsonl(metrics_path, metrics.as_dict())
            if writer is not None:
                for key in ("loss", "lr", "grad_norm", "tokens_per_s", "tflops"):
                    writer.add_scalar(f"train/{key}", getattr(metrics, key), metrics.step)
            postfix = {"loss": f"{metrics.loss:.4f}", "tok_s": f"{metrics.tokens_per_s:,.0f}", "tflops": f"{metrics.tflops:.3g}"}
            if metrics.router_aux_loss is not None:  # expert balance: n_experts * sum f_e P_e, top_k when even
                postfix["aux"] = f"{metrics.router_aux_loss:.3f}"
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
        if main:
            final = trainer.export(out / "final", tokenizer)
            if plot_loss(metrics_path, out / "loss.png"):
                print(f"loss curve: {out / 'loss.png'}", file=sys.stderr)
            print(f"model written to {final}", file=sys.stderr)
        else:
            trainer.finish_updates()
    finally:
        stop.__exit__()
        if writer is not None:
            writer.close()
        bar.close()
        trainer.close()
    return out

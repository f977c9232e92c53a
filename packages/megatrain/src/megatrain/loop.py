"""`megatrain train`: data in, a progress bar and metrics.jsonl while it runs, a model directory out.

The run holds its output_dir (a lock) from before its data is read until it ends; every save goes to
output_dir, or where that fails to `fallback_dir`, or stops the run saying what is lost; SIGINT and
SIGTERM stop it after a checkpoint with the shell's exit code (`RunInterrupted`)."""

import errno
import json
import math
import os
import signal
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tqdm import tqdm

from megatrain_data import PairWindows, TokenData, TokenWindows, load_token_data
from megatrain_data.multimodal import MediaRows, check_batches, check_media_model, media_of, row_windows
from megatrain_data.rewards import RewardError
from megatrain_data.serving import RUN_FOLDER, describe_export, keep_in_run, serving_of_run
from megatrain_optim import Ranks, Schedule, lr_at
from megatrain_optim.launch import leave_ranks
from megatrain_plan import stale_rates_note
from megatrain_store import atomic_write_text
from megatrain_store.checkpoints import (
    EXPORT_FILES_BYTES,
    SaveError,
    checkpoints_to_come,
    complete_checkpoints,
    fallback_checkpoints,
    free_bytes,
    step_of,
)
from megatrain_store.io import finite_record, remove_stale_temporaries, write_jsonl
from megatrain_store.plot import plot_loss
from megatrain_store.progress import progress, size_text
from megatrain_store.rundir import (
    RunLock,
    check_output_dir_free,
    check_steps_ahead,
    exported_step,
    prepare_fallback_dir,
    prepare_output_dir,
    supersede_later,
    write_trainer_state,
)
from megatrain_templates import Sequences
from megatrain_zoo import ModelConfig, generic_notes
from megatrain_zoo.hf_weights import check_same_weights, checkpoint_files
from megatrain_zoo.peft import experts_note, is_model_directory
from megatrain_zoo.read import check_reference_model

from .checkpoint import (
    CHECKPOINTS,
    FINAL,
    NonFiniteError,
    Resume,
    check_same_model,
    save_checkpoint,
)
from .config import Config, ConfigError, model_config_of, resolve_device, with_absolute_paths
from .distributed import init_ranks
from .grpo import check_grpo_settings, make_rollouts
from .planning import check_runnable
from .reference import PASS_STEPS, adapters_off, reference_scores, step_reference
from .rollouts import tokenizer_of
from .step import StepBatch
from .trackers import check_trackers, open_trackers
from .trainer import Trainer


class RunInterrupted(Exception):
    """SIGINT or SIGTERM stopped the run after its checkpoint was written; `exit_code` is 128 + the signal
    (130, 143: the shell's convention), so that a scheduler tells it from a run that finished."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


class Stopped(KeyboardInterrupt):
    """A signal before the steps, or a second one after them (in the export, or while the run closes): the run stops
    there; the message says what is lost. A KeyboardInterrupt, so that no `except Exception` on the way swallows it."""

    def __init__(self, signum: int, message: str):
        super().__init__(f"{signal.Signals(signum).name}: {message}")
        self.exit_code = 128 + signum


class StopRequested:
    """Turns SIGINT/SIGTERM into a flag the loop checks between steps (then it checkpoints and stops); while the run
    is `starting` (data, model, reference pass) either stops it at once, in one line (SIGTERM's default says none).
    Once the steps are done, `finishing` holds what a first signal is told (only said) and what a second stops with."""

    def __init__(self, says: bool = True):
        self.signum, self.says, self.starting = 0, says, True  # (says: whether this process says it: one rank)
        self._previous = {}
        self.finishing: tuple[str, str] | None = None  # (the trained state is in memory alone until final/ is written)

    def __enter__(self):
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.starting:
            raise Stopped(signum, "train stopped before training started: no checkpoint or model was written")
        if self.finishing is not None:
            said, stopped = self.finishing
            if self.signum:
                raise Stopped(signum, stopped)
            if self.says:
                tqdm.write(f"megatrain: {signal.Signals(signum).name}: {said}; another stops it now", file=sys.stderr)
        self.signum = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def check_objective_data(config: Config, data: TokenData) -> None:
    """Refuse preference pairs without the DPO objective, and DPO without pairs, before the model is built."""
    dpo = config.train.objective == "dpo"
    if dpo and not data.pairs:
        raise ConfigError(
            "train.objective dpo trains on preference pairs: set data.format: preference (prompt/chosen/rejected "
            'records) or name a dataset_info.json entry with "ranking": true'
        )
    if data.pairs and not dpo:
        raise ConfigError("the data are preference pairs (chosen/rejected): set train.objective: dpo to train on them")


def evaluate_pairs(trainer: Trainer, pairs: PairWindows, reference: np.ndarray | None, leave: bool = False) -> dict:
    """The DPO loss and TRL's metrics of the trainer's current weights over every pair (`reference`: their cached
    reference scores, None where the loss needs none), forward only."""
    sums = []
    bar = progress(total=pairs.n_pairs, desc="eval", unit="pair", leave=leave, disable=not trainer.is_main)
    for batch in pairs.in_order(PASS_STEPS * trainer.config.train.batch_size):
        sums.append(trainer.sequence_logps(StepBatch.of(batch)))
        bar.update(len(sums[-1].logps) // 2)
    bar.close()
    policy = Sequences(torch.cat([s.logps for s in sums]), torch.cat([s.lengths for s in sums]))
    scores = None if reference is None else Sequences(torch.from_numpy(reference), policy.lengths)
    trainer.objective.begin_step([], scores, n_pairs=pairs.n_pairs)
    loss, metrics = trainer.objective.loss(policy)
    return {"val_loss": round(float(loss), 6), "val_pairs": pairs.n_pairs} | {
        f"val_{name}": round(float(value), 6) for name, value in metrics.items()
    }


def evaluate(trainer: Trainer, windows: TokenWindows, max_batches: int | None = None, leave: bool = False) -> dict:
    """Validation loss and perplexity of the trainer's current weights over every window (or the first
    `max_batches` batches of train.batch_size rows), forward only."""
    total_loss, total_targets = 0.0, 0
    n_batches = -(-windows.n_windows // trainer.config.train.batch_size)
    if max_batches is not None:
        n_batches = min(n_batches, max_batches)
    batches = windows.in_order(trainer.config.train.batch_size)
    bar = progress(total=n_batches, desc="eval", unit="batch", leave=leave, disable=not trainer.is_main)
    for _, batch in zip(range(n_batches), batches):
        loss_sum, n_targets = trainer.evaluate(StepBatch.of(batch, media_of(batch)))
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
    model_dir, train = Path(config.model.hf_dir) if config.model.hf_dir else None, config.train

    def load():
        return load_token_data(
            config.data, model.vocab_size, out / "cache", model_dir, model.eos_token_id, train.seed,
            train.dpo.max_prompt_length, model.arch,
        )  # fmt: skip

    data = load() if ranks is None or ranks.is_main else None
    if ranks is not None:
        dist.barrier()
    return data if data is not None else load()


def check_run_tokenizer(config: Config, data: TokenData, out: Path) -> None:
    """Refuse to resume a run on text whose tokenizer megatrain trains (none is configured) where the text changed
    since it started: the tokenizer trained on it now gives its ids other meanings than the run learned."""
    kept = out / RUN_FOLDER / "tokenizer.json"
    if config.data.tokenizer or config.model.hf_dir or data.tokenizer is None or not kept.exists():
        return
    if Path(data.tokenizer).read_bytes() != kept.read_bytes():
        raise ConfigError(
            f"the run's text changed since it started, and the tokenizer megatrain trains on it changed with it; set "
            f"data.tokenizer: {kept} (the run's own) to go on, or start a new run"
        )


def room_warning(trainer: Trainer, config: Config, out: Path) -> str | None:
    """What to say at start where output_dir's disk cannot hold the run's saves (the final model, and a checkpoint
    where they are due) as it is now: better then than after the training. Refused (`ConfigError`) where it cannot
    hold the final model and no fallback_dir could take the state instead: the run would end losing every step."""
    store, adapters = trainer.store, trainer.spec.adapter_groups
    saved = sum(store.layouts[g].numel for g in adapters) if adapters else store.n_params  # (LoRA: the adapters)
    model_bytes = saved * store.master_dtype.itemsize
    every, start = config.train.save_every, trainer.step_index
    saves = config.train.steps // every - start // every if every else 0
    copies = checkpoints_to_come(out / CHECKPOINTS, config.train.keep_last, saves)
    needed = model_bytes * (1 + copies * (1 + len(store.state_names))) + EXPORT_FILES_BYTES
    free = free_bytes(out)
    if free >= needed:
        return None
    what = f"the final model and {copies} checkpoint{'s' * (copies > 1)} need" if copies else "the final model needs"
    said = f"{out}'s disk has {size_text(free)} free; {what} {size_text(needed)}"
    if free < model_bytes + EXPORT_FILES_BYTES and config.fallback_dir is None:
        raise ConfigError(f"{said}: free space there, or set fallback_dir to a directory on another disk")
    return f"{said}: free space there before the run ends, or set fallback_dir to a directory on another disk"


def train(config: Config, resume: Resume | None = None) -> Path:
    """Run training as configured, continuing from a checkpoint with `resume` (`checkpoint.resolve_resume`); returns
    the output directory. A checkpoint of another model or of a step at or past train.steps,
    a missing tracker package or an output_dir in use by another run are refused before anything is loaded.
    Raises `RunInterrupted` where a signal stopped the run (after its checkpoint) and `SaveError` where a save
    failed and nothing took it (saying what is lost)."""
    config = with_absolute_paths(config)
    out = Path(config.output_dir)
    model = model_config_of(config)
    if resume is not None:
        check_same_model(resume.directory, resume.manifest["model"], model)
        check_same_weights(config.model.hf_dir, resume.manifest.get("base_fingerprint"), resume.directory)
        if check_steps_ahead(resume.step, config.train.steps, out) and os.environ.get("RANK", "0") == "0":
            print(f"megatrain: step {resume.step} is done; finishing the export", file=sys.stderr)
    if config.model.hf_dir is not None:
        checkpoint_files(Path(config.model.hf_dir))  # (its tensors are matched once the model is planned)
    check_runnable(config, model)
    objective = config.train.objective
    ref_model = {"dpo": config.train.dpo.ref_model, "grpo": config.train.grpo.ref_model}.get(objective)
    if ref_model is not None:
        check_reference_model(Path(ref_model), model, f"train.{objective}.ref_model")
    check_trackers(config)
    ranks = init_ranks(resolve_device(config.device).type, config.engine)
    lock = RunLock(out) if ranks is None or ranks.is_main else None
    made_out = not out.exists()  # (a run refused before it starts takes back the directory it made)
    stop = StopRequested(says=ranks is None or ranks.is_main).__enter__()
    try:
        if lock is not None:
            prepare_output_dir(out)
            said = config.fallback_dir and prepare_fallback_dir(Path(config.fallback_dir), out)
            for note in (f"warning: {said}" if said else None, lock.acquire()):
                if note is not None:
                    print(f"megatrain: {note}", file=sys.stderr)
            check_output_dir_free(out, None if resume is None else resume.directory, is_model_directory(out / FINAL))
            freed = remove_stale_temporaries(out)
            if freed:
                print(f"megatrain: removed {size_text(freed)} of files killed runs left half-written", file=sys.stderr)
        # the data is read first: a bad record stops the run before any host memory is allocated
        if config.train.objective == "grpo":  # (prompts or given completions: read once the trainer is made)
            check_grpo_settings(config, ranks)
            data = TokenData(None, None, tokenizer_of(config)[1])
        else:
            data = load_data(config, model, out, ranks)
            if resume is not None:
                check_run_tokenizer(config, data, out)
            check_objective_data(config, data)
            check_batches(data, config.data.seq_len, config.train.batch_size)  # (before the model is loaded)
            if isinstance(data.train, MediaRows):
                check_media_model(data.train, model, config.model.hf_dir)
        trainer = Trainer(config, model, ranks=ranks)
    except BaseException:
        stop.__exit__()
        if lock is not None:
            lock.release(refused=True, made_dir=made_out)
        leave_ranks()  # (the Trainer leaves them on close; without one, this does)
        raise
    try:
        return TrainingRun(config, trainer, data, out, resume).run(stop)
    finally:
        if lock is not None:
            lock.release()


class TrainingRun:
    """One run once its data and trainer are ready: the checkpoint it resumes, the steps with their metrics,
    validation and checkpoints, then the export. Closes the trainer when it ends."""

    def __init__(self, config: Config, trainer: Trainer, data: TokenData, out: Path, resume: Resume | None):
        self.config, self.trainer, self.data, self.out, self.resume = config, trainer, data, out, resume
        self.main = trainer.is_main
        self.metrics_path = out / "metrics.jsonl"
        self.checkpoints = out / CHECKPOINTS
        # the newest saved state of this run: where a failed save leaves it
        self.last_checkpoint = None if resume is None else resume.directory
        self.windows = self.validation = None  # (made by `_start`, inside `run`, which closes the trainer)
        self.trackers: list = []
        self.last_eval: dict = {}
        self.reference = self.validation_reference = None  # DPO: the reference's scores of the pairs (rows)
        self.rollouts = None  # GRPO: each step's prompts, completions and advantages
        self.first_step = 0  # (set once the run has started: a resumed run's is its checkpoint's)
        self.serving = None  # what the export is served with (made by `_start`: its template file is read then)

    def run(self, stop: StopRequested) -> Path:
        """The steps, then the export (`stop`: the signals' handler, on since the run started); returns the output
        directory."""
        bar = None
        failed = True  # (until the export is written: a failed run's queued updates are dropped, not waited for)
        try:
            self._start()
            self.first_step = self.trainer.step_index
            self.trackers = open_trackers(self.config, self.out) if self.main else []
            bar = progress(
                total=self.config.train.steps,
                initial=self.trainer.step_index,
                desc="train",
                unit="step",
                disable=not self.main,
            )
            stop.starting = False
            for step in range(self.trainer.step_index, self.config.train.steps):
                self._step(step, bar)
                signum = stop.signum if self.trainer.sync is None else self.trainer.sync.max(stop.signum)
                if signum:  # (a signal seen by one rank stops all of them at the same step, each exiting as it says)
                    stop.signum = signum
                    self._stop(stop, bar)
            bar.close()
            self._finish(stop)
            failed = False
        finally:
            try:
                for tracker in self.trackers:
                    tracker.close()
                if bar is not None:
                    bar.close()
                self.trainer.close(abandon=failed)
            finally:  # (a rank stopped by a signal keeps taking them: torchrun's copy may come after the others')
                if not (stop.signum and self.trainer.sync is not None):
                    stop.__exit__()
        return self.out

    def _start(self) -> None:
        """Cut the data into windows (or pairs), score them under DPO's reference, load the checkpoint resumed, keep
        the metrics it holds, say what runs."""
        self._cut_data()
        if self.resume is not None:
            self._load_resumed()
        if not self.main:
            return
        self.serving = serving_of_run(self.config, self.trainer.model_config, self.out, self.data.tokenizer)
        keep_in_run(self.out, self.serving)
        atomic_write_text(self.out / "config.json", json.dumps(self.config.as_dict(), indent=2))
        atomic_write_text(self.out / "placement.json", json.dumps(self.trainer.plan.record(), indent=2))
        kept = self._resumed_metrics() if self.resume is not None and self.metrics_path.exists() else []
        atomic_write_text(self.metrics_path, "".join(line + "\n" for line in kept))
        self._say_what_runs()

    def _resumed_metrics(self) -> list[str]:
        """metrics.jsonl's records of the steps the resumed checkpoint holds, less any line that is no record (a
        kill or a full disk cuts the last one short), said."""
        kept = []
        for number, line in enumerate(self.metrics_path.read_text().splitlines(), 1):
            try:
                if json.loads(line)["step"] <= self.trainer.step_index:
                    kept.append(line)
            except (ValueError, KeyError, TypeError):
                print(
                    f"megatrain: {self.metrics_path} line {number} is no record (cut short?): left out", file=sys.stderr
                )
        return kept

    def _load_resumed(self) -> None:
        """The checkpoint resumed, said on stderr with the steps it trains again where final/ is newer."""
        self.trainer.load_state_dict(self.resume.state())
        step = self.resume.step
        if self.rollouts is not None:
            self.rollouts.resume(self.resume.directory)
        moved = supersede_later(self.out, step) if self.main else None
        if self.main:
            print(f"megatrain: resumed from step {step} ({self.resume.directory})", file=sys.stderr)
        if moved is not None:
            print(f"megatrain: the run's later steps (another line of it) were moved to {moved}", file=sys.stderr)
        self._say_schedule_change(step)
        exported = exported_step(self.out / FINAL)
        if exported is not None and exported > step and self.main:
            again = f"step {exported} is" if exported == step + 1 else f"steps {step + 1}-{exported} are"
            print(
                f"megatrain: {FINAL}/ holds step {exported}, newer than any checkpoint: {again} trained again "
                "(a train.save_every that divides train.steps checkpoints the last step)",
                file=sys.stderr,
            )

    def _say_schedule_change(self, step: int) -> None:
        """Where the run goes on with other schedule settings than its checkpoint's (train.steps, lr, warmup): the
        learning rate its next step takes, beside the one its schedule had; the schedule is the new settings'."""
        train = (self.resume.manifest.get("config") or {}).get("train")
        if not self.main or not train:
            return
        section = type(self.config.train)  # (a key the run's version lacked: its default, which the run trained with)
        was = lr_at(step, Schedule(*(train.get(key, getattr(section, key)) for key in section.SCHEDULE_KEYS)))
        now = lr_at(step, self.trainer.schedule)
        if not math.isclose(was, now, rel_tol=1e-6):
            print(
                f"megatrain: step {step + 1} trains at lr {now:.4g} on the changed schedule, where the run's own had "
                f"{was:.4g}",
                file=sys.stderr,
            )

    def _cut_data(self) -> None:
        """The step's windows, pairs or rollouts (and DPO's reference scores), before a checkpoint is loaded: the
        reference passes read the store's initial weights."""
        trainer, config, data, train = self.trainer, self.config, self.data, self.config.train
        if train.objective == "grpo":
            self.rollouts = make_rollouts(trainer, config)
        elif data.pairs:
            self.windows = trainer.pair_windows(data.train, train.batch_size, config.data.shuffle, train.seed)
            if config.data.pack and trainer.is_main:
                rows = len(self.windows.batch(0).input_ids)
                print(
                    f"megatrain: data.pack: the first step's {train.batch_size} pairs share {rows} rows of "
                    f"{config.data.seq_len} tokens, not {2 * train.batch_size} ({rows / (2 * train.batch_size):.0%} of the tokens)",
                    file=sys.stderr,
                )
            if data.validation is not None:
                self.validation = trainer.pair_windows(data.validation)
            if train.dpo.needs_reference:  # (before a checkpoint is loaded: the store holds the initial weights)
                cache = self.out / "cache"
                with adapters_off(trainer):  # (LoRA's reference: the base alone)
                    self.reference = reference_scores(trainer, data.train, cache)
                    if data.validation is not None:
                        self.validation_reference = reference_scores(trainer, data.validation, cache, "validation")
        else:  # (rows with images: MultimodalRows, each step's pixels made when it comes)
            self.windows = row_windows(
                data.train, config.data.seq_len, train.batch_size, config.data.shuffle, train.seed
            )
            if data.validation is not None:
                self.validation = row_windows(data.validation, config.data.seq_len, 1, shuffle=False, seed=0)

    def _say_what_runs(self) -> None:
        """The run's model, machine, memory, data and placement, and warnings, on stderr."""
        trainer, config = self.trainer, self.config
        for line in self.data.report:
            print(f"megatrain: {line}", file=sys.stderr)
        host_bytes = trainer.host_bytes()
        ranks = "" if trainer.ranks is None else f" x {trainer.ranks.world_size} ranks"
        if trainer.store_is_split:
            ranks += f", the state split over {trainer.ranks.n_nodes} hosts"
        print(
            f"megatrain: {trainer.model_config.arch} {trainer.model_config.n_params / 1e6:.1f}M params on "
            f"{trainer.device}{ranks} ({str(trainer.compute_dtype).removeprefix('torch.')} compute, fp32 master), host "
            f"{host_bytes / 2**30:.2f} GiB per host ({host_bytes / trainer.model_config.n_params:.1f} B/param), "
            f"{self._data_in_words()} of {config.data.seq_len} tokens",
            file=sys.stderr,
        )
        if trainer.model_config.implementation == "transformers":
            for note in generic_notes(trainer.model_config):
                print(f"megatrain: {note}", file=sys.stderr)
        print(f"megatrain: {trainer.plan.summary()} (placement.json)", file=sys.stderr)
        if trainer.warm_up_s:
            print(f"megatrain: kernels compiled and warmed up in {trainer.warm_up_s:.1f} s", file=sys.stderr)
        room = room_warning(trainer, config, self.out)
        if room is not None:
            print(f"megatrain: warning: {room}", file=sys.stderr)
        if config.train.warmup_steps > config.train.steps:  # (a short trial of a long run's config)
            print(
                f"megatrain: train.warmup_steps {config.train.warmup_steps} outlasts train.steps {config.train.steps}: "
                "the learning rate stays in its warmup, below train.lr",
                file=sys.stderr,
            )
        model = trainer.model_config
        if note := experts_note(trainer.spec):
            print(f"megatrain: warning: {note}", file=sys.stderr)
        # (a preset's drawn routers trained with fixed biases; fine-tuning keeps the published bias, LoRA every router)
        fixed_biases = config.model.adapter.type is None and not config.train.router_bias_update_rate
        if model.router_bias and config.model.preset and fixed_biases and self.resume is None:
            print(
                "megatrain: warning: pre-training a MoE with its routers' correction bias fixed: they "
                "collapse onto a few experts (watch maxvio); DeepSeek-V3 balanced them with "
                "train.router_bias_update_rate: 0.001",
                file=sys.stderr,
            )

    def _data_in_words(self) -> str:
        """What the run trains on: its preference pairs, or its sequences (text windows or chat examples' rows)."""
        if self.windows is None:  # (GRPO: each step's completions)
            return "rows"
        if isinstance(self.windows, PairWindows):
            return f"{self.windows.n_windows} preference pairs in rows"
        return f"{self.windows.n_windows} sequences"

    def _record(self, record: dict) -> None:
        """A metrics record into metrics.jsonl and every tracker."""
        if self.main:
            try:
                write_jsonl(self.metrics_path, record)
            except OSError as error:  # (a disk full or gone read-only: said as a failed save is, with what is kept)
                full = " (the disk is full)" if error.errno == errno.ENOSPC else ""
                raise SaveError(f"{self.metrics_path} could not be written{full}: {error}; {self._lost()}") from None
        for tracker in self.trackers:
            tracker.log(finite_record(record))

    def _step(self, step: int, bar) -> None:
        """One optimizer step with its record, validation, progress and checkpoint where due."""
        trainer, train = self.trainer, self.config.train
        if self.rollouts is not None:
            try:
                made = self.rollouts.step(step)
            except RewardError as error:  # (on every rank: the ranks gathered it)
                raise RewardError(f"{error}. {self._keep_trained_steps()}") from None
            fresh = step % train.grpo.num_iterations == 0  # (a rollout's rewards are recorded at its first update)
            batch, made_metrics = made.batch, made.metrics if fresh else {}
            metrics = trainer.train_step(
                StepBatch(batch.input_ids, batch.labels, valid=batch.valid, extras=made.rollout)
            )
            if fresh:
                self._write_samples(made, step)
        else:
            batch, made_metrics = self.windows.batch(step), {}
            reference = None
            if self.reference is not None:
                reference = step_reference(self.reference, self.windows.pair_indices(step), batch)
            metrics = trainer.train_step(StepBatch.of(batch, media_of(batch), reference))
        self._record(metrics.as_dict() | made_metrics)
        self._check_rates(step, metrics.step_time_s)
        postfix = _postfix(metrics, made_metrics)
        self._validate_if_due()
        if self.last_eval:
            postfix["val"] = f"{self.last_eval['val_loss']:.4f}"
        bar.set_postfix(**postfix)
        bar.update(1)
        if metrics.skipped and self.main:
            tqdm.write(
                f"step {metrics.step}: non-finite loss or gradient (loss={metrics.loss}, "
                f"grad_norm={metrics.grad_norm}); step skipped, weights unchanged",
                file=sys.stderr,
            )
        if metrics.skipped and trainer.bad_steps >= train.max_bad_steps:  # the same on every rank
            self._stop_for_bad_steps()
        if train.save_every and trainer.step_index % train.save_every == 0:
            self.save()

    def _validate_if_due(self) -> None:
        """The validation loss (or DPO's pair metrics) every train.eval_every steps and at the last, recorded."""
        trainer, train = self.trainer, self.config.train
        every = train.eval_every
        if self.validation is None or not (
            (every and trainer.step_index % every == 0) or trainer.step_index == train.steps
        ):
            return
        if isinstance(self.validation, PairWindows):
            self.last_eval.update(evaluate_pairs(trainer, self.validation, self.validation_reference))
        else:
            self.last_eval.update(evaluate(trainer, self.validation))
        self._record({"step": trainer.step_index, **self.last_eval})

    def _write_samples(self, made, step: int) -> None:
        """Every train.grpo.log_completions_every steps, the step's completions (a new rollout's) into
        completions.jsonl: prompt, completion, reward, advantage."""
        every = self.config.train.grpo.log_completions_every
        if self.main and every and step % every == 0 and made.samples:
            for sample in made.samples:
                write_jsonl(self.out / "completions.jsonl", {"step": step + 1, **sample})

    def _check_rates(self, step: int, seconds: float) -> None:
        """The run's fourth step (past compiling and warming up) against the plan's prediction: rates far off it are
        dropped for the next run to measure again (`stale_rates_note`); GRPO's steps also generate, unpredicted."""
        trainer, plan = self.trainer, self.trainer.plan
        if step != self.first_step + 3 or not (self.main and plan.predicts_step) or self.rollouts is not None:
            return
        run = (trainer.device, trainer.compute_dtype, self.config.data.seq_len, self.config.train.micro_batch_size)
        note = stale_rates_note(plan.step_s, seconds, trainer.model_config, *run, trainer.planner.spec)
        if note is not None:
            tqdm.write(f"megatrain: {note}", file=sys.stderr)

    def _stop_for_bad_steps(self) -> None:
        """`NonFiniteError` after train.max_bad_steps skipped steps, the last good step's weights saved: with every
        older checkpoint kept (those weights may have diverged already, and a retry that fails again must not rotate
        out the ones before) and the count of bad steps at 0, so that a resume with a lower rate gets its tries."""
        bad_steps, self.trainer.bad_steps = self.trainer.bad_steps, 0
        try:
            saved = f"The weights are those of the last good step, saved in {self.save(keep_all=True)}"
            good_step = self.trainer.step_index - bad_steps  # (checkpoints since hold its weights too)
            earlier = [path for path in complete_checkpoints(self.checkpoints) if step_of(path) < good_step]
            saved += (
                f"; where the loss rose before the stop they diverged too: --resume {earlier[-1]}." if earlier else "."
            )
        except NonFiniteError as error:  # the last good step's weights hold NaN or Inf themselves
            saved = str(error) + "."
        clip = self.config.train.grad_clip
        clipping = (
            f"lower train.grad_clip (it clips at {clip} now)" if clip > 0 else "turn on train.grad_clip (e.g. 1.0)"
        )
        raise NonFiniteError(
            f"{bad_steps} non-finite steps in a row; stopping. {saved} Lower train.lr, raise "
            f"train.warmup_steps or {clipping}."
        )

    def _keep_trained_steps(self) -> str:
        """A checkpoint of the steps trained since the last one (a run stopped by a failure that is no fault of the
        weights), and how to continue, in words."""
        step = self.trainer.step_index
        saved = step_of(self.last_checkpoint) if self.last_checkpoint is not None else 0
        if step == saved:
            where = "the start" if self.last_checkpoint is None else str(self.last_checkpoint)
            return f"No step was trained since {where}, so nothing is lost"
        return (
            f"Steps {saved + 1}-{step} are saved in {self.save()}; continue with `megatrain train --resume {self.out}`"
        )

    def _stop(self, stop: StopRequested, bar) -> None:
        """A signal: checkpoint, then `RunInterrupted` (the exit code says which signal)."""
        path = self.save()
        bar.close()
        message = (
            f"{signal.Signals(stop.signum).name} received; checkpoint {path} written. Continue with "
            f"`megatrain train --resume {self.out}`"
        )
        raise RunInterrupted(stop.signum, message if self.main else "")

    def save(self, keep_all: bool = False) -> Path:
        """A checkpoint of the current step in output_dir/checkpoints, or where that fails in fallback_dir;
        `SaveError` saying what is lost where neither takes it. A step already saved is not saved again (a stop
        signal in a step that ended on train.save_every wrote the same checkpoint twice, and a kill while the second
        replaced the first lost both). No older checkpoint is rotated out by train.keep_last where `keep_all` or in a
        streak of non-finite steps (the weights saved may be the divergence that made them)."""
        last = self.last_checkpoint
        if last is not None and step_of(last) == self.trainer.step_index and last.is_dir():
            return last
        try:
            keep_last = 2**31 if keep_all or self.trainer.bad_steps else self.config.train.keep_last  # (2**31: all)
            path = save_checkpoint(self.trainer.state_dict(), self.checkpoints, keep_last)
        except SaveError as error:
            path = self._save_elsewhere(str(error))
        self.last_checkpoint = path
        return path

    def _save_elsewhere(self, failure: str) -> Path:
        """The checkpoint in fallback_dir after `failure` (a save that output_dir's disk refused), or
        `SaveError` saying what is lost."""
        if self.config.fallback_dir is None:
            raise SaveError(
                f"{failure}; {self._lost()}; set fallback_dir to a directory on another disk to have the state "
                "written there instead"
            )
        try:
            root = fallback_checkpoints(self.config.fallback_dir, self.out)
            path = save_checkpoint(self.trainer.state_dict(), root, self.config.train.keep_last)
        except SaveError as error:
            raise SaveError(f"{failure}; fallback_dir failed too: {error}; {self._lost()}") from None
        if self.main:
            tqdm.write(f"megatrain: {failure}; the checkpoint went to fallback_dir instead: {path}", file=sys.stderr)
        return path

    def _lost(self, once: str = "once the disk takes writes again (room, permission), ") -> str:
        """What a run that stops now loses, and how to continue (`once`: when)."""
        step = self.trainer.step_index
        if self.last_checkpoint is None:
            return f"this run has no checkpoint: all its steps ({step}) are lost"
        since = step - step_of(self.last_checkpoint)
        lost = f"the steps since {self.last_checkpoint} ({since}) are lost" if since else "no step is lost"
        return (
            f"{lost}; {once}continue from it with "
            f"`megatrain train --resume {self.last_checkpoint}` (--set output_dir=DIR to continue elsewhere)"
        )

    def _finish(self, stop: StopRequested) -> None:
        """After the last step: the trace, the model, the loss curve."""
        trainer, out = self.trainer, self.out
        stop.finishing = ("the export finishes first", f"the export to {out / FINAL} stopped; {self._lost('')}")
        if self.config.engine.trace:
            suffix = "" if trainer.ranks is None else f"-rank{trainer.ranks.rank}"
            trainer.timeline.write_chrome_trace(out / f"trace{suffix}.json")
        final = self._export()
        stop.finishing = ("the model is written; the run closes first", f"stopped closing; the model is in {final}")
        if self.main:
            if self.config.train.loss_plot and plot_loss(self.metrics_path, out / "loss.png"):
                print(f"loss curve: {out / 'loss.png'}", file=sys.stderr)
            print(f"model written to {final}: {describe_export(final)}", file=sys.stderr)

    def _export(self) -> Path:
        """output_dir/final (every rank: hosts holding parts of the state send them), with the step it holds;
        where it cannot be written, the state goes to fallback_dir as a checkpoint, or `SaveError` says what
        is lost."""
        target = self.out / FINAL
        try:
            final = self.trainer.export(target, self.serving)
        except (SaveError, OSError) as error:
            failure = f"the model could not be written to {target}: {error}"
            path = self._save_elsewhere(failure)
            raise SaveError(
                f"{failure}; the trained state (step {self.trainer.step_index}) is in {path} instead: "
                f"`megatrain convert {path} DIR` writes the model from it"
            ) from None
        if self.main:
            write_trainer_state(final, self.trainer.step_index, self.config.train.steps)
        return final


def _postfix(metrics, made_metrics: dict) -> dict[str, str]:
    """The progress bar's numbers for a step: loss, rate, and what the model or objective adds."""
    postfix = {
        "loss": f"{metrics.loss:.4f}",
        "tok_s": f"{metrics.tokens_per_s:,.0f}",
        "tflops": f"{metrics.tflops:.3g}",
    }
    if metrics.router_aux_loss is not None:  # expert balance: n_experts * sum f_e P_e, top_k when even
        postfix["aux"] = f"{metrics.router_aux_loss:.3f}"
    if metrics.router_max_violation is not None:  # the worst layer's max expert load / mean - 1
        postfix["maxvio"] = f"{metrics.router_max_violation:.2f}"
    if metrics.objective and "rewards/accuracies" in metrics.objective:  # DPO: how often chosen beats rejected
        postfix["acc"] = f"{metrics.objective['rewards/accuracies']:.2f}"
        postfix["margin"] = f"{metrics.objective['rewards/margins']:.3f}"
    if "reward" in made_metrics:  # GRPO: the mean reward of the step's completions
        postfix["reward"] = f"{made_metrics['reward']:.3f}"
    return postfix

"""DPO's reference model, streamed once: every preference row's log-probability under the reference weights,
computed in one forward-only pass before training and cached on disk beside the tokenised data, so that training
holds one model. The reference is the policy's initial weights, or `train.dpo.ref_model`'s directory (loaded into
the same host store for the pass, then replaced by the policy's weights)."""

import hashlib
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from megatrain_data import Batch, Tokens, sequence_lengths
from megatrain_store import atomic_write
from megatrain_store.progress import progress
from megatrain_templates import Sequences
from megatrain_zoo.hf_weights import check_weights_unchanged

from .step import StepBatch

# The pass streams the weights once for this many training steps' rows (forward only: no checkpoints are kept,
# only each micro-batch's current activation)
PASS_STEPS = 4


@contextmanager
def adapters_off(trainer):
    """The base model alone inside (LoRA's adapters zeroed: their delta is then exactly zero), the adapters as they
    were after: the reference of DPO with adapters, as TRL's with a PEFT model (a no-op without adapters)."""
    trainer.finish_updates()
    store, groups = trainer.store, trainer.spec.adapter_groups
    writes = trainer.ranks is None or trainer.ranks.is_local_main  # (one copy of the weights per host)
    kept = {g: store.master(g).clone() for g in groups}
    for group in groups if writes else ():
        with store.writing(group) as views:
            for view in views.values():
                view.zero_()
    trainer.sync_weights()
    try:
        yield
    finally:
        for group in groups if writes else ():
            saved = store.layouts[group].views(kept[group])
            with store.writing(group) as views:
                for name, view in views.items():
                    view.copy_(saved[name])
        trainer.sync_weights()


def reference_key(trainer, arrays: tuple, ref_model: str | None) -> str:
    """What cached reference scores depend on (DPO's and GRPO's): the rows (`arrays`: tokens and masks), the
    reference weights (`ref_model`'s files, or the policy's initial weights: its directory's or the seeded
    initialisation), the model section (a LoRA base's storage: nf4 scores differ from bf16's), the model and compute
    dtype."""
    config = trainer.config
    digest = hashlib.sha256()
    for array in arrays:
        digest.update(np.ascontiguousarray(array).tobytes())
    source = ref_model or config.model.hf_dir
    if source is not None:
        for path in sorted(Path(source).glob("*.safetensors")) + [Path(source) / "config.json"]:
            stat = path.stat()
            digest.update(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    else:
        digest.update(f"{config.model.preset}:{config.train.seed}".encode())
    digest.update(json.dumps([repr(config.model), repr(trainer.model_config), str(trainer.compute_dtype)]).encode())
    return digest.hexdigest()[:16]


def reference_scores(trainer, rows: Tokens, cache_dir: Path, what: str = "training") -> np.ndarray:
    """Every row's summed log-probability of its trained tokens under the reference ([rows] float64), from the cache
    or one forward-only streamed pass (said in one line, with its time and tokens/s). The trainer's store must hold
    the policy's initial weights; it does again afterwards."""
    source = trainer.config.train.dpo.ref_model or trainer.config.model.hf_dir
    if source is not None and trainer.is_main:  # (a resumed SFT run that wrote over the model a DPO run started from)
        check_weights_unchanged(Path(source), cache_dir / "reference-weights.json", "the DPO reference")
    key = reference_key(trainer, (rows.tokens, rows.loss_mask), trainer.config.train.dpo.ref_model)
    path = cache_dir / f"reference-{key}.npy"
    if path.exists():
        return np.load(path)
    ref_dir = trainer.config.train.dpo.ref_model
    if ref_dir is not None:
        trainer.load_weights(Path(ref_dir))
    start = time.perf_counter()
    scores = _forward_pass(trainer, rows, what)
    seconds = time.perf_counter() - start
    if ref_dir is not None:
        trainer.load_weights(None)  # the policy's initial weights back
    if trainer.is_main:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda handle: np.save(handle, scores))
        tokens = int(np.asarray(rows.tokens).size)
        print(
            f"megatrain: reference log-probabilities of {len(scores)} {what} sequences in {seconds:.1f} s "
            f"({tokens / max(seconds, 1e-9):,.0f} tokens/s, forward only), cached in {path}",
            file=sys.stderr,
        )
    return scores


def _forward_pass(trainer, rows: Tokens, what: str) -> np.ndarray:
    """The rows' summed log-probabilities, PASS_STEPS training steps' pairs at a time, in order."""
    pairs = trainer.pair_windows(rows)
    per_pass = PASS_STEPS * trainer.config.train.batch_size
    scores = np.zeros(2 * pairs.n_pairs, dtype=np.float64)
    bar = progress(total=pairs.n_pairs, desc=f"reference ({what})", unit="pair", disable=not trainer.is_main)
    done = 0
    for batch in pairs.in_order(per_pass):
        logps = trainer.sequence_logps(StepBatch.of(batch)).logps
        scores[done : done + len(logps)] = logps.numpy()
        done += len(logps)
        bar.update(len(logps) // 2)
    bar.close()
    return scores


def step_reference(scores: np.ndarray, pairs: list[int], batch: Batch) -> Sequences:
    """The reference's `Sequences` of a step's batch: `pairs` (indices into the data's pairs) in batch order, their
    chosen and rejected sequences' cached scores."""
    rows = [row for pair in pairs for row in (2 * pair, 2 * pair + 1)]
    return Sequences(torch.from_numpy(scores[rows]), sequence_lengths(batch.labels, batch.sequences))

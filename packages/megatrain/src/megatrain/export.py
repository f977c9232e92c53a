"""Hugging Face model directories written whole: a store's weights (`export_hf`) or a checkpoint converted
(`convert`), with what they are served with (tokenizer, chat template, generation config), into a directory that is
replaced only once every file is written."""

import json
import os
import shutil
from pathlib import Path

from megatrain_data.serving import SERVING_FILES, Serving, write_serving_files
from megatrain_store import (
    HostStore,
    Pending,
    atomic_write_text,
    fsync_dir,
    open_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from megatrain_store.progress import counting, progress
from megatrain_zoo import ModelSpec, config_to_hf
from megatrain_zoo.hf_weights import WholeGroups, checkpoint_entries, checkpoint_files, entries_as_imported

from .rundir import check_room

SHARD_BYTES = 5 * 2**30  # the shard size transformers uses by default


def write_hf_directory(
    out_dir: Path, entries: list, config: dict, serving: Serving | Path | None, shard_bytes: int = SHARD_BYTES
) -> Path:
    """config.json + safetensors shards (with an index past one shard) + what it is served with (`serving`, or a
    tokenizer.json with its own files beside it): tokenizer, chat template, special tokens, generation config.

    entries: (name, Pending) in file order, each loaded as it is written: one tensor at a time. The files are
    written into a folder beside `out_dir` first (refused before that, `SaveError`, where its disk has no room
    for them) and moved in once all are whole, so a write that fails leaves `out_dir` as it was."""
    out_dir = Path(out_dir)
    weight_bytes = sum(p.numel() * p.element_size() for _, p in entries)
    check_room(out_dir.parent, weight_bytes + 2**20, f"the model {out_dir}")
    staging = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # left by a write that was killed
    staging.mkdir(parents=True)
    if not isinstance(serving, Serving):
        serving = Serving(None if serving is None else Path(serving))
    try:
        _write_model_files(staging, entries, config, serving, shard_bytes, what=out_dir.name)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _move_into(staging, out_dir)
    return out_dir


def _move_into(staging: Path, out_dir: Path) -> None:
    """Move a model's files from `staging` into `out_dir`, whose files of an earlier model go where this one
    writes none (stale shards beside a new index would be read as the model; another model's tokenizer, chat
    template or generation config as this one's)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    described = [out_dir / name for name in ("model.safetensors.index.json", *SERVING_FILES)]
    for stale in [*out_dir.glob("model*.safetensors"), *described]:
        if stale.exists() and not (staging / stale.name).exists():
            stale.unlink()
    for path in staging.iterdir():
        os.replace(path, out_dir / path.name)
    staging.rmdir()
    fsync_dir(out_dir)


def _write_model_files(
    out_dir: Path, entries: list, config: dict, serving: Serving, shard_bytes: int, what: str
) -> None:
    shards, size = [[]], 0
    for name, pending in entries:
        nbytes = pending.numel() * pending.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, pending))
        size += nbytes
    weight_map, total = {}, 0
    bar = progress(total=len(entries), desc=f"write {what}", unit="tensor", leave=False)
    for i, shard in enumerate(shards):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out_dir / filename, counting(shard, bar), metadata={"format": "pt"})
        weight_map.update({name: filename for name, _ in shard})
    bar.close()
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2))
    config = write_serving_files(out_dir, serving, config)
    atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2))


def export_hf(
    store: HostStore,
    spec: ModelSpec,
    out_dir: Path,
    serving: Serving | Path | None = None,
    shard_bytes: int = SHARD_BYTES,
    gather=None,
) -> Path:
    """Write config.json + fp32 safetensors (sharded with an index past `shard_bytes`) that
    transformers loads as the matching *ForCausalLM, with what it is served with (`serving`, or a tokenizer.json
    and its own files). With hosts that split the state, `gather` brings each group to this rank (see
    `WholeGroups`)."""
    entries = checkpoint_entries(spec, WholeGroups(store, gather).entries("master"))
    return write_hf_directory(out_dir, entries, config_to_hf(spec.config), serving, shard_bytes)


def convert(
    source: Path, out_dir: Path, dtype: str = "float32", shard_bytes: int = SHARD_BYTES, serving: Serving | None = None
) -> Path:
    """A Hugging Face directory from a megatrain checkpoint (or another HF directory), streamed
    tensor by tensor: at most one shard is in memory, served with `serving` (None: the tokenizer files beside the
    source, or in its run's final/). `dtype`: float32 or bfloat16. A quantized source
    (FP8 blocks, MXFP4 experts) is written dequantized, as megatrain imports it, without the
    multi-token-prediction layers of DeepSeek-V3, GLM-4.5 and ERNIE 4.5."""
    import torch

    from megatrain_zoo import ModelConfig, build_model, read_hf_config

    source = Path(source)
    manifest = source / "manifest.json"
    if manifest.exists():
        model = ModelConfig(**json.loads(manifest.read_text())["model"])
        files = [source / "model.safetensors"]
    else:
        model = read_hf_config(source)
        files = checkpoint_files(source)
    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    headers = {path: read_safetensors_header(path) for path in files}
    where = {name: path for path, header in headers.items() for name in header if name != "__metadata__"}
    shapes = {name: tuple(headers[path][name]["shape"]) for name, path in where.items()}
    spec = build_model(model)
    if manifest.exists() and spec.checkpoint_layout is not None:  # (a generic model's own names: as its family's)
        entries = [
            (name, Pending(shapes[name], target, lambda name=name: _read(where, name).to(target))) for name in where
        ]
        entries = checkpoint_entries(spec, entries)
    else:
        entries = entries_as_imported(spec, files, where, shapes, target)
    serving = serving or Serving(_tokenizer_of(source))
    return write_hf_directory(out_dir, entries, config_to_hf(model, dtype), serving, shard_bytes)


def _tokenizer_of(source: Path) -> Path | None:
    """The tokenizer.json beside a checkpoint or HF directory, or in its run's final/."""
    return next(
        (t for t in (source / "tokenizer.json", source.parent.parent / "final" / "tokenizer.json") if t.exists()), None
    )


def _read(where: dict, name: str):
    with open_safetensors({where[name]}) as handles:
        return handles[where[name]].get_tensor(name)

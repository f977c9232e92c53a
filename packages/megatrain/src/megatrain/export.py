"""Hugging Face model directories written whole: a store's weights (`export_hf`) or a checkpoint converted
(`convert`), with what they are served with (tokenizer, chat template, generation config), into a directory that is
replaced only once every file is written; a LoRA run's as a PEFT adapter directory, or merged into its base."""

import json
import os
import shutil
import sys
from dataclasses import replace
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
from megatrain_store.checkpoints import EXPORT_FILES_BYTES, check_room
from megatrain_store.progress import counting, progress
from megatrain_store.rundir import TRAINER_STATE
from megatrain_zoo import ModelConfig, ModelSpec, config_to_hf, read_hf_config
from megatrain_zoo.hf_weights import (
    PACKED_CACHE,
    WholeGroups,
    checkpoint_entries,
    checkpoint_files,
    entries_as_imported,
    is_hf_directory,
)
from megatrain_zoo.peft import (
    PEFT_CONFIG,
    PEFT_PREFIX,
    PEFT_WEIGHTS,
    LoraSource,
    base_entries,
    merged_entries,
    read_adapters,
    read_peft_config,
    write_peft_adapter,
)

from .config import ConfigError

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
    serving = _serving(serving)
    return _write_staged(
        out_dir,
        entries,
        lambda staging: _write_model_files(staging, entries, config, serving, shard_bytes, what=out_dir.name),
    )


def write_peft_directory(
    out_dir: Path, entries: list, spec: ModelSpec, base_model: str | None, serving: Serving | Path | None
) -> Path:
    """A PEFT adapter directory (`megatrain_zoo.peft.write_peft_adapter`: adapter_config.json +
    adapter_model.safetensors, loadable by `peft.PeftModel.from_pretrained(base, out_dir)`) with what the model is
    served with, as `write_hf_directory` writes a model: whole or not at all. `entries`: the adapters, by the model's
    names; `base_model`: the base model's directory or hub name (adapter_config.json's base_model_name_or_path)."""
    serving = _serving(serving)

    def write(staging: Path) -> None:
        write_peft_adapter(entries, spec, staging, base_model)
        write_serving_files(staging, serving, {})

    return _write_staged(Path(out_dir), entries, write)


def _serving(serving: Serving | Path | None) -> Serving:
    return serving if isinstance(serving, Serving) else Serving(None if serving is None else Path(serving))


def _write_staged(out_dir: Path, entries: list, write) -> Path:
    """Call write(folder) on a new folder beside `out_dir` (refused first, `SaveError`, where its disk has no room for
    `entries`), then move its files into `out_dir`: a write that fails leaves `out_dir` as it was."""
    staging = out_dir.parent / f".{out_dir.name}.partial"
    shutil.rmtree(staging, ignore_errors=True)  # left by a write that was killed (before the room is counted)
    weight_bytes = sum(p.numel() * p.element_size() for _, p in entries)
    check_room(out_dir.parent, weight_bytes + EXPORT_FILES_BYTES, f"the model {out_dir}")
    staging.mkdir(parents=True)
    try:
        write(staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _move_into(staging, out_dir)
    return out_dir


def _move_into(staging: Path, out_dir: Path) -> None:
    """Move a model's files from `staging` into `out_dir`, whose files of an earlier model (or adapter) go where this
    one writes none (stale shards beside a new index would be read as the model; another model's tokenizer, chat
    template or generation config as this one's; a full model's config.json beside an adapter as the model). The file
    that makes a directory a model (config.json, a PEFT adapter's adapter_config.json) goes first and comes back
    last: a kill while the files move leaves no directory that reads as a whole model."""
    out_dir.mkdir(parents=True, exist_ok=True)
    descriptor = PEFT_CONFIG if (staging / PEFT_CONFIG).exists() else "config.json"
    (out_dir / descriptor).unlink(missing_ok=True)
    described = [out_dir / name for name in ("model.safetensors.index.json", TRAINER_STATE, *SERVING_FILES)]
    adapter = [out_dir / name for name in (PEFT_CONFIG, PEFT_WEIGHTS)]
    model = [out_dir / "config.json"] if (staging / PEFT_CONFIG).exists() else []
    for stale in [*out_dir.glob("model*.safetensors"), *described, *adapter, *model]:
        if stale.exists() and not (staging / stale.name).exists():
            stale.unlink()
    for path in sorted(staging.iterdir(), key=lambda path: path.name == descriptor):
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
    # config.json first: its model_type picks the class transformers serves the tokenizer with (qwen2's: its own,
    # whatever tokenizer_config.json names), which the serving files' check loads; then with their special ids
    atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2))
    config = write_serving_files(out_dir, serving, config)
    atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2))


def export_hf(
    store: HostStore,
    spec: ModelSpec,
    out_dir: Path,
    serving: Serving | Path | None = None,
    shard_bytes: int = SHARD_BYTES,
    gather=None,
    base_model: str | None = None,
) -> Path:
    """Write config.json + fp32 safetensors (sharded with an index past `shard_bytes`) that
    transformers loads as the matching *ForCausalLM, with what it is served with (`serving`, or a tokenizer.json
    and its own files). With hosts that split the state, `gather` brings each group to this rank (see
    `WholeGroups`). A LoRA run's (`spec.adapter`) is its adapters alone, as a PEFT directory (`write_peft_directory`)
    naming `base_model` as its base."""
    whole = WholeGroups(store, gather)
    if spec.adapter is not None:
        return write_peft_directory(out_dir, whole.entries("master", trained_only=True), spec, base_model, serving)
    entries = checkpoint_entries(spec, whole.entries("master"))
    return write_hf_directory(out_dir, entries, config_to_hf(spec.config), serving, shard_bytes)


def convert(
    source: Path,
    out_dir: Path,
    dtype: str = "float32",
    shard_bytes: int = SHARD_BYTES,
    serving: Serving | None = None,
    merge: bool = False,
) -> Path:
    """A Hugging Face directory from a megatrain checkpoint (or another HF directory), streamed
    tensor by tensor: at most one shard is in memory, served with `serving` (None: the tokenizer files beside the
    source, or in its run's final/). `dtype`: float32 or bfloat16. A quantized source
    (FP8 blocks, MXFP4 experts) is written dequantized, as megatrain imports it, without the
    multi-token-prediction layers of DeepSeek-V3, GLM-4.5 and ERNIE 4.5.

    A LoRA run's checkpoint or PEFT directory (`lora_source`) is written as a PEFT adapter directory, or with `merge`
    as its base model with the adapters merged into it (`convert_lora`)."""
    import torch

    from megatrain_zoo import build_model

    source = Path(source)
    lora = lora_source(source)
    if lora is not None:
        return convert_lora(lora, out_dir, dtype, shard_bytes, serving, merge)
    if merge:
        raise ConfigError(
            f"convert --merge merges a LoRA run's adapters into its base model; {source} holds a whole model: "
            "convert it without --merge"
        )
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


def lora_source(source: Path) -> LoraSource | None:
    """The LoRA run `source` holds the adapters of: a checkpoint of a run with model.adapter, or a PEFT adapter
    directory (a run's final/, whose run config names the base; else the local base model directory its
    adapter_config.json names); None for a whole model's weights."""
    from .checkpoint import MANIFEST, run_config
    from .config import adapter_of, load_config, model_config_of

    source = Path(source)
    if (source / MANIFEST).exists():
        manifest = json.loads((source / MANIFEST).read_text())
        if ((manifest["config"].get("model") or {}).get("adapter") or {}).get("type") is None:
            return None
        config = load_config(None, [], run_config(source, manifest))
        model, weights, prefix = ModelConfig(**manifest["model"]), source / "model.safetensors", ""
        adapter = adapter_of(config)
    elif (source / PEFT_CONFIG).exists():
        values = run_config(source)
        config = None if values is None else load_config(None, [], values)
        adapter, weights, prefix = read_peft_config(source), source / PEFT_WEIGHTS, PEFT_PREFIX
        if config is None:  # (an adapter directory of its own: its base is the one it names)
            named = json.loads((source / PEFT_CONFIG).read_text()).get("base_model_name_or_path")
            if not named or not is_hf_directory(Path(named)):
                raise ConfigError(
                    f"{source} is a PEFT adapter of base_model_name_or_path {named!r}, which is not a local model "
                    f"directory; set it in {source / PEFT_CONFIG} to the base model's directory"
                )
            return LoraSource(read_hf_config(Path(named)), adapter, weights, prefix, Path(named))
        model = model_config_of(config)
        # (how the run held its base, which adapter_config.json does not say)
        adapter = replace(adapter, base_format=adapter_of(config).base_format)
    else:
        return None
    base = Path(config.model.hf_dir) if config.model.hf_dir else None
    held = config.precision.compute_dtype
    if held == "auto":  # (as the run resolved it: bfloat16 on a GPU)
        held = "float32" if config.device == "cpu" else "bfloat16"
    kept = Path(config.output_dir) / "cache" / PACKED_CACHE
    return LoraSource(model, adapter, weights, prefix, base, config.train.seed, held, kept)


def convert_lora(
    lora: LoraSource, out_dir: Path, dtype: str, shard_bytes: int, serving: Serving | None, merge: bool
) -> Path:
    """A LoRA run's adapters as a PEFT directory, or (`merge`) its base model with scale * B @ A added to each adapted
    matrix (as PEFT's merge_and_unload), in `dtype`, with what the model is served with."""
    import torch

    from megatrain_zoo import build_model

    spec = build_model(lora.model, 0, lora.adapter)
    adapters = read_adapters(spec, lora.weights, lora.prefix)
    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    tokenizer = _tokenizer_of(lora.weights.parent)
    if tokenizer is None and lora.base is not None and (lora.base / "tokenizer.json").exists():
        tokenizer = lora.base / "tokenizer.json"
    serving = serving or Serving(tokenizer)
    if not merge:
        entries = [(name, Pending(tuple(t.shape), target, lambda t=t: t.to(target))) for name, t in adapters.items()]
        return write_peft_directory(out_dir, entries, spec, lora.base_name, serving)
    base = base_entries(spec, lora.base, lora.seed, getattr(torch, lora.held), lora.packed_cache)
    entries, merged = merged_entries(spec, base, adapters, target)
    written = write_hf_directory(out_dir, entries, config_to_hf(lora.model, dtype), serving, shard_bytes)
    packed = spec.adapter.base_format
    print(
        f"megatrain: merged {merged} adapted matrices (scale alpha / r = {spec.adapter.scale:g}) of the base "
        f"{lora.base_name or 'drawn from model.preset'} into {written}"
        + (f", its layers' matrices dequantized from its {packed} form, as the run trained on them" if packed else ""),
        file=sys.stderr,
    )
    return written

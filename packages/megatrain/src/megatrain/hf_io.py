"""Hugging Face model directories: initial weights in, trained weights out, by tensor name."""

import json
import shutil
from pathlib import Path

from megatrain_store import HostStore, atomic_write_text, load_tensors_into, write_safetensors
from megatrain_zoo import ModelSpec, ZooError, config_to_hf

SHARD_BYTES = 5 * 2**30  # the shard size transformers uses by default


def named_masters(store: HostStore) -> dict:
    """fp32 master weights by Hugging Face name (views into the store)."""
    return {name: view for group in range(store.n_groups) for name, view in store.master_views(group).items()}


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: one file or the shards its index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / shard for shard in shards]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ZooError(f"{index} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ZooError(f"no *.safetensors weights in {model_dir}; download the model's safetensors files")
    return files


def load_hf_weights(store: HostStore, spec: ModelSpec, model_dir: Path) -> None:
    """Stream the directory's tensors into the fp32 masters (any stored dtype), then refresh wire copies."""
    load_tensors_into(checkpoint_files(model_dir), named_masters(store), ignore=spec.checkpoint_names_to_ignore)
    for group in range(store.n_groups):
        store.refresh_wire(group)


def export_hf(
    store: HostStore, spec: ModelSpec, out_dir: Path, tokenizer: Path | None = None, shard_bytes: int = SHARD_BYTES
) -> Path:
    """Write config.json + fp32 safetensors (sharded with an index past `shard_bytes`) that
    transformers loads as the matching *ForCausalLM; copies tokenizer.json when given."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = list(named_masters(store).items())
    shards: list[list] = [[]]
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * 4
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, tensor))
        size += nbytes
    if len(shards) == 1:
        write_safetensors(out_dir / "model.safetensors", shards[0], metadata={"format": "pt"})
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            filename = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            write_safetensors(out_dir / filename, shard, metadata={"format": "pt"})
            weight_map.update({name: filename for name, _ in shard})
        index = {"metadata": {"total_size": sum(t.numel() * 4 for _, t in tensors)}, "weight_map": weight_map}
        atomic_write_text(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2))
    atomic_write_text(out_dir / "config.json", json.dumps(config_to_hf(spec.config), indent=2))
    if tokenizer is not None and Path(tokenizer).exists():
        shutil.copyfile(tokenizer, out_dir / "tokenizer.json")
    return out_dir


def convert(source: Path, out_dir: Path, dtype: str = "float32", shard_bytes: int = SHARD_BYTES) -> Path:
    """A Hugging Face directory from a megatrain checkpoint (or another HF directory), streamed
    tensor by tensor: at most one shard is in memory. `dtype`: float32 or bfloat16."""
    import torch
    from safetensors import safe_open

    from megatrain_zoo import ModelConfig, read_hf_config

    source = Path(source)
    manifest = source / "manifest.json"
    if manifest.exists():
        model = ModelConfig(**json.loads(manifest.read_text())["model"])
        files = [source / "model.safetensors"]
    else:
        model = read_hf_config(source)
        files = checkpoint_files(source)
    target = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    sizes = []  # (file, tensor name, bytes in the target dtype), in file order
    for path in files:
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                sizes.append((path, name, torch.Size(handle.get_slice(name).get_shape()).numel() * target.itemsize))
    shards, current, size = [], [], 0
    for path, name, nbytes in sizes:
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((path, name))
        size += nbytes
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        filename = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = []
        for path, name in shard:
            with safe_open(str(path), framework="pt") as handle:
                tensors.append((name, handle.get_tensor(name).to(target)))
        total += write_safetensors(out_dir / filename, tensors, metadata={"format": "pt"})
        weight_map.update({name: filename for name, _ in tensors})
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        atomic_write_text(out_dir / "model.safetensors.index.json", json.dumps(index, indent=2))
    atomic_write_text(out_dir / "config.json", json.dumps(config_to_hf(model, dtype), indent=2))
    for candidate in (source / "tokenizer.json", source.parent.parent / "final" / "tokenizer.json"):
        if candidate.exists():
            shutil.copyfile(candidate, out_dir / "tokenizer.json")
            break
    return out_dir

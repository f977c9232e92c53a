"""Hugging Face checkpoints by tensor name: reading a model directory's safetensors into a `HostStore` (any stored
dtype, MXFP4 experts and block-scaled FP8 dequantized, a generic model's converted as transformers' loader converts
them), checking them against a `ModelSpec` from their headers, and a store's weights as the named tensors an export
or a checkpoint writes (`WholeGroups`, `checkpoint_entries`)."""

import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from math import prod
from pathlib import Path

from megatrain_store import (
    BITSANDBYTES_NF4_PARTS,
    HostStore,
    Pending,
    QuantizedNF4,
    atomic_write_text,
    dequantize_nf4,
    match_tensors,
    nf4_from_bitsandbytes,
    open_safetensors,
    packed_cache_key,
    read_safetensors_header,
)
from megatrain_store.progress import progress
from megatrain_store.quant import ABSMAX_BLOCK, BLOCK
from megatrain_templates import file_tensors, join_stored, split_precision, split_precision_of

from .config import ZooError
from .skeleton import GenericError
from .spec import ModelSpec

# MXFP4 (OCP microscaling, gpt-oss' published experts): e2m1 values, two per byte (low nibble first),
# 32 per block sharing an 8-bit power-of-two scale (biased by 127)
FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32


def mxfp4_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of an MXFP4 expert tensor [n_experts, in, out] as gpt-oss stores it:
    [n_experts, out, in / 32, 16] bytes and [n_experts, out, in / 32] exponents."""
    experts, rows_in, rows_out = shape
    return (experts, rows_out, rows_in // MXFP4_BLOCK, MXFP4_BLOCK // 2), (experts, rows_out, rows_in // MXFP4_BLOCK)


def dequantize_mxfp4(blocks, scales):
    """MXFP4 blocks [E, out, G, 16] uint8 and scales [E, out, G] uint8 -> fp32 [E, in = 32 G, out]."""
    import torch

    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # low nibble first
    values = values.reshape(*scales.shape, MXFP4_BLOCK) * torch.exp2(scales.float() - 127).unsqueeze(-1)
    return values.reshape(*scales.shape[:2], -1).transpose(1, 2).contiguous()


def dequantize_fp8_blocks(weight, scale_inv, block: tuple[int, int], first_row: int = 0):
    """Block-scaled FP8 (DeepSeek-V3's checkpoints): rows first_row.. of an e4m3 matrix times the inverse
    scale of each [block[0], block[1]] tile it falls in ([ceil(out / b0), ceil(in / b1)] fp32) -> fp32."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return weight.float() * scale[first_row : first_row + rows, :cols]


def is_hf_directory(path: Path) -> bool:
    """A Hugging Face model directory: a config.json that describes a model (`model_type`), not a run
    directory's training config.json."""
    try:
        values = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(values, dict) and "model_type" in values


def all_finite(tensor, chunk: int = 2**20) -> bool:
    """Whether a tensor holds no NaN or Inf, checked a chunk at a time: torch.isfinite makes a float temporary of
    its input's size besides its result (a chunk of 2**24 fp32 values raised a run's peak memory by 80 MiB,
    past its plan, as the run exported its model), so a chunk's are a few MiB."""
    import torch

    flat = tensor.reshape(-1)
    if not flat.is_floating_point():
        return True
    return all(bool(torch.isfinite(flat[i : i + chunk]).all()) for i in range(0, flat.numel(), chunk))


def finite_checked(entries: list, offenders: list[str]) -> list:
    """`entries` whose tensors are checked for NaN/Inf as they are loaded to be written (no second pass over
    the state); the names of those that hold any are appended to `offenders`."""

    def load(name: str, pending):
        tensor = pending.load() if isinstance(pending, Pending) else pending
        if tensor is not None and not all_finite(tensor):
            offenders.append(name)
        return tensor

    return [(name, Pending(tuple(p.shape), p.dtype, lambda n=name, p=p: load(n, p))) for name, p in entries]


def named_masters(store: HostStore) -> dict:
    """fp32 master weights by the names files use (the store must hold every group whole): views into
    the store, or copies joined from the row slices of a tensor split over several groups (a packed group's: its
    weights unpacked, copies too; write them through `HostStore.writing`)."""
    views = {
        name: view
        for g in range(store.n_groups)
        for name, view in (
            store.layouts[g].views(store.weights(g)) if store.packing(g) else store.master_views(g)
        ).items()
    }
    return _named(store, views)


def named_wire(store: HostStore) -> dict:
    """What the device computes with, by the names files use: views of the store's wire copy (compute dtype), or of
    the fp32 master where it keeps none; pinned where the store pins (joined copies for a tensor split over groups; a
    packed group's weights unpacked, `HostStore.weights`)."""
    return _named(
        store,
        {name: view for g in range(store.n_groups) for name, view in store.layouts[g].views(store.weights(g)).items()},
    )


def _named(store: HostStore, views: dict) -> dict:
    return {
        name: join_stored(covered, [views[part] for part in covered])
        for name, (_, covered) in _store_layout(store).items()
    }


def _store_layout(
    store: HostStore, arena: str = "master", trained_only: bool = False
) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """File tensor name -> (shape, the stored tensors it is, back to back), for every stored tensor (of `arena`:
    optimizer state leaves out the frozen groups, which keep none; so do the weights, `trained_only`)."""
    frozen = store.frozen if arena.startswith("state.") or trained_only else ()
    layouts = [layout for group, layout in enumerate(store.layouts) if group not in frozen]
    return file_tensors({e.name: e.shape for layout in layouts for e in layout.entries})


class WholeGroups:
    """A store's master weights or optimizer state as named tensors to write, produced a group at a
    time in group order: views of its own buffers when it holds whole groups; otherwise (hosts split
    the state) each group is gathered from every host when its turn comes, by `gather(group, arena)`,
    which returns the whole flat group on the writing rank and None on the others. Those `replay`
    the same entries, so every host takes part in each gather in the same order."""

    def __init__(self, store: HostStore, gather=None):
        self.store, self.gather = store, gather
        self._last = (None, None)

    def _whole(self, arena: str, group: int):
        if self.gather is None:
            return self.store.held(arena, group)
        if self._last[0] != (arena, group):
            self._last = (None, None)  # let the previous group go before the next arrives
            self._last = ((arena, group), self.gather(group, arena))
        return self._last[1]

    def entries(self, arena: str = "master", prefix: str = "", trained_only: bool = False) -> list:
        """(prefix + name, Pending) for every tensor as files name them (the frozen groups' left out, `trained_only`),
        in buffer order: the row slices of a tensor split over several groups are joined, at its first slice's
        place; each in the dtype the store holds it in (a frozen group's may be the compute dtype)."""
        place = {e.name: (group, e) for group, layout in enumerate(self.store.layouts) for e in layout.entries}
        out = []
        for name, (shape, covered) in _store_layout(self.store, arena, trained_only).items():

            def load(arena=arena, covered=covered, shape=shape):
                pieces = []
                for part in covered:  # every part's group, also where it is not written here (the gathers)
                    group, e = place[part]
                    whole = self._whole(arena, group)
                    pieces.append(None if whole is None else whole[e.offset : e.offset + e.numel])
                if pieces[0] is None:
                    return None
                return join_stored(covered, pieces).view(shape)

            dtype = self.store.held(arena, place[covered[0]][0]).dtype
            out.append((prefix + name, Pending(shape, dtype, load)))
        return out

    @staticmethod
    def replay(entries: list) -> None:
        """Take part in writing `entries` without writing them (a rank that holds part of the state)."""
        for _, pending in entries:
            pending.load()


def load_groups(
    store: HostStore, files: list[Path], arena: str = "master", prefix: str = "", trained_only: bool = False
) -> None:
    """Fill the store's master weights (or optimizer state `state.NAME`) from safetensors files naming
    them `prefix + name` (as `WholeGroups` writes them; the frozen groups left as they are, `trained_only`); every
    tensor's presence and shape is checked first, so a bad file leaves the store untouched."""
    layout = _store_layout(store, arena, trained_only)
    shapes = {prefix + name: shape for name, (shape, _) in layout.items()}
    where = match_tensors(files, shapes, ignore=lambda name: not name.startswith(prefix))
    skip = store.frozen if trained_only else frozenset()
    with open_safetensors(where.values()) as handles:
        desc = f"load {files[0].parent.name}/{files[0].name}" + (f" {prefix.rstrip('.')}" if prefix else "")
        _fill_groups(store, handles, where, layout, arena, prefix, desc=desc, skip=skip)


def _check_finite(tensor, name: str, path: Path) -> None:
    """Refuse weights holding NaN or Inf as they are read, naming the tensor and its file: training from them
    only makes non-finite steps (and would save them)."""
    if not all_finite(tensor):
        raise ZooError(
            f"tensor {name} in {path} holds NaN or Inf values; these weights are damaged (a diverged run "
            "saved them?): use an earlier checkpoint or the original weights"
        )


def _fill_groups(
    store: HostStore,
    handles,
    where,
    layout: dict,
    arena="master",
    prefix="",
    quantized=None,
    desc="load weights",
    skip: frozenset[int] = frozenset(),
    placed: frozenset[str] = frozenset(),
) -> None:
    """Copy file tensors into the store group by group through `store.writing` (whatever part of the
    state it holds), refusing any that holds NaN or Inf. `layout`: file tensor name (less `prefix`) ->
    (shape, the stored tensors it is, back to back); a file tensor spanning several groups (a layer's
    experts streamed in parts) is read a group's rows at a time. `quantized` maps tensors stored
    quantized to how (`Quantized`), dequantized as they are read. Groups in `skip` (adapters) are left as they are;
    file tensors in `placed` too (a packed base's bytes, placed after: `_place_packed_nf4`)."""
    quantized = quantized or {}
    numel = {e.name: e.numel for lay in store.layouts for e in lay.entries}
    place = {}  # stored name -> (file tensor, its flat offset there)
    for name, (_, covered) in layout.items():
        offset = 0
        for part in covered:
            place[part] = (name, offset)
            offset += 0 if split_precision_of(part) else numel[part]
    frozen = store.frozen if arena.startswith("state.") else ()
    for group in progress(range(store.n_groups), desc=desc, unit="group", leave=False):
        if group in frozen or group in skip:  # (a frozen group keeps no optimizer state)
            continue
        with store.writing(group, arena) as views:
            targets: dict[str, list] = {}
            for part, view in views.items():
                name, offset = place[part]
                targets.setdefault(name, []).append((view, offset, part))
            for name, parts in targets.items():
                if name in placed:
                    continue
                low = min(offset for _, offset, _ in parts)
                high = max(offset + view.numel() for view, offset, _ in parts)
                rows, start = _read_rows(handles, where, prefix + name, layout[name][0], low, high, quantized.get(name))
                _check_finite(rows, prefix + name, where.get(prefix + name) or where.get(f"{prefix}{name}_blocks"))
                flat = rows.reshape(-1)
                for view, offset, part in parts:
                    piece = flat[offset - start : offset - start + view.numel()]
                    split = split_precision_of(part)
                    if split is not None:  # its hi or its lo, in the store's dtype
                        piece = split_precision(piece.to(view.dtype))[split[1]]
                    view.view(-1).copy_(piece)


def _read_rows(handles, where, name: str, shape: tuple[int, ...], low: int, high: int, quantized=None):
    """The rows (along dim 0) of file tensor `name` that hold its flat elements low..high-1, as
    (tensor, the flat offset of its first element); the whole tensor when they are all of it."""
    row = prod(shape[1:])
    first, stop = low // row, -(-high // row)
    whole = (first, stop) == (0, shape[0] if shape else 1)

    def read(key: str, rows: tuple[int, int] = (first, stop)):
        handle = handles[where[key]]
        return handle.get_tensor(key) if whole else handle.get_slice(key)[rows[0] : rows[1]]

    if quantized is None:
        return read(name), first * row
    if quantized.kind == "mxfp4":
        return dequantize_mxfp4(read(f"{name}_blocks"), read(f"{name}_scales")), first * row
    if quantized.kind == "nf4":  # (blocks run across rows: the whole weight, then its rows)
        import torch

        return dequantize_nf4(_bitsandbytes_nf4(handles, where, name, torch.float32))[first:stop], first * row
    tile = quantized.block[0]
    scale = read(f"{name}_scale_inv", (first // tile, -(-stop // tile)))
    return dequantize_fp8_blocks(read(name), scale, quantized.block, first % tile), first * row


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a Hugging Face directory: one file or the shards its index names."""
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:  # (an interrupted download: empty, cut)
            raise ZooError(f"{index} is damaged ({error!r}); download it again") from None
        files = [model_dir / shard for shard in shards]
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise ZooError(f"{index} names shard(s) that do not exist: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ZooError(f"no *.safetensors weights in {model_dir}; download the model's safetensors files")
    return files


# A model directory is known by its weight files' names and sizes and this many 64 KiB blocks of each, spread evenly:
# merged LoRA adapters change every adapted matrix, so a changed model differs in most of them (read in milliseconds,
# where hashing a 70B model whole takes minutes), and a copy of the same files is the same model.
FINGERPRINT_BLOCKS = 64


def weights_fingerprint(model_dir: Path) -> str:
    """A short hash of a Hugging Face directory's weight files (`FINGERPRINT_BLOCKS`)."""
    digest = hashlib.sha256()
    for path in checkpoint_files(model_dir):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as handle:
            for block in range(FINGERPRINT_BLOCKS):
                handle.seek(size * block // FINGERPRINT_BLOCKS)
                digest.update(handle.read(2**16))
    return digest.hexdigest()[:16]


def check_same_weights(model_dir: str | None, fingerprint: str | None, trained: Path) -> None:
    """Refuse a LoRA checkpoint (`trained`, its base's `fingerprint`) over a base model whose files changed since it
    was trained over them (merged adapters written over it, another revision): its adapters would run over weights
    they never saw. None (no base directory, a checkpoint of no LoRA run or of an older megatrain) passes."""
    if model_dir is not None and fingerprint is not None and weights_fingerprint(Path(model_dir)) != fingerprint:
        raise ZooError(
            f"the base model {model_dir} is not the one checkpoint {trained} was trained over (its weight files "
            "changed since); restore that base, or start a new run from these adapters (model.adapter.path)"
        )


def check_weights_unchanged(model_dir: Path, record: Path, what: str) -> None:
    """Refuse `model_dir` where `record` holds another fingerprint of the same directory (its weight files changed
    since: a resumed run wrote a new model over it); the first time, or for another directory, write `record`."""
    fingerprint = weights_fingerprint(Path(model_dir))
    try:
        recorded = json.loads(Path(record).read_text())
    except (OSError, ValueError):
        recorded = {}
    if recorded.get("directory") == str(Path(model_dir).resolve()) and recorded.get("fingerprint") != fingerprint:
        raise ZooError(
            f"{what} {model_dir} changed since this run used it (its weight files differ): what it gives now is "
            "another model's; restore it, or point the setting at a copy of the model it was"
        )
    Path(record).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(
        Path(record), json.dumps({"directory": str(Path(model_dir).resolve()), "fingerprint": fingerprint})
    )


def _checkpoint_layout(spec: ModelSpec, present: set[str]) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """Checkpoint tensor name -> (shape, the stored tensors it holds, in buffer order), for the
    names the files (holding `present`) use: published per-expert names, or transformers' in-memory
    layout (fused 3-D expert tensors, Mixtral's module renamed `mlp`), either way, under any of the names'
    aliases (an image-text checkpoint's text model)."""
    layout = file_tensors(spec.param_shapes(adapters=False))
    for name, (shape, covered) in spec.fused_checkpoint_names().items():
        if not present.isdisjoint((name, *spec.checkpoint_aliases(name))):
            for part in covered:
                del layout[part]
            layout[name] = (shape, covered)
    for name in list(layout):
        alias = next((alias for alias in spec.checkpoint_aliases(name) if alias in present), None)
        if alias is not None:
            layout[alias] = layout.pop(name)
    return layout


@dataclass(frozen=True)
class Quantized:
    """How a checkpoint tensor is stored: "mxfp4" (`NAME_blocks` + `NAME_scales`, gpt-oss' experts) or
    "fp8" (`NAME` in e4m3 + `NAME_scale_inv` per `block` tile, DeepSeek-V3's matrices)."""

    kind: str
    block: tuple[int, int] = (0, 0)


def _fp8_block(files: list[Path]) -> tuple[int, int]:
    """The FP8 tile of the directory's config.json (`quantization_config.weight_block_size`)."""
    config = files[0].parent / "config.json"
    quantization = json.loads(config.read_text()).get("quantization_config") or {} if config.exists() else {}
    block = quantization.get("weight_block_size")
    if not block or len(block) != 2:
        raise ZooError(
            f"{files[0].parent}: the checkpoint holds FP8 weights with weight_scale_inv, but config.json names no "
            "quantization_config.weight_block_size (DeepSeek-V3's is [128, 128]); add it"
        )
    return int(block[0]), int(block[1])


def _read_layout(spec: ModelSpec, files: list[Path]):
    """From the files' headers, read once: (the layout as `_checkpoint_layout`, the tensors they hold
    quantized -> `Quantized`, every name the files must hold -> its shape, every name they hold)."""
    headers = {name: info for path in files for name, info in read_safetensors_header(path).items()}
    present = set(headers)
    layout = _checkpoint_layout(spec, present)
    quantized, fp8 = {}, None
    for name, (shape, _) in layout.items():
        if len(shape) == 3 and f"{name}_blocks" in present and f"{name}_scales" in present:
            quantized[name] = Quantized("mxfp4")
        elif len(shape) == 2 and f"{name}_scale_inv" in present:
            quantized[name] = fp8 = fp8 or Quantized("fp8", _fp8_block(files))  # config.json read once
        elif len(shape) == 2 and f"{name}.{BITSANDBYTES_NF4_PARTS[-1]}" in present:
            quantized[name] = Quantized("nf4")
    shapes = {
        name: shape for name, (shape, _) in layout.items() if name not in quantized or quantized[name].kind == "fp8"
    }
    for name, how in quantized.items():
        shape = layout[name][0]
        if how.kind == "mxfp4":
            shapes[f"{name}_blocks"], shapes[f"{name}_scales"] = mxfp4_shapes(shape)
        elif how.kind == "nf4":  # (the state's JSON is as long as it is)
            shapes |= _bitsandbytes_nf4_shapes(
                name, shape, tuple(headers[f"{name}.{BITSANDBYTES_NF4_PARTS[-1]}"]["shape"])
            )
        else:
            shapes[f"{name}_scale_inv"] = (-(-shape[0] // how.block[0]), -(-shape[1] // how.block[1]))
    return layout, quantized, shapes, present


def _bitsandbytes_nf4_shapes(name: str, shape: tuple[int, ...], state: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
    """The tensors a bitsandbytes NF4 weight of `shape` is saved as, by name, with their shapes (`state`: its JSON's)."""
    blocks = -(-prod(shape) // BLOCK)
    sizes = {"absmax": (blocks,), "quant_map": (16,), "nested_absmax": (-(-blocks // ABSMAX_BLOCK),)}
    sizes["nested_quant_map"] = (256,)  # (the 8-bit statistics' code map)
    return {name: (-(-prod(shape) // 2), 1)} | {
        f"{name}.{part}": sizes.get(part, state) for part in BITSANDBYTES_NF4_PARTS
    }


def _bitsandbytes_nf4(handles, where, name: str, dtype) -> QuantizedNF4:
    """File tensor `name`, saved by bitsandbytes in NF4 (`_bitsandbytes_nf4_shapes`), as a QuantizedNF4 in `dtype`."""
    parts = {part: handles[where[f"{name}.{part}"]].get_tensor(f"{name}.{part}") for part in BITSANDBYTES_NF4_PARTS}
    return nf4_from_bitsandbytes(name, handles[where[name]].get_tensor(name), parts, dtype)


def _packed_nf4_names(store: HostStore, layout: dict, quantized: dict, skip: frozenset[int]) -> dict[str, int]:
    """The checkpoint's NF4 matrices that a packed base takes as they are: file tensor name -> its group."""
    group_of = {
        p.entry.name: g for g, packed in store.packed.layouts.items() for p in packed.entries if p.format == "nf4"
    }
    names = {}
    for name, how in quantized.items():
        covered = layout[name][1]
        group = group_of.get(covered[0]) if how.kind == "nf4" and len(covered) == 1 else None
        if group is not None and group not in skip:
            names[name] = group
    return names


def _place_packed_nf4(store: HostStore, handles, where, layout: dict, names: dict[str, int]) -> None:
    """A packed base's NF4 matrices (`names`) as the checkpoint holds them, byte for byte, read once: their
    dequantized weights quantized again need not give back the same bytes. Their scales are checked as a read
    weight is (the dequantized values are finite where the absmax is)."""
    for name, group in names.items():
        q = _bitsandbytes_nf4(handles, where, name, store.packed.layouts[group].dtype)
        _check_finite(q.absmax_scales, name, where[name])
        _check_finite(q.offset, name, where[name])
        store.packed.place(group, layout[name][1][0], q)


def check_hf_weights(spec: ModelSpec, model_dir: Path) -> None:
    """Refuse, from the headers alone and before any memory is allocated, a directory whose tensors
    are missing, unexpected or mis-shaped for `spec`."""
    _check_files(spec, checkpoint_files(model_dir))


def _check_files(spec: ModelSpec, files: list[Path]) -> None:
    """`check_hf_weights` of a directory's safetensors `files`."""
    if spec.checkpoint_layout is not None:
        _bind_generic_buffers(spec, files)  # (here, as every rank checks: each rank's layers compute with them)
        return
    match_tensors(files, _read_layout(spec, files)[2], ignore=spec.checkpoint_names_to_ignore)


PACKED_CACHE = "packed-base.safetensors"  # a packed base's bytes, in a run's cache directory


def load_hf_weights(store: HostStore, spec: ModelSpec, model_dir: Path, cache_dir: Path | None = None) -> None:
    """Stream the directory's tensors into the fp32 masters (any stored dtype), group by group through
    `store.writing` (which also refreshes the wire copies).

    A fused expert tensor fills the tensors it covers (back to back, in one group or several); MXFP4
    experts and block-scaled FP8 matrices are dequantized into theirs. `cache_dir`: where a packed base's bytes are
    kept as these files quantize (PACKED_CACHE, `PackedGroups.save`): read instead of quantizing where they match the
    files and the layout, else written once quantized."""
    files = checkpoint_files(model_dir)
    packed_cache = None if cache_dir is None else cache_dir / PACKED_CACHE
    skip = set(spec.adapter_groups)
    key = packed_base_key(files, store.packed.layouts) if packed_cache is not None and store.packed.layouts else None
    cached = key is not None and store.packed.load(packed_cache, key)
    if cached:
        print(f"megatrain: read the packed base from {packed_cache}, not quantizing it again", file=sys.stderr)
        skip |= set(store.packed.layouts)
    if spec.checkpoint_layout is not None:
        _load_generic(store, spec, files, frozenset(skip))
    else:
        _load_native(store, spec, files, frozenset(skip))
    if key is not None and not cached:
        _cache_packed_base(store, packed_cache, key)


def _load_native(store: HostStore, spec: ModelSpec, files: list[Path], skip: frozenset[int]) -> None:
    layout, quantized, shapes, present = _read_layout(spec, files)
    where = match_tensors(files, shapes, ignore=spec.checkpoint_names_to_ignore)
    for kind in sorted({how.kind for how in quantized.values()}):
        count = sum(how.kind == kind for how in quantized.values())
        into = "into the packed base as they are" if kind == "nf4" and store.packed.layouts else "dequantized"
        print(f"megatrain: reading {count} {kind.upper()} tensors {into}", file=sys.stderr)
    skipped = sorted(name for name in present if spec.left_out(name) is not None)
    if skipped:
        print(
            f"megatrain: leaving out {len(skipped)} tensors of {spec.left_out(skipped[0])} ({skipped[0]} ...): "
            "the causal language model does not use them and megatrain does not train them",
            file=sys.stderr,
        )
    placed = _packed_nf4_names(store, layout, quantized, skip)
    with open_safetensors(where.values()) as handles:
        _fill_groups(store, handles, where, layout, quantized=quantized, skip=skip, placed=frozenset(placed))
        _place_packed_nf4(store, handles, where, layout, placed)


def packed_base_key(files: list[Path], layouts: dict) -> str:
    """What a packed base kept of checkpoint `files` in these packed layouts depends on (`packed_cache_key`): the
    files' names, sizes and modification times, and the layouts."""
    identity = repr([(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files])
    return packed_cache_key(identity, layouts)


def _cache_packed_base(store: HostStore, path: Path, key: str) -> None:
    """Keep the packed base beside the run, for a resumed run (or eval) to read, where the disk has room for it twice
    over (the rest stays the checkpoints'); a disk that cannot take it only costs that run the quantizing."""
    needed = store.arenas["packed"].numel()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        free = shutil.disk_usage(path.parent).free
        if free < 2 * needed:
            raise OSError(f"it takes {needed / 2**30:.1f} GiB and the disk has {free / 2**30:.1f} GiB free")
        size = store.packed.save(path, key)
    except OSError as error:
        print(
            f"megatrain: not keeping the packed base in {path} ({error}); a resumed run quantizes it again",
            file=sys.stderr,
        )
        return
    print(f"megatrain: kept the packed base in {path} ({size / 2**30:.1f} GiB) for a resumed run", file=sys.stderr)


def _generic_sources(spec: ModelSpec, files: list[Path]) -> tuple[dict[str, list[str]], dict[str, Path]]:
    """(a generic model's parameter -> the checkpoint tensors making it, checkpoint tensor -> its file)."""
    where = {name: path for path in files for name in read_safetensors_header(path) if name != "__metadata__"}
    try:
        return spec.checkpoint_layout.sources(list(where), str(files[0].parent), buffers=True), where
    except GenericError as error:
        raise ZooError(str(error)) from None


def _bind_generic_buffers(spec: ModelSpec, files: list[Path]) -> None:
    """A generic model's persistent buffers (Apertus' xIELU beta and eps) set to the checkpoint's values: constants
    its layers compute with, held by its modules rather than the store; the checkpoint is checked on the way."""
    where = {name: path for path in files for name in read_safetensors_header(path) if name != "__metadata__"}
    if any(name.endswith(BITSANDBYTES_NF4_PARTS[-1]) for name in where):
        raise ZooError(
            f"{files[0].parent} holds bitsandbytes NF4 weights, which megatrain's own templates read, not transformers' "
            "modules; set model.implementation: auto (or native)"
        )
    try:
        sources = spec.checkpoint_layout.buffer_sources(list(where), str(files[0].parent))
        if sources:
            with open_safetensors({where[key] for key in sources.values()}) as handles:
                values = {name: handles[where[key]].get_tensor(key) for name, key in sources.items()}
            spec.checkpoint_layout.bind_buffers(values, str(files[0].parent))
    except GenericError as error:
        raise ZooError(str(error)) from None


def _load_generic(store: HostStore, spec: ModelSpec, files: list[Path], skip: frozenset[int]) -> None:
    """A generic model's weights, a group at a time: its checkpoint tensors read, converted to its modules'
    names and layouts as transformers' loader converts them, checked and copied into the store (but the groups in
    `skip`: a LoRA run's adapters, a packed base read from its cache)."""
    _bind_generic_buffers(spec, files)
    sources, where = _generic_sources(spec, files)
    with open_safetensors(set(where.values())) as handles:
        for group in progress(range(store.n_groups), desc="load weights", unit="group", leave=False):
            if group in skip:
                continue
            with store.writing(group) as views:
                keys = [key for name in views for key in sources[name]]
                read = {key: handles[where[key]].get_tensor(key) for key in keys}
                for key, tensor in read.items():
                    _check_finite(tensor, key, where[key])
                loaded = spec.checkpoint_layout.load(read)
                for name, view in views.items():
                    if tuple(loaded[name].shape) != tuple(view.shape):
                        raise ZooError(
                            f"{files[0].parent}: {name} is {tuple(loaded[name].shape)} in the checkpoint, the model "
                            f"needs {tuple(view.shape)}; the checkpoint is for a different configuration"
                        )
                    view.copy_(loaded[name])


def checkpoint_entries(spec: ModelSpec, entries: list) -> list:
    """`entries` ((name, Pending) by the model's names) as the family's checkpoints name and lay them out: a
    generic model's converted a group at a time, as transformers saves them; a native model's as they are."""
    if spec.checkpoint_layout is None:
        return entries
    import torch

    pending = dict(entries)
    out = []
    for group in spec.groups:
        names = [p.name for p in group.params if p.name in pending]
        meta = {name: torch.empty(pending[name].shape, dtype=pending[name].dtype, device="meta") for name in names}
        converted = _ConvertedGroup(spec.checkpoint_layout, {name: pending[name] for name in names})
        for key, tensor in spec.checkpoint_layout.save(meta).items():
            out.append((key, Pending(tuple(tensor.shape), tensor.dtype, lambda key=key, c=converted: c.take(key))))
    # (the persistent buffers, as transformers saves them: a reload computes with the values trained with)
    for name, buffer in spec.checkpoint_layout.bound_buffers().items():
        out.append((name, Pending(tuple(buffer.shape), buffer.dtype, lambda b=buffer: b.cpu())))
    return out


class _ConvertedGroup:
    """A group's tensors in checkpoint form: converted once, when the first is written; each handed out once."""

    def __init__(self, layout, pending: dict):
        self.layout, self.pending, self.tensors = layout, pending, None

    def take(self, key: str):
        if self.tensors is None:
            self.tensors = self.layout.save({name: p.load() for name, p in self.pending.items()})
        return self.tensors.pop(key)


def entries_as_imported(spec: ModelSpec, files: list[Path], where: dict, shapes: dict, target) -> list:
    """The files' tensors as megatrain imports them, to be read when written: quantized ones dequantized under their
    own names, those the model leaves out left out, those the files name otherwise under the model's names. Refused
    first, as an import refuses them (`check_hf_weights`), where they are not `spec`'s: a config.json that does not
    describe its weights would be written beside tensors it does not load."""
    _check_files(spec, files)
    leave_out = spec.checkpoint_names_to_ignore  # the config written says it has none of what is left out
    # tensors the files name otherwise (Gemma 3's text model in its image-text checkpoint) go out under the model's names
    canonical = {alias: name for name in file_tensors(spec.param_shapes()) for alias in spec.checkpoint_aliases(name)}
    fp8_block = _fp8_block(files) if any(name.endswith("_scale_inv") for name in where) else None

    nf4_parts = tuple(f".{part}" for part in BITSANDBYTES_NF4_PARTS)

    def load(name: str, how: str | None):
        if how == "nf4":
            keys = (name, *(name + part for part in nf4_parts))
            with open_safetensors({where[key] for key in keys}) as handles:
                return dequantize_nf4(_bitsandbytes_nf4(handles, where, name, target))
        keys = {"fp8": (name, f"{name}_scale_inv"), "mxfp4": (f"{name}_blocks", f"{name}_scales")}.get(how, (name,))
        with open_safetensors({where[key] for key in keys}) as handles:
            tensors = [handles[where[key]].get_tensor(key) for key in keys]
        if how == "fp8":
            tensors = [dequantize_fp8_blocks(*tensors, fp8_block)]
        elif how == "mxfp4":
            tensors = [dequantize_mxfp4(*tensors)]
        return tensors[0].to(target)

    entries = []
    for name in where:
        if name.endswith(("_scale_inv", "_scales", *nf4_parts)) or leave_out(name):
            continue
        shape = shapes[name]
        how = "fp8" if f"{name}_scale_inv" in where else "nf4" if name + nf4_parts[-1] in where else None
        if name.endswith("_blocks"):
            name, how = name.removesuffix("_blocks"), "mxfp4"
            experts, rows_out, groups, _ = shape
            shape = (experts, groups * MXFP4_BLOCK, rows_out)
        if how == "nf4":
            shape = _bitsandbytes_nf4_shape(where, name)
        entries.append((canonical.get(name, name), Pending(shape, target, lambda name=name, how=how: load(name, how))))
    return entries


def _bitsandbytes_nf4_shape(where: dict, name: str) -> tuple[int, ...]:
    """The weight's shape a bitsandbytes NF4 tensor's state (its JSON) records."""
    key = f"{name}.{BITSANDBYTES_NF4_PARTS[-1]}"
    with open_safetensors({where[key]}) as handles:
        return tuple(json.loads(bytes(handles[where[key]].get_tensor(key).tolist()).decode())["shape"])

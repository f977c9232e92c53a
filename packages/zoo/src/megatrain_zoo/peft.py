"""PEFT's adapter directories: `adapter_config.json` (the LoRA settings) beside `adapter_model.safetensors` (the
adapters, named `base_model.model.` + the model's own names), read into a run's adapter groups and written from
them, so that an adapter trained here loads with `peft.PeftModel.from_pretrained` and back."""

import json
import math
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatrain_store import (
    Entry,
    HostStore,
    PackedBaseFile,
    Pending,
    atomic_write_text,
    match_tensors,
    open_safetensors,
    read_safetensors_header,
    write_safetensors,
)
from megatrain_store.packed import quantizes, round_trip
from megatrain_templates import ALL_LINEAR, EXPERT_NAMING, Lora, MoeShape, file_tensors
from megatrain_templates.expert_adapters import FUSED_MATRICES, adapted_expert_matrices
from megatrain_templates.moe_layout import router_name, transformers_module

from .config import ModelConfig, ZooError
from .hf_weights import _fill_groups, is_hf_directory, packed_base_key
from .shapes import moe_shape
from .spec import ModelSpec

PEFT_CONFIG, PEFT_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
# PEFT 0.22's target_parameters of a MoE, which it makes of target_modules in the families transformers fuses the
# experts of (`MoeShape.lora_reaches_experts`), each with the target_modules name megatrain reads it as
FUSED_TARGETS = {"gate.weight": "gate", "gate_up_proj": "gate_up_proj", "down_proj": "down_proj"}
GATE_UP_PATTERN = r".*\.gate_up_proj"
PEFT_PREFIX = "base_model.model."  # PeftModel's name of the model it wraps, before the model's own names
# settings of adapter_config.json that change what the adapters compute, at the value that leaves LoRA as megatrain
# computes it (scale alpha / r, every targeted layer at rank r, no bias, no magnitude vector)
_PLAIN_LORA = {
    "use_rslora": False,
    "use_dora": False,
    "bias": "none",
    "lora_bias": False,
    "rank_pattern": {},
    "alpha_pattern": {},
    "layers_to_transform": None,
    "modules_to_save": None,
    "fan_in_fan_out": False,
    "trainable_token_indices": None,
    "target_parameters": None,
    "layer_replication": None,
    "use_qalora": False,
    "alora_invocation_tokens": None,
}


@dataclass(frozen=True)
class LoraSource:
    """What a LoRA run's weights are: its model, its adapter's settings, the file holding the adapters (their names
    there: `prefix` + the model's), and its base: a Hugging Face directory, or (a preset's run) drawn as the run drew
    it, from `seed` in the dtype it held the base in."""

    model: ModelConfig
    adapter: Lora
    weights: Path
    prefix: str
    base: Path | None
    seed: int = 0
    held: str = "float32"
    packed_cache: Path | None = None  # the packed base the run kept (`PackedGroups.save`), where it packed one

    @property
    def base_name(self) -> str | None:
        """adapter_config.json's base_model_name_or_path: the base's directory (None: a preset's drawn weights)."""
        return None if self.base is None else str(self.base)


def read_peft_config(adapter_dir: Path) -> Lora:
    """The LoRA settings of a PEFT adapter directory (r, lora_alpha, lora_dropout, target_modules); settings that
    change what its adapters compute beyond plain LoRA (rsLoRA, DoRA, per-layer ranks, biases, ...) are refused."""
    path = Path(adapter_dir) / PEFT_CONFIG
    if not path.is_file():
        raise ZooError(f"{adapter_dir} holds no {PEFT_CONFIG}: model.adapter.path must name a PEFT adapter directory")
    settings = json.loads(path.read_text())
    if settings.get("peft_type", "LORA") != "LORA":
        raise ZooError(f"{path}: peft_type {settings['peft_type']!r}; megatrain trains LORA adapters")
    fused = tuple(settings.get("target_parameters") or ())
    plain_settings = _PLAIN_LORA | _fused_patterns(int(settings["r"]), float(settings["lora_alpha"]), fused)
    del plain_settings["target_parameters"]  # (checked by name below)
    for key, plain in plain_settings.items():
        if settings.get(key) not in (plain, None, {}, []):
            raise ZooError(
                f"{path}: {key} is {settings[key]!r}; megatrain computes plain LoRA ({key}: {plain!r}): "
                "train this adapter with PEFT, or start a plain one"
            )
    strange = [name for name in fused if name not in FUSED_TARGETS]
    if strange:
        raise ZooError(
            f"{path}: target_parameters names {strange[0]!r}; megatrain adapts the parameters PEFT 0.22 adapts for "
            f"target_modules ({', '.join(FUSED_TARGETS)}): train this adapter with PEFT, or start one by module names"
        )
    targets = settings.get("target_modules") or ()
    if isinstance(targets, str) and targets != ALL_LINEAR and not re.fullmatch(r"[\w.]+", targets):
        raise ZooError(
            f"{path}: target_modules is the pattern {targets!r}; megatrain reads module names: list them instead"
        )
    targets = ((targets,) if isinstance(targets, str) else tuple(targets)) + tuple(FUSED_TARGETS[n] for n in fused)
    lora_alpha, dropout = float(settings["lora_alpha"]), float(settings.get("lora_dropout", 0.0))
    return Lora(int(settings["r"]), lora_alpha, _layer_module_names(targets), dropout)


def _fused_patterns(r: int, alpha: float, fused: tuple[str, ...]) -> dict:
    """rank_pattern and alpha_pattern as PEFT 0.22 writes them for the fused targets `fused`: the gate-up matrix of
    two members at rank 2r, alpha 2 alpha (its scale alpha / r)."""
    if "gate_up_proj" not in fused:
        return {}
    alpha_2 = int(2 * alpha) if float(2 * alpha).is_integer() else 2 * alpha
    return {"rank_pattern": {GATE_UP_PATTERN: 2 * r}, "alpha_pattern": {GATE_UP_PATTERN: alpha_2}}


def _layer_module_names(targets: tuple[str, ...]) -> tuple[str, ...]:
    """target_modules as names within a decoder layer: a module's full path (`model.layers.0.self_attn.q_proj`, as
    PEFT writes all-linear resolved) becomes its part after `layers.N.` (every layer's templates are alike; an adapter
    missing from some layers is then refused by its weights' check), a name stays as it is."""
    names = []
    for target in targets:
        inside = re.match(r"^(?:.*\.)?layers\.\d+\.(.+)$", target)
        name = inside.group(1) if inside else target
        if name not in names:
            names.append(name)
    return tuple(names)


def is_peft_directory(path: Path) -> bool:
    """A PEFT adapter directory: an adapter_config.json beside adapter_model.safetensors."""
    return (Path(path) / PEFT_CONFIG).is_file() and (Path(path) / PEFT_WEIGHTS).is_file()


def is_model_directory(path: Path) -> bool:
    """A whole model's directory: a Hugging Face model's, or a PEFT adapter's (not an export a kill left midway)."""
    return is_hf_directory(path) or is_peft_directory(path)


def adapter_layout(spec: ModelSpec) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """The adapters' tensors as PEFT's files name them (less `PEFT_PREFIX`) -> (shape, the stored tensors each is)."""
    return file_tensors({p.name: p.shape for g in sorted(spec.adapter_groups) for p in spec.groups[g].params})


def check_peft_weights(spec: ModelSpec, adapter_dir: Path) -> Path:
    """Refuse, from its header alone, a PEFT directory's adapter_model.safetensors whose tensors are not those of
    `spec`'s adapter (another base model, another r, other target modules), in one line naming the tensor, both shapes
    and the fix. Returns the file."""
    path = Path(adapter_dir) / PEFT_WEIGHTS
    if not path.is_file():
        other = (
            " (adapter_model.bin: save it again with safetensors)"
            if (path.parent / "adapter_model.bin").exists()
            else ""
        )
        raise ZooError(f"{adapter_dir} holds no {PEFT_WEIGHTS}{other}; model.adapter.path must name a PEFT adapter")
    lora, layout = spec.adapter, adapter_layout(spec)
    found = {k: tuple(v["shape"]) for k, v in read_safetensors_header(path).items() if k != "__metadata__"}
    targets = ", ".join(lora.target_modules)
    for key, shape in found.items():
        name = key.removeprefix(PEFT_PREFIX)
        if ".lora_A.default." in key or ".lora_B.default." in key:
            raise ZooError(
                f"{path}: {key} is named as in PeftModel.state_dict(), not as PEFT saves an adapter; write it with "
                "PeftModel.save_pretrained (or name its tensors without .default)"
            )
        if not key.startswith(PEFT_PREFIX) or name not in layout:
            module = name.rsplit(".lora_", 1)[0]
            raise ZooError(
                f"{path}: {key} {shape} adapts {module}, which this model's adapter (target_modules: {targets}) does "
                f"not have; the adapter is for another base model (use model.hf_dir of the model it was trained on)"
            )
        need = layout[name][0]
        if shape != need:
            rank_axis = 0 if ".lora_A." in name else 1
            if len(shape) == 2 and shape[1 - rank_axis] == need[1 - rank_axis]:
                fix = (
                    f"its rank is {shape[rank_axis]}, adapter_config.json says r: {lora.r}; set r to {shape[rank_axis]}"
                )
            else:
                fix = "the adapter is for another base model (use model.hf_dir of the model it was trained on)"
            raise ZooError(f"{path}: {key} has shape {shape}, this model needs {need}; {fix}")
    missing = [name for name in layout if PEFT_PREFIX + name not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ZooError(
            f"{path} holds no {PEFT_PREFIX + missing[0]} {layout[missing[0]][0]}{more}: target_modules ({targets}) "
            "adapt it on this model; the adapter is for another base model, or its adapter_config.json names "
            "target_modules its weights do not have (set them to the modules it adapts)"
        )
    return path


def load_peft_adapter(store: HostStore, spec: ModelSpec, adapter_dir: Path) -> None:
    """Fill the store's adapter groups from a PEFT directory's adapter_model.safetensors (any stored dtype), every
    tensor's presence and shape checked first (`check_peft_weights`): a bad file leaves the store untouched."""
    path = check_peft_weights(spec, adapter_dir)
    layout = adapter_layout(spec)
    where = match_tensors([path], {PEFT_PREFIX + name: shape for name, (shape, _) in layout.items()})
    others = frozenset(range(store.n_groups)) - spec.adapter_groups
    with open_safetensors(where.values()) as handles:
        _fill_groups(store, handles, where, layout, prefix=PEFT_PREFIX, desc=f"load {path.parent.name}", skip=others)


def target_module_names(spec: ModelSpec) -> list[str]:
    """The names (q_proj, ..., down_proj) of the modules `spec`'s adapter adapts, all-linear resolved; a MoE's fused
    experts and router not (`fused_target_names`)."""
    fused = fused_target_names(spec)
    names = {name.rsplit(".lora_", 1)[0] for name in adapter_layout(spec)}
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name in names
            if not name.endswith((".experts", ".experts.base_layer"))
            and not ("gate.weight" in fused and name.endswith(".mlp.gate"))
        }
    )


# the names of an expert's projections in transformers' mixtures of experts (Mixtral's w1, w2, w3)
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj", "gate_up_proj", "w1", "w2", "w3")
# config.json's counts of routed experts, by family (Mixtral's, Qwen2-MoE's, DeepSeek's, ERNIE's)
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def experts_note(spec: ModelSpec) -> str | None:
    """What a MoE run whose target_modules name an expert's projection (or all-linear) says where they reach no
    expert: its family's experts are parameters PEFT 0.22 does not adapt either (gpt-oss', Llama 4's, Qwen3.5's),
    or the generic path runs it (its LoRA adapts nn.Linear layers; fused experts are parameters, which PEFT 0.22
    adapts in the families it converts); None where they reach them, or name none."""
    adapter, config = spec.adapter, spec.config
    named = adapter and [
        t for t in adapter.target_modules if t == ALL_LINEAR or t.rsplit(".", 1)[-1] in EXPERT_PROJECTIONS
    ]
    if not named or any(".experts." in name for name in adapter_layout(spec)):
        return None
    if config.implementation == "transformers":
        if not any(json.loads(config.hf_config or "{}").get(key) for key in EXPERT_COUNTS):
            return None
        why = "on the generic path, whose LoRA adapts nn.Linear layers (PEFT 0.22 adapts fused experts where it converts them)"
    elif config.is_moe:
        why = f"of {config.arch}'s MoE layers, whose experts PEFT does not adapt either"
    else:
        return None
    return (
        f"model.adapter.target_modules {named} adapt no routed expert {why}: megatrain adapts the matrices beside "
        "them (a shared expert's, a dense layer's)"
    )


def fused_target_names(spec: ModelSpec) -> list[str]:
    """PEFT 0.22's target_parameters of `spec`'s adapter: the fused expert matrices and the router it adapts."""
    reached = _reached_experts(spec)
    if reached is None:
        return []
    moe, experts = reached
    router = spec.adapter.adapts(router_name(moe))
    return sorted((["gate.weight"] if router else []) + [FUSED_MATRICES[name] for name in experts])


def _reached_experts(spec: ModelSpec) -> "tuple[MoeShape, tuple[str, ...]] | None":
    """(the MoE's shape, the span names of the expert matrices `spec`'s adapter adapts: `adapted_expert_matrices`)
    where its target_modules reach experts (`MoeShape.lora_reaches_experts`); None where they cannot."""
    if spec.adapter is None or not spec.config.is_moe or not moe_shape(spec.config).lora_reaches_experts:
        return None
    moe = moe_shape(spec.config)
    return moe, adapted_expert_matrices(spec.adapter, EXPERT_NAMING[moe.naming][1])


def peft_config(spec: ModelSpec, base_model_name_or_path: str | None) -> dict:
    """The adapter_config.json of `spec`'s adapter, as PEFT writes one for a causal language model."""
    lora = spec.adapter
    alpha = int(lora.alpha) if float(lora.alpha).is_integer() else lora.alpha
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.r,
        "lora_alpha": alpha,
        "lora_dropout": lora.dropout,
        "target_modules": target_module_names(spec),
        "init_lora_weights": True,
        "inference_mode": True,
        "revision": None,
        **_PLAIN_LORA,
        **({"target_parameters": fused} if (fused := fused_target_names(spec)) else {}),
        **_fused_patterns(lora.r, lora.alpha, tuple(fused)),
    }


def write_peft_adapter(entries: list, spec: ModelSpec, out_dir: Path, base_model_name_or_path: str | None) -> Path:
    """Write `entries` ((model name, Pending) of the adapters, as `WholeGroups.entries(trained_only=True)` gives
    them) into `out_dir` as PEFT saves an adapter: adapter_model.safetensors (PEFT's names, in the dtype held), then
    adapter_config.json. Each file is written atomically, the config last, so a directory with an adapter_config.json
    holds its weights; `megatrain.export` writes the directory whole (with its tokenizer) through a staging folder."""
    out_dir = Path(out_dir)
    layout = adapter_layout(spec)
    names = [name for name, _ in entries]
    if sorted(names) != sorted(layout):
        stray = sorted(set(names) ^ set(layout))
        raise ZooError(f"write_peft_adapter: the entries are not {spec.config.arch}'s adapters ({stray[:3]} ...)")
    out_dir.mkdir(parents=True, exist_ok=True)
    renamed = [(PEFT_PREFIX + name, pending) for name, pending in entries]
    write_safetensors(out_dir / PEFT_WEIGHTS, renamed, metadata={"format": "pt"})
    atomic_write_text(out_dir / PEFT_CONFIG, json.dumps(peft_config(spec, base_model_name_or_path), indent=2))
    return out_dir


def read_adapters(spec: ModelSpec, weights: Path, prefix: str) -> dict:
    """A LoRA run's adapters by the model's names, as float32 tensors, from `weights` (a checkpoint's file naming them
    as the model does, or a PEFT directory's, `prefix` PEFT_PREFIX), each checked first for presence and shape."""
    layout = adapter_layout(spec)
    if prefix == PEFT_PREFIX:
        check_peft_weights(spec, weights.parent)
    else:
        match_tensors([weights], {prefix + name: shape for name, (shape, _) in layout.items()})
    with open_safetensors([weights]) as handles:
        return {name: handles[weights].get_tensor(prefix + name).float() for name in layout}


def base_entries(spec: ModelSpec, base_dir: Path | None, seed: int, held, packed_cache: Path | None = None) -> list:
    """The base model's (name, Pending) in Hugging Face's layout: read from `base_dir`, or (a preset's run) drawn as the
    run drew them, from `seed` in the dtype it held its base in (`held`). A packed base's matrices come from the
    bytes the run kept (`packed_cache`, `PackedGroups.save`) where they are this checkpoint's."""
    import torch

    from .hf_weights import checkpoint_files, entries_as_imported

    if base_dir is not None:
        files = checkpoint_files(base_dir)
        headers = {path: read_safetensors_header(path) for path in files}
        where = {name: path for path, header in headers.items() for name in header if name != "__metadata__"}
        shapes = {name: tuple(headers[path][name]["shape"]) for name, path in where.items()}
        entries = entries_as_imported(spec, files, where, shapes, torch.float32)
        return _as_trained(spec, entries, held, _kept_base(spec, files, held, packed_cache))
    return _drawn_base(spec, seed, held)


def _kept_base(spec: ModelSpec, files: list[Path], held, path: Path | None) -> Callable[[str], Any] | None:
    """name -> a packed base's matrix as the run computed with it, read from the file the run kept of it where that
    file is this checkpoint's in this layout (the very bytes trained on, whichever device quantized them); None
    otherwise, where the merge quantizes the checkpoint again as the run did."""
    if path is None or not spec.packed_groups:
        return None
    layouts = spec.packed_layouts(held)
    kept = PackedBaseFile(path)
    if not kept.holds(packed_base_key(files, layouts), layouts):
        return None
    print(f"megatrain: the merge reads the packed base the run kept in {path}", file=sys.stderr)
    group_of = {p.entry.name: g for g, layout in layouts.items() for p in layout.entries}
    return lambda name: kept.entry(group_of[name], layouts[group_of[name]], name)


def _drawn_base(spec: ModelSpec, seed: int, held) -> list:
    """A preset run's base, drawn as the run drew it from `seed` in `held`."""
    import torch

    from .model import init_param_

    def draw(name: str, shape: tuple[int, ...]):
        tensor = torch.empty(shape, dtype=held)
        init_param_(name, tensor, spec.config, seed)
        return tensor

    shapes = spec.param_shapes(adapters=False)
    return _as_trained(spec, [(n, Pending(s, held, lambda n=n, s=s: draw(n, s))) for n, s in shapes.items()], held)


def _as_trained(spec: ModelSpec, entries: list, held, kept: Callable[[str], Any] | None = None) -> list:
    """The base's entries as a run over a packed base (QLoRA, `spec.packed_groups`) trained on them: each matrix the
    store packs as `kept` gives it, else quantized from the `held` dtype and dequantized (a fused tensor of experts,
    expert by expert, as the store holds them); the rest as they are. Without packing, `entries`."""
    if not spec.packed_groups:
        return entries
    packed = {
        p.name: p.shape
        for g in spec.packed_groups
        for p in spec.groups[g].params
        if quantizes(Entry(p.name, tuple(p.shape), 0, True))
    }
    fused = {name: covered for name, (_, covered) in spec.fused_checkpoint_names().items()}

    def as_trained(pending: Pending, parts: tuple, shapes: list) -> Pending:
        if kept is not None:
            return Pending(pending.shape, held, lambda: _joined([kept(part) for part in parts], pending.shape))
        return Pending(pending.shape, held, lambda: _round_trip(pending.load().to(held), shapes, format))

    format, out = spec.adapter.base_format, []
    for name, pending in entries:
        parts = fused.get(name, (name,))
        shapes = [packed.get(part) for part in parts]
        # (a fused tensor's parts are all experts' matrices: packed, all of them)
        out.append((name, as_trained(pending, parts, shapes) if all(shapes) else pending))
    return out


def _joined(tensors: list, shape: tuple):
    """`tensors` back to back as one of `shape` (a fused tensor of experts from the store's per-expert ones)."""
    import torch

    return torch.cat([t.reshape(-1) for t in tensors]).view(shape)


def _round_trip(tensor, shapes: list, format: str):
    """`tensor` (entries of these shapes back to back) quantized in `format` and dequantized entry by entry."""
    flat, start = tensor.reshape(-1).clone(), 0
    for shape in shapes:
        numel = math.prod(shape)
        flat[start : start + numel] = round_trip(flat[start : start + numel].view(shape), format).reshape(-1)
        start += numel
    return flat.view(tensor.shape)


def with_adapters_merged(weights: dict, spec: ModelSpec) -> dict:
    """`weights` (a store's tensors by name, the base's and the adapters') with each adapted matrix W replaced by
    W + scale * B @ A (in float32, cast back to W's dtype) and the adapters left out: the model with its adapters on,
    for what runs transformers' modules on it (generation). Computed afresh on the host at each call."""
    if spec.adapter is None:
        return weights
    merge, merged = _Merge(spec, weights), {}
    for name, weight in weights.items():
        if ".lora_" in name:
            continue
        delta = merge.delta(name)
        merged[name] = weight if delta is None else (weight.float() + delta()).to(weight.dtype)
    return merged


class _Merge:
    """Each adapted base matrix's delta, scale * B @ A in float32, from `adapters` (the adapters' tensors by the
    model's names): a matrix's own adapters', or (`_merge_sources`) its rows of a MoE's expert adapters' delta, or
    its router's adapters' named apart from it (Mixtral's). Records the adapters' modules it used."""

    def __init__(self, spec: ModelSpec, adapters: dict):
        self.adapters, self.scale, self.used = adapters, spec.adapter.scale, set()
        self.sources = _merge_sources(spec)
        self.n_experts = spec.config.n_experts

    def delta(self, name: str) -> "Callable[[], Any] | None":
        """What makes base matrix `name`'s delta (None: it has no adapters), computed at the call."""
        module, expert, rows = self.sources.get(name, (name.removesuffix(".weight"), None, slice(None)))
        down, up = self.adapters.get(f"{module}.lora_A.weight"), self.adapters.get(f"{module}.lora_B.weight")
        if down is None:
            return None
        self.used.add(module)
        if expert is not None:  # (PEFT's layouts: A [experts * rank, in], B [out, rank * experts])
            rank = down.shape[0] // self.n_experts
            down, up = down.view(self.n_experts, rank, -1)[expert], up.view(up.shape[0], rank, -1)[:, :, expert]
        return lambda: (up.float() @ down.float()).mul_(self.scale)[rows]


def _merge_sources(spec: ModelSpec) -> dict[str, tuple[str, int | None, slice]]:
    """The base matrices whose adapters PEFT names apart from them, a MoE's experts and Mixtral's router: base name
    -> (the adapters' module, the expert whose A and B they are, or None: a plain adapter; the base's rows of the
    delta: a gate or an up projection's half of the fused gate-up matrix)."""
    config, reached = spec.config, _reached_experts(spec)
    if reached is None:
        return {}
    moe, adapted = reached
    (gate, up, down), f = EXPERT_NAMING[moe.naming][1], moe.d_ff
    sources = {}
    for layer in filter(config.layer_is_moe, range(config.n_layers)):
        prefix = f"model.layers.{layer}."
        stored, named = f"{prefix}{moe.module}.experts", f"{prefix}{transformers_module(moe)}"
        sources[prefix + router_name(moe)] = (f"{named}.gate", None, slice(None))
        gate_up = f"{named}.experts" + (".base_layer" if len(adapted) == 2 else "")
        for e in range(moe.n_experts):
            if "experts_gate_up" in adapted:
                sources[f"{stored}.{e}.{gate}.weight"] = (gate_up, e, slice(0, f))
                sources[f"{stored}.{e}.{up}.weight"] = (gate_up, e, slice(f, 2 * f))
            if "experts_down" in adapted:
                sources[f"{stored}.{e}.{down}.weight"] = (f"{named}.experts", e, slice(None))
    return sources


def merged_entries(spec: ModelSpec, base: list, adapters: dict, target) -> tuple[list, int]:
    """The base model's (name, Pending) `base` with each adapted matrix W replaced by W + scale * B @ A (in float32,
    then cast to `target`), as PEFT's merge_and_unload computes it; `adapters`: model name -> the adapters' tensors
    (`lora_A.weight` [r, in], `lora_B.weight` [out, r]). Returns (entries, how many matrices merged)."""
    import torch

    merge, out, merged = _Merge(spec, adapters), [], 0
    for name, pending in base:
        delta = merge.delta(name)
        if delta is None:
            out.append((name, Pending(pending.shape, target, lambda p=pending: p.load().to(target))))
            continue

        def load(p=pending, delta=delta):
            return (p.load().to(torch.float32) + delta()).to(target)

        out.append((name, Pending(pending.shape, target, load)))
        merged += 1
    if len(merge.used) * 2 != len(adapters):
        raise ZooError(f"{len(adapters) // 2 - len(merge.used)} adapted matrices have no base weight to merge into")
    return out, merged


def check_export_target(out: Path, reads: dict[str, Path], overwrite: bool) -> None:
    """Refuse to write a model into `out` where it is a file, holds files but no model, is one of what the export
    `reads` (by what they are: the source, a LoRA run's base, ...; --overwrite allows none of them), or holds a model
    already and not `overwrite`."""
    holds_model = is_model_directory(out)
    if out.exists() and not out.is_dir():
        raise ZooError(f"{out} is a file; name a directory to write the model into")
    if out.is_dir() and any(out.iterdir()) and not holds_model:
        raise ZooError(f"{out} holds files but no model (no config.json of one); name a new directory")
    for what, path in reads.items():
        if out.resolve() == path.resolve():
            raise ZooError(f"{out} is {what}, which this conversion reads; name another directory to write into")
    if holds_model and not overwrite:
        raise ZooError(f"{out} holds a model already; name a new directory, or add --overwrite to replace it")

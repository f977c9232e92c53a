"""Any transformers decoder on day one: stateless templates that call the model's own modules with the streamed
weights, exact by construction; the native templates stay the fast path.

transformers' causal LM is built once from the config with its parameters on the meta device (`skeleton.py`); each
stage binds its slot's views to the parameters it owns (`generic_stages.py`). This module makes such a model's
`ModelConfig` (`generic_model_config`: the sizes megatrain plans with, its counts from the modules themselves) and
its `ModelSpec` (`build_generic_model`: a stage per decoder layer beside the embedding and the head), refusing in
one line what the generic path cannot train.
"""

import contextlib
import json
import traceback

from .checkpoint_layout import CheckpointLayout
from .config import ModelConfig, TemplateLacks, ZooError
from .generic_stages import GenericEmbedding, GenericHead, GenericLayer, _spec
from .hf import config_from_hf, has_template
from .image_text import ImageTextSkeleton
from .skeleton import GenericError, HFSkeleton
from .spec import ADAPTER_GROUP_SUFFIX, Group, ModelSpec, StageSpec


def hf_config_json(hf_config: dict) -> str:
    """The config as the generic model keeps it: canonical JSON text (hashable, comparable)."""
    return json.dumps(hf_config, sort_keys=True)


def generic_model_config(hf: dict, image_text: bool = False):
    """The `ModelConfig` of a config.json trained through transformers' own modules: the sizes megatrain plans with,
    its counts from the modules themselves. Refuses, naming it, a model_type transformers does not know, a config
    it does not accept and a load-balancing loss the generic path cannot add; anything else that fails in building
    it, in one line (`_building`). `image_text`: the whole image-text model, its vision tower streamed too
    (`image_text.py`)."""
    _check_config(hf)
    with _building(hf["model_type"]):
        return _generic_model_config(hf, image_text)


def _generic_model_config(hf: dict, image_text: bool):
    skeleton = (ImageTextSkeleton if image_text else HFSkeleton)(hf)
    config, parts = skeleton.text_config, skeleton.parts
    counts = _counter(skeleton)
    heads = _read(config, "num_attention_heads", 1) or 1
    d_model = config.hidden_size
    in_layers = {name for names in parts.layers for name in names}
    return ModelConfig(
        arch=skeleton.config.model_type,
        vocab_size=config.vocab_size,
        d_model=d_model,
        n_layers=len(skeleton.layers),
        n_heads=heads,
        n_kv_heads=_read(config, "num_key_value_heads", None) or heads,
        d_ff=_read(config, "intermediate_size", None) or 4 * d_model,
        head_dim=_read(config, "head_dim", None) or d_model // heads,
        max_seq_len=_read(config, "max_position_embeddings", None) or 4096,
        tie_embeddings=parts.head_reads_embedding,
        initializer_range=_read(config, "initializer_range", 0.02) or 0.02,
        bos_token_id=_token_id(_read(config, "bos_token_id", None)),
        eos_token_id=_token_id(_read(config, "eos_token_id", None)),
        pad_token_id=_token_id(_read(config, "pad_token_id", None)),
        implementation="transformers",
        packs_documents=not image_text and skeleton.packs_documents,
        hf_config=hf_config_json(hf),
        layer_counts=tuple(counts(names, index) for index, names in enumerate(parts.layers)),
        outer_params=counts([name for name in skeleton.names.values() if name not in in_layers])[0],
        image_text=image_text,
    )


def _read(config, name: str, default):
    """`config.name`, or `default` where the config lacks it or holds it per layer (Gemma 4 Unified's head_dim:
    transformers refuses a global read of a heterogeneous config)."""
    try:
        return getattr(config, name, default)
    except Exception:  # noqa: BLE001 (transformers' AmbiguousGlobalPerLayerAttributeError, a class of its own)
        return default


@contextlib.contextmanager
def _building(model_type: str):
    """An unexpected exception while building a generic model (transformers' modules failing on a config they
    accepted, or the generic path meeting a field it does not read) raised as one GenericError line naming the
    model type, what failed or is missing, and where; the project's own errors pass as they are."""

    try:
        yield
    except (GenericError, ZooError):
        raise
    except Exception as error:  # noqa: BLE001 (whatever transformers' modules raise)
        import transformers

        raise GenericError(
            f"{model_type} cannot be built through transformers' own modules: {_what_failed(error)}; check "
            f"config.json's fields against transformers {transformers.__version__}'s {model_type} config (a newer "
            "transformers may build it), or use a family with a native template"
        ) from error


def _what_failed(error: Exception) -> str:
    """An exception in a few words: what is missing (a key, an attribute) or its first line, and the source line
    it came from (the innermost in a model's or megatrain's code: transformers' helpers say less)."""
    if isinstance(error, KeyError):
        what = f"{error.args[0]!r} missing (KeyError)" if error.args else "KeyError"
    else:
        first = (str(error).splitlines() or [""])[0][:200]
        what = f"{type(error).__name__}: {first}" if first else type(error).__name__
    frames = traceback.extract_tb(error.__traceback__)
    telling = [f for f in frames if "/modeling_" in f.filename or "/megatrain" in f.filename] or frames
    if telling:
        what += f" at {telling[-1].filename.rsplit('/', 1)[-1]}:{telling[-1].lineno}"
    return what


def _check_config(hf: dict) -> None:
    import transformers

    model_type = hf.get("model_type")
    if model_type not in transformers.CONFIG_MAPPING:
        raise GenericError(
            f"model_type {model_type!r} is known to neither megatrain nor the installed transformers "
            f"{transformers.__version__}; upgrade transformers (a newer one may know it) or use a supported family"
        )
    try:
        config = transformers.AutoConfig.for_model(**hf)
    except Exception as error:  # noqa: BLE001 (transformers' validators raise several kinds)
        raise GenericError(
            f"config.json is no valid {model_type} config for transformers {transformers.__version__}: "
            f"{' '.join(str(error).split())[:240]}"
        ) from None
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        raise GenericError(
            f"{model_type}'s load-balancing loss (output_router_logits) is added by transformers' model "
            "forward, which the generic path does not run as a whole; set output_router_logits: false in its "
            "config.json (experts then train without it) or use a family with a native template"
        )


def _counter(skeleton: HFSkeleton):
    """counts(names, layer) -> (parameters, those a token uses: an expert's k / n_experts share, the matrices among
    those), for decoder layer `layer` (None: outside the layers)."""
    config, params = skeleton.text_config, dict(skeleton.model.named_parameters())
    k = getattr(config, "num_experts_per_tok", 0) or 0
    n_experts = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0

    def counts(names: list[str], layer: int | None = None) -> tuple[int, int, int]:
        # (Hunyuan-V1-MoE's config may give its top-k and expert count per layer, as lists)
        layer_k, layer_experts = _of_layer(k, layer), _of_layer(n_experts, layer)
        total = active = matrices = 0
        for name in names:
            numel = params[name].numel()
            share = layer_k / layer_experts if layer_experts and layer_k and ".experts." in name else 1.0
            total += numel
            active += round(numel * share)
            matrices += round(numel * share) if params[name].dim() >= 2 else 0
        return total, active, matrices

    return counts


def _of_layer(value, layer: int | None):
    """A config field's value for decoder layer `layer`, where the field is a list of one per layer (0 outside
    the layers)."""
    if isinstance(value, (list, tuple)):
        return value[layer] if layer is not None and layer < len(value) else 0
    return value


def generic_notes(config) -> list[str]:
    """What a run of a generic model says at its start: the path it takes and why, what of its config.json it
    leaves out (dropout: megatrain trains without it)."""
    hf = json.loads(config.hf_config)
    native = "" if has_template(hf) else " (megatrain has no template for it)"
    if not native and not config.image_text:
        try:
            config_from_hf(hf)
        except TemplateLacks as lack:  # (a native family with a feature its template lacks)
            native = f" (its native template: {lack})"
        except ZooError:  # (what the template refuses of its own: the generic path, chosen, reads it)
            pass
    whole = " (the whole image-text model, its vision tower streamed too)" if config.image_text else ""
    notes = [
        f"{config.arch}{whole} trains through transformers' own modules{native}: exact, slower than a native template"
    ]
    dropout = {k: v for k, v in hf.items() if ("dropout" in k or "pdrop" in k) and isinstance(v, float) and v > 0}
    if dropout:
        notes.append(f"megatrain trains without dropout: config.json's {dropout} are not applied")
    return notes


def _token_id(value) -> int | None:
    """A config's token id (transformers allows a list of them: the first)."""
    return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


def build_generic_model(config, adapter=None):
    """The `ModelSpec` of a generic model: groups [embedding, each decoder layer, the rest (final norm, LM head;
    with a tied table, the embedding group too)], one stage each, their templates transformers' own modules; with a
    LoRA `adapter`, each layer's adapters a group after its own (`layerN.lora`)."""
    hf = json.loads(config.hf_config)
    with _building(hf.get("model_type")):
        return _build_generic_model(config, hf, adapter)


def _build_generic_model(config, hf: dict, adapter=None):
    skeleton = HFSkeleton(hf)
    shapes = {name: tuple(p.shape) for name, p in skeleton.model.named_parameters()}
    parts = skeleton.parts

    def group(name: str, names: list[str]) -> Group:
        return Group(name, tuple(_spec(n, shapes[n]) for n in names))

    groups = [group("embed", parts.embedding)]
    stages = [StageSpec("embed", GenericEmbedding(skeleton, (tuple(parts.embedding),)), (0,))]
    for index, names in enumerate(parts.layers):
        layer = GenericLayer(skeleton, index, tuple(names), adapter)
        groups.append(group(f"layer{index}", names))
        bound = (len(groups) - 1,)
        if layer.adapters is not None:
            groups.append(Group(f"layer{index}{ADAPTER_GROUP_SUFFIX}", layer.groups[1]))
            bound += (len(groups) - 1,)
        stages.append(StageSpec(f"layer{index}", layer, bound))
    groups.append(group("head", parts.head))
    head = len(groups) - 1
    bound, names = (
        ((0, head), (tuple(parts.embedding), tuple(parts.head)))
        if config.tie_embeddings
        else ((head,), (tuple(parts.head),))
    )
    stages.append(StageSpec("head", GenericHead(skeleton, names, config.d_model, config.vocab_size), bound))

    layout = CheckpointLayout(skeleton)
    return ModelSpec(config, tuple(groups), tuple(stages), checkpoint_layout=layout, adapter=adapter)

"""Image-text models trained whole: the vision tower's blocks are stages of the same pipeline as the decoder's layers.

transformers' image-text model (`AutoModelForImageTextToText`) is built once on the meta device, as the generic
decoder's causal LM is (`skeleton.HFSkeleton`), and its forward drives every stage with the tower's blocks and the
decoder's layers stood in for:

    vision embedding    the forward up to the tower's first block (patch and position embeddings, a window
                        reordering): the micro-batch's pixels -> the first block's input
    vision block i      the tower's block i, on every image's (and video's) patches
    connector           the forward from the tower's last block to the first decoder layer: the tower's end (a
                        merger, a post-norm), the projector, the token embedding and the splice of the image
                        features into it at the placeholder tokens
    decoder layer j     as the generic decoder's, its arguments (a multimodal rotary embedding's positions among
                        them) from the forward on the micro-batch's own tokens and images
    head                as the generic decoder's

Every stage runs the model's own code, so what a family does between its parts (Qwen2.5-VL's window reordering,
Gemma 3's pooling, LLaVA's feature selection) is exact by construction. The tower's activations are its patches
[patches, width] of every call the forward makes to it (images, then videos), back to back.

Qwen3-VL's deepstack takes features from inside the tower (a merger on the output of some of its blocks) and adds
them to the output of the decoder's first layers at the image tokens. Those features travel with the activations:
from the block whose output they merge to the decoder layer that adds them, a stage's activation is its hidden states
and the features it carries, flat and back to back (`pack`), so the pipeline keeps, offloads and differentiates them
as it does any activation.
"""

import contextlib
import functools
import inspect
import json
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import Tensor, nn

from .checkpoint_layout import CheckpointLayout
from .generic_stages import GenericHead, GenericLayer, _GenericStage, _spec
from .skeleton import (
    CalledModules,
    GenericError,
    HFSkeleton,
    Parts,
    _hidden_states,
    _hidden_states_first,
    _output,
    _Reached,
)
from .spec import Group, ModelSpec, StageSpec

# where transformers' image-text models keep their vision tower
VISION_TOWERS = ("visual", "vision_tower", "vision_model", "vision_encoder")
# the tower's attention on the GPU in half precision: every window and image in one call of torch's flash varlen
# kernel ("flash" in the name: transformers then gives the attention its cu_seqlens instead of a call per window)
VARLEN_ATTENTION = "megatrain_flash_varlen"


def varlen_attention(module, query, key, value, attention_mask=None, **kwargs):
    """transformers' attention interface over the sequences `cu_seq_lens_q` delimits ([1, heads, tokens, head_dim]
    in, [1, tokens, heads, head_dim] out) in one varlen flash call; without them transformers' SDPA."""
    cu_q, cu_k = kwargs.pop("cu_seq_lens_q", None), kwargs.pop("cu_seq_lens_k", None)
    max_q, max_k = kwargs.pop("max_length_q", None), kwargs.pop("max_length_k", None)
    if cu_q is None or query.shape[0] != 1:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    from torch.nn.attention.varlen import varlen_attn

    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [tokens, heads, head_dim]
    if k.shape[1] != q.shape[1]:  # (grouped keys: torch 2.11's kernel takes as many as queries)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    out = varlen_attn(q, k, v, cu_q.int(), cu_k.int(), int(max_q), int(max_k), scale=kwargs.get("scaling"))
    return out.unsqueeze(0), None


@functools.cache
def _varlen_attention_registered() -> bool:
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention)
    return True


@dataclass(frozen=True)
class ImageTextParts(Parts):
    """The generic parts, the embedding stage's being the connector's, and the vision tower's stages'."""

    vision_embedding: list[str] = ()
    vision_blocks: list[list[str]] = ()
    unused: list[str] = ()  # the tower's blocks after the one whose output the model takes: stored, never run
    deepstack: dict[int, list[str]] = field(default_factory=dict)  # block index -> its deepstack merger's names


@dataclass
class _Recorded:
    """What the forward gives the tower's blocks and the decoder's layers for one micro-batch."""

    sizes: list[int]  # patches of each tower call, in call order
    blocks: list[list[tuple[tuple, dict]]]  # [call][block] -> (args, kwargs)
    layers: list[tuple[tuple, dict]]  # [layer] -> (args, kwargs)
    visual_mask: Tensor | None = None  # where the deepstack features are added: the image and video tokens


def pack(main: Tensor, carried: list[Tensor]) -> Tensor:
    """A stage's activation: `main` alone, or with the deepstack features it carries, flat and back to back."""
    return torch.cat([main.reshape(-1), *(f.reshape(-1) for f in carried)]) if carried else main


def unpack(x: Tensor, shape: tuple, count: int, width: int) -> tuple[Tensor, list[Tensor]]:
    """(the hidden states of `shape`, the `count` features of `width` carried after them) of a `pack`ed `x`."""
    if not count:
        return x, []
    flat = x.reshape(-1)
    main = math.prod(shape)
    rows = (flat.numel() - main) // (count * width)
    return flat[:main].view(shape), list(flat[main:].view(count, rows, width).unbind())


@contextlib.contextmanager
def _keyword_arguments(module: nn.Module):
    """The keyword arguments `module` is called with, inside the block (a dict, filled at the call)."""
    seen = {}
    handle = module.register_forward_pre_hook(lambda m, args, kwargs: seen.update(kwargs), with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


class ImageTextSkeleton(HFSkeleton):
    """transformers' image-text model of `hf_config`, its parameters on the meta device: `HFSkeleton` with the
    vision tower's blocks stood in for as the decoder's layers are."""

    auto_class = "AutoModelForImageTextToText"

    @cached_property
    def causal_lm(self) -> nn.Module:
        """The language model where it is a causal LM of its own (Llama 4's: transformers 5.24's image-text forward
        fails building its output object after it), else the model."""
        output = self.model.get_output_embeddings()
        inner = [
            m
            for m in self.model.modules()
            if m is not self.model
            and callable(getattr(m, "get_output_embeddings", None))
            and m.get_output_embeddings() is output
            and any(child is self.layers for child in m.modules())
        ]
        return inner[0] if inner else self.model

    @cached_property
    def tower(self) -> nn.Module:
        base = self.model.base_model
        for name in VISION_TOWERS:
            if isinstance(getattr(base, name, None), nn.Module):
                return getattr(base, name)
        raise GenericError(f"{type(self.model).__name__} has no vision tower the image-text path recognises")

    @cached_property
    def all_blocks(self) -> nn.ModuleList:
        """The tower's list of blocks: its longest ModuleList."""
        lists = [m for m in self.tower.modules() if isinstance(m, nn.ModuleList)]
        if not lists:
            raise GenericError(f"{type(self.tower).__name__} has no list of blocks the image-text path recognises")
        return max(lists, key=len)

    @cached_property
    def blocks(self) -> nn.ModuleList:
        """The blocks whose output reaches the decoder: all, or those up to the one whose hidden states the model
        takes (LLaVA's `vision_feature_layer` -2 leaves the last out), found by which blocks' outputs the first
        decoder layer's input depends on (zero weights, a marker added to each block's output)."""
        markers = [torch.zeros((), requires_grad=True) for _ in self.all_blocks]
        reached = []

        def vision(call, index, hidden, *args, **kwargs):
            return hidden + markers[index]

        def first_layer(index, hidden, *args, **kwargs):
            reached.append(hidden)
            raise _Reached(hidden)

        failures = []
        for form in (_hidden_states, _hidden_states_first):  # (how the tower reads a block's output)
            self.block_output = form
            try:
                with torch.enable_grad():
                    with contextlib.suppress(_Reached):
                        self._run_blocks(self.all_blocks, self.zero_weights, self.probe, None, first_layer, vision)
                    found = torch.autograd.grad(reached[0].sum(), markers, allow_unused=True)
                break
            except Exception as error:  # noqa: BLE001 (the wrong form breaks the tower's forward)
                failures.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        else:
            raise GenericError(
                f"{type(self.model).__name__}'s forward cannot run with its vision tower's blocks streamed "
                f"({'; '.join(failures)})"
            )
        used = [index for index, grad in enumerate(found) if grad is not None]
        if not used:
            raise GenericError(f"{type(self.model).__name__}'s decoder reads no output of its vision tower's blocks")
        return nn.ModuleList(self.all_blocks[: used[-1] + 1])

    @contextlib.contextmanager
    def attention_for(self, x: Tensor):
        """The tower's attention for a block call on `x`: one varlen flash call (CUDA, half precision), else the
        model's own (SDPA: a call per window or image)."""
        config = self.tower.config
        fast = x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and _varlen_attention_registered()
        own = config._attn_implementation
        config._attn_implementation = VARLEN_ATTENTION if fast else own
        try:
            yield
        finally:
            config._attn_implementation = own

    @cached_property
    def _hidden_name(self) -> str:
        """The name a block's forward gives its hidden states (hidden_states; Llama 4's hidden_state)."""
        return list(inspect.signature(type(self.all_blocks[0]).forward).parameters)[1]  # (after self)

    @cached_property
    def zero_weights(self) -> dict[str, Tensor]:
        """Every parameter as zeros of no memory (stride 0): what the traces run with."""
        return {name: torch.zeros((), dtype=p.dtype).expand(p.shape) for name, p in self.model.named_parameters()}

    @cached_property
    def probe(self) -> dict:
        return probe_inputs(self)

    @cached_property
    def tower_prefix(self) -> str:
        return next(name for name, m in self.model.named_modules() if m is self.tower) + "."

    @cached_property
    def width(self) -> int:
        """The width of the tower's blocks' hidden states."""
        config = self.config.vision_config
        return getattr(config, "hidden_size", None) or config.embed_dim

    def run(self, weights, inputs, documents, stand_in, head=False, vision=None, deepstack=None):
        """`HFSkeleton.run`, each of the tower's blocks replaced by `vision(call, index, hidden_states, *args,
        **kwargs)` (`call`: the how-manyth call of the tower in this forward), or passing its input through, and
        the deepstack merger after block `index` by `deepstack(call, index, hidden_states)`, or zeros."""
        deepstack = deepstack or self._deepstack_zeros
        return self._run_blocks(self.blocks, weights, inputs, documents, stand_in, vision, head, deepstack)

    def _run_blocks(self, blocks, weights, inputs, documents, stand_in, vision, head=False, deepstack=None):
        """`run` with `blocks` (the first of the tower's) stood in for; the rest pass their input through. Without
        `deepstack`, the deepstack mergers run as the model's own (their weights among `weights`)."""
        calls, hidden_name = [-1], self._hidden_name
        mergers = self.deepstack_mergers if deepstack is not None else {}
        for index, merger in mergers.items():
            merger.forward = lambda hidden, _index=index: deepstack(calls[0], _index, hidden)

        def block(*args, _index, **kwargs):
            hidden_states, args = (args[0], args[1:]) if args else (kwargs.pop(hidden_name), ())
            calls[0] += _index == 0
            if vision is None or _index >= len(blocks):
                return self.block_output(hidden_states)
            return self.block_output(vision(calls[0], _index, hidden_states, *args, **kwargs))

        for index, module in enumerate(self.all_blocks):
            module.forward = lambda *args, _index=index, **kwargs: block(*args, _index=_index, **kwargs)
        try:
            return HFSkeleton.run(self, weights, inputs, documents, stand_in, head)
        finally:
            for module in [*self.all_blocks, *mergers.values()]:
                del module.forward

    block_output = staticmethod(_hidden_states)  # (how the tower reads a block's output)

    def _deepstack_zeros(self, call, index, hidden: Tensor) -> Tensor:
        """Zeros of the shape the deepstack merger after block `index` gives (found on meta): for a forward that
        does not bind the merger, and whose use of its output is thrown away."""
        merger = self.deepstack_mergers[index]
        shape = type(merger).forward(merger, hidden.to("meta")).shape
        return hidden.new_zeros(()).expand(shape)

    @cached_property
    def text_model(self) -> nn.Module:
        """The decoder: the module whose forward calls the decoder's layers."""
        return next(m for m in self.model.modules() if getattr(m, "layers", None) is self.layers)

    def unpack_tower(self, x: Tensor, recorded: "_Recorded", count: int) -> tuple[Tensor, list[Tensor]]:
        """`unpack` of a tower stage's activation: [patches, width] and `count` deepstack features."""
        return unpack(x, (sum(recorded.sizes), self.width), count, self.text_config.hidden_size)

    def _parts(self) -> ImageTextParts:
        """The generic parts (the text forward's), the tower's split off them by one forward on a small image: what
        it calls before its first block, each block, and the rest it calls before the first decoder layer (the
        tower's end, the projector), which the connector stage binds beside the token embedding."""
        self.blocks, self.deepstack_mergers  # noqa: B018 (traced first: the text forward's trace must not see theirs)
        text = super()._parts()
        before, between, _ = self._tower_trace
        in_blocks = {id(p) for block in self.all_blocks for p in block.parameters()}
        tower_ids = {id(p) for p in self.tower.parameters()}
        vision_embedding = dict.fromkeys(
            id(p) for m in before for p in m.parameters(recurse=False) if id(p) in tower_ids and id(p) not in in_blocks
        )
        connector = dict.fromkeys(self.names[id(p)] for m in between for p in m.parameters(recurse=False))
        connector = [n for n in connector if n not in text.embedding] + list(text.embedding)
        block_names = [[self.names[id(p)] for p in block.parameters()] for block in self.blocks]
        unused = [self.names[id(p)] for block in self.all_blocks[len(self.blocks) :] for p in block.parameters()]
        deepstack = {k: [self.names[id(p)] for p in m.parameters()] for k, m in self.deepstack_mergers.items()}
        taken = {*connector, *(self.names[i] for i in vision_embedding), *(n for b in block_names for n in b)}
        taken |= {n for layer in text.layers for n in layer} | set(unused) | {n for m in deepstack.values() for n in m}
        return ImageTextParts(
            embedding=connector,
            layers=text.layers,
            head=[n for n in self.names.values() if n not in taken],
            unused=unused,
            head_reads_embedding=text.head_reads_embedding,
            vision_embedding=[self.names[i] for i in vision_embedding],
            vision_blocks=block_names,
            deepstack=deepstack,
        )

    @cached_property
    def _tower_trace(self) -> tuple[list[nn.Module], list[nn.Module], dict[int, list[nn.Module]]]:
        """(the modules the forward calls before the tower's first block, those after its last block and before the
        first decoder layer, those after each block and before the next), on a small image with zero weights."""
        inside = {id(m) for block in self.all_blocks for m in block.modules()}
        inside |= {id(m) for layer in self.layers for m in layer.modules()}
        calls = CalledModules(self.model, inside)

        def vision(call, index, hidden, *args, **kwargs):
            calls.passed(index, len(self.blocks))
            return hidden

        def first_layer(index, hidden, *args, **kwargs):
            raise _Reached(hidden)

        with calls, torch.no_grad(), contextlib.suppress(_Reached):
            self._run_blocks(self.blocks, self.zero_weights, self.probe, None, first_layer, vision)
        return calls.phases[0], calls.phases[2], calls.after

    @cached_property
    def deepstack_mergers(self) -> dict[int, nn.Module]:
        """block index -> the module the tower calls on that block's output, whose output the decoder adds to its
        first layers' at the image tokens (Qwen3-VL's deepstack); refuses any other module with weights called
        between blocks."""
        mergers = {}
        for index, called in self._tower_trace[2].items():
            weighted = [m for m in called if any(True for _ in m.parameters())]
            if not weighted:
                continue
            merger = weighted[0]  # (called first: its own modules are called inside it)
            inside = {id(m) for m in merger.modules()}
            takes = inspect.signature(type(self.text_model).forward).parameters
            if "deepstack_visual_embeds" not in takes or any(id(m) not in inside for m in weighted):
                raise GenericError(
                    f"{type(self.model).__name__}'s vision tower calls {type(merger).__name__} between its blocks "
                    "(features taken from inside the tower) for a decoder that reads them in a way the image-text "
                    "path does not know (it streams Qwen3-VL's deepstack)"
                )
            mergers[index] = merger
        return mergers

    def media_inputs(self, media) -> dict:
        return {"input_ids": media.input_ids, **media.tensors}

    def recorded(self, media, like: Tensor, documents) -> _Recorded:
        """The blocks' and layers' arguments for the micro-batch `media`, computed once (kept in its cache)."""
        key = ("image-text", like.device, like.dtype)
        if key not in media.cache:
            media.cache[key] = self._record(media, like, documents)
        return media.cache[key]

    def _record(self, media, like: Tensor, documents) -> _Recorded:
        sizes, blocks, layers = [], [], [None] * len(self.layers)

        def vision(call, index, hidden, *args, **kwargs):
            if index == 0:
                sizes.append(hidden.shape[0])
                blocks.append([])
            blocks[call].append((args, kwargs))
            return hidden

        def layer(index, hidden, *args, **kwargs):
            layers[index] = (args, kwargs)
            if index == len(self.layers) - 1:
                raise _Reached(hidden)
            return hidden

        names = [*self.parts.vision_embedding, *self.parts.embedding]
        with torch.no_grad(), contextlib.suppress(_Reached), _keyword_arguments(self.text_model) as decoder:
            self.run(self.placeholders(names, like), self.media_inputs(media), documents, layer, vision=vision)
        return _Recorded(sizes, blocks, layers, decoder.get("visual_pos_masks"))

    def layer_arguments(self, hidden: Tensor, documents, media=None) -> list[tuple[tuple, dict]]:
        if media is None:  # (a forward of the text alone: the planner's trace of a layer)
            return super().layer_arguments(hidden, documents)
        return self.recorded(media, hidden, documents).layers


def probe_inputs(skeleton: ImageTextSkeleton) -> dict:
    """A one-image input the forward accepts (zero pixels and their placeholder tokens): what the trace runs on."""
    config, vision = skeleton.config, skeleton.config.vision_config
    image_token = getattr(config, "image_token_id", None) or getattr(config, "image_token_index", None)
    if image_token is None:
        raise GenericError(f"{config.model_type}'s config names no image token (image_token_id)")
    channels = getattr(vision, "in_channels", None) or getattr(vision, "num_channels", 3)
    if getattr(vision, "temporal_patch_size", None):  # (Qwen2-VL's family: patches as rows, a grid per image)
        merge = vision.spatial_merge_size
        grid = torch.tensor([[1, 2 * merge, 2 * merge]])
        patch = channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = {"pixel_values": torch.zeros(4 * merge * merge, patch), "image_grid_thw": grid}
        tokens = 4
    elif getattr(config, "image_grid_pinpoints", None):  # (LLaVA-NeXT: an image of tiles, the first resolution's)
        size, (height, width) = vision.image_size, config.image_grid_pinpoints[0]
        tiles = 1 + (height // size) * (width // size)  # (and the whole image, resized)
        pixels = {
            "pixel_values": torch.zeros(1, tiles, channels, size, size),
            "image_sizes": torch.tensor([[height, width]]),
        }
        tokens = _image_tokens(skeleton, pixels)
    else:  # (a fixed-size image: Gemma 3's pooled tokens, LLaVA's patches, Pixtral's merged ones, as the model counts)
        size = vision.image_size
        pixels = {"pixel_values": torch.zeros(1, channels, size, size)}
        if "image_sizes" in inspect.signature(type(skeleton.tower).forward).parameters:  # (Pixtral: images of any size)
            pixels["image_sizes"] = torch.tensor([[size, size]])
        try:  # (the model's own count: GOT-OCR2's convolutions shrink its patches)
            tokens = _image_tokens(skeleton, pixels)
        except Exception:  # noqa: BLE001 (a tower that reads values, Pixtral's image_sizes: its patches counted)
            tokens = _patch_tokens(config, size)
    ids = torch.full((1, tokens + 2), image_token)
    ids[0, 0] = ids[0, -1] = 0
    start = getattr(config, "vision_start_token_id", None)
    if start is not None:
        ids[0, 0] = start
    takes = inspect.signature(type(skeleton.model.base_model).forward).parameters
    if "mm_token_type_ids" in takes:  # (which tokens are an image's, for the multimodal rotary positions)
        pixels["mm_token_type_ids"] = (ids == image_token).int()
    return {"input_ids": ids, **pixels}


def _patch_tokens(config, size: int) -> int:
    """How many tokens a fixed-size image of `size` pixels a side makes: its patches, merged (Pixtral) or shuffled
    into channels (Llama 4), the class token where the model keeps it (or the config's count: Gemma 3's)."""
    vision = config.vision_config
    side = size // vision.patch_size // (getattr(config, "spatial_merge_size", None) or 1)
    shuffled = getattr(vision, "pixel_shuffle_ratio", None) or 1
    tokens = getattr(config, "mm_tokens_per_image", None) or int(side**2 * shuffled**2)
    return tokens + (getattr(config, "vision_feature_select_strategy", "default") == "full")


def _image_tokens(skeleton: ImageTextSkeleton, pixels: dict) -> int:
    """How many tokens the model's own `get_image_features` makes of `pixels` (computed on meta: shapes alone)."""
    meta = {name: t.to("meta") if name == "pixel_values" else t for name, t in pixels.items()}
    features = skeleton.model.base_model.get_image_features(**meta)
    features = getattr(features, "pooler_output", features)
    return sum(f.shape[-2] for f in features) if isinstance(features, (list, tuple)) else features.shape[-2]


class _ImageTextStage(_GenericStage):
    """What the vision stages share: the placeholders of what they do not bind, the forward on the micro-batch."""

    @cached_property
    def _unbound(self) -> list[str]:
        """What the forward calls before the first decoder layer that this stage does not bind."""
        parts = self.skeleton.parts
        return [n for n in parts.vision_embedding + parts.embedding if n not in set(self.names)]

    def _run(self, views: dict, media, documents, layer, vision, deepstack=None):
        like = next(iter(views.values()))
        weights = {**self.skeleton.placeholders(self._unbound, like), **views}
        inputs = self.skeleton.media_inputs(media)
        return self.skeleton.run(weights, inputs, documents, layer, vision=vision, deepstack=deepstack)

    @staticmethod
    def _until_first_layer(index, hidden, *args, **kwargs):
        raise _Reached(hidden)


class VisionEmbedding(_ImageTextStage):
    """The forward up to the tower's first block: the micro-batch's pixels -> the first block's input ([patches,
    width], every tower call's back to back; none without pixels)."""

    backward_reads_weights = True

    def forward(self, weights: list[Tensor], ids: Tensor, documents=None, media=None) -> Tensor:
        with torch.no_grad():
            return self._first_block_input(self.weights(weights), documents, media)

    def _first_block_input(self, views: dict, documents, media) -> Tensor:
        like = next(iter(views.values()))
        calls = len(self.skeleton.recorded(media, like, documents).sizes)
        if calls == 0:
            return like.new_zeros(0, self.skeleton.width)
        inputs = []

        def vision(call, index, hidden, *args, **kwargs):
            if index == 0:
                inputs.append(hidden)
                if len(inputs) == calls:
                    raise _Reached(hidden)
            return hidden

        with contextlib.suppress(_Reached):
            self._run(views, media, documents, self._until_first_layer, vision)
        return torch.cat(inputs)

    def backward(self, weights, ids, grad_out: Tensor, grads: list[Tensor], documents=None, media=None):
        if grad_out.numel():
            views = self.weights(weights, grad=True)
            with torch.enable_grad():
                out = self._first_block_input(views, documents, media)
                self.accumulate(grads, views, out, grad_out)
        return None


class VisionBlock(_ImageTextStage):
    """The tower's block `index` on each call's patches, as its own module computes it, and the deepstack merger on
    its output where the model has one there (its weights a second group: `merger_names`); the backward recomputes
    it."""

    def __init__(self, skeleton: ImageTextSkeleton, index: int, names: tuple[str, ...], merger_names=()):
        super().__init__(skeleton, (names, tuple(merger_names)) if merger_names else (names,))
        self.index, self.module = index, skeleton.blocks[index]
        self.merger = skeleton.deepstack_mergers.get(index)
        self.carried = sum(block < index for block in skeleton.deepstack_mergers)  # (features in its input)
        self.numel = sum(spec.numel for spec in self.groups[0])
        self.prefixes = {m: prefix for prefix, m in skeleton.model.named_modules() if m in (self.module, self.merger)}

    def _call(self, views: dict, x: Tensor, documents, media) -> Tensor:
        recorded = self.skeleton.recorded(media, x, documents)
        hidden, carried = self.skeleton.unpack_tower(x, recorded, self.carried)
        outputs, features = [], []
        with self.skeleton.attention_for(x):
            for patches, blocks in zip(hidden.split(recorded.sizes), recorded.blocks):
                args, kwargs = blocks[self.index]
                outputs.append(_output(self._module_call(self.module, views, (patches, *args), kwargs)))
                if self.merger is not None:
                    features.append(self._module_call(self.merger, views, (outputs[-1],), {}))
        hidden = torch.cat(outputs) if outputs else hidden
        if self.merger is not None:
            carried.append(torch.cat(features) if features else x.new_zeros(0, self.skeleton.text_config.hidden_size))
        return pack(hidden, carried)

    def _module_call(self, module: nn.Module, views: dict, args: tuple, kwargs: dict):
        prefix = self.prefixes[module] + "."
        local = {name.removeprefix(prefix): value for name, value in views.items() if name.startswith(prefix)}
        return torch.func.functional_call(module, local, args, kwargs, strict=False)

    def forward(self, weights: list[Tensor], x: Tensor, documents=None, media=None) -> Tensor:
        with torch.no_grad():
            return self._call(self.weights(weights), x, documents, media)

    def backward(self, weights, x: Tensor, grad_out: Tensor, grads: list[Tensor], documents=None, media=None):
        if not x.numel():
            return torch.zeros_like(x)
        return self._recomputed_backward(weights, x, grad_out, grads, documents, media)


class Connector(_ImageTextStage):
    """The forward from the tower's last block to the first decoder layer: the tower's end, the projector, the token
    embedding and the splice of the image features in at their placeholder tokens. Its backward gives the gradient
    of the tower's output (none where no stage before it needs one: a frozen tower)."""

    backward_reads_weights = True

    def _first_layer_input(self, views: dict, x: Tensor, documents, media) -> Tensor:
        """The first decoder layer's input, with the deepstack features the decoder is given (`pack`ed)."""
        recorded = self.skeleton.recorded(media, x, documents)
        mergers = list(self.skeleton.deepstack_mergers)
        hidden, carried = self.skeleton.unpack_tower(x, recorded, len(mergers))
        pieces = hidden.split(recorded.sizes) if hidden.numel() else ()
        patches = max(1, hidden.shape[0])  # (a call's features: its share of the rows, mergers merge evenly)
        features = [f.split([size * f.shape[0] // patches for size in recorded.sizes]) for f in carried]
        last = len(self.skeleton.blocks) - 1

        def vision(call, index, hidden, *args, **kwargs):
            return pieces[call] if index == last else hidden

        def deepstack(call, index, hidden):
            return features[mergers.index(index)][call]

        try:
            with _keyword_arguments(self.skeleton.text_model) as decoder:
                self._run(views, media, documents, self._until_first_layer, vision, deepstack)
        except _Reached as first:
            return pack(first.hidden, decoder.get("deepstack_visual_embeds") or [])
        raise GenericError("the model's forward reached no decoder layer")

    def forward(self, weights: list[Tensor], x: Tensor, documents=None, media=None) -> Tensor:
        with torch.no_grad():
            return self._first_layer_input(self.weights(weights), x, documents, media)

    def backward(self, weights, x: Tensor, grad_out: Tensor, grads: list[Tensor], documents=None, media=None):
        views = self.weights(weights, grad=True)
        x = x.detach().requires_grad_(x.numel() > 0)
        with torch.enable_grad():
            out = self._first_layer_input(views, x, documents, media)
            inputs = (x,) if x.numel() else ()
            found = self.accumulate(grads, views, out, grad_out, inputs)
        return found[0] if found and found[0] is not None else torch.zeros_like(x)


class DeepstackLayer(GenericLayer):
    """A decoder layer whose output the model adds deepstack features to (Qwen3-VL's first layers): its input carries
    those features (`pack`ed), the first of them added after the layer by the model's own `_deepstack_process`, the
    rest passed on."""

    def __init__(self, skeleton: ImageTextSkeleton, index: int, names: tuple[str, ...]):
        super().__init__(skeleton, index, names)
        self.carried = len(skeleton.deepstack_mergers) - index
        self.checkpoint_planes = 1 + self.carried  # (at most: the features sit at the image tokens alone)

    def _call(self, views: dict, x: Tensor, documents, media=None) -> Tensor:
        if media is None:  # (the layer alone on hidden states: the planner's trace)
            return super()._call(views, x, documents)
        width = self.skeleton.text_config.hidden_size
        hidden, carried = unpack(x, (*media.input_ids.shape, width), self.carried, width)
        out = super()._call(views, hidden, documents, media)
        mask = self.skeleton.recorded(media, x, documents).visual_mask
        if mask is not None:
            out = self.skeleton.text_model._deepstack_process(out, mask, carried[0])
        return pack(out, carried[1:])


def part_of(skeleton: ImageTextSkeleton, name: str) -> str:
    """Which part of the model a parameter is, as LLaMA-Factory's freeze_* options name them: the projector (a
    `multi_modal_projector`, Qwen's `merger`, LLaVA-NeXT's `image_newline`), the vision tower (the rest of the
    tower), or the language model."""
    if "projector" in name or ".merger." in name or "image_newline" in name:
        return "multi_modal_projector"
    return "vision_tower" if name.startswith(skeleton.tower_prefix) else "language_model"


def build_image_text_model(config):
    """The `ModelSpec` of an image-text model: groups [the tower's embedding, each of its blocks, the connector's
    (the tower's end, the projector, the token embedding: a group per part, so that each can be frozen alone),
    each decoder layer, the head], one stage each."""
    skeleton = ImageTextSkeleton(json.loads(config.hf_config))
    parts, shapes = skeleton.parts, skeleton.shapes

    def group(name: str, names: list[str]) -> Group:
        return Group(name, tuple(_spec(n, shapes[n]) for n in names))

    groups = [group("vision.embed", parts.vision_embedding)]
    stages = [StageSpec("vision.embed", VisionEmbedding(skeleton, (tuple(parts.vision_embedding),)), (0,))]
    for index, names in enumerate(parts.vision_blocks):
        groups.append(group(f"vision.block{index}", names))
        merger = parts.deepstack.get(index, ())
        if merger:  # (its deepstack merger: a group of its own, bound beside the block)
            groups.append(group(f"vision.deepstack{list(parts.deepstack).index(index)}", merger))
        bound = tuple(range(len(groups) - 1 - bool(merger), len(groups)))
        template = VisionBlock(skeleton, index, tuple(names), tuple(merger))
        stages.append(StageSpec(f"vision.block{index}", template, bound))
    connector = {}  # part -> its names among the connector's
    for name in parts.embedding:
        connector.setdefault(part_of(skeleton, name), []).append(name)
    labels = {"vision_tower": "vision.end", "multi_modal_projector": "projector", "language_model": "embed"}
    bound = tuple(range(len(groups), len(groups) + len(connector)))
    groups += [group(labels[part], names) for part, names in connector.items()]
    embed = groups.index(next(g for g in groups if g.name == "embed"))
    connector_names = tuple(tuple(names) for names in connector.values())
    stages.append(StageSpec("embed", Connector(skeleton, connector_names), bound))
    for index, names in enumerate(parts.layers):
        groups.append(group(f"layer{index}", names))
        kind = DeepstackLayer if index < len(parts.deepstack) else GenericLayer
        stages.append(StageSpec(f"layer{index}", kind(skeleton, index, tuple(names)), (len(groups) - 1,)))
    groups.append(group("head", parts.head))
    head = len(groups) - 1
    tied = config.tie_embeddings
    bound = (embed, head) if tied else (head,)
    names = (connector["language_model"], tuple(parts.head)) if tied else (tuple(parts.head),)
    text = skeleton.text_config
    stages.append(StageSpec("head", GenericHead(skeleton, names, text.hidden_size, text.vocab_size), bound))
    group_parts = [part_of(skeleton, g.params[0].name) if g.params else "vision_tower" for g in groups]
    if parts.unused:  # (stored and exported, never run: no stage binds them)
        groups.append(group("vision.unused", parts.unused))
        group_parts.append("unused")
    layout = CheckpointLayout(skeleton)
    return ModelSpec(config, tuple(groups), tuple(stages), checkpoint_layout=layout, group_parts=tuple(group_parts))

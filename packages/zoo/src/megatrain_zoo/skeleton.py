"""A transformers decoder built once from its config.json, its parameters on the meta device (`HFSkeleton`): which
modules are its embedding, decoder layers and head (`Parts`), and the arguments its forward gives each layer, taken
from that forward itself, run with the layers stood in for, once per micro-batch shape. What the generic templates
(`generic_stages.py`), the image-text model (`image_text.py`) and generation (`generate.py`) run on."""

import contextlib
import inspect
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from megatrain_templates import Documents

# micro-batch shapes whose layer arguments are remembered (a step's micro-batches, evaluation's, a warm-up's)
ARGUMENTS_CACHED = 64
# the [batch, seq] of the traces that find a model's parts and check its layers' inputs: more than one of each, so
# that a wrong reading of a layer's output cannot pass for the right one
TRACED_TOKENS = (2, 3)


class GenericError(ValueError):
    """A model the generic path cannot train, with the reason and the fix in the message."""


class _Reached(Exception):
    """Raised by a stood-in layer to stop the model's forward there, with what that layer was given."""

    def __init__(self, hidden: Tensor):
        super().__init__()
        self.hidden = hidden


class _EmptyOnMeta(torch.overrides.TorchFunctionMode):
    """`torch.empty` with no device makes a meta tensor: what modules make their parameters with (a large MoE
    layer's experts would otherwise take tens of GB for a moment); buffers (rotary tables) are computed, not empty."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules made inside put their parameters on the meta device as they register them (buffers stay real)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:  # (one on meta already is kept: tying shares the object)
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        with _EmptyOnMeta():
            yield
    finally:
        nn.Module.register_parameter = register


def _output(value):
    """A layer's or model's hidden-state output: older transformers return tuples (GPT-1's blocks, lists)."""
    return value[0] if isinstance(value, (tuple, list)) else value


class HFSkeleton:
    """transformers' causal LM of `hf_config` (a config.json dict), its parameters on the meta device, in eval mode
    (no dropout); the layer arguments its forward makes, per micro-batch."""

    auto_class = "AutoModelForCausalLM"  # (transformers' auto class the skeleton is built with)

    def __init__(self, hf_config: dict, attention: str = "sdpa"):
        import transformers

        config = transformers.AutoConfig.for_model(**hf_config)
        auto = getattr(transformers, self.auto_class)
        try:
            with _parameters_on_meta():
                self.model = auto.from_config(config, attn_implementation=attention)
        except ValueError as error:  # (a family without SDPA support, Gemma 2's soft-capped scores: eager)
            if "attention implementation" not in str(error):
                raise
            with _parameters_on_meta():
                self.model = auto.from_config(config, attn_implementation="eager")
        self.model.eval()
        self.config = self.model.config
        self.text_config = self.config.get_text_config()
        self.base, self.layers = _base_and_layers(self.model, self.text_config)
        self._device = torch.device("cpu")
        self._arguments: OrderedDict = OrderedDict()
        self.layer_output = _hidden_states  # (how the forward reads a layer's output: settled by `parts`)
        self.product_bytes: dict = {}  # (kind of layer, dtype, backend) -> bytes per token its kept graph holds
        self.parts  # noqa: B018 (traced now: the stages need it, and it settles `layer_output`)

    @cached_property
    def names(self) -> dict[int, str]:
        """id(parameter) -> its name in the model's state dict (a tied parameter under its first name)."""
        return {id(p): name for name, p in self.model.named_parameters(remove_duplicate=True)}

    @cached_property
    def parts(self) -> "Parts":
        return self._parts()

    def _parts(self) -> "Parts":
        """Parameter names (as the model's state dict and checkpoints name them) of the embedding stage (what the
        forward uses before its first decoder layer: the token table, a position table), each decoder layer, and
        the head (everything else: final norm, LM head), found by running the forward once on a one-token input."""
        before, after = self._modules_called()
        layer_ids = [[id(p) for p in layer.parameters()] for layer in self.layers]
        in_layers = {i for ids in layer_ids for i in ids}
        embedding_ids = dict.fromkeys(
            id(p) for module in before for p in module.parameters(recurse=False) if id(p) not in in_layers
        )
        head_ids = [i for i in self.names if i not in embedding_ids and i not in in_layers]
        reads_embedding = any(id(p) in embedding_ids for module in after for p in module.parameters(recurse=False))
        return Parts(
            embedding=[self.names[i] for i in embedding_ids],
            layers=[[self.names[i] for i in ids] for ids in layer_ids],
            head=[self.names[i] for i in head_ids],
            head_reads_embedding=reads_embedding,
        )

    def _modules_called(self) -> tuple[list[nn.Module], list[nn.Module]]:
        """The modules the forward calls before its first decoder layer (the input embedding included) and after
        its last (up to its LM head), run on a few tokens with zero weights (stride-0 views: no memory). Settles on
        the way the forward reads its layers' outputs (`layer_output`): the one that brings the tokens to the LM head
        as [batch, seq, ...] (the wrong one breaks the forward or cuts the hidden states: GPT-Neo's `outputs[0]` of
        a bare tensor is its first row)."""
        weights = {
            name: torch.zeros((), dtype=p.dtype).expand(p.shape)
            for name, p in self.model.named_parameters()
            if name not in {n for names in self._layer_names for n in names}
        }
        failures = []
        for form in (_hidden_states, _hidden_states_first):
            self.layer_output = form
            try:
                phases, reached = self._trace(weights)
            except GenericError:
                raise
            except Exception as error:  # noqa: BLE001
                failures.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            if tuple(reached.shape[:2]) == TRACED_TOKENS:
                self._check_layer_inputs(weights)
                return phases[0], phases[2]
            failures.append(f"tokens {TRACED_TOKENS} reached the LM head as {tuple(reached.shape)}")
        raise GenericError(
            f"{type(self.model).__name__}'s forward cannot run with its decoder layers streamed ({failures[0]}); "
            "use a family with a native template"
        )

    def _check_layer_inputs(self, weights: dict[str, Tensor]) -> None:
        """Refuse a model whose layers are given more than hidden states and what follows from positions (masks,
        rotary tables): an input computed from the tokens or the weights (Gemma 3n's per-layer embeddings) or from
        an earlier layer's output (ZAYA's router states, Inkling 2's growing block states) would need its
        gradient, which the generic path's stages do not carry. Found by running the forward twice, with different
        token and weight values and different outputs of every stood-in layer (a second output too, where layers
        return tuples), and comparing what each layer is given."""
        signature = inspect.signature(type(self.layers[0]).forward).parameters
        positional = [name for name in signature if name != "self"][1:]  # (after the hidden states)
        read_output = self.layer_output

        def layer_arguments(fill: float, tokens: Tensor) -> list[dict]:
            recorded: list[dict] = [{} for _ in self.layers]

            def record(index, hidden_states, *args, **kwargs):
                recorded[index].update(zip(positional, args), **kwargs)
                if index == len(self.layers) - 1:
                    raise _Reached(hidden_states)
                return torch.full_like(hidden_states, fill + 1 + index)

            marker = torch.full((1,), fill + 1)  # (a tuple's second output, passed on by ZAYA's forward)
            self.layer_output = read_output if read_output is _hidden_states else lambda hidden: (hidden, marker)
            filled = {name: torch.full((), fill, dtype=w.dtype).expand(w.shape) for name, w in weights.items()}
            try:
                with contextlib.suppress(_Reached), torch.no_grad():
                    self.run(filled, {"input_ids": tokens}, None, record)
            finally:
                self.layer_output = read_output
            return recorded

        tokens = torch.zeros(TRACED_TOKENS, dtype=torch.long)
        for index, (first, second) in enumerate(zip(layer_arguments(0.0, tokens), layer_arguments(0.5, tokens + 1))):
            for name, value in first.items():
                if not _same(value, second[name]):
                    raise GenericError(
                        f"{type(self.layers[index]).__name__} {index} is given {name!r}, computed from the tokens, the "
                        "weights or an earlier layer's output; the generic path gives a layer only its hidden states "
                        f"and what follows from positions, so {self.config.model_type} needs a native template"
                    )

    @cached_property
    def carries_state(self) -> bool:
        """Whether the layers mix tokens along a row by more than attention (a Mamba or linear recurrence, a short
        convolution): transformers' implementations of those run through a packed row's documents as one. Known by
        a convolution among the layers' modules, the model's own flag, or a layer type transformers caches a
        recurrent state for (MiniMax's lightning attention: "linear_attention")."""
        convolves = any(isinstance(m, nn.Conv1d) for layer in self.layers for m in layer.modules())
        layer_types = set(getattr(self.text_config, "layer_types", None) or ())
        recurrent = bool(layer_types & _recurrent_layer_types())
        return convolves or recurrent or bool(getattr(self.model, "_is_stateful", False))

    @cached_property
    def packs_documents(self) -> bool:
        """Whether a packed row's documents stay apart as transformers runs the model: no recurrence or convolution
        carries state along the row (`carries_state`), and for positions restarting at each document the forward
        gives every layer an attention mask that keeps a document from the one before (OPT's and GPT-1's forwards
        ignore the restart: their layers would attend across documents)."""
        if self.carries_state:
            return False
        # two documents of 3 tokens: query 3 (the second's first) must not see key 2 (the first's last)
        documents = Documents(torch.tensor([[0, 1, 2, 0, 1, 2]]))
        hidden = torch.zeros(1, 6, self.text_config.hidden_size)
        recorded = self._record_layer_arguments(hidden, documents)
        return all(any(_blocks(mask, 3, 2) for mask in _masks(arguments, 6)) for arguments in recorded)

    @cached_property
    def _layer_names(self) -> list[list[str]]:
        return [[self.names[id(p)] for p in layer.parameters()] for layer in self.layers]

    def _trace(self, weights: dict[str, Tensor]) -> tuple[list[list[nn.Module]], Tensor]:
        """(the modules outside the layers called before, between and after them; what reached the LM head)."""
        inside = {id(m) for layer in self.layers for m in layer.modules()}
        calls = CalledModules(self.model, inside, stop_at=self.model.get_output_embeddings())

        order = []

        def stand_in(index, hidden_states, *args, **kwargs):
            calls.passed(index, len(self.layers))
            order.append(index)
            return hidden_states

        try:
            with calls, torch.no_grad():
                tokens = torch.zeros(TRACED_TOKENS, dtype=torch.long)
                reached = self.run(weights, {"input_ids": tokens}, None, stand_in, True).logits
        except _Reached as at_head:
            reached = at_head.hidden
        if order != list(range(len(self.layers))):
            raise GenericError(
                f"{type(self.model).__name__}'s forward calls its decoder layers in the order {order[:12]}, not each "
                "once in turn (a looped section), which the generic path's one-stage-per-layer cannot stream; use a "
                "family with a native template"
            )
        if calls.shared is not None:
            raise GenericError(
                f"{type(self.model).__name__} calls {type(calls.shared).__name__} between its decoder layers (a block "
                "shared across layers), which the generic path's one-stage-per-layer cannot stream; use a family "
                "with a native template"
            )
        return calls.phases, reached

    @property
    def device(self) -> torch.device:
        """Where the buffers are (the device the last forward ran on)."""
        return self._device

    def to(self, device: torch.device) -> None:
        """The buffers (rotary tables) to `device` (the parameters stay on meta: each call binds its own)."""
        if device != self._device:
            for module in self.model.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(device)
            self._device = device
            self._arguments.clear()

    def run(self, weights: dict[str, Tensor], inputs: dict, documents, stand_in, head: bool = False):
        """The model's forward (the causal LM's with `head`, else its decoder's) on `inputs` (input_ids or
        inputs_embeds), bound to `weights`, each decoder layer replaced by `stand_in(index, hidden_states, *args,
        **kwargs)`, whose hidden states the model reads as it reads a layer's (`_LayerOutput`)."""
        self.to(next(iter(inputs.values())).device)
        inputs = {**inputs, "use_cache": False, **_position_inputs(documents)}
        for index, layer in enumerate(self.layers):
            layer.forward = lambda hidden_states, *args, _index=index, **kwargs: self.layer_output(
                stand_in(_index, hidden_states, *args, **kwargs)
            )
        try:
            module = self.causal_lm if head else self.base
            return torch.func.functional_call(module, _relative(weights, module, self.model), (), inputs, strict=False)
        finally:
            for layer in self.layers:
                del layer.forward

    @property
    def causal_lm(self) -> nn.Module:
        """The module whose forward gives the logits (the model; an image-text model's language model where that is
        a causal LM of its own)."""
        return self.model

    def zero_embeddings(self, hidden: Tensor) -> Tensor:
        """Token embeddings of zeros for a forward whose layers are given `hidden` ([batch, seq, ...]) instead: as
        wide as the embedding table (OPT's are narrower than its layers and projected in)."""
        width = getattr(self.model.get_input_embeddings(), "embedding_dim", hidden.shape[-1])
        return hidden.new_zeros(*hidden.shape[:2], width)

    def placeholders(self, names: list[str], like: Tensor) -> dict[str, Tensor]:
        """Zeros (stride-0 views: no memory) for the parameters `names` on `like`'s device, for a forward whose
        use of them is thrown away."""
        zero = torch.zeros((), dtype=like.dtype, device=like.device)
        return {name: zero.expand(self.shapes[name]) for name in names}

    @cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(p.shape) for name, p in self.model.named_parameters(remove_duplicate=False)}

    def layer_arguments(self, hidden: Tensor, documents, media=None) -> list[tuple[tuple, dict]]:
        """What the model's forward gives each layer besides the hidden states, for a micro-batch like `hidden`
        ([batch, seq, d_model]) laid out as `documents`: computed once per micro-batch (kept in its `Documents`,
        as the native templates keep its masks) or, without one, once per shape. (`media`: an image-text model's,
        `megatrain_zoo.image_text`.)"""
        key = ("generic", tuple(hidden.shape), hidden.device, hidden.dtype)
        cache = self._arguments if documents is None else documents._masks
        if key not in cache:
            cache[key] = self._record_layer_arguments(hidden, documents)
            while len(self._arguments) > ARGUMENTS_CACHED:
                self._arguments.popitem(last=False)
        return cache[key]

    def _record_layer_arguments(self, hidden: Tensor, documents) -> list[tuple[tuple, dict]]:
        recorded: list = [None] * len(self.layers)

        def record(index, hidden_states, *args, **kwargs):
            recorded[index] = (args, kwargs)
            if index == len(self.layers) - 1:
                raise _Reached(hidden_states)
            return hidden_states

        with contextlib.suppress(_Reached), torch.no_grad():
            embeds = {"inputs_embeds": self.zero_embeddings(hidden)}
            self.run(self.placeholders(self.parts.embedding, hidden), embeds, documents, record)
        if any(r is None for r in recorded):
            raise GenericError(f"{type(self.model).__name__}'s forward did not call every decoder layer")
        return recorded


class CalledModules:
    """The modules outside `inside` (the stood-in blocks' own) that a forward calls, by phase: before the first
    stood-in block, between them, after the last (`passed(index, n)` from each stand-in moves the phase);
    `stop_at`: a module whose call ends the forward (`_Reached` with its input)."""

    def __init__(self, model: nn.Module, inside: set[int], stop_at: nn.Module | None = None):
        self.phases: list[list[nn.Module]] = [[], [], []]
        self.phase = 0
        self.after: dict[int, list[nn.Module]] = {}  # block index -> the modules called between it and the next
        self._block = None
        self._modules = [m for m in model.modules() if id(m) not in inside]
        self._stop_at, self._handles = stop_at, []

    def passed(self, index: int, n_blocks: int) -> None:
        self.phase, self._block = (2 if index == n_blocks - 1 else 1), index

    def _called(self, module: nn.Module, args) -> None:
        self.phases[self.phase].append(module)
        if self.phase == 1:
            self.after.setdefault(self._block, []).append(module)
        if module is self._stop_at:
            raise _Reached(args[0])

    def __enter__(self) -> "CalledModules":
        self._handles = [m.register_forward_pre_hook(self._called) for m in self._modules]
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()

    @property
    def shared(self) -> nn.Module | None:
        """The first module with weights called between the blocks (None: none)."""
        return next((m for m in self.phases[1] if any(True for _ in m.parameters(recurse=False))), None)


def _recurrent_layer_types() -> set[str]:
    """The layer types for which transformers' cache keeps a recurrent or convolution state (empty where the
    installed transformers has no such mapping)."""
    try:
        from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, LinearAttentionCacheLayerMixin
    except ImportError:
        return set()
    return {
        kind for kind, layer in DYNAMIC_LAYER_TYPE_MAPPING.items() if issubclass(layer, LinearAttentionCacheLayerMixin)
    }


def _same(a, b) -> bool:
    """Whether two layer arguments are equal: tensors by value, containers item by item, the rest by identity."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a is b or type(a) is type(b) and not isinstance(a, Tensor)


def _masks(value, seq: int):
    """The attention masks among a layer's arguments (tensors, also inside tuples, lists and dicts, whose last two
    dimensions are [seq, seq]: bool, or float added to the scores)."""
    if isinstance(value, Tensor):
        if (
            value.ndim >= 2
            and tuple(value.shape[-2:]) == (seq, seq)
            and (value.dtype == torch.bool or value.is_floating_point())
        ):
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from _masks(item, seq)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _masks(item, seq)


def _blocks(mask: Tensor, query: int, key: int) -> bool:
    """Whether `mask` keeps `query` from `key` in every row and head (False where bool; a large negative score)."""
    entry = mask[..., query, key]
    return bool((~entry).all()) if mask.dtype == torch.bool else bool((entry < torch.finfo(mask.dtype).min / 2).all())


def _hidden_states(hidden: Tensor):
    """A layer's output as most families' layers return it."""
    return hidden


def _hidden_states_first(hidden: Tensor) -> tuple:
    """A layer's output as Falcon-H1's, Bamba's, Chameleon's layers return it: (hidden states, attention weights)."""
    return hidden, None


@dataclass(frozen=True)
class Parts:
    """A generic model's parameter names by stage."""

    embedding: list[str]
    layers: list[list[str]]
    head: list[str]
    head_reads_embedding: bool  # (a tied LM head: the head stage binds the embedding's group too)


def _base_and_layers(model: nn.Module, text_config) -> tuple[nn.Module, nn.ModuleList]:
    """The module a forward without the LM head runs, and the ModuleList of decoder layers inside it (a child's, or
    deeper: Llama 4's language model is a causal LM). The list is as long as num_hidden_layers, or as num_layers
    where that differs (LongCat-Flash counts each layer's two attentions as layers), found in the model's own
    `get_decoder()` (not where that is its LM head: ModernBERT's is named `decoder`), else in its base model. The
    module run is the base model where it holds the list: its forward does what a wrapper does before its decoder
    (Gemma 4 Unified's replaces image and audio tokens by padding; an image-text model's splices the images in)."""
    counts = [n for n in (text_config.num_hidden_layers, getattr(text_config, "num_layers", None)) if n]
    candidates = [model.get_decoder()] if hasattr(model, "get_decoder") else []
    for decoder in [*candidates, model.base_model]:
        for n_layers in counts:
            for module in [*decoder.children(), *decoder.modules()]:
                if isinstance(module, nn.ModuleList) and len(module) == n_layers:
                    holds = any(child is module for child in model.base_model.modules())
                    return (model.base_model if holds else decoder), module
    raise GenericError(
        f"{type(model.base_model).__name__} has no list of {counts[0]} decoder layers the generic path recognises"
    )


def _relative(weights: dict[str, Tensor], module: nn.Module, model: nn.Module) -> dict[str, Tensor]:
    """`weights` by the model's names, renamed relative to `module` (the decoder drops its prefix)."""
    if module is model:
        return weights
    prefix = next(name for name, child in model.named_modules() if child is module) + "."
    return {name.removeprefix(prefix): value for name, value in weights.items() if name.startswith(prefix)}


def _position_inputs(documents) -> dict:
    """The model's position_ids and attention_mask for a micro-batch's layout: positions restarting at each packed
    document (transformers then keeps the documents apart), a padding mask where rows end in padding."""
    if documents is None:
        return {}
    if documents.position_ids is not None:
        return {"position_ids": documents.position_ids}
    if documents.valid is not None:
        return {"attention_mask": documents.valid.long()}
    return {}

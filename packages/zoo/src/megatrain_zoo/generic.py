"""Any transformers decoder on day one: stateless templates that call the model's own modules with the streamed
weights, exact by construction; the native templates stay the fast path.

transformers' causal LM is built once from the config with its parameters on the meta device (its buffers, the
rotary tables, real). Each stage binds its slot's views to the parameters it owns (`torch.func.functional_call`):
the embedding stage runs the model's forward up to its first layer (the embedding and whatever the model does to it
before the layers), a layer stage one decoder layer, the head stage everything after the last layer (final norm,
LM head, soft caps and scalings) then the cross-entropy. The arguments the model's forward gives each layer
(position embeddings, masks for causal, sliding or chunked attention, packed documents where transformers supports
them, a hybrid's per-layer extras) are taken from that forward itself, run with the layers stood in for, once per
micro-batch shape.
"""

import contextlib
import inspect
import json
import traceback
from collections import OrderedDict
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor, nn

from megatrain_templates import IGNORE_INDEX, ParamSpec, Template, distribution_entropy
from megatrain_templates.kept_graph import KeptGraphs, saved_bytes

# micro-batch shapes whose layer arguments are remembered (a step's micro-batches, evaluation's, a warm-up's)
ARGUMENTS_CACHED = 64


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
    """A layer's or model's hidden-state output: older transformers return tuples."""
    return value[0] if isinstance(value, tuple) else value


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
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
        self.base = self._base_module(decoder)
        self.layers = _decoder_layers(decoder, self.text_config.num_hidden_layers)
        self._device = torch.device("cpu")
        self._arguments: OrderedDict = OrderedDict()
        self.layer_output = _hidden_states  # (how the forward reads a layer's output: settled by `parts`)
        self.product_bytes: dict = {}  # (kind of layer, dtype) -> bytes per token its kept graph holds
        self.parts  # noqa: B018 (traced now: the stages need it, and it settles `layer_output`)

    def _base_module(self, decoder: nn.Module) -> nn.Module:
        """The module a forward without the head runs: the decoder."""
        return decoder

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
        its last (up to its LM head), run on one token with zero weights (stride-0 views: no memory). Settles on
        the way the forward reads its layers' outputs (`layer_output`): the one token reaches the LM head whole."""
        weights = {
            name: torch.zeros((), dtype=p.dtype).expand(p.shape)
            for name, p in self.model.named_parameters()
            if name not in {n for names in self._layer_names for n in names}
        }
        failures = []
        for form in (_hidden_states, _hidden_states_first):
            self.layer_output = form
            try:  # (the wrong form breaks the model's forward, or leaves the hidden states cut)
                phases, reached = self._trace(weights)
            except Exception as error:  # noqa: BLE001
                failures.append(f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
                continue
            if tuple(reached.shape[:2]) == (1, 1):
                self._check_layer_inputs(weights)
                return phases[0], phases[2]
            failures.append(f"one token reached the LM head as {tuple(reached.shape)}")
        raise GenericError(
            f"{type(self.model).__name__}'s forward cannot run with its decoder layers streamed ({failures[0]}); "
            "use a family with a native template"
        )

    def _check_layer_inputs(self, weights: dict[str, Tensor]) -> None:
        """Refuse a model whose layers are given more than hidden states and what follows from positions (masks,
        rotary tables): an input computed from the tokens or the weights (Gemma 3n's per-layer embeddings) would
        need its gradient, which the generic path's stages do not carry; found by giving the first layer's
        arguments two different token and weight values."""

        signature = inspect.signature(type(self.layers[0]).forward).parameters
        positional = [name for name in signature if name != "self"][1:]  # (after the hidden states)

        def first_layer_arguments(fill: float, token: int) -> dict:
            recorded = {}

            def record(index, hidden_states, *args, **kwargs):
                recorded.update(zip(positional, args), **kwargs)
                raise _Reached(hidden_states)

            filled = {name: torch.full((), fill, dtype=w.dtype).expand(w.shape) for name, w in weights.items()}
            with contextlib.suppress(_Reached), torch.no_grad():
                self.run(filled, {"input_ids": torch.full((1, 2), token)}, None, record)
            return recorded

        first, second = first_layer_arguments(0.0, 0), first_layer_arguments(0.5, 1)
        for name, value in first.items():
            if not _same(value, second[name]):
                raise GenericError(
                    f"{type(self.layers[0]).__name__} is given {name!r}, computed from the tokens or the weights "
                    "before it; the generic path gives a layer only its hidden states and what follows from "
                    f"positions, so {self.config.model_type} needs a native template"
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
    def _layer_names(self) -> list[list[str]]:
        return [[self.names[id(p)] for p in layer.parameters()] for layer in self.layers]

    def _trace(self, weights: dict[str, Tensor]) -> tuple[list[list[nn.Module]], Tensor]:
        """(the modules outside the layers called before, between and after them; what reached the LM head)."""
        inside = {id(m) for layer in self.layers for m in layer.modules()}
        calls = CalledModules(self.model, inside, stop_at=self.model.get_output_embeddings())

        def stand_in(index, hidden_states, *args, **kwargs):
            calls.passed(index, len(self.layers))
            return hidden_states

        try:
            with calls, torch.no_grad():
                reached = self.run(weights, {"input_ids": torch.zeros(1, 1, dtype=torch.long)}, None, stand_in, True)
                reached = reached.logits
        except _Reached as at_head:
            reached = at_head.hidden
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

        embeds = torch.zeros_like(hidden)
        with contextlib.suppress(_Reached), torch.no_grad():
            self.run(self.placeholders(self.parts.embedding, hidden), {"inputs_embeds": embeds}, documents, record)
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


def _decoder_layers(base: nn.Module, n_layers: int) -> nn.ModuleList:
    """The decoder's ModuleList of its layers (a child's, or deeper: Llama 4's language model is a causal LM)."""
    for module in [*base.children(), *base.modules()]:
        if isinstance(module, nn.ModuleList) and len(module) == n_layers:
            return module
    raise GenericError(f"{type(base).__name__} has no list of {n_layers} decoder layers the generic path recognises")


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


class _GenericStage(Template):
    """What the generic templates share: their parameters by name, laid out in the stage's flat buffers (one per
    bound group, its names back to back)."""

    def __init__(self, skeleton: HFSkeleton, groups: tuple[tuple[str, ...], ...]):
        self.skeleton = skeleton
        self.shapes = skeleton.shapes
        self.param_groups = groups
        self.names = [name for group in groups for name in group]
        self.groups = tuple(tuple(_spec(name, self.shapes[name]) for name in group) for group in groups)
        # (a vision stage's checkpoint is counted as the text's width a token: the planner's count of it)
        self.d_model = skeleton.text_config.hidden_size

    def _spans(self, buffers: list[Tensor]):
        """(name, its flat span of the buffer bound to its group; a group without one, frozen, has none)."""
        for names, buffer in zip(self.param_groups, buffers):
            if buffer is None:
                continue
            offset = 0
            for name in names:
                numel = int(torch.Size(self.shapes[name]).numel())
                yield name, buffer[offset : offset + numel]
                offset += numel

    def weights(self, buffers: list[Tensor], grad: bool = False) -> dict[str, Tensor]:
        """name -> a view of the slot (a leaf of its own with `grad`)."""
        views = {}
        for name, span in self._spans(buffers):
            view = span.view(self.shapes[name])
            views[name] = view.detach().requires_grad_(True) if grad else view
        return views

    def accumulate(self, grads: list[Tensor], views: dict, outputs, grad_outputs, inputs=()) -> tuple:
        """autograd.grad of `outputs` w.r.t. `inputs` and the parameter leaves `views`; the parameters' gradients are
        added into the flat fp32 `grads` (None for a frozen group's: none is computed); returns the inputs'
        gradients."""
        trained = self._trained(grads)
        leaves = [views[name] for name in trained]
        found = torch.autograd.grad(outputs, [*inputs, *leaves], grad_outputs, allow_unused=True)
        self._add(grads, dict(zip(trained, found[len(inputs) :])))
        return found[: len(inputs)]

    def _recomputed_backward(self, weights, x: Tensor, grad_out: Tensor, grads: list[Tensor], documents, media):
        """The backward of a stage that computes `self._call(views, x, documents, media)`: recomputed under
        autograd, the weights' gradients added into `grads`, the input's returned."""
        views = self.weights(weights, grad=True)
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self._call(views, x, documents, media)
            (grad_x,) = self.accumulate(grads, views, out, grad_out, (x,))
        return grad_x

    def _trained(self, grads: list) -> list[str]:
        """The parameter names of the groups that take a gradient (a frozen group's buffer is None)."""
        return [name for names, grad in zip(self.param_groups, grads) if grad is not None for name in names]

    def _add(self, grads: list[Tensor], found) -> None:
        """The parameters' gradients (name -> gradient; None or absent: unused) added into the flat fp32 `grads`."""
        by_name = found if isinstance(found, dict) else dict(zip(self.names, found))
        for name, span in self._spans(grads):
            if by_name.get(name) is not None:
                span.add_(by_name[name].reshape(-1).to(span.dtype))


def _zeros_of_little_memory(shape: tuple, dtype: torch.dtype) -> Tensor:
    """Zeros of `shape` that take about one matrix's memory: stride 0 (a vector's or matrix's), or, for a stack of
    experts' matrices (whose grouped GEMM takes no stride 0), the matrices overlapping 16 elements apart."""
    if len(shape) < 3:
        return torch.zeros((), dtype=dtype).expand(shape).requires_grad_(True)
    inner = torch.Size(shape[1:]).numel()
    base = torch.zeros(inner + 16 * shape[0], dtype=dtype)
    strides = (16, *torch.empty(shape[1:]).stride())
    return base.as_strided(shape, strides).detach().requires_grad_(True)


def _spec(name: str, shape: tuple) -> ParamSpec:
    """Matrices decay, vectors (norms, biases, Mamba's A_log, D and dt_bias) do not, as megatrain's native rule."""
    return ParamSpec(name, shape, weight_decay=len(shape) >= 2)


class GenericEmbedding(_GenericStage):
    """The model's forward up to its first decoder layer: token ids -> what the first layer is given."""

    backward_reads_weights = True

    def forward(self, weights: list[Tensor], ids: Tensor, documents=None) -> Tensor:
        with torch.no_grad():
            return self._first_layer_input(self.weights(weights), ids, documents)

    def _first_layer_input(self, views: dict, ids: Tensor, documents) -> Tensor:
        def reached(index, hidden_states, *args, **kwargs):
            raise _Reached(hidden_states)

        try:
            self.skeleton.run(views, {"input_ids": ids}, documents, reached)
        except _Reached as first:
            return first.hidden
        raise GenericError("the model's forward reached no decoder layer")

    def backward(self, weights: list[Tensor], ids: Tensor, grad_out: Tensor, grads: list[Tensor], documents=None):
        views = self.weights(weights, grad=True)
        with torch.enable_grad():
            out = self._first_layer_input(views, ids, documents)
            self.accumulate(grads, views, out, grad_out)
        return None


class GenericLayer(_GenericStage):
    """Decoder layer `index` of the model, as its own module computes it; the backward recomputes it under autograd,
    or, where the placement keeps the layer's products, goes back through the forward's own graph."""

    def __init__(self, skeleton: HFSkeleton, index: int, names: tuple[str, ...]):
        super().__init__(skeleton, (names,))
        self.index, self.module = index, skeleton.layers[index]
        self.prefix = next(n for n, m in skeleton.model.named_modules() if m is self.module) + "."
        self.numel = sum(spec.numel for spec in self.groups[0])
        # what sets its speed (the planner times one layer of each kind): its module, its layer type where the
        # config names one (sliding or full attention, Mamba or attention), its sizes
        layer_types = getattr(skeleton.text_config, "layer_types", None) or ()
        layer_type = layer_types[index] if index < len(layer_types) else None
        self.kind = (type(self.module).__name__, layer_type, tuple(spec.shape for spec in self.groups[0]))
        self.kept = KeptGraphs()

    def _call(self, views: dict, x: Tensor, documents, media=None) -> Tensor:
        if documents is not None and documents.position_ids is not None and self.skeleton.carries_state:
            raise GenericError(
                f"{type(self.module).__name__} carries state along a row, which transformers does not restart at "
                "each packed document: give it a row per sequence (no position_ids)"
            )
        args, kwargs = self.skeleton.layer_arguments(x, documents, media)[self.index]
        local = {name.removeprefix(self.prefix): value for name, value in views.items()}
        return _output(torch.func.functional_call(self.module, local, (x, *args), kwargs, strict=False))

    def forward(self, weights: list[Tensor], x: Tensor, documents=None, media=None) -> Tensor:
        with torch.no_grad():
            return self._call(self.weights(weights), x, documents, media)

    @property
    def forward_keeping_products(self):
        """`_keeping_products` where the layer's forward can be traced on the CPU (its products then known), else
        None: it recomputes."""
        return self._keeping_products if self._product_bytes(torch.float32) is not None else None

    def _keeping_products(self, weights: list[Tensor], x: Tensor, documents=None, media=None) -> tuple[Tensor, dict]:
        """`forward`, also returning what its backward reads (`KeptGraphs`): given to `backward` as `products`,
        the backward recomputes nothing."""
        views = self.weights(weights, grad=True)
        leaves = [views[name] for name in self.names]
        return self.kept.forward(lambda x: self._call(views, x, documents, media), x, weights, leaves)

    def product_bytes_per_token(self, element_size: int) -> int:
        """Device bytes per token that `forward_keeping_products` returns (in the compute dtype)."""
        dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[element_size]
        measured = self._product_bytes(dtype)
        if measured is None:
            raise GenericError(f"{type(self.module).__name__}'s forward could not be traced in {dtype}")
        return measured

    def _product_bytes(self, dtype: torch.dtype) -> int | None:
        """Bytes per token the layer's autograd graph saves (beyond its weights and input), from its forward on the
        CPU at two lengths (zero weights of no memory); None where that forward fails. Once per kind of layer."""
        key = (self.kind, dtype)
        if key not in self.skeleton.product_bytes:
            views = {name: _zeros_of_little_memory(self.shapes[name], dtype) for name in self.names}

            def at(tokens: int) -> int:  # (the weights saved count the same at both lengths: only products differ)
                x = torch.zeros(1, tokens, self.skeleton.text_config.hidden_size, dtype=dtype)
                return saved_bytes(lambda x: self._call(views, x, None), x, [])

            try:  # (a forward that cannot run so, a MoE's on some backends: the layer recomputes)
                self.skeleton.product_bytes[key] = max(0, (at(64) - at(32)) // 32)
            except Exception:  # noqa: BLE001
                self.skeleton.product_bytes[key] = None
        return self.skeleton.product_bytes[key]

    def backward(
        self,
        weights: list[Tensor],
        x: Tensor,
        grad_out: Tensor,
        grads: list[Tensor],
        documents=None,
        products=None,
        media=None,
    ):
        if products is not None:  # (its forward's graph, kept)
            grad_x, *found = self.kept.backward(products, x, weights, grad_out)
            self._add(grads, found)
            return grad_x
        return self._recomputed_backward(weights, x, grad_out, grads, documents, media)


class GenericHead(_GenericStage):
    """Everything the model does after its last decoder layer (final norm, LM head, soft caps, scalings), then the
    next-token cross-entropy; a row at a time, so that only one row's logits exist at once."""

    def __init__(self, skeleton: HFSkeleton, groups: tuple[tuple[str, ...], ...], d_model: int, vocab_size: int):
        super().__init__(skeleton, groups)
        self.d_model, self.vocab_size = d_model, vocab_size
        self.chunk_rows = 1
        # what the forward uses before the first layer (a position table) where the head is bound without it: its
        # outputs are replaced by the hidden states at the first layer
        self.unbound = [name for name in skeleton.parts.embedding if name not in self.names]

    def logits(self, weights: list[Tensor], hidden: Tensor) -> Tensor:
        """Logits [batch, seq, vocab] in fp32 (or wider)."""
        with torch.no_grad():
            logits = self._logits(self.weights(weights), hidden)
            return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _logits(self, views: dict, hidden: Tensor) -> Tensor:
        def inject(index, hidden_states, *args, **kwargs):
            return hidden if index == 0 else hidden_states

        views = {**self.skeleton.placeholders(self.unbound, hidden), **views}
        embeds = {"inputs_embeds": torch.zeros_like(hidden.detach())}
        return self.skeleton.run(views, embeds, None, inject, head=True).logits

    @torch.no_grad()
    def token_logps(self, weights: list[Tensor], hidden: Tensor, labels: Tensor, entropy: bool = False):
        """Each target's log-probability [batch, seq], 0 where the label is -100, and with `entropy` each position's
        entropy (as `Head.token_logps`)."""
        views = self.weights(weights)
        out = torch.zeros(labels.shape, dtype=_loss_dtype(hidden), device=hidden.device)
        entropies = torch.zeros_like(out) if entropy else None
        for start in range(0, hidden.shape[0], self.chunk_rows):
            rows = slice(start, start + self.chunk_rows)
            logits = self._logits(views, hidden[rows])
            out[rows] = _target_logps(logits, labels[rows])
            if entropy:
                wide = logits.to(out.dtype)
                log_norm = wide.logsumexp(-1, keepdim=True)
                entropies[rows] = distribution_entropy(wide, log_norm) * (labels[rows] != IGNORE_INDEX)
        return (out, entropies) if entropy else out

    @torch.no_grad()
    def loss_sum(self, weights: list[Tensor], hidden: Tensor, labels: Tensor) -> Tensor:
        return -self.token_logps(weights, hidden, labels).sum()

    def loss(self, weights, hidden: Tensor, labels: Tensor, loss_scale, grads: list[Tensor]) -> tuple[Tensor, Tensor]:
        """Summed cross-entropy and its gradient, as `megatrain_templates.Head.loss` (a scalar or per-token scale)."""
        views = self.weights(weights, grad=True)
        grad_hidden = torch.empty_like(hidden)
        loss_sum = torch.zeros((), dtype=_loss_dtype(hidden), device=hidden.device)
        for start in range(0, hidden.shape[0], self.chunk_rows):
            rows = slice(start, start + self.chunk_rows)
            x = hidden[rows].detach().requires_grad_(True)
            scale = loss_scale[rows] if isinstance(loss_scale, Tensor) else loss_scale
            with torch.enable_grad():
                logps = _target_logps(self._logits(views, x), labels[rows])
                scaled = -(logps * torch.as_tensor(scale, dtype=logps.dtype, device=logps.device)).sum()
                (grad_hidden[rows],) = self.accumulate(grads, views, scaled, None, (x,))
            loss_sum -= logps.detach().sum()
        return loss_sum, grad_hidden


def _loss_dtype(hidden: Tensor) -> torch.dtype:
    return torch.promote_types(hidden.dtype, torch.float32)


def _target_logps(logits: Tensor, labels: Tensor) -> Tensor:
    """Each target's log-probability in fp32 (or wider), 0 where the label is -100."""
    logps = logits.to(torch.promote_types(logits.dtype, torch.float32)).log_softmax(-1)
    picked = logps.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return picked * (labels != IGNORE_INDEX)


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
    from .config import ModelConfig

    if image_text:
        from .image_text import ImageTextSkeleton as Skeleton
    else:
        Skeleton = HFSkeleton
    skeleton = Skeleton(hf)
    config, parts = skeleton.text_config, skeleton.parts
    counts = _counter(skeleton)
    heads = getattr(config, "num_attention_heads", 1) or 1
    d_model = config.hidden_size
    in_layers = {name for names in parts.layers for name in names}
    return ModelConfig(
        arch=skeleton.config.model_type,
        vocab_size=config.vocab_size,
        d_model=d_model,
        n_layers=config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        d_ff=getattr(config, "intermediate_size", None) or 4 * d_model,
        head_dim=getattr(config, "head_dim", None) or d_model // heads,
        max_seq_len=getattr(config, "max_position_embeddings", None) or 4096,
        tie_embeddings=parts.head_reads_embedding,
        initializer_range=getattr(config, "initializer_range", 0.02) or 0.02,
        bos_token_id=_token_id(getattr(config, "bos_token_id", None)),
        eos_token_id=_token_id(getattr(config, "eos_token_id", None)),
        pad_token_id=_token_id(getattr(config, "pad_token_id", None)),
        implementation="transformers",
        packs_documents=not skeleton.carries_state and not image_text,
        hf_config=hf_config_json(hf),
        layer_counts=tuple(counts(names, index) for index, names in enumerate(parts.layers)),
        outer_params=counts([name for name in skeleton.names.values() if name not in in_layers])[0],
        image_text=image_text,
    )


@contextlib.contextmanager
def _building(model_type: str):
    """An unexpected exception while building a generic model (transformers' modules failing on a config they
    accepted, or the generic path meeting a field it does not read) raised as one GenericError line naming the
    model type, what failed or is missing, and where; the project's own errors pass as they are."""
    from .config import ZooError

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
    from .hf import has_template

    hf = json.loads(config.hf_config)
    native = "" if has_template(hf) else " (megatrain has no template for it)"
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


def build_generic_model(config):
    """The `ModelSpec` of a generic model: groups [embedding, each decoder layer, the rest (final norm, LM head;
    with a tied table, the embedding group too)], one stage each, their templates transformers' own modules."""
    hf = json.loads(config.hf_config)
    with _building(hf.get("model_type")):
        return _build_generic_model(config, hf)


def _build_generic_model(config, hf: dict):
    from .model import Group, ModelSpec, StageSpec

    skeleton = HFSkeleton(hf)
    shapes = {name: tuple(p.shape) for name, p in skeleton.model.named_parameters()}
    parts = skeleton.parts

    def group(name: str, names: list[str]) -> Group:
        return Group(name, tuple(_spec(n, shapes[n]) for n in names))

    groups = [group("embed", parts.embedding)]
    stages = [StageSpec("embed", GenericEmbedding(skeleton, (tuple(parts.embedding),)), (0,))]
    for index, names in enumerate(parts.layers):
        groups.append(group(f"layer{index}", names))
        stages.append(StageSpec(f"layer{index}", GenericLayer(skeleton, index, tuple(names)), (index + 1,)))
    groups.append(group("head", parts.head))
    head = len(groups) - 1
    bound, names = (
        ((0, head), (tuple(parts.embedding), tuple(parts.head)))
        if config.tie_embeddings
        else ((head,), (tuple(parts.head),))
    )
    stages.append(StageSpec("head", GenericHead(skeleton, names, config.d_model, config.vocab_size), bound))
    from .checkpoint_layout import CheckpointLayout

    return ModelSpec(config, tuple(groups), tuple(stages), checkpoint_layout=CheckpointLayout(skeleton))

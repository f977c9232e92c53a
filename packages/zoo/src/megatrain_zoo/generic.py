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
import json
from collections import OrderedDict
from functools import cached_property

import torch
from torch import Tensor, nn

from megatrain_templates import IGNORE_INDEX, ParamSpec

# micro-batch shapes whose layer arguments are remembered (a step's micro-batches, evaluation's, a warm-up's)
ARGUMENTS_CACHED = 64


class GenericError(ValueError):
    """A model the generic path cannot train, with the reason and the fix in the message."""


class _Reached(Exception):
    """Raised by a stood-in layer to stop the model's forward there, with what that layer was given."""

    def __init__(self, hidden: Tensor):
        super().__init__()
        self.hidden = hidden


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules made inside put their parameters on the meta device as they register them (buffers stay real)."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None:
            module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _output(value):
    """A layer's or model's hidden-state output: older transformers return tuples."""
    return value[0] if isinstance(value, tuple) else value


class HFSkeleton:
    """transformers' causal LM of `hf_config` (a config.json dict), its parameters on the meta device, in eval mode
    (no dropout); the layer arguments its forward makes, per micro-batch."""

    def __init__(self, hf_config: dict, attention: str = "sdpa"):
        import transformers

        config = transformers.AutoConfig.for_model(**hf_config)
        config._attn_implementation = attention
        with _parameters_on_meta():
            self.model = transformers.AutoModelForCausalLM.from_config(config)
        self.model.eval()
        self.config = config
        self.base = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.base_model
        self.layers = _decoder_layers(self.base, config.num_hidden_layers)
        self._device = torch.device("cpu")
        self._arguments: OrderedDict = OrderedDict()

    @cached_property
    def names(self) -> dict[int, str]:
        """id(parameter) -> its name in the model's state dict (a tied parameter under its first name)."""
        return {id(p): name for name, p in self.model.named_parameters(remove_duplicate=True)}

    def parts(self) -> tuple[list[str], list[list[str]], list[str]]:
        """Parameter names (as the model's state dict and checkpoints name them) of (the embedding, each decoder
        layer, everything else: final norm, LM head)."""
        embedding = [self.names[id(p)] for p in self.model.get_input_embeddings().parameters()]
        layers = [[self.names[id(p)] for p in layer.parameters()] for layer in self.layers]
        taken = set(embedding) | {n for names in layers for n in names}
        rest = [name for name in self.names.values() if name not in taken]
        return embedding, layers, rest

    def to(self, device: torch.device) -> None:
        """The buffers (rotary tables) to `device` (the parameters stay on meta: each call binds its own)."""
        if device != self._device:
            for module in self.model.modules():
                for name, buffer in module._buffers.items():
                    if buffer is not None:
                        module._buffers[name] = buffer.to(device)
            self._device = device
            self._arguments.clear()

    def run(self, weights: dict[str, Tensor], inputs_embeds: Tensor, documents, stand_in, head: bool = False):
        """The model's forward (the causal LM's with `head`, else its decoder's) from `inputs_embeds`, bound to
        `weights`, each decoder layer replaced by `stand_in(index, hidden_states, *args, **kwargs)`."""
        self.to(inputs_embeds.device)
        inputs = {"inputs_embeds": inputs_embeds, "use_cache": False, **_position_inputs(documents)}
        for index, layer in enumerate(self.layers):
            layer.forward = lambda hidden_states, *args, _index=index, **kwargs: stand_in(
                _index, hidden_states, *args, **kwargs
            )
        try:
            module = self.model if head else self.base
            return torch.func.functional_call(module, _relative(weights, module, self.model), (), inputs, strict=False)
        finally:
            for layer in self.layers:
                del layer.forward

    def layer_arguments(self, hidden: Tensor, documents) -> list[tuple[tuple, dict]]:
        """What the model's forward gives each layer besides the hidden states, for a micro-batch like `hidden`
        ([batch, seq, d_model]) with `documents`: computed once per shape and layout, remembered."""
        key = (tuple(hidden.shape), hidden.device, hidden.dtype, id(documents) if documents is not None else None)
        if key not in self._arguments:
            recorded: list = [None] * len(self.layers)

            def record(index, hidden_states, *args, **kwargs):
                recorded[index] = (args, kwargs)
                if index == len(self.layers) - 1:
                    raise _Reached(hidden_states)
                return hidden_states

            with contextlib.suppress(_Reached), torch.no_grad():
                self.run({}, torch.zeros_like(hidden), documents, record)
            if any(r is None for r in recorded):
                raise GenericError(f"{type(self.model).__name__}'s forward did not call every decoder layer")
            self._arguments[key] = recorded
            while len(self._arguments) > ARGUMENTS_CACHED:
                self._arguments.popitem(last=False)
        return self._arguments[key]


def _decoder_layers(base: nn.Module, n_layers: int) -> nn.ModuleList:
    """The decoder's ModuleList of its layers."""
    for module in base.children():
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


class _GenericStage:
    """What the generic templates share: their parameters by name, laid out in the stage's flat buffers (one per
    bound group, its names back to back)."""

    def __init__(self, skeleton: HFSkeleton, groups: tuple[tuple[str, ...], ...]):
        self.skeleton = skeleton
        self.shapes = {name: tuple(p.shape) for name, p in skeleton.model.named_parameters(remove_duplicate=False)}
        self.param_groups = groups
        self.names = [name for group in groups for name in group]
        self.groups = tuple(tuple(_spec(name, self.shapes[name]) for name in group) for group in groups)

    def _spans(self, buffers: list[Tensor]):
        """(name, its flat span of the buffer bound to its group)."""
        for names, buffer in zip(self.param_groups, buffers):
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
        added into the flat fp32 `grads` (unused ones skipped); returns the inputs' gradients."""
        leaves = [views[name] for name in self.names]
        found = torch.autograd.grad(outputs, [*inputs, *leaves], grad_outputs, allow_unused=True)
        by_name = dict(zip(self.names, found[len(inputs) :]))
        for name, span in self._spans(grads):
            if by_name[name] is not None:
                span.add_(by_name[name].reshape(-1).to(span.dtype))
        return found[: len(inputs)]


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
        embedding = self.skeleton.model.get_input_embeddings()
        local = {self.skeleton.names[id(p)]: name for name, p in embedding.named_parameters()}
        embeds = torch.func.functional_call(embedding, {local[n]: v for n, v in views.items() if n in local}, (ids,))

        def reached(index, hidden_states, *args, **kwargs):
            raise _Reached(hidden_states)

        try:
            self.skeleton.run(views, embeds, documents, reached)
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
    """Decoder layer `index` of the model, as its own module computes it; the backward recomputes it under autograd."""

    def __init__(self, skeleton: HFSkeleton, index: int, names: tuple[str, ...]):
        super().__init__(skeleton, (names,))
        self.index, self.module = index, skeleton.layers[index]
        self.prefix = next(n for n, m in skeleton.model.named_modules() if m is self.module) + "."

    def _call(self, views: dict, x: Tensor, documents) -> Tensor:
        args, kwargs = self.skeleton.layer_arguments(x, documents)[self.index]
        local = {name.removeprefix(self.prefix): value for name, value in views.items()}
        return _output(torch.func.functional_call(self.module, local, (x, *args), kwargs, strict=False))

    def forward(self, weights: list[Tensor], x: Tensor, documents=None) -> Tensor:
        with torch.no_grad():
            return self._call(self.weights(weights), x, documents)

    def backward(self, weights: list[Tensor], x: Tensor, grad_out: Tensor, grads: list[Tensor], documents=None):
        views = self.weights(weights, grad=True)
        x = x.detach().requires_grad_(True)
        with torch.enable_grad():
            out = self._call(views, x, documents)
            (grad_x,) = self.accumulate(grads, views, out, grad_out, (x,))
        return grad_x


class GenericHead(_GenericStage):
    """Everything the model does after its last decoder layer (final norm, LM head, soft caps, scalings), then the
    next-token cross-entropy; a row at a time, so that only one row's logits exist at once."""

    def __init__(self, skeleton: HFSkeleton, groups: tuple[tuple[str, ...], ...], d_model: int, vocab_size: int):
        super().__init__(skeleton, groups)
        self.d_model, self.vocab_size = d_model, vocab_size
        self.chunk_rows = 1

    def logits(self, weights: list[Tensor], hidden: Tensor) -> Tensor:
        """Logits [batch, seq, vocab] in fp32 (or wider)."""
        with torch.no_grad():
            logits = self._logits(self.weights(weights), hidden)
            return logits.to(torch.promote_types(logits.dtype, torch.float32))

    def _logits(self, views: dict, hidden: Tensor) -> Tensor:
        def inject(index, hidden_states, *args, **kwargs):
            return hidden if index == 0 else hidden_states

        return self.skeleton.run(views, torch.zeros_like(hidden.detach()), None, inject, head=True).logits

    @torch.no_grad()
    def token_logps(self, weights: list[Tensor], hidden: Tensor, labels: Tensor) -> Tensor:
        """Each target's log-probability [batch, seq], 0 where the label is -100 (as `Head.token_logps`)."""
        views = self.weights(weights)
        out = torch.zeros(labels.shape, dtype=_loss_dtype(hidden), device=hidden.device)
        for start in range(0, hidden.shape[0], self.chunk_rows):
            rows = slice(start, start + self.chunk_rows)
            out[rows] = _target_logps(self._logits(views, hidden[rows]), labels[rows])
        return out

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


def generic_model_config(hf: dict):
    """The `ModelConfig` of a config.json trained through transformers' own modules: the sizes megatrain plans with,
    its counts from the modules themselves. Refuses, naming it, a model_type transformers does not know and a
    load-balancing loss the generic path cannot add."""
    import transformers

    from .config import ModelConfig

    try:
        skeleton = HFSkeleton(hf)
    except (ValueError, KeyError) as error:
        raise GenericError(
            f"model_type {hf.get('model_type')!r} is known to neither megatrain nor the installed transformers "
            f"{transformers.__version__} ({str(error).splitlines()[0][:160]}); upgrade transformers or use a "
            "supported family"
        ) from error
    config = skeleton.config
    if getattr(config, "output_router_logits", False) and getattr(config, "router_aux_loss_coef", 0):
        raise GenericError(
            f"{config.model_type}'s load-balancing loss (output_router_logits) is added by transformers' model "
            "forward, which the generic path does not run as a whole; set output_router_logits: false in its "
            "config.json (experts then train without it) or use a family with a native template"
        )
    embedding, layers, rest = skeleton.parts()
    params = dict(skeleton.model.named_parameters())
    k = getattr(config, "num_experts_per_tok", 0) or 0
    n_experts = getattr(config, "num_local_experts", 0) or getattr(config, "num_experts", 0) or 0

    def counts(names: list[str]) -> tuple[int, int, int]:
        """(parameters, those a token uses: an expert's k / n_experts share, the matrices among those)."""
        total = active = matrices = 0
        for name in names:
            numel = params[name].numel()
            share = k / n_experts if n_experts and k and ".experts." in name else 1.0
            total += numel
            active += round(numel * share)
            matrices += round(numel * share) if params[name].dim() >= 2 else 0
        return total, active, matrices

    heads = getattr(config, "num_attention_heads", 1) or 1
    d_model = config.hidden_size
    return ModelConfig(
        arch=config.model_type,
        vocab_size=config.vocab_size,
        d_model=d_model,
        n_layers=config.num_hidden_layers,
        n_heads=heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        d_ff=getattr(config, "intermediate_size", None) or 4 * d_model,
        head_dim=getattr(config, "head_dim", None) or d_model // heads,
        max_seq_len=getattr(config, "max_position_embeddings", None) or 4096,
        tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        initializer_range=getattr(config, "initializer_range", 0.02) or 0.02,
        bos_token_id=_token_id(getattr(config, "bos_token_id", None)),
        eos_token_id=_token_id(getattr(config, "eos_token_id", None)),
        pad_token_id=_token_id(getattr(config, "pad_token_id", None)),
        implementation="transformers",
        hf_config=hf_config_json(hf),
        layer_counts=tuple(counts(names) for names in layers),
        outer_params=counts(embedding + rest)[0],
    )


def _token_id(value) -> int | None:
    """A config's token id (transformers allows a list of them: the first)."""
    return value[0] if isinstance(value, list) and value else value if isinstance(value, int) else None


def build_generic_model(config):
    """The `ModelSpec` of a generic model: groups [embedding, each decoder layer, the rest (final norm, LM head;
    with a tied table, the embedding group too)], one stage each, their templates transformers' own modules."""
    from .model import Group, ModelSpec, StageSpec

    skeleton = HFSkeleton(json.loads(config.hf_config))
    shapes = {name: tuple(p.shape) for name, p in skeleton.model.named_parameters()}
    embedding, layers, rest = skeleton.parts()

    def group(name: str, names: list[str]) -> Group:
        return Group(name, tuple(_spec(n, shapes[n]) for n in names))

    groups = [group("embed", embedding)]
    stages = [StageSpec("embed", GenericEmbedding(skeleton, (tuple(embedding),)), (0,))]
    for index, names in enumerate(layers):
        groups.append(group(f"layer{index}", names))
        stages.append(StageSpec(f"layer{index}", GenericLayer(skeleton, index, tuple(names)), (index + 1,)))
    groups.append(group("head", rest))
    head_groups = ((0, len(groups) - 1), (tuple(embedding), tuple(rest))) if config.tie_embeddings else None
    bound, names = head_groups or ((len(groups) - 1,), (tuple(rest),))
    stages.append(StageSpec("head", GenericHead(skeleton, names, config.d_model, config.vocab_size), bound))
    return ModelSpec(config, tuple(groups), tuple(stages))

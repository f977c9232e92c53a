"""The generic templates: stateless stages that call a transformers model's own modules (`skeleton.HFSkeleton`)
with the streamed weights bound to their parameters (`torch.func.functional_call`). The embedding stage runs the
model's forward up to its first layer, a layer stage one decoder layer, the head stage everything after the last
layer (final norm, LM head, soft caps and scalings) then the cross-entropy."""

import sys
from collections.abc import Callable
from contextlib import nullcontext

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from megatrain_templates import IGNORE_INDEX, DropoutKey, Lora, ParamSpec, Template, compiling, distribution_entropy
from megatrain_templates.kept_graph import KeptGraphs, saved_bytes
from megatrain_templates.ops import compile_once

from .generic_adapters import LinearAdapters
from .skeleton import GenericError, HFSkeleton, _output, _Reached


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


class _ZeroProductsUncomputed(TorchDispatchMode):
    """Matrix products with a zero operand of stride 0 (`_zeros_of_little_memory`'s matrices) made as zeros of their
    shape (plus the bias, for addmm), without the GEMM: what the planner's trace counts is what autograd saves, which
    these ops' results do not change. On the CPU such a GEMM takes a naive kernel: a Qwen2.5-7B layer's trace in
    bf16 took three minutes, nearly all of it there."""

    PRODUCTS = {torch.ops.aten.mm.default: 0, torch.ops.aten.bmm.default: 0, torch.ops.aten.addmm.default: 1}

    def __init__(self):
        super().__init__()
        self.skipped = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        first = self.PRODUCTS.get(func)
        if first is None or kwargs or not any(_is_stride_zero_zeros(a) for a in args[first : first + 2]):
            return func(*args, **kwargs)
        self.skipped += 1
        a, b = args[first : first + 2]
        out = a.new_zeros((*a.shape[:-1], b.shape[-1]))
        return out if first == 0 else out.add_(args[0])


def _is_stride_zero_zeros(t: Tensor) -> bool:
    """Whether `t` is a matrix of zeros with no memory of its own (a scalar zero expanded)."""
    return t.numel() > 1 and all(stride == 0 for stride in t.stride()) and not t.reshape(-1)[0].item()


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

    def __init__(self, skeleton: HFSkeleton, index: int, names: tuple[str, ...], lora: Lora | None = None):
        module = skeleton.layers[index]
        prefix = next(n for n, m in skeleton.model.named_modules() if m is module) + "."
        # LoRA: the layer's targeted linears take adapters, a second group (the base's is then frozen)
        self.adapters = None if lora is None else LinearAdapters(module, prefix, lora, skeleton.config.model_type)
        if self.adapters is not None:
            skeleton.shapes.update(self.adapters.shapes)
        super().__init__(skeleton, (names,) if self.adapters is None else (names, self.adapters.names))
        self.index, self.module, self.prefix = index, module, prefix
        self.trained_names = self.names if self.adapters is None else list(self.adapters.names)
        self.takes_dropout = lora is not None and lora.dropout > 0
        self.numel = sum(spec.numel for spec in self.groups[0])
        # what sets its speed (the planner times one layer of each kind): its module, its layer type where the
        # config names one (sliding or full attention, Mamba or attention), its sizes
        layer_types = getattr(skeleton.text_config, "layer_types", None) or ()
        layer_type = layer_types[index] if index < len(layer_types) else None
        self.kind = (type(self.module).__name__, layer_type, tuple(spec.shape for spec in self.groups[0]))
        self.kept = KeptGraphs()
        self.holds_a_mamba_mixer = any(_is_mamba_mixer(m) for m in module.modules())

    def _call(self, views: dict, x: Tensor, documents, media=None, backend: str | None = None) -> Tensor:
        """The layer's output for `x`; through torch.compile's `backend` where given, or where the layer runs
        compiled (`runs_compiled`: Inductor), else eagerly."""
        if documents is not None and documents.position_ids is not None and not self.skeleton.packs_documents:
            raise GenericError(
                f"{type(self.module).__name__} would mix a packed row's documents as transformers runs it (state "
                "carried along the row, or attention not kept apart where positions restart): give it a row per "
                "sequence (no position_ids)"
            )
        args, kwargs = self.skeleton.layer_arguments(x, documents, media)[self.index]
        adapters = () if self.adapters is None else self.adapters.names
        local = {name.removeprefix(self.prefix): value for name, value in views.items() if name not in adapters}
        backend = backend or ("inductor" if self.runs_compiled(x.device) else None)
        if backend is not None:
            try:
                with _saving_costly_only():
                    return _compiled_layer_call(backend)(self.module, local, x, args, kwargs)
            except _compile_failures() as error:
                if backend != "inductor":  # (the planner's trace: `product_bytes_per_token` handles it)
                    raise
                self._run_eagerly_from_now(error)
        if self.adapters is None:
            return _layer_call(self.module, local, x, args, kwargs)
        with self.adapters.bound(views):
            return _layer_call(self.module, local, x, args, kwargs)

    def _run_eagerly_from_now(self, error: Exception) -> None:
        """Layers of this kind run eagerly from now on, after Inductor failed to compile one (said once)."""
        KINDS_RUN_EAGERLY.add(self.kind)
        cause = getattr(error, "inner_exception", error)  # (what the backend raised)
        reason = (str(cause).strip().splitlines() or [""])[0][:200]
        print(
            f"megatrain: torch.compile failed on {type(self.module).__name__} ({type(cause).__name__}: {reason}); "
            "layers of its kind run eagerly (exact, slower; where the plan counted their compiled products, eager "
            "ones take more memory: if the GPU runs out of it, set engine.compile: false)",
            file=sys.stderr,
        )

    def runs_compiled(self, device: torch.device) -> bool:
        """Whether the layer runs through Inductor on `device`: on CUDA, compiling, where torch.compile can trace
        its kind of layer, with no adapters bound (their hooks and dropout masks stay eager), and no Mamba mixer.

        (A Mamba mixer's scan is mamba_ssm's kernel where installed, else transformers' reference in torch, which
        is what Dynamo would trace: at a real size, 2 x 4096 tokens of transformers' default configs on an H200,
        Falcon-H1's failed Inductor's code generation and Jamba's had not compiled in four minutes.)"""
        return (
            device.type == "cuda"
            and compiling()
            and self.adapters is None
            and not self.holds_a_mamba_mixer
            and self.kind not in KINDS_RUN_EAGERLY
        )

    def _dropping(self, dropout: DropoutKey | None):
        """LoRA dropout for the calls inside, keyed by `dropout` (a training pass's: the recompute draws the forward's
        masks)."""
        return nullcontext() if self.adapters is None else self.adapters.dropping(dropout)

    def forward(self, weights: list[Tensor], x: Tensor, documents=None, media=None, dropout=None) -> Tensor:
        with torch.no_grad(), self._dropping(dropout):
            return self._call(self.weights(weights), x, documents, media)

    @property
    def forward_keeping_products(self):
        """`_keeping_products` where the layer's forward can be traced on the CPU (its products then known), else
        None: it recomputes."""
        return self._keeping_products if self._product_bytes(torch.float32) is not None else None

    def _keeping_products(
        self, weights: list[Tensor], x: Tensor, documents=None, media=None, dropout=None
    ) -> tuple[Tensor, dict]:
        """`forward`, also returning what its backward reads (`KeptGraphs`): given to `backward` as `products`,
        the backward recomputes nothing."""
        views = self.weights(weights, grad=True)
        leaves = [views[name] for name in self.trained_names]
        with self._dropping(dropout):
            return self.kept.forward(lambda x: self._call(views, x, documents, media), x, weights, leaves)

    def product_bytes_per_token(self, element_size: int) -> int:
        """Device bytes per token that `forward_keeping_products` returns (in the compute dtype)."""
        dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[element_size]
        # where the layer will run compiled: its products as Inductor's partitioner splits it, no code generated
        compiles = torch.cuda.is_available() and self.runs_compiled(torch.device("cuda"))
        measured = self._product_bytes(dtype, "aot_eager_decomp_partition") if compiles else None
        if compiles and measured is None:  # (torch.compile could not trace it: that kind of layer runs eagerly)
            KINDS_RUN_EAGERLY.add(self.kind)
        measured = self._product_bytes(dtype) if measured is None else measured
        if measured is None:
            raise GenericError(f"{type(self.module).__name__}'s forward could not be traced in {dtype}")
        return measured

    def _product_bytes(self, dtype: torch.dtype, backend: str | None = None) -> int | None:
        """Bytes per token the layer's autograd graph saves (beyond its weights and input), from its forward on the
        CPU at two lengths (zero weights of no memory), through torch.compile's `backend` where given; None where
        that forward fails. Once per kind of layer."""
        key = (self.kind, dtype, backend)
        if key not in self.skeleton.product_bytes:
            views = {name: _zeros_of_little_memory(self.shapes[name], dtype) for name in self.names}

            def at(tokens: int) -> int:  # (the weights saved count the same at both lengths: only products differ)
                x = torch.zeros(1, tokens, self.skeleton.text_config.hidden_size, dtype=dtype)
                with nullcontext() if backend else _ZeroProductsUncomputed():  # (not under torch.compile's trace)
                    return saved_bytes(lambda x: self._call(views, x, None, backend=backend), x, [])

            try:  # (a forward that cannot run so, a MoE's on some backends: the layer recomputes)
                with self._dropping(DropoutKey(0, 0, 0) if self.takes_dropout else None):  # (its masks are kept too)
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
        dropout=None,
    ):
        if products is not None:  # (its forward's graph, kept)
            grad_x, *found = self.kept.backward(products, x, weights, grad_out)
            self._add(grads, dict(zip(self.trained_names, found)))
            return grad_x
        with self._dropping(dropout):
            return self._recomputed_backward(weights, x, grad_out, grads, documents, media)


def _is_mamba_mixer(module: torch.nn.Module) -> bool:
    """Whether `module` is a Mamba (selective state-space) mixer, as every transformers family names its parts: a
    causal convolution and the log of the state's decay, A_log."""
    return hasattr(module, "conv1d") and hasattr(module, "A_log")


def _layer_call(module, local: dict, x: Tensor, args: tuple, kwargs: dict) -> Tensor:
    """A decoder layer's hidden-state output for `x`, its parameters the tensors `local` (name in the layer ->
    tensor)."""
    return _output(torch.func.functional_call(module, local, (x, *args), kwargs, strict=False))


_COMPILED_LAYER_CALLS: dict[str, Callable] = {}


def _compiled_layer_call(backend: str) -> Callable:
    """`_layer_call` through torch.compile's `backend`, one for every layer: layers of one kind share its graphs
    (Dynamo guards on what a layer's forward reads of its module, not on which module it is).

    Static shapes: a run's layers see one micro-batch shape. Left to Dynamo, the planner's trace at two lengths
    (`_product_bytes`, the same function's code) made the GPU's compile symbolic in the sequence length (seen in
    Falcon-H1's failed compile, H200, 2026-11-30), which costs kernels their fixed sizes."""
    if backend not in _COMPILED_LAYER_CALLS:
        _COMPILED_LAYER_CALLS[backend] = compile_once(_layer_call, backend=backend, dynamic=False)
    return _COMPILED_LAYER_CALLS[backend]


# Kinds of layer (`GenericLayer.kind`) that run eagerly: torch.compile could not trace them for the planner, or
# Inductor failed to compile them. Process-wide, as Dynamo's caches are: a run's rate measurement builds its model
# apart from the run's, and the planner then counts such a kind's products as eager ones. The rate measurement
# remembers them beside its rates (`eager_kinds`, `run_eagerly`), so that a later run which finds its rates
# remembered plans those kinds as eager too, instead of meeting the failed compile at its first step.
KINDS_RUN_EAGERLY: set[tuple] = set()


def eager_kinds() -> list[list]:
    """`KINDS_RUN_EAGERLY` as JSON takes it: [module name, layer type, [weight shapes]] each."""
    return [[name, layer_type, [list(shape) for shape in shapes]] for name, layer_type, shapes in KINDS_RUN_EAGERLY]


def run_eagerly(kinds: list[list]) -> None:
    """Add `eager_kinds`' JSON form of kinds to `KINDS_RUN_EAGERLY`."""
    KINDS_RUN_EAGERLY.update((name, layer_type, tuple(map(tuple, shapes))) for name, layer_type, shapes in kinds)


def _compile_failures() -> tuple[type[Exception], ...]:
    """What a failed compile raises (Inductor's errors among them); an error of the layer's own computation does not.
    (Looked up when raised: importing Dynamo costs every process that imports the zoo.)"""
    return torch._dynamo.exc.BackendCompilerFailed, torch._dynamo.exc.Unsupported


# Any memory budget below 1 has Inductor's partitioner recompute in the backward what costs no FLOPs (norms,
# rotary embedding, activations, casts) and save only matmul and attention outputs: a kept graph of Qwen2.5-7B's
# layer then holds 100 kB a token (eager: 255 kB; the native template's products: 92 kB), and more layers keep
# theirs. (Found the same from 0.7 to 0.99 on that layer: the pointwise work is recomputed first.)
SAVING_COSTLY_ONLY = 0.99


def _saving_costly_only():
    return torch._functorch.config.patch(activation_memory_budget=SAVING_COSTLY_ONLY)


class GenericHead(_GenericStage):
    """Everything the model does after its last decoder layer (final norm, LM head, soft caps, scalings), then the
    next-token cross-entropy; a row at a time, so that only one row's logits exist at once."""

    def __init__(self, skeleton: HFSkeleton, groups: tuple[tuple[str, ...], ...], d_model: int, vocab_size: int):
        super().__init__(skeleton, groups)
        self.d_model, self.vocab_size = d_model, vocab_size
        self.chunk_rows = 1
        self.temperature = 1.0  # what the logits are divided by before their softmax (as `Head.temperature`)
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
        embeds = {"inputs_embeds": self.skeleton.zero_embeddings(hidden.detach())}
        logits = self.skeleton.run(views, embeds, None, inject, head=True).logits
        return logits if self.temperature == 1.0 else logits / self.temperature

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

"""Completions from a trainer's current weights: transformers' own `generate` (its KV cache, sampling and stopping)
run on the family's transformers modules (`skeleton.HFSkeleton`) with the weights of megatrain's
store, in the compute dtype on the trainer's device. The skeleton is the one the generic template trains with, or,
for a family with a native template, the same model built from the config.json megatrain exports; weights reach it
as transformers' loader converts a checkpoint. Exact by construction: greedy decoding equals transformers'
`generate` on the exported model. Two of transformers' parts move less memory here: a decoding step's attention
over grouped key/value heads (`grouped_decoding_attention`) and a KV cache that grows in place (`_kv_cache`). With
resident weights on a GPU the decoding step may instead be compiled over a static KV cache (`decoding`), which
launches a fraction of the kernels: a step of a large batch is bound by the host issuing them.

The weights stay on the GPU for a whole generation where they fit beside a useful KV cache (`resident`), else the
decoder layers stream from the store's pinned memory, layer i + 1's copy overlapping layer i's work, once per
decoding step of the whole batch (`streamed`), the batch as large as the KV cache's room allows so that each
streamed layer serves many sequences (`GenerationPlan`). Sampling draws each row's noise from its own key
(`RowSampler`), so a completion does not depend on the rows decoded beside it."""

import functools
import json
import math
import sys
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatrain_store import free_device_bytes

from .checkpoint_layout import CheckpointLayout
from .config import ZooError
from .hf_export import config_to_hf
from .peft import with_adapters_merged
from .skeleton import HFSkeleton

KV_ROOM_SHARE = 0.8  # of the device's free memory, what the KV cache may take (the rest: activations, logits)
RESIDENT_NEEDS_SEQUENCES = 64  # resident weights only where a KV cache of this many sequences fits beside them
DECODING = ("eager", "compiled")
# a compiled decoding step's static KV cache holds a multiple of this many tokens a sequence, so that rollouts of
# prompts of other lengths reuse one compiled step (each length would compile its own)
STATIC_CACHE_STEP = 256
# how the decoding step compiles: inductor's fused kernels without CUDA graphs, since the weights are converted into
# new device tensors at each rollout and the cache is freed between rollouts (a graph records addresses)
DECODING_COMPILE = dict(mode="default", dynamic=False)


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn: greedy (temperature 0) or sampled with transformers' temperature, top-p and top-k,
    after its repetition penalty (1: none; greedy too); each ends at one of `stop_ids` (kept, as the end of a trained
    completion) or after `max_new_tokens`."""

    max_new_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_ids: tuple[int, ...] = ()
    repetition_penalty: float = 1.0


# transformers' (5.x) defaults of the settings `Sampling` applies, where a generation_config.json that samples leaves
# them out or null (its top_k: 50, where megatrain's own default filters none) ...
SAMPLED_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 50}
# ... and of those it does not apply: a file that sets one otherwise is told of
UNAPPLIED_DEFAULTS = {
    "min_p": None, "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "no_repeat_ngram_size": 0,
    "min_new_tokens": None, "min_length": 0, "num_beams": 1, "stop_strings": None, "suppress_tokens": None,
    "begin_suppress_tokens": None, "bad_words_ids": None, "sequence_bias": None, "renormalize_logits": False,
}  # fmt: skip


def file_sampling(folder) -> tuple[dict, list[str]]:
    """What the generation_config.json in `folder` asks transformers' `generate()` for, as `Sampling`'s fields
    (temperature 0 where it does not sample; transformers' defaults where it samples and is silent; {} where there is
    no file), and the settings it makes that `Sampling` does not apply ("min_p 0.05")."""
    try:
        config = json.loads((folder / "generation_config.json").read_text())
    except (OSError, ValueError):
        return {}, []
    settings = {"temperature": 0.0, "repetition_penalty": config.get("repetition_penalty") or 1.0}
    if config.get("do_sample"):
        settings |= {
            name: default if config.get(name) is None else config[name] for name, default in SAMPLED_DEFAULTS.items()
        }
    if config.get("max_new_tokens"):
        settings["max_new_tokens"] = config["max_new_tokens"]
    unapplied = [
        f"{k} {config[k]}" for k, default in UNAPPLIED_DEFAULTS.items() if config.get(k) not in (None, default)
    ]
    return settings, unapplied


class _Generating(nn.Module):
    """transformers' `generate` as a module's forward, so `torch.func.functional_call` binds the weights for it."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model.generate(**kwargs)


@dataclass(frozen=True)
class GenerationPlan:
    """How a generation runs: the decoder layers resident on the device or streamed, and how many sequences decode
    together (their KV cache's room)."""

    resident: bool
    batch: int
    placement: str  # the weights and the batch, in words
    compiled: bool = False

    @property
    def reason(self) -> str:
        """The plan in one line, for the run's log."""
        return f"{self.placement}, decoding " + ("compiled over a static KV cache" if self.compiled else "eager")


class Generator:
    """Completions of a trainer's model from its current weights (converted afresh for each `generate`). `weights`:
    auto (resident where they fit beside a KV cache of RESIDENT_NEEDS_SEQUENCES), resident or streamed;
    `decoding`: eager, or compiled over a static KV cache where the weights are resident on a GPU and the model's
    transformers class compiles whole (elsewhere eager); `generate_options`: more of transformers' `generate` options
    (`benchmarks/decoding.py` tries some).

    `trainer`: what holds the weights (megatrain's `Trainer`): its `model_config`, `spec`, `device`,
    `compute_dtype` and `streamed_weights()` (the store's tensors by name, as the device copies them)."""

    def __init__(self, trainer, weights: str = "auto", decoding: str = "eager", generate_options: dict | None = None):
        if decoding not in DECODING:
            raise ValueError(f"decoding {decoding!r}: one of {', '.join(DECODING)}")
        self.trainer, self.weights, self.decoding = trainer, weights, decoding
        self.generate_options = dict(generate_options or {})
        self.skeleton = HFSkeleton(_hf_config(trainer.model_config))
        if self.skeleton.config._attn_implementation == "sdpa" and _grouped_decoding_registered():
            self.skeleton.config._attn_implementation = GROUPED_DECODING
        self.layout = CheckpointLayout(self.skeleton)
        trained = trainer.spec.checkpoint_layout
        if trained is not None:  # (a generic model's persistent buffers as it trains with them: its checkpoint's)
            held = trained.bound_buffers()
            self.layout.bind_buffers({n: held[n] for n in self.layout.buffers if n in held}, "the trained model")
        self._streamed: _StreamedLayers | None = None
        self._renamed: dict[str, str] | None = None  # parameter -> the stored tensor that is it (see `_bound`)
        self._sources: dict[str, list[str]] = {}
        self.last_plan: GenerationPlan | None = None

    def _bound(self, resident: bool) -> dict[str, Tensor]:
        """The parameters the forward binds, in the compute dtype on the device: all of them where resident, else
        the embedding's and the head's, the layers' as views of the streaming buffers (filled as each layer runs)."""
        parts = self.skeleton.parts
        wire = with_adapters_merged(self.trainer.streamed_weights(), self.trainer.spec)  # (LoRA's on)
        if self._renamed is None:
            self._renamed = self.layout.renamed(wire, "the store")
            self._sources = self.layout.sources(list(wire), "the store", buffers=True)
        on_device = [parts.embedding, *parts.layers, parts.head] if resident else [parts.embedding, parts.head]
        buffers = dict(self.skeleton.model.named_buffers())  # (those the store holds: in their own dtype)
        bound = {
            n: wire[self._renamed[n]].to(self.trainer.device, buffers[n].dtype, non_blocking=True)
            for n in self.layout.buffers
            if n in self._sources
        }
        for names, converted in zip(on_device, self._converted(on_device, wire)):
            bound |= {n: self._on_device(wire[self._renamed[n]]) for n in names if n in self._renamed}
            bound |= {n: self._on_device(w) for n, w in converted.items()}
        if resident:
            self._streamed = None
            return bound
        if self._streamed is None:
            self._streamed = _StreamedLayers(
                self.skeleton, self.trainer.device, self.trainer.compute_dtype, self._renamed
            )
        self._streamed.bind(wire, self._renamed, self._converted(parts.layers, wire))
        return bound | self._streamed.views

    def _converted(self, names_per_part, wire):
        """Each part's parameters that renaming alone does not give (transformers' loader converts them on the
        host, fp32), by name; the rest come straight from the store's views."""
        for names in names_per_part:
            rest = [n for n in names if n not in self._renamed]
            loaded = self.layout.load({key: wire[key] for n in rest for key in self._sources[n]}) if rest else {}
            yield {n: loaded[n] for n in rest}

    def _on_device(self, weight: Tensor) -> Tensor:
        """A weight in the compute dtype on the device (from pinned memory: cast on the device, asynchronously)."""
        return weight.to(self.trainer.device, self.trainer.compute_dtype, non_blocking=True)

    def plan(self, n_sequences: int, length: int) -> GenerationPlan:
        """Resident or streamed layers, and the decoding batch, for `n_sequences` of up to `length` tokens."""
        trainer = self.trainer
        if trainer.device.type != "cuda":
            resident = self.weights != "streamed"
            how = "resident" if resident else "streamed layer by layer"
            return GenerationPlan(
                resident, n_sequences, f"on the CPU: weights {how}, one batch", self._compiles(resident)
            )
        itemsize = torch.empty((), dtype=trainer.compute_dtype).element_size()
        weights, per_sequence = _weight_and_kv_bytes(self.skeleton, itemsize, length)
        streaming = 0 if self._streamed is None else sum(b.nbytes for b in self._streamed.buffers)
        free = free_device_bytes(trainer.device) + streaming  # (the streaming buffers kept are room too)
        resident = self.weights == "resident" or (
            self.weights == "auto" and _resident_fits(weights, per_sequence, free)
        )
        held = weights if resident else _StreamedLayers.held_bytes(self.skeleton, itemsize)
        batch = max(1, min(n_sequences, int((free * KV_ROOM_SHARE - held) // per_sequence)))
        how = "resident" if resident else "streamed layer by layer"
        placement = (
            f"weights {how} ({weights / 2**30:.1f} GiB in {trainer.compute_dtype}), {batch} sequences per batch "
            f"(KV cache {per_sequence / 2**20:.0f} MiB each, {free / 2**30:.1f} GiB free)"
        )
        return GenerationPlan(resident, batch, placement, self._compiles(resident))

    @torch.no_grad()
    def generate(
        self, prompts: list[list[int]], sampling: Sampling, pad_id: int, seed: int = 0, first_row: int = 0
    ) -> list[list[int]]:
        """Each prompt's completion (token ids, ending at its stop token where one came), drawn with `seed` from
        noise of the prompt's own row (`first_row` + its index): the same seed samples the same completion of a
        row whichever rows share its batch (`RowSampler`); the global RNG is not used."""
        vocab = self.trainer.model_config.vocab_size
        for i, ids in enumerate(prompts):  # (a tokenizer not the model's gives ids its embedding has no row for)
            if ids and (min(ids) < 0 or max(ids) >= vocab):
                raise ZooError(
                    f"prompt {first_row + i + 1}: token ids span [{min(ids)}, {max(ids)}] but the model's vocab_size "
                    f"is {vocab}; use the tokenizer the model was built for (data.tokenizer)"
                )
        longest = max(len(p) for p in prompts)
        plan = self.last_plan = self._planned(len(prompts), longest + sampling.max_new_tokens)
        weights = {f"model.{name}": w for name, w in self._bound(plan.resident).items()}
        self.skeleton.to(self.trainer.device)
        completions = []
        for start in range(0, len(prompts), plan.batch):
            batch = prompts[start : start + plan.batch]
            streamed = None if plan.resident else self._streamed
            rows = torch.arange(first_row + start, first_row + start + len(batch))
            keys = row_keys(seed, rows)
            try:
                completions += self._generate_batch(batch, sampling, pad_id, keys, weights, streamed, plan.compiled)
            except Exception as error:  # (the compiled step failed: this family decodes eager, where that fails too)
                if not plan.compiled:
                    raise
                plan = self.last_plan = self._eager_from_now(plan, error)
                completions += self._generate_batch(batch, sampling, pad_id, keys, weights, streamed, False)
        del weights  # (the device copies go: training's placement counts on that memory)
        if self.trainer.device.type == "cuda":
            torch.cuda.empty_cache()
        return completions

    def _compiles(self, resident: bool) -> bool:
        """Whether a generation with these weights compiles its decoding step (`decoding`)."""
        model = self.skeleton.model
        whole = model._can_compile_fullgraph and model._supports_default_dynamic_cache()  # (no hybrid's own cache)
        return self.decoding == "compiled" and resident and self.trainer.device.type == "cuda" and whole

    def _eager_from_now(self, plan: GenerationPlan, error: Exception) -> GenerationPlan:
        """Decoding eager for the rest of the run, where the compiled step failed (dynamo or inductor could not
        compile it, or transformers' static cache does not serve the family: 5.17's for Llama 4); said in one line."""
        words = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        print(
            f"megatrain: generation: the compiled decoding step failed ({type(error).__name__}: {words}); decoding "
            "eager from now on (train.grpo.generation_decoding: eager skips the attempt)",
            file=sys.stderr,
        )
        self.decoding = "eager"
        return replace(plan, compiled=False)

    def _planned(self, n_sequences: int, length: int) -> GenerationPlan:
        """`plan` for sequences of up to `length` tokens: a compiled step's static KV cache holds the multiple of
        STATIC_CACHE_STEP at or above it (its bytes counted), an eager step's the length itself."""
        rounded = _rounded_up(length, STATIC_CACHE_STEP)
        plan = self.plan(n_sequences, rounded if self.decoding == "compiled" else length)
        return self.plan(n_sequences, length) if rounded != length and not plan.compiled else plan

    def _generate_batch(self, prompts, sampling: Sampling, pad_id: int, keys: Tensor, weights, streamed, compiled):
        device = self.trainer.device
        longest = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, prompt in enumerate(prompts):  # (left-padded: the completions start together)
            ids[row, longest - len(prompt) :] = torch.tensor(prompt)
            mask[row, longest - len(prompt) :] = 1
        options = dict(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=sampling.max_new_tokens,
            pad_token_id=pad_id,
            eos_token_id=list(sampling.stop_ids) or None,
            **self.generate_options,
        )
        if "cache_implementation" not in options and self.skeleton.model._supports_default_dynamic_cache():
            from transformers.generation.utils import ALL_CACHE_NAMES  # (its name first: 5.17's past_key_values)

            length, config = longest + sampling.max_new_tokens, self.skeleton.config
            if compiled:
                from transformers.generation.configuration_utils import CompileConfig

                options[ALL_CACHE_NAMES[0]] = _static_cache(config, _rounded_up(length, STATIC_CACHE_STEP))
                options.setdefault("compile_config", CompileConfig(**DECODING_COMPILE))
            else:
                options[ALL_CACHE_NAMES[0]] = _kv_cache(config, length)
        if hasattr(self.skeleton.config, "output_router_logits"):  # (a load-balancing loss is no generation's)
            options["output_router_logits"] = False
        options |= dict(do_sample=False, temperature=None, top_p=None, top_k=None)  # (sampled: by RowSampler)
        options["repetition_penalty"] = sampling.repetition_penalty  # (before RowSampler's warpers, as transformers')
        if sampling.temperature > 0:
            from transformers.generation.logits_process import LogitsProcessorList

            options["logits_processor"] = LogitsProcessorList([RowSampler(keys.to(device), longest, sampling)])
        with _streaming(streamed, self.skeleton.layers):
            out = torch.func.functional_call(_Generating(self.skeleton.model), weights, (), options, strict=False)
        return [_until_stop(row[longest:].tolist(), sampling.stop_ids) for row in out.cpu()]


# transformers' SDPA attention, but a decoding step's one query token over grouped key/value heads without repeating
# the keys and values per query head (`grouped_decoding_attention`)
GROUPED_DECODING = "megatrain_grouped_decoding"
# what transformers' models give their attention beside the mask to change the scores (soft-capping, biases, sinks):
# a step that has any of them runs transformers' SDPA attention
SCORE_TERMS = ("softcap", "position_bias", "alibi", "s_aux")
# a decoding step's attention kernels: not cuDNN's, which builds a plan for each new key length, so once a layer and
# step (~1 ms of the host's time a call on an H200: 27 ms of a Qwen2.5-1.5B step's 50, `benchmarks/decoding.py`)
DECODING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def grouped_decoding_attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface ([batch, heads, queries, head_dim] in, [batch, queries, heads, head_dim]
    out). One query token over fewer key/value heads: each key/value head's queries attend to it together (queries as
    [batch, kv_heads, group, head_dim]; the padding mask broadcast over them), where transformers' SDPA attention
    (5.17 and others) copies every layer's whole key/value cache once per query head at every decoding step of a batch
    whose prompts differ in length. Anything else: transformers' SDPA attention."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    batch, heads, queries, _ = query.shape
    kv_heads = key.shape[1]
    plain = all(kwargs.get(term) is None for term in SCORE_TERMS) and not kwargs.get("dropout")
    broadcast_mask = attention_mask is None or attention_mask.shape[1] == 1
    if queries != 1 or heads == kv_heads or heads % kv_heads or not (plain and broadcast_mask):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    grouped = query.reshape(batch, kv_heads, heads // kv_heads, query.shape[-1])
    with sdpa_kernel(DECODING_BACKENDS):
        out = nn.functional.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(batch, 1, heads, value.shape[-1]), None


@functools.cache
def _grouped_decoding_registered() -> bool:
    """Registered with transformers' attention and mask interfaces (the mask: SDPA's), where they are."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
    except ImportError:
        return False
    AttentionInterface.register(GROUPED_DECODING, grouped_decoding_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(GROUPED_DECODING, sdpa_mask)
    return True


def _kv_cache(config, length: int):
    """transformers' dynamic KV cache for the model of `config` (as `generate` makes it), but its full-attention
    layers' keys and values views of buffers of `length` tokens, each step's written in place
    (`_layer_growing_in_place`), where transformers copies a layer's whole cache into a new tensor at every step."""
    from transformers import DynamicCache

    growing, in_place = _layer_growing_in_place()
    cache = DynamicCache(config=config)
    cache.layers = [in_place(length) if type(layer) is growing else layer for layer in cache.layers]
    return cache


def _static_cache(config, length: int):
    """transformers' static KV cache of `length` tokens a sequence, whose fixed shapes a compiled decoding step takes."""
    from transformers import StaticCache

    return StaticCache(config=config, max_cache_len=length)


@functools.cache
def _layer_growing_in_place():
    """(transformers' DynamicLayer, its subclass whose keys and values are views of buffers made at its first update
    for `length` tokens: each update writes its tokens after those cached, and no method but `update` changes them)."""
    from transformers.cache_utils import DynamicLayer

    class LayerGrowingInPlace(DynamicLayer):
        def __init__(self, length: int):
            super().__init__()
            self.length = length

        def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
                batch, heads = key_states.shape[:2]
                self.buffers = [s.new_empty(batch, heads, self.length, s.shape[-1]) for s in (key_states, value_states)]
            start, end = self.get_seq_length(), self.get_seq_length() + key_states.shape[-2]
            for buffer, states in zip(self.buffers, (key_states, value_states)):
                buffer[:, :, start:end] = states
            self.keys, self.values = (buffer[:, :, :end] for buffer in self.buffers)
            return self.keys, self.values

    return DynamicLayer, LayerGrowingInPlace


_SPLITMIX = (-7046029254386353131, -4658895280553007687, -7723592293110705685)  # (2^64-wrapped int64 constants)


def _mixed(x: Tensor) -> Tensor:
    """splitmix64 on int64 tensors (wrapping products, logical shifts): well-spread bits of each element."""

    def shifted(value: Tensor, bits: int) -> Tensor:
        return (value >> bits) & ((1 << (64 - bits)) - 1)

    x = x + _SPLITMIX[0]
    x = (x ^ shifted(x, 30)) * _SPLITMIX[1]
    x = (x ^ shifted(x, 27)) * _SPLITMIX[2]
    return x ^ shifted(x, 31)


def row_keys(seed: int, rows: Tensor) -> Tensor:
    """Each row's sampling key: of the seed and the row's index alone."""
    return _mixed(_mixed(torch.full_like(rows, seed)) + rows)


class RowSampler:
    """Sampling with transformers' temperature, top-k and top-p warpers by the inverse of each row's cumulative
    distribution at a uniform hashed from the row's key and the decoding step, not drawn from a stream the batch
    shares: a row's completion is the same whichever rows decode beside it (a KV batch of another size, a rank's
    share of the step). As a logits processor it leaves only the drawn token finite, so decoding's argmax takes it."""

    def __init__(self, keys: Tensor, prompt_length: int, sampling: Sampling):
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.keys, self.prompt_length = keys, prompt_length
        self.warpers = [TemperatureLogitsWarper(sampling.temperature)]
        self.warpers += [TopKLogitsWarper(sampling.top_k)] if sampling.top_k else []
        self.warpers += [TopPLogitsWarper(sampling.top_p)] if sampling.top_p < 1 else []

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:
        for warper in self.warpers:
            scores = warper(input_ids, scores)
        bits = _mixed(self.keys + (input_ids.shape[1] - self.prompt_length))  # (one per row and step)
        uniform = ((bits >> 11) & (2**53 - 1)).double() / 2**53  # [0, 1), 53 bits
        cumulative = scores.float().softmax(-1).double().cumsum(-1)  # (float64: no token's share lost to rounding)
        at = (uniform * cumulative[:, -1]).unsqueeze(-1)
        token = torch.searchsorted(cumulative, at, right=True).clamp_max(scores.shape[-1] - 1)
        return torch.full_like(scores, -math.inf).scatter_(1, token, 0.0)


class _StreamedLayers:
    """The decoder layers' weights for streaming: two device buffers that take turns holding a layer, and `views`
    binding each layer's parameters to its buffer. While layer i runs, layer i + 1 copies into the other buffer on a
    stream of its own, once the layer that last used that buffer is done. A parameter that is a stored tensor
    renamed copies straight from the store's pinned view (fp32 masters cast on the device); one transformers'
    loader converts (stacked experts) from a pinned host copy in the compute dtype, refilled for each generation
    (`generation_host_bytes`: what the planner counts)."""

    def __init__(self, skeleton: HFSkeleton, device: torch.device, dtype: torch.dtype, renamed: dict[str, str]):
        shapes = dict(skeleton.model.named_parameters(remove_duplicate=False))
        self.names = skeleton.parts.layers
        sizes = [sum(math.prod(shapes[n].shape) for n in names) for names in self.names]
        self.on_cuda = device.type == "cuda"
        self.host = {
            name: torch.empty(shapes[name].shape, dtype=dtype, pin_memory=self.on_cuda)
            for names in self.names
            for name in names
            if name not in renamed
        }
        self.buffers = [torch.empty(max(sizes), dtype=dtype, device=device) for _ in range(2)]
        self.views: dict[str, Tensor] = {}
        for index, names in enumerate(self.names):
            offset, buffer = 0, self.buffers[index % 2]
            for name in names:
                shape = shapes[name].shape
                self.views[name] = buffer[offset : offset + math.prod(shape)].view(shape)
                offset += math.prod(shape)
        self.copies: list[list[tuple[Tensor, Tensor]]] = []  # per layer: (device view, host source) pairs
        self.copy_stream = torch.cuda.Stream(device) if self.on_cuda else None
        self.copied: list[torch.cuda.Event | None] = [None] * len(sizes)
        self.released = [torch.cuda.Event(), torch.cuda.Event()] if self.on_cuda else []  # (as a buffer's layer ends)
        self.deferred: int | None = None

    @staticmethod
    def held_bytes(skeleton: HFSkeleton, itemsize: int) -> int:
        """Device bytes streaming holds: the embedding and head, and two layers' buffers."""
        shapes = dict(skeleton.model.named_parameters(remove_duplicate=False))
        parts = skeleton.parts
        ends = sum(math.prod(shapes[n].shape) for n in [*parts.embedding, *parts.head])
        largest = max(sum(math.prod(shapes[n].shape) for n in names) for names in parts.layers)
        return (ends + 2 * largest) * itemsize

    def bind(self, wire: dict[str, Tensor], renamed: dict[str, str], converted) -> None:
        """This generation's sources: the store's views (`wire`) of renamed parameters, the host copies refilled
        from `converted` (per layer, name -> the loader's fp32 tensor) for the rest."""
        self.copies = []
        for names, weights in zip(self.names, converted):
            for name, weight in weights.items():
                self.host[name].copy_(weight)
            self.copies.append([(self.views[n], wire[renamed[n]] if n in renamed else self.host[n]) for n in names])

    def _copy(self, index: int) -> None:
        if not self.on_cuda:
            for view, source in self.copies[index]:
                view.copy_(source)
            return
        with torch.cuda.stream(self.copy_stream):
            self.copy_stream.wait_event(self.released[index % 2])
            for view, source in self.copies[index]:  # (an fp32 source is cast on the device, on this stream)
                view.copy_(source, non_blocking=True)
            self.copied[index] = torch.cuda.Event()
            self.copied[index].record(self.copy_stream)

    def before_layer(self, index: int) -> None:
        """Wait for the layer's weights (copying them now where no prefetch did), then prefetch the next layer
        where its buffer is not this one's (else after this layer: `after_layer`)."""
        if not self.on_cuda:
            return self._copy(index)
        if self.copied[index] is None:
            self._copy(index)
        torch.cuda.current_stream().wait_event(self.copied[index])
        self.copied[index] = None
        following = (index + 1) % len(self.names)
        if following % 2 != index % 2:
            self._copy(following)
        else:
            self.deferred = following

    def after_layer(self, index: int) -> None:
        if not self.on_cuda:
            return
        self.released[index % 2].record(torch.cuda.current_stream())
        if self.deferred is not None:
            self._copy(self.deferred)
            self.deferred = None


class _streaming:
    """Streamed layers' hooks on the decoder layers for the duration of a generation (none where resident)."""

    def __init__(self, streamed: _StreamedLayers | None, layers: list[nn.Module]):
        self.streamed, self.layers, self.hooks = streamed, layers, []

    def __enter__(self):
        if self.streamed is not None:
            for index, layer in enumerate(self.layers):
                self.hooks.append(layer.register_forward_pre_hook(lambda *_, i=index: self.streamed.before_layer(i)))
                self.hooks.append(layer.register_forward_hook(lambda *_, i=index: self.streamed.after_layer(i)))
        return self

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        self.hooks.clear()


def _hf_config(model) -> dict:
    """The transformers config.json of a megatrain model: its own where it is a generic one, else as exported."""
    return json.loads(model.hf_config) if model.implementation == "transformers" else config_to_hf(model)


def _weight_and_kv_bytes(skeleton: HFSkeleton, itemsize: int, length: int) -> tuple[int, int]:
    """(the weights' bytes, a sequence of `length` tokens' KV-cache bytes) in a dtype of `itemsize` bytes."""
    weights = sum(math.prod(p.shape) for p in skeleton.model.parameters()) * itemsize
    return weights, kv_bytes_per_token(skeleton.config, itemsize) * length


def _resident_fits(weights: int, per_sequence: int, free: int) -> bool:
    return weights + RESIDENT_NEEDS_SEQUENCES * per_sequence <= free * KV_ROOM_SHARE


def generation_host_bytes(model, stored: dict[str, tuple], dtype: torch.dtype, weights: str, gpu_bytes, length) -> int:
    """Host bytes a generation of up to `length` tokens per sequence takes beside the store: the host copies of the
    layer parameters streaming converts (`_StreamedLayers`; none for most dense families, whose stored tensors are
    the parameters), where the layers may stream (weights `streamed`, or `auto` and the weights with a KV cache of
    RESIDENT_NEEDS_SEQUENCES not fitting `gpu_bytes`). `stored`: the store's tensors' shapes by file name."""
    if weights == "resident" or (weights == "auto" and gpu_bytes is None):  # (on the CPU, auto is resident)
        return 0
    skeleton = HFSkeleton(_hf_config(model))
    itemsize = torch.empty((), dtype=dtype).element_size()
    shapes = dict(skeleton.model.named_parameters(remove_duplicate=False))
    if weights == "auto" and _resident_fits(*_weight_and_kv_bytes(skeleton, itemsize, length), gpu_bytes):
        return 0
    meta = {name: torch.empty(shape, device="meta") for name, shape in stored.items()}
    renamed = CheckpointLayout(skeleton).renamed(meta, "the store")
    return itemsize * sum(
        math.prod(shapes[n].shape) for names in skeleton.parts.layers for n in names if n not in renamed
    )


def kv_bytes_per_token(config, itemsize: int) -> int:
    """A sequence's KV-cache bytes per token: keys and values of every layer (an upper bound for hybrids, whose
    linear layers keep a fixed state instead)."""
    text = config.get_text_config()
    heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    return 2 * text.num_hidden_layers * heads * head_dim * itemsize


def _until_stop(tokens: list[int], stop_ids: tuple[int, ...]) -> list[int]:
    """A completion up to and including its first stop token (what follows is padding)."""
    for index, token in enumerate(tokens):
        if token in stop_ids:
            return tokens[: index + 1]
    return tokens


def _rounded_up(length: int, step: int) -> int:
    return -(-length // step) * step

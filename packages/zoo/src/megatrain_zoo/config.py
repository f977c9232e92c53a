"""ModelConfig: the numbers that describe a decoder-only model, with validation and counts.

A mixture-of-experts model is the same config with `n_experts > 0`: its layers (all but
`dense_layers`) replace the dense MLP by a router over `n_experts` SwiGLU experts of
width `moe_d_ff`, `n_experts_per_tok` of them active per token, plus an optional shared
expert. Parameter counts are per layer; FLOPs count the active parameters only.
"""

import json
from dataclasses import asdict, dataclass, field, fields, replace
from types import NoneType, UnionType
from typing import get_args

# Gemma 2 and 3: (1 + weight) RMSNorms before and after both halves of a block, a GELU-gated MLP, embeddings
# scaled by sqrt(d_model), attention scaled by query_pre_attn_scalar, soft caps (Gemma 2), windowed layers
GEMMA = ("gemma2", "gemma3_text")
# OLMo 2 and 3: norms on the attention's and the MLP's outputs, q/k normed over all heads, weights applied in fp32
OLMO = ("olmo2", "olmo3")
# Qwen3-Next and Qwen3.5: three of four layers Gated DeltaNet (linear attention), the others softmax attention
# whose output a gate scales; (1 + weight) norms, a quarter of each head rotating
LINEAR_ATTENTION_ARCHITECTURES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
DENSE_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "mistral",
    "ernie4_5",
    *GEMMA,
    "phi3",
    *OLMO,
    "smollm3",
    "qwen3_5_text",
    "granite",
    "granitemoehybrid",
)
# IBM Granite 3.x/4.1 (granite) and 4.0 (granitemoehybrid, its dense models: the MLP stored as `shared_mlp`, every
# layer without rotary embedding where position_embedding_type is not "rope", the H models' Mamba-2 layers as
# linear attention): multipliers on the embedding, the residual branches, the scores and the logits
GRANITE = ("granite", "granitemoehybrid")
GRANITE_MULTIPLIERS = ("embedding_multiplier", "residual_multiplier", "attention_multiplier", "logits_scaling")
# families whose sliding-window layers have their own rotary base, never scaled (`rope_local_theta`)
LOCAL_ROPE_ARCHITECTURES = ("gemma3_text", "olmo3")
# families with layers that have no rotary embedding (every fourth, by default)
NOPE_ARCHITECTURES = ("llama4_text", "smollm3", "granitemoehybrid")
MOE_ARCHITECTURES = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "olmoe",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "glm4_moe",
    "minimax_m2",
    "dots1",
    "ernie4_5_moe",
    "llama4_text",
    "qwen3_next",
    "qwen3_5_moe_text",
)
# families whose shared expert a sigmoid gate scales (the templates' "qwen" expert naming)
GATED_SHARED_EXPERT = ("qwen2_moe", "qwen3_next", "qwen3_5_moe_text")
# the linear attention's chunk (the templates' GatedDeltaNetShape.chunk), for FLOP counts
LINEAR_ATTENTION_CHUNK = 64
# families whose routers score experts with a sigmoid and choose with a correction bias
SIGMOID_ROUTED = ("deepseek_v3", "glm4_moe", "minimax_m2", "dots1")
ERNIE = ("ernie4_5", "ernie4_5_moe")
# routers that choose by score + a correction bias: the sigmoid ones and ERNIE 4.5's softmax
CORRECTION_BIASED = (*SIGMOID_ROUTED, "ernie4_5_moe")
ARCHITECTURES = DENSE_ARCHITECTURES + MOE_ARCHITECTURES
ROPE_SCALINGS = ("default", "llama3", "linear", "yarn", "longrope")
QK_NORM_SCOPES = ("head", "full")  # per head (Qwen3) or over all heads' concatenation (OLMoE)
ROUTER_SCORINGS = ("softmax", "sigmoid", "sigmoid_of_top_k")  # the templates' SCORINGS
GEMMA_ACTIVATIONS = ("gelu_tanh", "gelu")  # transformers' gelu_pytorch_tanh (every published Gemma) and gelu


def windowed_but_every(n_layers: int, every: int) -> tuple[int, ...]:
    """The layers that attend over a sliding window when every `every`-th one attends fully (gpt-oss and
    Gemma 2: every other; Gemma 3: one of six), as transformers' default layer_types make them."""
    return tuple(i for i in range(n_layers) if (i + 1) % every)


class ZooError(Exception):
    """An unknown or unsupported model description, with the fix in the message."""


class TemplateLacks(ZooError):
    """A config.json no native template runs (an architecture or a feature megatrain's templates lack): under
    model.implementation auto its model trains through transformers' own modules instead."""


def _check_number_fields(config: "ModelConfig") -> None:
    """A ZooError naming the first field of a ModelConfig that its type says is a number (int: a whole one; float:
    any) and that holds something else: a size written as text, a null where only some fields allow one. Caught here
    once, for every way a config is made, rather than as a TypeError in the checks or the model's arithmetic."""
    for spec in fields(config):
        kinds = get_args(spec.type) if isinstance(spec.type, UnionType) else (spec.type,)
        number = next((kind for kind in kinds if kind in (int, float)), None)
        value = getattr(config, spec.name)
        if number is None or (value is None and NoneType in kinds):
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float) if number is float else int):
            what = ("a whole number" if number is int else "a number") + (" or null" if NoneType in kinds else "")
            raise ZooError(f"model.{spec.name} must be {what}, got {value!r} ({type(value).__name__})")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of a decoder-only model: its family and sizes, no weights. Made by `preset(name)`
    (`PRESETS`), `config_from_hf` (a Hugging Face config.json as a dict) or directly, and checked as it is made
    (`ZooError` naming the field); `build_model(config)` turns it into groups and stages, and `n_params`,
    `active_params` and `flops_per_token` count it.

    `arch` is the family as config.json's `model_type` names it (one of ARCHITECTURES, or any with `implementation`
    "transformers"); the sizes after it are required, and the other fields default to a Llama-2-style decoder
    with each family's feature off."""

    arch: str
    vocab_size: int  # tokens: the embedding's and the LM head's rows
    d_model: int  # hidden size
    n_layers: int  # decoder layers
    n_heads: int  # query heads
    n_kv_heads: int  # key/value heads (grouped-query attention: n_heads is a multiple of it)
    d_ff: int  # the dense MLP's intermediate width
    head_dim: int = 0  # 0: d_model // n_heads
    max_seq_len: int = 4096  # config.json's max_position_embeddings
    rope_theta: float = 10000.0  # the rotary embedding's base
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None  # as in transformers: the embedding row of this token gets no gradient
    qk_norm_scope: str = "head"  # with qk_norm: "head" or "full" (QK_NORM_SCOPES)
    clip_qkv: float | None = None  # clamp q, k, v to [-clip_qkv, clip_qkv] (OLMoE)
    # mixture of experts; n_experts 0 is a dense model
    n_experts: int = 0
    n_experts_per_tok: int = 0
    moe_d_ff: int = 0  # intermediate size of each routed expert
    shared_expert_d_ff: int = 0  # a shared expert every token passes through, behind a sigmoid gate (0: none)
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP of width d_ff instead of experts
    router_aux_loss_coef: float = 0.0  # weight of the load-balancing loss ...
    output_router_logits: bool = False  # ... which, as in transformers, is added only when this is true
    # gpt-oss: biases on all four attention projections, a sink logit per head, router and expert biases,
    # a clamped SwiGLU; `sliding_window` on `sliding_layers` only (full attention elsewhere), any family
    o_bias: bool = False
    attention_sinks: bool = False
    sliding_layers: tuple[int, ...] = ()
    swiglu_limit: float = 0.0
    # DeepSeek-V2/V3: multi-head latent attention (kv_lora_rank > 0; head_dim is the rotary part's width),
    # routing weights scaled by routed_scaling_factor, group-limited routing (n_group > 1)
    kv_lora_rank: int = 0
    q_lora_rank: int = 0  # 0: queries straight from the hidden state
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True  # latent attention's rotary part on adjacent pairs (DeepSeek) or halves
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    # "softmax" routers, or "sigmoid" (SIGMOID_ROUTED): scores chosen from with a correction bias, moved
    # only by load (train.router_bias_update_rate)
    router_scoring: str = "softmax"
    partial_rotary_factor: float = 1.0  # the share of each head's dims that rotate (GLM-4.5: the first half)
    # the dense MLP's gate: silu (SwiGLU), or for Gemma one of GEMMA_ACTIVATIONS
    activation: str = "silu"
    # Gemma (GEMMA): scores scaled by query_pre_attn_scalar ** -0.5 instead of head_dim's; soft caps
    # cap * tanh(x / cap) on the attention scores and the final logits (Gemma 2); the sliding-window
    # layers' own rotary base, never scaled (Gemma 3's rope_local_base_freq)
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    rope_local_theta: float | None = None
    # Llama 4 (SmolLM3: nope_layers only): layers without the rotary embedding ("NoPE": every fourth), whose
    # queries are scaled by log(floor((position + 1) / attn_temperature_floor_scale) + 1) *
    # attn_temperature_scale + 1 (floor scale 0: not at all); the others attend within chunks of
    # `attention_chunk_size` positions (`chunked_layers`) and, with `qk_rms_normalized`, RMS-norm their queries
    # and keys with no weight after the rotary embedding
    nope_layers: tuple[int, ...] = ()
    attention_chunk_size: int | None = None
    chunked_layers: tuple[int, ...] = ()
    qk_rms_normalized: bool = False
    attn_temperature_floor_scale: float = 0.0
    attn_temperature_scale: float = 0.0
    # Qwen3-Next and Qwen3.5 (LINEAR_ATTENTION_ARCHITECTURES): the layers whose token mixer is Gated DeltaNet, its
    # query/key heads and value heads (several value heads per key head), and its short convolution's taps;
    # Granite 4.0-H (granitemoehybrid): its Mamba-2 layers, the key heads its groups (B and C), the key head dim
    # its state size, the value heads and their dim its heads and head dim
    linear_attention_layers: tuple[int, ...] = ()
    linear_n_key_heads: int = 0
    linear_n_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel: int = 4
    # Granite (GRANITE): the embedding's rows scaled by embedding_multiplier, attention's and the MLP's outputs by
    # residual_multiplier before their residual adds, the scores by attention_multiplier (in place of
    # head_dim ** -0.5), the logits divided by logits_scaling (GRANITE_MULTIPLIERS, all set or none)
    embedding_multiplier: float | None = None
    residual_multiplier: float | None = None
    attention_multiplier: float | None = None
    logits_scaling: float | None = None
    # "transformers": a family trained through transformers' own modules (generic.py), whose config.json this keeps
    # (as JSON text) and whose counts come from its modules: per decoder layer (parameters, those a token uses, the
    # matrices among those), and the parameters outside the layers (embedding, final norm, LM head)
    implementation: str = "native"
    hf_config: str | None = None
    layer_counts: tuple[tuple[int, int, int], ...] = ()
    outer_params: int = 0
    packs_documents: bool = True  # whether packed documents stay apart (not in a generic recurrence or convolution)
    # an image-text model trained whole (image_text.py): its vision tower and projector stream as stages before the
    # decoder's, counted in outer_params
    image_text: bool = False

    def __post_init__(self):
        object.__setattr__(self, "layer_counts", tuple(tuple(counts) for counts in self.layer_counts))  # (from JSON)
        _check_number_fields(self)
        if self.implementation == "transformers":
            return  # (its own modules define it: none of the native templates' checks apply)
        if self.arch not in ARCHITECTURES:
            raise ZooError(f"unknown architecture {self.arch!r}; supported: {ARCHITECTURES}")
        object.__setattr__(self, "dense_layers", tuple(sorted(int(i) for i in self.dense_layers)))
        for name in ("sliding_layers", "nope_layers", "chunked_layers", "linear_attention_layers"):
            object.__setattr__(self, name, tuple(sorted(int(i) for i in getattr(self, name))))
        self._check_layer_kinds()
        self._check_linear_attention()
        self._check_experts()
        self._check_sizes()
        self._check_family_fields()
        self._check_rope_scaling()

    def _check_layer_kinds(self) -> None:
        """Windowed, chunked and rotary-free layers: each with its setting, and only in the families that have them."""
        if bool(self.sliding_layers) != bool(self.sliding_window):
            raise ZooError(
                "sliding_window and sliding_layers go together: the window, and the layers that attend over it "
                "(every layer for Mistral)"
            )
        if bool(self.chunked_layers) != bool(self.attention_chunk_size):
            raise ZooError("attention_chunk_size and chunked_layers go together: the chunk, and the layers it is on")
        llama4_only = ("chunked_layers", "qk_rms_normalized", "attn_temperature_floor_scale")
        if self.arch != "llama4_text" and any(getattr(self, name) for name in llama4_only):
            raise ZooError(f"{llama4_only} are Llama 4's; {self.arch} has none of them: leave them unset")
        if self.nope_layers and self.arch not in NOPE_ARCHITECTURES:
            raise ZooError(
                f"nope_layers (layers without rotary embedding) are only {NOPE_ARCHITECTURES}': leave them unset"
            )
        if self.arch == "llama4_text" and self.shared_expert_d_ff != self.moe_d_ff:
            raise ZooError(
                f"Llama 4's shared expert is as wide as its routed ones (intermediate_size): shared_expert_d_ff "
                f"{self.shared_expert_d_ff} must equal moe_d_ff {self.moe_d_ff}"
            )
        if set(self.nope_layers) & set(self.chunked_layers):
            raise ZooError(
                "Llama 4's layers without rotary embedding (nope_layers) attend over everything: not chunked"
            )

    def _check_experts(self) -> None:
        """The router's scoring as the family's, and an expert count, top-k and width that make a MoE layer."""
        if self.router_scoring not in ROUTER_SCORINGS or self.router_scoring != self.expected_router_scoring:
            raise ZooError(
                f"router_scoring {self.router_scoring!r}: {SIGMOID_ROUTED} score experts with a sigmoid, Llama 4 with "
                f"the sigmoid of each top-k logit, the other families with a softmax ({ROUTER_SCORINGS})"
            )
        if self.n_experts < 0 or (self.arch in MOE_ARCHITECTURES) != (self.n_experts > 0):
            raise ZooError(
                f"{self.arch} needs n_experts {'> 0' if self.arch in MOE_ARCHITECTURES else '= 0'}, "
                f"got {self.n_experts}; mixture-of-experts models are {MOE_ARCHITECTURES}"
            )
        if self.n_experts:
            if not 0 < self.n_experts_per_tok <= self.n_experts:
                raise ZooError(
                    f"n_experts_per_tok must be in 1..n_experts ({self.n_experts}), got {self.n_experts_per_tok}"
                )
            if self.moe_d_ff <= 0:
                raise ZooError(f"moe_d_ff (moe_intermediate_size) must be positive, got {self.moe_d_ff}")
            outside = [i for i in self.dense_layers if not 0 <= i < self.n_layers]
            if outside:
                raise ZooError(f"dense_layers {outside} are not layers of a {self.n_layers}-layer model")

    def _check_sizes(self) -> None:
        """Positive sizes, whole key-value groups, and a head_dim (derived when unset) the rotary embedding fits."""
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ZooError(f"model.{name} must be positive, got {getattr(self, name)}")
        if self.n_heads % self.n_kv_heads:
            raise ZooError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if self.head_dim == 0:
            if self.d_model % self.n_heads:
                raise ZooError(f"d_model ({self.d_model}) is not divisible by n_heads ({self.n_heads}); set head_dim")
            object.__setattr__(self, "head_dim", self.d_model // self.n_heads)
        if self.head_dim % 2:
            raise ZooError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ZooError(
                f"partial_rotary_factor {self.partial_rotary_factor} rotates {self.rotary_dim} of head_dim "
                f"{self.head_dim}: it must be an even number of them, at least two"
            )

    def _check_family_fields(self) -> None:
        """Fields that only some families have (Granite's multipliers, Gemma's scalars and caps, a second rotary base,
        the activation, the q/k norm's scope) set only there."""
        multipliers = [getattr(self, name) for name in GRANITE_MULTIPLIERS]
        expected = len(GRANITE_MULTIPLIERS) if self.arch in GRANITE else 0
        if sum(m is not None for m in multipliers) != expected or any(m is not None and not m > 0 for m in multipliers):
            raise ZooError(
                f"{GRANITE_MULTIPLIERS} are Granite's, all four positive (transformers' default is 1.0 each); "
                f"{self.arch} got {multipliers}"
            )
        gemma_only = ("query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
        set_here = [name for name in gemma_only if getattr(self, name) is not None]
        if set_here and self.arch not in GEMMA:
            raise ZooError(f"{set_here} are Gemma's ({GEMMA}); {self.arch} has none of them: leave them unset")
        if self.rope_local_theta is not None and self.arch not in LOCAL_ROPE_ARCHITECTURES:
            raise ZooError(f"rope_local_theta is {LOCAL_ROPE_ARCHITECTURES}'s; {self.arch} has none: leave it unset")
        activations = GEMMA_ACTIVATIONS if self.arch in GEMMA else ("silu",)
        if self.activation not in activations:
            raise ZooError(f"{self.arch}'s activation must be one of {activations}, got {self.activation!r}")
        if self.qk_norm_scope not in QK_NORM_SCOPES:
            raise ZooError(f"qk_norm_scope must be one of {QK_NORM_SCOPES}, got {self.qk_norm_scope!r}")

    def _check_rope_scaling(self) -> None:
        """A rope scaling the templates implement, LongRoPE's factors complete."""
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ROPE_SCALINGS:
            raise ZooError(
                f"rope_scaling type {kind!r} is not supported (supported: {ROPE_SCALINGS}); remove rope_scaling "
                "from config.json to train at the model's native context length"
            )
        if kind == "longrope":
            missing = {"short_factor", "long_factor", "original_max_position_embeddings", "factor"} - set(
                self.rope_scaling
            )
            wrong = [
                k
                for k in ("short_factor", "long_factor")
                if len(self.rope_scaling.get(k) or ()) != self.rotary_dim // 2
            ]
            if missing or wrong:
                raise ZooError(
                    f"LongRoPE scaling needs short_factor and long_factor of rotary_dim / 2 = {self.rotary_dim // 2} "
                    f"values each, original_max_position_embeddings and factor; missing {sorted(missing)}, "
                    f"wrong length {wrong}"
                )

    def _check_linear_attention(self) -> None:
        if self.arch not in (*LINEAR_ATTENTION_ARCHITECTURES, "granitemoehybrid"):
            if self.linear_attention_layers:
                raise ZooError(
                    f"linear_attention_layers are {LINEAR_ATTENTION_ARCHITECTURES}' and Granite 4.0-H's (Mamba-2); "
                    f"{self.arch} has none: leave them unset"
                )
            return
        if self.arch == "granitemoehybrid" and not self.linear_attention_layers:
            return  # Granite 4.0's attention-only models
        heads = (self.linear_n_key_heads, self.linear_n_value_heads)
        dims = (self.linear_key_head_dim, self.linear_value_head_dim, self.linear_conv_kernel)
        if min(*heads, *dims) <= 0 or heads[1] % heads[0]:
            raise ZooError(
                f"{self.arch}'s linear attention needs positive head counts, head dims and conv kernel, and "
                f"linear_n_value_heads a multiple of linear_n_key_heads; got heads {heads}, dims and kernel {dims}"
            )
        outside = [i for i in self.linear_attention_layers if not 0 <= i < self.n_layers]
        if outside:
            raise ZooError(f"linear_attention_layers {outside} are not layers of a {self.n_layers}-layer model")
        if self.sliding_layers or (self.nope_layers and self.arch != "granitemoehybrid"):
            raise ZooError(f"{self.arch} has no sliding-window layers and no layers without rotary embedding")
        if self.arch == "granitemoehybrid" and self.linear_n_value_heads * self.linear_value_head_dim % self.d_model:
            raise ZooError(
                f"Granite 4.0-H's Mamba-2 width (heads {self.linear_n_value_heads} x head dim "
                f"{self.linear_value_head_dim}) must be a multiple of d_model {self.d_model} (mamba_expand)"
            )
        if self.arch == "qwen3_5_moe_text" and self.dense_layers:
            raise ZooError("Qwen3.5-MoE has experts on every layer: dense_layers must be empty (use qwen3_next)")

    def layer_is_linear(self, layer: int) -> bool:
        """Whether `layer`'s token mixer is linear attention (Gated DeltaNet; Granite 4.0-H's Mamba-2) rather than
        softmax attention."""
        return layer in self.linear_attention_layers

    @property
    def softmax_scale(self) -> float | None:
        """The attention scores' scale where it is not head_dim ** -0.5: Granite's attention_multiplier, Gemma's
        query_pre_attn_scalar ** -0.5."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return None if self.query_pre_attn_scalar is None else self.query_pre_attn_scalar**-0.5

    @property
    def attn_output_gate(self) -> bool:
        """Whether softmax attention's output is scaled by sigmoid(gate), the gate from q_proj (Qwen3-Next, 3.5)."""
        return self.arch in LINEAR_ATTENTION_ARCHITECTURES

    @property
    def expected_router_scoring(self) -> str:
        """The router scoring of the family (ROUTER_SCORINGS)."""
        if self.arch in SIGMOID_ROUTED:
            return "sigmoid"
        return "sigmoid_of_top_k" if self.arch == "llama4_text" else "softmax"

    def first_layers(self, n_layers: int) -> "ModelConfig":
        """The model cut to its first `n_layers` layers, each as it was (its window, chunk, rotary, MLP kind)."""
        per_layer = ("dense_layers", "sliding_layers", "nope_layers", "chunked_layers", "linear_attention_layers")
        cut = {name: tuple(i for i in getattr(self, name) if i < n_layers) for name in per_layer}
        if not cut["sliding_layers"]:
            cut["sliding_window"] = None
        if not cut["chunked_layers"]:
            cut["attention_chunk_size"] = None
        return replace(self, n_layers=n_layers, **cut)

    def with_changes(self, **changes) -> "ModelConfig":
        """A copy with `changes` (field=value), checked anew."""
        return replace(self, **changes)

    def as_dict(self) -> dict:
        """Plain JSON types (lists, not tuples), so that a dict read back from JSON compares equal."""
        return json.loads(json.dumps(asdict(self)))

    @property
    def rope_interleaved(self) -> bool:
        """Rotary embedding on adjacent pairs: latent attention as `rope_interleave` says, ERNIE 4.5 and Llama 4
        always."""
        return self.rope_interleave if self.kv_lora_rank else self.arch in (*ERNIE, "llama4_text")

    @property
    def gemma(self) -> bool:
        """Gemma's block and embedding: (1 + weight) RMSNorms on both halves' inputs and outputs, a GELU-gated
        MLP, the embedding's rows scaled by sqrt(d_model)."""
        return self.arch in GEMMA

    @property
    def norm_scale(self) -> str:
        """How the norms apply their weights (the templates' NORM_SCALES): Gemma's, Qwen3-Next's and Qwen3.5's
        1 + weight and OLMo's weight in fp32 before the cast back, Llama's after it."""
        if self.arch in OLMO:
            return "fp32"
        return "one_plus_fp32" if self.gemma or self.arch in LINEAR_ATTENTION_ARCHITECTURES else "cast_first"

    @property
    def norm_placement(self) -> str:
        """Where the block's norms are (the templates' NORM_PLACEMENTS): before attention and MLP, also on their
        outputs (Gemma), or on their outputs only (OLMo)."""
        return "sandwich" if self.gemma else "post" if self.arch in OLMO else "pre"

    @property
    def router_bias(self) -> bool:
        """Whether the router chooses by score + a correction bias (moved only by load)."""
        return self.arch in CORRECTION_BIASED

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each query and key head that rotate (all but with partial_rotary_factor)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def is_moe(self) -> bool:
        return self.n_experts > 0

    def layer_is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer not in self.dense_layers

    @property
    def attention_widths(self) -> tuple[int, int]:
        """(query/key width, value width) of one attention head."""
        if self.kv_lora_rank:
            return self.qk_nope_head_dim + self.head_dim, self.v_head_dim
        return self.head_dim, self.head_dim

    def _attention_params(self, layer: int) -> tuple[int, int]:
        """(matrix parameters, norm and bias parameters) of `layer`'s attention and its two norms (the linear
        attention's convolution taps counted as matrix parameters: a token multiplies with each once)."""
        if self.layer_is_linear(layer):
            d, keys = self.d_model, self.linear_n_key_heads * self.linear_key_head_dim
            values, heads = self.linear_n_value_heads * self.linear_value_head_dim, self.linear_n_value_heads
            channels = 2 * keys + values
            matrices = d * (channels + values + 2 * heads) + values * d + channels * self.linear_conv_kernel
            return matrices, 2 * d + self.linear_value_head_dim + 2 * heads
        if self.kv_lora_rank:
            d, heads, (qk, v) = self.d_model, self.n_heads, self.attention_widths
            queries = d * self.q_lora_rank + self.q_lora_rank * heads * qk if self.q_lora_rank else d * heads * qk
            latent = d * (self.kv_lora_rank + self.head_dim) + self.kv_lora_rank * heads * (self.qk_nope_head_dim + v)
            return queries + latent + heads * v * d, 2 * d + self.kv_lora_rank + self.q_lora_rank
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        norms = (4 if self.norm_placement == "sandwich" else 2) * d
        small = norms + (q + 2 * kv if self.qkv_bias else 0) + (d if self.o_bias else 0)
        small += self.n_heads if self.attention_sinks else 0
        if self.qk_norm:
            small += q + kv if self.qk_norm_scope == "full" else 2 * self.head_dim
        return (3 if self.attn_output_gate else 2) * d * q + 2 * d * kv, small

    def _mlp_params(self, layer: int) -> tuple[int, int]:
        """(all MLP parameters, those one token multiplies with) of `layer`."""
        d = self.d_model
        if not self.layer_is_moe(layer):
            return 3 * d * self.d_ff, 3 * d * self.d_ff
        router = self.n_experts * d
        shared_gate = d if self.arch in GATED_SHARED_EXPERT else 0
        shared = 3 * d * self.shared_expert_d_ff + shared_gate if self.shared_expert_d_ff else 0
        expert = 3 * d * self.moe_d_ff
        biases = self.n_experts * (1 + 2 * self.moe_d_ff + d) if self.arch == "gpt_oss" else 0  # not multiplied with
        if self.router_bias:  # the correction bias, stored as hi + lo (no gradient)
            biases = 2 * self.n_experts
        return router + shared + self.n_experts * expert + biases, router + shared + self.n_experts_per_tok * expert

    def layer_params(self, layer: int) -> int:
        """Trainable parameters of decoder layer `layer` (all experts counted)."""
        if self.layer_counts:
            return self.layer_counts[layer][0]
        matrices, small = self._attention_params(layer)
        return matrices + small + self._mlp_params(layer)[0]

    @property
    def block_params(self) -> int:
        """Parameters of the largest decoder layer."""
        return max(self.layer_params(layer) for layer in range(self.n_layers))

    @property
    def n_params(self) -> int:
        """All trainable parameters (the tied embedding counted once, every expert counted)."""
        embed = self.vocab_size * self.d_model
        layers = sum(self.layer_params(layer) for layer in range(self.n_layers))
        if self.layer_counts:
            return layers + self.outer_params
        return embed + layers + self.d_model + (0 if self.tie_embeddings else embed)

    @property
    def matmul_params(self) -> int:
        """Parameters one token multiplies with: attention matrices, the router, shared and active
        experts (or the dense MLP) and the LM head (tied or not), but not the embedding lookup,
        norms or biases. For a dense model these are all the matrices."""
        if self.layer_counts:
            return sum(matrices for _, _, matrices in self.layer_counts) + self.vocab_size * self.d_model
        layers = sum(self._attention_params(layer)[0] + self._mlp_params(layer)[1] for layer in range(self.n_layers))
        return layers + self.vocab_size * self.d_model

    @property
    def active_params(self) -> int:
        """Parameters a token uses (the tied embedding counted once); n_params for a dense model."""
        if self.layer_counts:
            return self.n_params - sum(params - active for params, active, _ in self.layer_counts)
        inactive = sum(self._mlp_params(layer)[0] - self._mlp_params(layer)[1] for layer in range(self.n_layers))
        return self.n_params - inactive


def linear_attention_flops_per_token(config: ModelConfig) -> float:
    """Forward + backward FLOPs per token of one linear-attention layer's delta rule (its projections and
    convolution are matmul parameters): within its chunk as causal attention over the chunk, and three
    [key_head_dim, value_head_dim] products with the state (its read, the delta's prediction, its update; Mamba-2
    has no prediction); the chunks' triangular solves not counted."""
    d_k, d_v = config.linear_key_head_dim, config.linear_value_head_dim
    state_products = 2 if config.arch == "granitemoehybrid" else 3  # (Mamba-2 has no delta to predict)
    return 3 * config.linear_n_value_heads * ((d_k + d_v) * LINEAR_ATTENTION_CHUNK + 2 * state_products * d_k * d_v)


def softmax_attention_flops_per_token(config: ModelConfig, keys: int) -> float:
    """A softmax attention layer's FLOPs a token, forward + backward (QK^T and AV, 2 FLOPs a product each way, the
    backward twice the forward), where a query attends to `keys` / 2 keys on average (causal over a sequence of
    `keys`)."""
    return 3 * config.n_heads * sum(config.attention_widths) * keys


def flops_per_token(config: ModelConfig, seq_len: int, adapter_params: float | None = None) -> float:
    """Training FLOPs per token, forward + backward, recomputation not counted:
    6 x matmul parameters + causal attention (QK^T and AV over half the square; over the window, at
    most, in sliding-window layers; over half a chunk, at most, in chunked layers) + linear attention's
    delta rule (`linear_attention_flops_per_token`). With `adapter_params` (LoRA's, over a frozen base: those a token
    computes with, `ModelSpec.active_adapter_params`): 4 x the base's matmul parameters (no weight gradient) + 6 x
    the adapters' + the same attention."""
    windowed = min(seq_len, 2 * config.sliding_window) if config.sliding_window else seq_len
    chunked = min(seq_len, config.attention_chunk_size or seq_len)

    def keys(layer: int) -> int:  # twice the mean number of keys a query attends to
        return windowed if layer in config.sliding_layers else chunked if layer in config.chunked_layers else seq_len

    softmax_layers = [layer for layer in range(config.n_layers) if not config.layer_is_linear(layer)]
    attention = sum(softmax_attention_flops_per_token(config, keys(layer)) for layer in softmax_layers)
    linear = len(config.linear_attention_layers) * linear_attention_flops_per_token(config)
    if adapter_params is not None:
        return 4 * config.matmul_params + 6 * adapter_params + attention + linear
    return 6 * config.matmul_params + attention + linear

"""ModelConfig: the numbers that describe a decoder-only model, with validation and counts."""

from dataclasses import asdict, dataclass, field, replace

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
ROPE_SCALINGS = ("default", "llama3", "linear")


class ZooError(Exception):
    """An unknown or unsupported model description, with the fix in the message."""


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    head_dim: int = 0  # 0: d_model // n_heads
    max_seq_len: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, hash=False)
    rms_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    initializer_range: float = 0.02
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ZooError(f"unknown architecture {self.arch!r}; supported: {ARCHITECTURES}")
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
        kind = (self.rope_scaling or {}).get("rope_type", (self.rope_scaling or {}).get("type", "default"))
        if kind not in ROPE_SCALINGS:
            raise ZooError(
                f"rope_scaling type {kind!r} is not supported (supported: {ROPE_SCALINGS}); remove rope_scaling "
                "from config.json to train at the model's native context length"
            )

    def with_changes(self, **changes) -> "ModelConfig":
        return replace(self, **changes)

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def block_params(self) -> int:
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        n = 2 * d * q + 2 * d * kv + 3 * d * self.d_ff + 2 * d
        if self.qkv_bias:
            n += q + 2 * kv
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def n_params(self) -> int:
        """All trainable parameters (the tied embedding counted once)."""
        embed = self.vocab_size * self.d_model
        return embed + self.n_layers * self.block_params + self.d_model + (0 if self.tie_embeddings else embed)

    @property
    def matmul_params(self) -> int:
        """Parameters that take part in a matrix product per token: all block matrices and the
        LM head (tied or not), but not the embedding lookup or norms/biases."""
        d, q, kv = self.d_model, self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        block = 2 * d * q + 2 * d * kv + 3 * d * self.d_ff
        return self.n_layers * block + self.vocab_size * d


def flops_per_token(config: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token, forward + backward, recomputation not counted:
    6 x matmul parameters + causal attention (QK^T and AV over half the square)."""
    attention = 6 * config.n_layers * seq_len * config.n_heads * config.head_dim
    return 6 * config.matmul_params + attention

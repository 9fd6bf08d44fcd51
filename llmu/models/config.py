"""The hyper-parameters of a Llama-family decoder, and of the small byte-level one the course trains.

:class:`LlamaConfig` describes any checkpoint llmu loads; :func:`byte_llama_config` sizes a fresh
decoder over the 256 byte values (no tokenizer), which modules 04 and 15 train from scratch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from llmu.checks import require_positive

#: What ``LlamaConfig.position_embedding`` may be: rotary embeddings, or none at all (NoPE).
POSITION_EMBEDDINGS = ("rope", "none")


@dataclass
class LlamaConfig:
    """Shape of a Llama-family decoder. Defaults are SmolLM2-135M's.

    ``rope_layout`` says which channels of a head RoPE rotates together: ``"half"`` (channel ``i``
    with ``i + head_dim/2``, the Hugging Face convention) or ``"interleaved"`` (``2i`` with
    ``2i + 1``, llama.cpp's). It must match how the checkpoint's Q/K projection rows are ordered;
    see ``llmu.models.loading`` and, for the two layouts, ``llmu.layers.reference``.

    ``position_embedding`` says how attention learns where a token is: ``"rope"`` (rotary
    embeddings, every Llama) or ``"none"`` (NoPE: queries and keys are not rotated; the causal
    mask alone tells a token how many came before it).
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None  # hidden_size // num_attention_heads when None
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    pad_token_id: int | None = 2
    rope_layout: str = "half"
    position_embedding: str = "rope"  # "rope" or "none" (NoPE)
    rope_scaling: dict | None = None  # e.g. Llama 3's {"rope_type": "llama3", "factor": 32.0, ...}
    attention_bias: bool = False  # q/k/v projections with a bias (Qwen2; Llama's attention_bias)
    attention_out_bias: bool = False  # o_proj with a bias (Llama's attention_bias, not Qwen2)
    name: str = "llama"
    extra: dict = field(default_factory=dict)  # anything else the source file said, for reference

    def __post_init__(self):
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.position_embedding not in POSITION_EMBEDDINGS:
            raise ValueError(f"position_embedding must be one of {POSITION_EMBEDDINGS} ('none': no rotation, "
                             f"NoPE), got {self.position_embedding!r}")
        if self.head_dim % 2 and self.position_embedding == "rope":
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.rope_scaling is not None:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ("default", "llama3"):
                raise ValueError(f"rope_scaling: llmu implements the 'llama3' RoPE scaling only, got {kind!r}")
        if self.rope_layout not in ("half", "interleaved"):
            raise ValueError(f"rope_layout must be 'half' or 'interleaved', got {self.rope_layout!r}")

    @property
    def n_rep(self) -> int:
        """How many query heads share one KV head (1 = multi-head attention, >1 = GQA)."""
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def eos_token_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, (list, tuple)) else [self.eos_token_id]

    def num_parameters(self) -> int:
        """Parameters of the model this config describes (tied embeddings counted once)."""
        d, f, v, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_hidden_layers
        kv = self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        per_layer = d * q + 2 * d * kv + q * d + 3 * d * f + 2 * d
        if self.attention_bias:
            per_layer += q + 2 * kv
        if self.attention_out_bias:
            per_layer += d
        head = 0 if self.tie_word_embeddings else v * d
        return v * d + L * per_layer + d + head

    def to_dict(self) -> dict:
        return asdict(self)


def byte_llama_config(hidden: int, layers: int, max_len: int = 1024, head_dim: int = 64) -> LlamaConfig:
    """A Llama-architecture decoder over the 256 byte values, ``hidden`` wide and ``layers`` deep
    (multi-head attention with ``head_dim`` channels per head, SwiGLU ``≈ 8·hidden/3`` wide, untied head)."""
    require_positive("hidden", hidden, integer=True)
    require_positive("layers", layers, integer=True)
    if hidden % head_dim:
        raise ValueError(f"hidden ({hidden}) must be a multiple of head_dim ({head_dim})")
    heads = hidden // head_dim
    ffn = -(-8 * hidden // 3 // 64) * 64
    return LlamaConfig(vocab_size=256, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                       num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
                       max_position_embeddings=max_len, tie_word_embeddings=False, bos_token_id=None,
                       eos_token_id=None, pad_token_id=None, name=f"byte-llama-{hidden}x{layers}")

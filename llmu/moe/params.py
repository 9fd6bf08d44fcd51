"""Parameters and FLOPs per token of a decoder with dense or Mixture-of-Experts feed-forwards.

An MoE model stores every expert but runs only ``k`` of them per token, so two counts matter:

- **total** parameters: what the weights take in memory (and what a GPU must hold or stream);
- **active** parameters: the ones a single token's forward pass multiplies with.

Per decoder layer, with hidden size ``H``, ``n_q`` query heads and ``n_kv`` key/value heads of
size ``d``, SwiGLU experts of width ``F``, ``E`` routed experts of which ``k`` are chosen, and
``S`` shared experts (always on) of width ``F_s``::

    attention  H*(n_q*d) + 2*H*(n_kv*d) + (n_q*d)*H     (q, k, v, o; GQA shrinks k and v)
    norms      2*H                                      (RMSNorm gains before attention and FFN)
    router     E*H                                      (only when E > 1)
    experts    E * 3*H*F      total,   k * 3*H*F  active
    shared     S * 3*H*F_s    total and active

plus the embedding ``V*H``, the final norm ``H`` and, when not tied to the embedding, the LM head
``V*H``. A dense model is ``E = k = 1`` with no router.

FLOPs per token: every active weight of a matmul does one multiply and one add, so a forward pass
costs about ``2 * (active parameters that multiply)``; the embedding is a table lookup, not a
matmul, so it is left out (a tied head still multiplies with the same matrix and counts once, as
the head). Attention adds what no parameter counts: a token that attends to ``c`` earlier
positions does ``q . k`` and ``p . v`` for each, ``2 * 2 * n_q * d * c`` FLOPs per layer.
Element-wise work (norms, softmax, SiLU) is a rounding error next to these and is left out; only
the norms' gains, being parameters, fall inside ``2 * active`` (``2H`` FLOPs per norm: negligible).

Presets, each checked against its published config (``config.json`` of the checkpoint) and the
figures its authors state:

- ``MIXTRAL_8X7B``: 46.7B total, 12.9B active (Mistral AI, "Mixtral of experts", 2024);
- ``MISTRAL_7B``: 7.24B, dense (Mistral AI's model card);
- ``QWEN15_MOE_A27B``: 60 fine-grained experts, top-4, plus a shared expert with a sigmoid gate;
  14.3B total, 2.7B active (Qwen team, "Qwen1.5-MoE", 2024);
- ``SMOLLM2_135M``: the course's model, dense, tied embeddings (134.5M).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["DecoderShape", "ParamCount", "count_parameters", "flops_per_token", "from_llama_config",
           "with_experts", "MIXTRAL_8X7B", "MISTRAL_7B", "QWEN15_MOE_A27B", "SMOLLM2_135M", "PRESETS"]


@dataclass(frozen=True)
class DecoderShape:
    """The shape of a Llama-family decoder whose feed-forward may be a Mixture-of-Experts.

    Field names follow Hugging Face configs. ``intermediate_size`` is the width of the dense
    SwiGLU MLP, and of each routed expert unless ``moe_intermediate_size`` says otherwise.
    ``num_experts`` = 1 with ``num_experts_per_tok`` = 1 is a dense model (no router).
    ``num_shared_experts`` experts of width ``shared_intermediate_size`` (default:
    ``moe_intermediate_size``) run on every token; ``shared_expert_gate`` adds Qwen-MoE's
    ``Linear(H, 1)`` that scales their output. ``attention_bias``: q, k, v projections with biases.
    """

    name: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    head_dim: int | None = None
    tie_word_embeddings: bool = False
    num_experts: int = 1
    num_experts_per_tok: int = 1
    moe_intermediate_size: int | None = None
    num_shared_experts: int = 0
    shared_intermediate_size: int | None = None
    shared_expert_gate: bool = False
    attention_bias: bool = False

    def __post_init__(self):
        for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "num_key_value_heads", "intermediate_size", "num_experts", "num_experts_per_tok"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{key} must be a positive int, got {value!r}")
        for key in ("head_dim", "moe_intermediate_size", "shared_intermediate_size"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{key} must be a positive int or None, got {value!r}")
        if isinstance(self.num_shared_experts, bool) or not isinstance(self.num_shared_experts, int) \
                or self.num_shared_experts < 0:
            raise ValueError(f"num_shared_experts must be an int >= 0, got {self.num_shared_experts!r}")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be at most "
                             f"num_experts ({self.num_experts})")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError("head_dim must be given when hidden_size is not a multiple of num_attention_heads")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 1

    @property
    def expert_size(self) -> int:
        """Width ``F`` of one routed expert."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def shared_size(self) -> int:
        return self.shared_intermediate_size or self.expert_size


@dataclass(frozen=True)
class ParamCount:
    """Parameter counts of a :class:`DecoderShape`. ``parts`` maps each part (``embedding``,
    ``attention``, ``norms``, ``router``, ``experts``, ``shared_experts``, ``lm_head``) to
    ``(total, active)``, summed over the layers."""

    total: int
    active: int
    parts: dict

    @property
    def active_fraction(self) -> float:
        return self.active / self.total


def count_parameters(shape: DecoderShape) -> ParamCount:
    """Total and active (per token) parameters of ``shape``; see the module docstring for the sums."""
    if not isinstance(shape, DecoderShape):
        raise TypeError(f"shape must be a DecoderShape, got {type(shape).__name__}")
    h, layers, v = shape.hidden_size, shape.num_hidden_layers, shape.vocab_size
    q_dim = shape.num_attention_heads * shape.head_dim
    kv_dim = shape.num_key_value_heads * shape.head_dim
    # Step 1: what every layer has, dense or not
    attention = h * q_dim + 2 * h * kv_dim + q_dim * h
    if shape.attention_bias:
        attention += q_dim + 2 * kv_dim
    norms = 2 * h
    # Step 2: the feed-forward: E experts stored, k of them run; shared experts always run
    mlp = 3 * h * shape.expert_size
    router = shape.num_experts * h if shape.is_moe else 0
    shared = shape.num_shared_experts * 3 * h * shape.shared_size
    if shape.num_shared_experts and shape.shared_expert_gate:
        shared += h
    parts = {
        "embedding": (v * h, v * h),
        "attention": (layers * attention, layers * attention),
        "norms": (layers * norms + h, layers * norms + h),          # + the final norm
        "router": (layers * router, layers * router),
        "experts": (layers * shape.num_experts * mlp, layers * shape.num_experts_per_tok * mlp),
        "shared_experts": (layers * shared, layers * shared),
        "lm_head": (0, 0) if shape.tie_word_embeddings else (v * h, v * h),
    }
    return ParamCount(total=sum(t for t, _ in parts.values()), active=sum(a for _, a in parts.values()),
                      parts=parts)


def flops_per_token(shape: DecoderShape, context: int = 0) -> dict:
    """Forward FLOPs of one token that attends to ``context`` positions (itself included).

    Returns ``{"matmul": 2 * active matmul weights, "attention": 4 * layers * n_q * d * context,
    "total": their sum, "dense_equivalent": the matmul FLOPs if all E experts ran}``; the last one
    is what the same stored parameters would cost as a dense model (``E`` experts run on every
    token), the comparison that makes MoE worth it. Training costs about 3x the forward
    (the backward does two matmuls per forward matmul).
    """
    if isinstance(context, bool) or not isinstance(context, int) or context < 0:
        raise ValueError(f"context must be an int >= 0, got {context!r}")
    counts = count_parameters(shape)
    # The embedding is a lookup: no multiply. The head multiplies with a (V, H) matrix: its own, or
    # (tied) the embedding's, which count_parameters counted once, as the embedding.
    not_multiplied = counts.parts["embedding"][0] - (shape.vocab_size * shape.hidden_size
                                                     if shape.tie_word_embeddings else 0)
    matmul = 2 * (counts.active - not_multiplied)
    all_experts = 2 * (counts.total - not_multiplied)
    attention = 4 * shape.num_hidden_layers * shape.num_attention_heads * shape.head_dim * context
    return {"matmul": matmul, "attention": attention, "total": matmul + attention, "dense_equivalent": all_experts}


def from_llama_config(config, name: str | None = None) -> DecoderShape:
    """The :class:`DecoderShape` of an ``llmu.models.LlamaConfig`` (a dense model)."""
    return DecoderShape(
        name=name or config.name, vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        intermediate_size=config.intermediate_size, tie_word_embeddings=config.tie_word_embeddings,
        attention_bias=config.attention_bias,
    )


def with_experts(shape: DecoderShape, num_experts: int, k: int, expert_size: int | None = None,
                 name: str | None = None) -> DecoderShape:
    """``shape`` with every feed-forward replaced by ``num_experts`` experts, ``k`` per token, each
    of width ``expert_size`` (default: the dense MLP's width, as Mixtral did with Mistral-7B)."""
    return replace(shape, name=name or f"{shape.name} ({num_experts} experts, top-{k})", num_experts=num_experts,
                   num_experts_per_tok=k, moe_intermediate_size=expert_size or shape.expert_size)


#: Mixtral-8x7B-v0.1's config.json: each MLP of Mistral-7B becomes 8 experts, top-2.
MIXTRAL_8X7B = DecoderShape(
    name="Mixtral-8x7B", vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
    num_experts=8, num_experts_per_tok=2,
)

#: Mistral-7B-v0.1's config.json (dense).
MISTRAL_7B = DecoderShape(
    name="Mistral-7B", vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, intermediate_size=14336, tie_word_embeddings=False,
)

#: Qwen1.5-MoE-A2.7B's config.json: 60 routed experts of width 1408, top-4 (not renormalised),
#: plus one shared expert of width 5632 behind a sigmoid gate; multi-head attention with q/k/v biases.
QWEN15_MOE_A27B = DecoderShape(
    name="Qwen1.5-MoE-A2.7B", vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=16,
    num_key_value_heads=16, intermediate_size=5632, tie_word_embeddings=False, num_experts=60,
    num_experts_per_tok=4, moe_intermediate_size=1408, num_shared_experts=1, shared_intermediate_size=5632,
    shared_expert_gate=True, attention_bias=True,
)

#: SmolLM2-135M (the course's model): dense, GQA 9/3, tied embeddings.
SMOLLM2_135M = DecoderShape(
    name="SmolLM2-135M", vocab_size=49152, hidden_size=576, num_hidden_layers=30, num_attention_heads=9,
    num_key_value_heads=3, intermediate_size=1536, tie_word_embeddings=True,
)

PRESETS = {s.name: s for s in (MIXTRAL_8X7B, MISTRAL_7B, QWEN15_MOE_A27B, SMOLLM2_135M)}

"""A small Mixture-of-Experts language model that trains on a CPU in seconds, to watch the router.

What module 12 trains: a byte-level decoder (the vocabulary is the 256 byte values, so no
tokenizer is involved) with a few pre-norm blocks whose feed-forward is an
:class:`~llmu.moe.layer.MoEFeedForward`::

    x = embed[bytes]                                        (B, T, d)
    for each block:
        x = x + attention(rms_norm(x))                      causal, RoPE on q and k
        x = x + moe(rms_norm(x))                            router -> top-k of E SwiGLU experts
    logits = rms_norm(x) @ embed^T                          tied input and output embeddings

:func:`train` runs AdamW on random windows of one of the texts shipped in ``llmu.data`` and
records, at every step, the language-model loss and each layer's **expert load**: the fraction of
the step's ``T * k`` token copies that each expert received (before any capacity drop, so it is
the router's demand; each row sums to 1). The loss it minimises is

.. math::

    L = L_{\\text{LM}} + \\sum_{\\text{layers}} \\big(\\alpha\\, E \\textstyle\\sum_i f_i P_i
        + \\beta\\, \\overline{(\\operatorname{logsumexp} z)^2}\\big),

with ``aux_weight`` = :math:`\\alpha` (Switch Transformer's load-balancing loss) and
``z_weight`` = :math:`\\beta` (ST-MoE's router z-loss). ``balancer`` balances without a loss
term instead (``llmu.moe.balance``: a per-expert bias that only the top-k choice sees, moved
after every step against its expert's load). With ``aux_weight=0`` nothing pushes the
router towards balance, and the experts that happen to win early get more tokens, learn more and
win more: the load drifts towards a few experts (how far depends on the scale and the number of
steps; the notebook measures it). With ``aux_weight=0.01`` the load stays near ``1/E``.

The parts come from llmu where they are differentiable: ``rms_norm``, ``rope_angles`` and
``apply_rope`` of ``llmu.layers.reference`` and the MoE layer itself. ``llmu.models`` holds
inference-only weights (``requires_grad=False``), so the attention here is a small trainable
module around ``torch.nn.functional.scaled_dot_product_attention`` (module 02's causal softmax
attention, as PyTorch ships it).

Everything is seeded: the same arguments on the same machine and thread count give the same run.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from llmu.checks import require_positive
from llmu.layers.reference import apply_rope, rms_norm, rope_angles
from llmu.moe.layer import MoEFeedForward
from llmu.moe.reference import load_balancing_loss

__all__ = ["TinyMoEConfig", "TinyMoELM", "TrainResult", "train", "load_stats"]


@dataclass
class TinyMoEConfig:
    """Shape of :class:`TinyMoELM`. ``vocab_size`` 256: one token per byte of UTF-8 text."""

    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate: int = 64
    num_experts: int = 8
    k: int = 2
    renormalize: bool = True
    capacity_factor: float | None = None
    rope_base: float = 10000.0
    max_len: int = 256

    def __post_init__(self):
        for key in ("vocab_size", "hidden", "num_layers", "num_heads", "intermediate", "num_experts", "k", "max_len"):
            require_positive(key, getattr(self, key), integer=True)
        if self.hidden % self.num_heads or (self.hidden // self.num_heads) % 2:
            raise ValueError(f"hidden ({self.hidden}) must split into num_heads ({self.num_heads}) heads "
                             "of even size (RoPE rotates pairs)")
        if self.k > self.num_experts:
            raise ValueError(f"k must be at most num_experts ({self.num_experts}), got {self.k}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.num_heads


class CausalSelfAttention(nn.Module):
    """Multi-head causal attention with RoPE, trainable (``nn.Linear`` projections, no bias)."""

    def __init__(self, config: TinyMoEConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden, bias=False)
        self.out = nn.Linear(config.hidden, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        # (B, T, 3d) -> three (B, heads, T, head_dim)
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """Pre-norm decoder block: ``x + attn(norm(x))``, then ``x + moe(norm(x))``."""

    def __init__(self, config: TinyMoEConfig):
        super().__init__()
        self.attn_norm = nn.Parameter(torch.ones(config.hidden))
        self.attn = CausalSelfAttention(config)
        self.moe_norm = nn.Parameter(torch.ones(config.hidden))
        self.moe = MoEFeedForward(config.hidden, config.intermediate, config.num_experts, config.k,
                                  renormalize=config.renormalize, capacity_factor=config.capacity_factor,
                                  impl="torch")

    def forward(self, x, cos, sin):
        x = x + self.attn(rms_norm(x, self.attn_norm), cos, sin)
        return x + self.moe(rms_norm(x, self.moe_norm))


class TinyMoELM(nn.Module):
    """A byte-level MoE decoder (see the module docstring). ``forward(ids)`` -> logits ``(B, T, V)``;
    after a forward, ``self.aux()`` lists each block's :class:`~llmu.moe.reference.MoEAux`."""

    def __init__(self, config: TinyMoEConfig | None = None):
        super().__init__()
        self.config = config = config or TinyMoEConfig()
        self.embed = nn.Embedding(config.vocab_size, config.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.final_norm = nn.Parameter(torch.ones(config.hidden))
        cos, sin = rope_angles(torch.arange(config.max_len), config.head_dim, config.rope_base)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.ndim != 2:
            raise ValueError(f"ids must be (B, T), got shape {tuple(ids.shape)}")
        t = ids.shape[1]
        if t > self.config.max_len:
            raise ValueError(f"ids has {t} positions, more than max_len={self.config.max_len}")
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        return rms_norm(x, self.final_norm) @ self.embed.weight.T   # tied head

    def aux(self):
        """The routing decisions of the last forward, one ``MoEAux`` per block."""
        return [block.moe.last_aux for block in self.blocks]


@dataclass
class TrainResult:
    """What :func:`train` measured.

    ``loss`` ``(steps,)``: the language-model cross-entropy (nats per byte) of each step's batch,
    without the auxiliary terms; ``aux_loss`` and ``z_loss`` ``(steps,)``: the unweighted
    load-balancing loss (``E * sum f_i P_i``, 1 at perfect balance) and router z-loss, averaged
    over the layers; ``load`` ``(steps, layers, E)``: each expert's share of the step's token copies
    (rows sum to 1); ``seconds``: wall-clock time of the loop; ``config`` and ``settings``: what
    was trained, and how; ``model``: the trained model.
    """

    loss: torch.Tensor
    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    load: torch.Tensor
    seconds: float
    config: dict
    settings: dict
    model: TinyMoELM

    def final_load(self, last: int = 10) -> torch.Tensor:
        """``(layers, E)``: the load averaged over the last ``last`` steps (one step is noisy)."""
        return self.load[-last:].mean(dim=0)


def load_stats(load: torch.Tensor) -> dict:
    """Summaries of expert loads ``(..., E)`` (rows summing to 1), over the last dimension.

    ``max_share``: the busiest expert's share (``1/E`` at perfect balance; at most ``1/k`` with
    top-``k`` routing, since a token's ``k`` copies go to ``k`` different experts); ``cv``: the
    coefficient of variation, std / mean of the shares (population std; 0 at balance,
    ``sqrt(E/k - 1)`` when ``k`` experts take everything); ``idle``: experts with less than a
    tenth of their fair share ``1/E``.
    """
    if not isinstance(load, torch.Tensor) or load.ndim < 1 or load.shape[-1] < 1:
        raise ValueError("load must be a tensor (..., E)")
    num_experts = load.shape[-1]
    mean = load.mean(dim=-1)
    return {
        "max_share": load.max(dim=-1).values,
        "cv": load.std(dim=-1, correction=0) / mean,
        "idle": (load < 0.1 / num_experts).sum(dim=-1),
    }


def _batches(tokens: torch.Tensor, batch_size: int, seq_len: int, steps: int, generator: torch.Generator):
    """``steps`` batches of ``batch_size`` random windows of ``seq_len + 1`` tokens (input, target)."""
    starts = torch.randint(0, tokens.numel() - seq_len - 1, (steps, batch_size), generator=generator)
    offsets = torch.arange(seq_len + 1)
    for row in starts:
        window = tokens[row[:, None] + offsets]
        yield window[:, :-1], window[:, 1:]


def train(aux_weight: float = 0.01, z_weight: float = 0.0, *, steps: int = 300, batch_size: int = 16,
          seq_len: int = 64, lr: float = 3e-3, seed: int = 0, text: str = "essays",
          config: TinyMoEConfig | None = None, balancer=None) -> TrainResult:
    """Train a :class:`TinyMoELM` on ``llmu.data.text(text)`` and record loss and expert load per step.

    ``aux_weight``: :math:`\\alpha` of the load-balancing loss (0 switches it off); ``z_weight``:
    :math:`\\beta` of the router z-loss. ``seed`` fixes the initial weights and the batches, so
    runs that differ only in ``aux_weight`` start from the same model and see the same data (the
    caller's global random state is left as it was). The defaults are notebook 12's runs: 300
    steps of 16 windows of 64 bytes, AdamW at ``lr = 3e-3``, a few seconds each on one CPU thread.

    ``balancer``: an object with ``select(layer, logits) -> (weights, experts)``, the top-k rule of
    MoE layer ``layer`` (``logits`` ``(T, E)``; weights and experts ``(T, k)``), and
    ``update(load)``, called after every optimizer step with the step's loads ``(layers, E)``
    (each row the experts' shares of the token copies, summing to 1);
    ``llmu.moe.balance.BiasBalancer`` is one. Returns a :class:`TrainResult`.
    """
    from llmu.data import byte_tokens, text as load_text

    for name, value in (("aux_weight", aux_weight), ("z_weight", z_weight)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    for name, value in (("steps", steps), ("batch_size", batch_size), ("seq_len", seq_len)):
        require_positive(name, value, integer=True)
    if not (isinstance(lr, (int, float)) and lr > 0):
        raise ValueError(f"lr must be a positive number, got {lr!r}")
    config = config or TinyMoEConfig()
    if balancer is not None and not all(callable(getattr(balancer, m, None)) for m in ("select", "update")):
        raise TypeError(f"balancer must have methods select(layer, logits) and update(load), got {balancer!r}")
    if seq_len > config.max_len:
        raise ValueError(f"seq_len ({seq_len}) must be at most config.max_len ({config.max_len})")
    tokens = byte_tokens(load_text(text))
    if tokens.numel() < seq_len + 2:
        raise ValueError(f"text {text!r} has {tokens.numel()} bytes, too few for windows of seq_len + 1 = {seq_len + 1}")

    with torch.random.fork_rng(devices=[]):                  # the initial weights, from `seed` only
        torch.manual_seed(seed)
        model = TinyMoELM(config)
    if balancer is not None:                                 # each MoE layer chooses through the balancer
        for i, block in enumerate(model.blocks):
            block.moe.select = functools.partial(balancer.select, i)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    data = torch.Generator().manual_seed(seed + 1)           # the batches

    losses, aux_losses, z_losses, loads = [], [], [], []
    copies = batch_size * seq_len * config.k                 # token copies routed per layer and step
    t0 = time.perf_counter()
    for inputs, targets in _batches(tokens, batch_size, seq_len, steps, data):
        logits = model(inputs)
        lm_loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
        aux = model.aux()
        # E * sum_i f_i P_i per layer (alpha = 1 here; aux_weight scales it below)
        balance = torch.stack([load_balancing_loss(a.probs, a.experts, config.num_experts, alpha=1.0) for a in aux])
        z = torch.stack([a.z_loss for a in aux])
        loss = lm_loss + aux_weight * balance.sum() + z_weight * z.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(lm_loss.item())
        aux_losses.append(balance.mean().item())
        z_losses.append(z.mean().item())
        loads.append(torch.stack([a.tokens_per_expert.float() / copies for a in aux]))
        if balancer is not None:
            balancer.update(loads[-1].clone())
    seconds = time.perf_counter() - t0

    settings = dict(aux_weight=aux_weight, z_weight=z_weight, steps=steps, batch_size=batch_size,
                    seq_len=seq_len, lr=lr, seed=seed, text=text,
                    balancer=None if balancer is None else repr(balancer))
    return TrainResult(loss=torch.tensor(losses), aux_loss=torch.tensor(aux_losses), z_loss=torch.tensor(z_losses),
                       load=torch.stack(loads), seconds=seconds, config=asdict(config), settings=settings,
                       model=model)

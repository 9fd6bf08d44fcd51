"""The Mamba block and a tiny Mamba language model, for CPU training and decoding.

One block (Gu & Dao, 2023; ``mamba_ssm/modules/mamba_simple.py``), for an input ``(B, L, H)``::

    x, z   = in_proj(h).chunk(2)                 H -> 2 E   (E = expand * H, no bias)
    x      = silu(causal_depthwise_conv1d(x))    kernel 4, with bias: a short local mix over time
    Δ, B, C = split(x_proj(x))                   E -> dt_rank + 2 N   (input-dependent: selective)
    Δ      = dt_proj(Δ)                           dt_rank -> E; its bias is the scan's delta_bias,
                                                  softplus inside the scan
    y      = selective_scan(x, Δ, A, B, C, D, z)  A = -exp(A_log), gated by silu(z)
    out    = out_proj(y)                          E -> H   (no bias)

**Time-invariant ablation** (``selective=False``): the S4-like SSM the paper compares Mamba with
(its section 4.1.1). ``x_proj`` and ``dt_proj`` are gone; ``Δ`` is one learnt number per channel
(``dt_bias``, through the same softplus), ``B`` and ``C`` are learnt ``N``-vectors shared by every
channel, the same at every step. The convolution, the gate ``z`` and the skip ``D`` stay, so the
only difference from the selective block is that ``Δ``, ``B`` and ``C`` no longer see the token:
the SSM is a fixed convolution kernel, whatever the sequence holds.

``A_log`` starts at ``log(1..N)`` for every channel (the "S4D-real" initialisation: ``A_n = -n``,
decay rates spread over a range of time scales); ``D`` starts at ones; ``dt_proj``'s bias is set so
that ``softplus(bias)`` is log-uniform in ``[dt_min, dt_max]`` (steps between 0.001 and 0.1); the
time-invariant block's ``dt_bias`` starts the same way, its ``B`` at ones and ``C`` at
``N(0, 1 / N)``.

Decoding needs no cache that grows with the sequence: per block a **conv state** (the last
``d_conv`` inputs of the convolution, ``(B, E, d_conv)``) and an **SSM state** (``(B, E, N)``
float32). :meth:`MambaBlock.step` consumes one token and returns the new states;
:meth:`MambaBlock.forward` with ``return_state=True`` returns the states after a prompt, so a
prompt can be prefilled in one parallel pass and continued step by step.

:class:`MambaLM`: embedding, ``n_layers`` blocks each as ``h = h + block(rms_norm(h))``, a final
RMSNorm and a head tied to the embedding (``selective=False``: every block time-invariant). With
``block_class``, the blocks are a class of your own (a learner's block, notebook 13's exercise 6):
each is built with the sizes of the ``MambaBlock`` it replaces and loads that block's initial
weights (``load_from``), so that a model of your blocks starts where llmu's does, seed for seed.
Such a model has ``forward`` only: ``step`` and ``generate`` need ``MambaBlock``'s decode interface.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from llmu.mamba import reference
from llmu.models.llama import RMSNorm

__all__ = ["MambaBlock", "MambaLM", "RMSNorm", "IMPLS"]

#: The scans ``MambaBlock.forward`` can use: the torch ones and the Triton kernel, all differentiable
#: (the kernel's backward is a Triton kernel too; in Triton's interpreter on a CPU, slow).
IMPLS = ("parallel", "sequential", "triton")


def _scan(impl: str):
    if impl == "parallel":
        return reference.selective_scan_parallel
    if impl == "sequential":
        return reference.selective_scan_sequential
    if impl == "triton":
        from llmu.mamba.kernels import selective_scan_triton  # imports triton only when asked

        return selective_scan_triton
    raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")


class MambaBlock(nn.Module):
    """One Mamba mixer (module docstring): ``forward(x)`` for a sequence, ``step`` for decoding."""

    def __init__(self, d_model: int, d_state: int = 16, d_conv: int = 4, expand: int = 2,
                 dt_rank: int | str = "auto", dt_min: float = 0.001, dt_max: float = 0.1,
                 dt_init_floor: float = 1e-4, selective: bool = True):
        super().__init__()
        if not isinstance(selective, bool):
            raise TypeError(f"selective must be a bool, got {type(selective).__name__}")
        self.selective = selective
        self.d_model, self.d_state, self.d_conv = d_model, d_state, d_conv
        self.d_inner = expand * d_model
        self.dt_rank = math.ceil(d_model / 16) if dt_rank == "auto" else int(dt_rank)
        E, N = self.d_inner, d_state

        self.in_proj = nn.Linear(d_model, 2 * E, bias=False)
        self.conv1d = nn.Conv1d(E, E, kernel_size=d_conv, groups=E, padding=d_conv - 1, bias=True)
        if selective:
            self.x_proj = nn.Linear(E, self.dt_rank + 2 * N, bias=False)
            self.dt_proj = nn.Linear(self.dt_rank, E, bias=True)
        self.out_proj = nn.Linear(E, d_model, bias=False)

        # Δ: dt_proj's weight small, its bias the inverse softplus of a log-uniform step
        if selective:
            std = self.dt_rank ** -0.5
            nn.init.uniform_(self.dt_proj.weight, -std, std)
        dt = torch.exp(torch.rand(E) * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
        dt = dt.clamp(min=dt_init_floor)
        dt_bias = dt + torch.log(-torch.expm1(-dt))                      # softplus^-1(dt)
        if selective:
            with torch.no_grad():
                self.dt_proj.bias.copy_(dt_bias)
        else:
            # time-invariant: Δ per channel, B and C one N-vector each, none of them sees the token
            self.dt_bias = nn.Parameter(dt_bias)
            self.B = nn.Parameter(torch.ones(N))
            self.C = nn.Parameter(torch.randn(N) * N ** -0.5)
        # S4D-real: A = -(1, 2, ..., N) for every channel, stored as log so that A stays negative
        self.A_log = nn.Parameter(torch.log(torch.arange(1, N + 1, dtype=torch.float32)).repeat(E, 1))
        self.D = nn.Parameter(torch.ones(E))

    @property
    def delta_bias(self) -> torch.Tensor:
        """``(E,)``: the step's bias, added to Δ before the softplus inside the scan."""
        return self.dt_proj.bias if self.selective else self.dt_bias

    def _ssm_inputs(self, x: torch.Tensor):
        """``x`` ``(..., E)`` after the conv -> ``(Δ, B, C)``: Δ ``(..., E)`` before bias and
        softplus, B and C ``(..., N)``. Time-invariant: Δ is zero (the step is the bias alone) and
        B, C are the learnt vectors, the same for every position."""
        if not self.selective:
            lead = x.shape[:-1]
            return (x.new_zeros(*lead, self.d_inner), self.B.expand(*lead, self.d_state),
                    self.C.expand(*lead, self.d_state))
        dbc = self.x_proj(x)
        dt, B, C = torch.split(dbc, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        return F.linear(dt, self.dt_proj.weight), B, C    # the bias goes to the scan (delta_bias)

    def forward(self, hidden: torch.Tensor, impl: str = "parallel", return_state: bool = False):
        """``hidden`` ``(B, L, H)`` -> ``(B, L, H)``; with ``return_state`` also
        ``(conv_state, ssm_state)`` after the last position, ready for :meth:`step`.

        ``impl``: the scan (:data:`IMPLS`); each one trains (``"triton"`` with its Triton backward)."""
        if hidden.ndim != 3 or hidden.shape[-1] != self.d_model:
            raise ValueError(f"hidden must have shape (B, L, {self.d_model}), got {tuple(hidden.shape)}")
        scan = _scan(impl)
        L = hidden.shape[1]
        xz = self.in_proj(hidden).transpose(1, 2)                    # (B, 2E, L)
        x, z = xz.chunk(2, dim=1)
        x_conv_in = x
        x = F.silu(self.conv1d(x)[..., :L])                          # causal: keep the first L outputs
        dt, B, C = self._ssm_inputs(x.transpose(1, 2))               # (B, L, E), (B, L, N) x 2
        if self.selective:
            B, C = B.transpose(1, 2).contiguous(), C.transpose(1, 2).contiguous()   # (B, N, L)
        else:
            # the scan's time-invariant form: (D, N), one row per channel, the same at every step
            B, C = self.B.expand(self.d_inner, -1), self.C.expand(self.d_inner, -1)
        # negative by construction: the scan need not read A back to check it (a wait for a GPU)
        A = -torch.exp(self.A_log.float())
        y = scan(x, dt.transpose(1, 2).contiguous(), A, B, C, D=self.D.float(), z=z,
                 delta_bias=self.delta_bias.float(), delta_softplus=True,
                 return_last_state=return_state, check_values=False)
        if return_state:
            y, ssm_state = y
        out = self.out_proj(y.transpose(1, 2))
        if not return_state:
            return out
        # the conv state: the last d_conv inputs of the convolution, zeros before the sequence
        conv_state = F.pad(x_conv_in, (max(0, self.d_conv - L), 0))[..., -self.d_conv:]
        return out, (conv_state.contiguous(), ssm_state)

    def allocate_state(self, batch: int, device=None, dtype=None):
        """Zero states for :meth:`step`: conv ``(B, E, d_conv)`` and SSM ``(B, E, N)`` float32."""
        device = device or self.in_proj.weight.device
        dtype = dtype or self.in_proj.weight.dtype
        return (torch.zeros(batch, self.d_inner, self.d_conv, device=device, dtype=dtype),
                torch.zeros(batch, self.d_inner, self.d_state, device=device, dtype=torch.float32))

    def step(self, hidden_t: torch.Tensor, conv_state: torch.Tensor, ssm_state: torch.Tensor):
        """One token: ``hidden_t`` ``(B, H)`` (or ``(B, 1, H)``) -> ``(out_t, conv_state, ssm_state)``.

        The states are returned, new tensors (the inputs are not modified): the memory is the same
        whatever the position, unlike a KV cache."""
        squeeze = hidden_t.ndim == 3
        if squeeze:
            hidden_t = hidden_t[:, 0]
        xz = self.in_proj(hidden_t)                                  # (B, 2E)
        x, z = xz.chunk(2, dim=-1)
        # convolution: shift the window left, append x, dot with each channel's kernel
        conv_state = torch.cat([conv_state[..., 1:], x[..., None].to(conv_state.dtype)], dim=-1)
        x = (conv_state * self.conv1d.weight[:, 0, :]).sum(-1) + self.conv1d.bias
        x = F.silu(x)
        dt, B, C = self._ssm_inputs(x)
        A = -torch.exp(self.A_log.float())  # negative by construction: no check, no wait at every token
        y, ssm_state = reference.selective_state_step(
            ssm_state, x, dt, A, B, C, D=self.D.float(), z_t=z,
            delta_bias=self.delta_bias.float(), delta_softplus=True, check_values=False)
        out = self.out_proj(y)
        return (out[:, None] if squeeze else out), conv_state, ssm_state


class MambaLM(nn.Module):
    """A tiny Mamba language model: embedding, pre-norm residual blocks, final norm, tied head."""

    def __init__(self, vocab_size: int, d_model: int = 64, n_layers: int = 2, d_state: int = 16,
                 d_conv: int = 4, expand: int = 2, selective: bool = True, block_class: type | None = None):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, d_model)
        nn.init.normal_(self.embedding.weight, std=0.02)
        self.blocks = nn.ModuleList(MambaBlock(d_model, d_state, d_conv, expand, selective=selective)
                                    for _ in range(n_layers))
        if block_class is not None:
            self.blocks = nn.ModuleList(_own_block(block_class, block) for block in self.blocks)
        self.norms = nn.ModuleList(RMSNorm(d_model, requires_grad=True) for _ in range(n_layers))
        self.norm_f = RMSNorm(d_model, requires_grad=True)

    @property
    def own_blocks(self) -> bool:
        """True when the blocks are not ``MambaBlock`` (``block_class``): ``forward`` only."""
        return not all(isinstance(block, MambaBlock) for block in self.blocks)

    def head(self, h):
        return h @ self.embedding.weight.t()                          # tied to the embedding

    def forward(self, ids: torch.Tensor, impl: str = "parallel", return_state: bool = False):
        """``ids`` ``(B, L)`` -> logits ``(B, L, V)``; with ``return_state`` also the list of every
        block's ``(conv_state, ssm_state)`` for :meth:`step`."""
        own = self.own_blocks
        if own and (return_state or impl != "parallel"):
            raise ValueError("a MambaLM of blocks of your own class runs forward(ids) only: impl and return_state "
                             "are MambaBlock's")
        h = self.embedding(ids)
        states = []
        for norm, block in zip(self.norms, self.blocks):
            if own:
                h = h + block(norm(h))
                continue
            r = block(norm(h), impl=impl, return_state=return_state)
            if return_state:
                r, st = r
                states.append(st)
            h = h + r
        logits = self.head(self.norm_f(h))
        return (logits, states) if return_state else logits

    def allocate_state(self, batch: int, device=None):
        if self.own_blocks:
            raise ValueError("a MambaLM of blocks of your own class has no decode state: forward(ids) only")
        return [block.allocate_state(batch, device) for block in self.blocks]

    def step(self, ids_t: torch.Tensor, states):
        """One token per sequence: ``ids_t`` ``(B,)`` -> logits ``(B, V)`` and the new states."""
        if self.own_blocks:
            raise ValueError("a MambaLM of blocks of your own class cannot step: forward(ids) only")
        h = self.embedding(ids_t)
        new_states = []
        for norm, block, (conv, ssm) in zip(self.norms, self.blocks, states):
            r, conv, ssm = block.step(norm(h), conv, ssm)
            new_states.append((conv, ssm))
            h = h + r
        return self.head(self.norm_f(h)), new_states

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy continuation: prefill the prompt in one pass, then one :meth:`step` per token."""
        logits, states = self.forward(ids, return_state=True)
        out = [ids]
        nxt = logits[:, -1].argmax(-1)
        for _ in range(max_new_tokens):
            out.append(nxt[:, None])
            logits_t, states = self.step(nxt, states)
            nxt = logits_t.argmax(-1)
        return torch.cat(out, dim=1)


def _own_block(block_class, block: MambaBlock) -> nn.Module:
    """A block of ``block_class`` with the sizes of the library ``block``, holding its weights."""
    if not isinstance(block_class, type):
        raise TypeError(f"block_class must be a class, got {type(block_class).__name__}")
    mine = block_class(block.d_model, d_state=block.d_state, d_conv=block.d_conv,
                       expand=block.d_inner // block.d_model)
    if not isinstance(mine, nn.Module) or not callable(getattr(mine, "load_from", None)):
        raise TypeError(f"block_class must build an nn.Module with a load_from(block) method, got "
                        f"{type(mine).__name__}")
    mine.load_from(block)
    return mine

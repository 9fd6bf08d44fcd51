"""Expert parallelism: the experts of one MoE layer spread over ``W`` processes, tokens sent to them.

An MoE layer with ``E`` experts holds ``E`` times the parameters of one MLP, but each token uses
only ``k`` of them. *Expert parallelism* (GShard, DeepSpeed-MoE, Megablocks) gives each of ``W``
ranks ``E / W`` experts and its own shard of the tokens; the router, small, is replicated. A
token whose chosen expert lives elsewhere travels there and back:

1. **route** locally: ``reference.route`` on this rank's ``T_r`` tokens, as the single-process
   layer does (same softmax, same top-k, same gate weights);
2. **group by destination**: ``kernels.sort_by_expert`` orders the ``T_r * k`` token copies by
   expert, and since rank ``d`` holds experts ``d * E/W ... (d+1) * E/W - 1``, that order also
   groups them by destination rank;
3. **all-to-all of the counts**: every rank tells every other how many rows per expert it is
   about to send (a fixed-size exchange, so that the receivers can size their buffers);
4. **all-to-all of the rows** (``dist.all_to_all_single`` with uneven split sizes): the
   *dispatch*. Rank ``s`` sends ``traffic[s, d]`` rows to rank ``d``;
5. **local experts**: each rank runs its ``E/W`` SwiGLU experts on the rows it received;
6. **all-to-all back**: the *combine* exchange, the same split sizes with the roles swapped, so
   every output row returns to the rank (and the position) its token came from;
7. **gate-weighted sum** of each token's ``k`` rows, in float32, as ``moe_reference`` does.

The exchange is an autograd function whose backward is the reverse exchange (gradients of the
rows travel back the way the rows came), so the layer trains: the expert weights' gradients
stay on the rank that holds them, ``x``'s gradient arrives on ``x``'s rank, and the router's
gradient on each rank covers that rank's tokens (all-reduce it with a SUM, as data parallelism
does: :meth:`ExpertParallelMoE.all_reduce_router_grad`).

The load-balancing and z losses are computed over the **global** batch, as the single process
computes them on the concatenated batch: the per-expert counts and the sums of the router's
probabilities are all-reduced. Their gradient on each rank flows only into that rank's own
router probabilities, so that the per-rank router gradients, summed, are the global gradient.

Not supported: capacity-factor dropping (the layer refuses it). With a capacity, the
single-process layer drops in *global* token order, which a rank cannot decide without the other
ranks' choices first; real systems cap the receive buffer per expert instead, with other drops.

The numbers that decide the cost are the rows exchanged: with balanced routing a rank keeps
``1/W`` of its ``T_r * k`` rows and sends the rest, twice per layer (dispatch and combine),
forward and backward. ``traffic`` (a ``(W, W)`` matrix, sender by receiver) records them.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist
import torch.nn as nn

from llmu.checks import require_positive
from llmu.layers.reference import swiglu
from llmu.moe import reference
from llmu.moe.kernels import sort_by_expert
from llmu.moe.layer import IMPLS, MoEFeedForward

__all__ = ["experts_per_rank", "check_expert_parallel_inputs", "all_to_all", "expert_parallel_moe",
           "ExpertParallelMoE", "demo"]


# ----------------------------------------------------------------------------------------------
# Shapes
# ----------------------------------------------------------------------------------------------


def experts_per_rank(num_experts: int, world_size: int) -> int:
    """``E / W``, refusing an ``E`` that ``W`` ranks cannot share evenly."""
    for name, value in (("num_experts", num_experts), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if num_experts % world_size:
        raise ValueError(f"num_experts={num_experts} is not divisible by world_size={world_size}: "
                         f"every rank must hold the same number of experts")
    return num_experts // world_size


def check_expert_parallel_inputs(x, router_weight, w_gate, w_up, w_down, k, world_size: int) -> tuple[int, int]:
    """Shapes of one rank's call; returns ``(E, E / W)`` or raises naming the argument.

    ``router_weight`` is the full ``(E, H)`` router; ``w_gate``, ``w_up`` ``(E/W, F, H)`` and
    ``w_down`` ``(E/W, H, F)`` are this rank's experts only (``reference.check_moe_inputs``).
    """
    num_experts, _, _ = reference.check_moe_inputs(x, router_weight, w_gate, w_up, w_down, k, world_size=world_size)
    return num_experts, num_experts // world_size


# ----------------------------------------------------------------------------------------------
# The exchange
# ----------------------------------------------------------------------------------------------


def _exchange(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """One ``all_to_all_single``: ``send_splits[d]`` rows of ``rows`` go to rank ``d`` (in rank
    order), ``recv_splits[s]`` rows arrive from rank ``s``, concatenated in rank order."""
    out = rows.new_empty((sum(recv_splits), *rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), output_split_sizes=recv_splits,
                           input_split_sizes=send_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    """The row exchange. Its transpose is the same exchange with the splits swapped: the gradient
    of a received row is sent back to the rank (and the position) the row came from."""

    @staticmethod
    def forward(ctx, rows, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _exchange(rows, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, d_out):
        return _exchange(d_out, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def all_to_all(rows: torch.Tensor, send_splits: list[int], recv_splits: list[int], group=None) -> torch.Tensor:
    """Differentiable all-to-all of rows: ``send_splits[d]`` rows to rank ``d``, ``recv_splits[s]``
    from rank ``s``. Every rank of ``group`` must call it (and, in training, its backward) together."""
    return _AllToAll.apply(rows, list(send_splits), list(recv_splits), group)


def _require_group(group) -> tuple[int, int]:
    """``(world_size, rank)`` in ``group``, or a clear error outside a process group."""
    if not dist.is_initialized():
        raise RuntimeError("expert parallelism needs a process group: run it inside llmu.distributed.launch "
                           "(or after torch.distributed.init_process_group)")
    return dist.get_world_size(group), dist.get_rank(group)


def _global_sum_local_grad(t: torch.Tensor, group) -> torch.Tensor:
    """The sum of ``t`` over the ranks, whose gradient flows into this rank's ``t`` only.

    Every rank computes the same global loss from it; each backward then gives the gradient
    through this rank's own contribution, and summing those over the ranks gives the full one."""
    total = t.detach().clone()
    dist.all_reduce(total, group=group)
    return t + (total - t.detach())


# ----------------------------------------------------------------------------------------------
# The layer, functional
# ----------------------------------------------------------------------------------------------


def _local_experts(x_recv, local_ids, w_gate, w_up, w_down, impl):
    """Each received row through its expert's SwiGLU MLP; rows stay in arrival order."""
    num_local = w_gate.shape[0]
    if impl == "triton":
        from llmu.layers.swiglu import swiglu_fused
        from llmu.moe.kernels import grouped_gemm, permute, unpermute

        # The single-GPU layout of module 12 on the rows that arrived: sort them by local expert,
        # one grouped GEMM per projection, and back to arrival order (a combine with weight 1).
        x_sorted, order, _, offsets = permute(x_recv, local_ids[:, None], num_local)
        h = swiglu_fused(grouped_gemm(x_sorted, w_gate, offsets), grouped_gemm(x_sorted, w_up, offsets))
        out_sorted = grouped_gemm(h, w_down, offsets)
        ones = torch.ones((x_recv.shape[0], 1), dtype=torch.float32, device=x_recv.device)
        return unpermute(out_sorted, order, ones, x_recv.shape[0])
    out = x_recv.new_zeros(x_recv.shape)
    for e in range(num_local):
        rows = torch.nonzero(local_ids == e).squeeze(1)
        # Run every expert, even on no rows: the autograd graph, and so the backward exchange,
        # must have the same shape on every rank or the ranks' collectives would not pair up.
        out = out.index_add(0, rows, swiglu(x_recv[rows], w_gate[e], w_up[e], w_down[e]))
    return out


def expert_parallel_moe(x, router_weight, w_gate, w_up, w_down, k: int, *, renormalize: bool = True,
                        alpha: float = 0.01, impl: str = "torch", group=None):
    """One rank's share of an expert-parallel MoE feed-forward: ``(y, aux, traffic)``.

    Call it on every rank of ``group`` (default: the whole world) at once. ``x``: this rank's
    tokens ``(..., H)`` (ranks may hold different numbers, zero included); ``router_weight``:
    the replicated router ``(E, H)``; ``w_gate``, ``w_up`` ``(E/W, F, H)`` and ``w_down``
    ``(E/W, H, F)``: this rank's experts, ``rank * E/W`` to ``(rank + 1) * E/W - 1``.

    ``y``: ``x``'s shape and dtype, what the single-process ``moe_reference`` gives on these
    tokens. ``aux``: a ``reference.MoEAux`` whose per-token fields (``logits``, ``probs``,
    ``experts``, ``weights``, ``dropped``: all False) are this rank's tokens, while
    ``tokens_per_expert``, ``lb_loss`` and ``z_loss`` cover the **global** batch (identical on
    every rank). ``traffic``: ``(W, W)`` int64, ``traffic[s, d]`` = token copies rank ``s`` sent
    to rank ``d`` (the diagonal stays home). ``impl``: ``"torch"`` (a loop over the local
    experts) or ``"triton"`` (``kernels.permute`` + ``grouped_gemm`` + ``unpermute``).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    world, rank = _require_group(group)
    num_experts, num_local = check_expert_parallel_inputs(x, router_weight, w_gate, w_up, w_down, k, world)
    x2 = x.reshape(-1, x.shape[-1])
    num_tokens = x2.shape[0]

    # Step 1: route this rank's tokens, exactly as the single-process layer does
    aux = reference.route(x2, router_weight, k, renormalize=renormalize, alpha=alpha)

    # Step 2: the token copies sorted by expert, hence grouped by destination rank
    order, counts, _ = sort_by_expert(aux.experts, num_experts)
    send_per_rank = counts.view(world, num_local).sum(1)
    send_splits = send_per_rank.tolist()

    # Step 3: tell every rank how many rows per expert it gets from us; learn what we get
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)          # equal splits: E/W each
    recv_counts = recv_counts.view(world, num_local)                 # [source rank, local expert]
    recv_splits = recv_counts.sum(1).tolist()

    # Step 4: dispatch. Rows from source s arrive in s's order: by expert, token order inside
    x_recv = all_to_all(x2[order // k], send_splits, recv_splits, group)
    local_ids = torch.repeat_interleave(torch.arange(num_local, device=x.device).repeat(world),
                                        recv_counts.reshape(-1))

    # Step 5: the local experts
    out_recv = _local_experts(x_recv, local_ids, w_gate, w_up, w_down, impl)

    # Step 6: combine exchange, the reverse trip: row i comes back where x2[order[i] // k] left
    out_back = all_to_all(out_recv, recv_splits, send_splits, group)

    # Step 7: y_t = sum_j g_tj * out(t, j), in float32 (float64 stays float64), expert order
    tok, slot = order // k, order % k
    wide = torch.promote_types(x.dtype, torch.float32)
    gated = out_back.to(wide) * aux.weights[tok, slot, None].to(wide)
    y = torch.zeros((num_tokens, x2.shape[1]), dtype=wide, device=x.device).index_add(0, tok, gated)

    # The global statistics: token counts and the traffic matrix (one int all-reduce), the
    # router's probability sums and squared log-partitions (one float all-reduce)
    int_stats = torch.zeros(1 + num_experts + world * world, dtype=torch.int64, device=x.device)
    int_stats[0] = num_tokens
    int_stats[1:1 + num_experts] = counts
    int_stats[1 + num_experts + rank * world: 1 + num_experts + (rank + 1) * world] = send_per_rank
    dist.all_reduce(int_stats, group=group)
    global_tokens = int(int_stats[0])
    tokens_per_expert = int_stats[1:1 + num_experts]
    traffic = int_stats[1 + num_experts:].view(world, world).cpu()

    lse = torch.logsumexp(aux.logits, dim=-1)
    sums = _global_sum_local_grad(torch.cat([aux.probs.sum(0), lse.pow(2).sum()[None]]), group)
    if global_tokens:
        frac_tokens = tokens_per_expert.to(sums.dtype) / (global_tokens * k)      # f_i
        frac_probs = sums[:num_experts] / global_tokens                           # P_i
        lb_loss = alpha * num_experts * (frac_tokens * frac_probs).sum()
        z_loss = sums[num_experts] / global_tokens
    else:  # no tokens anywhere: nothing to balance, as in the single-process layer
        lb_loss = z_loss = sums.sum() * 0.0
    aux = dataclasses.replace(aux, tokens_per_expert=tokens_per_expert, lb_loss=lb_loss, z_loss=z_loss)
    return y.to(x.dtype).view(x.shape), aux, traffic


# ----------------------------------------------------------------------------------------------
# The layer, as a module
# ----------------------------------------------------------------------------------------------


class ExpertParallelMoE(nn.Module):
    """This rank's part of an expert-parallel MoE SwiGLU feed-forward.

    Holds the full router (``nn.Linear(hidden, num_experts)``, replicated: rank 0's initial
    weights are broadcast) and experts ``first_expert`` to ``first_expert + E/W - 1`` as
    ``w_gate``, ``w_up`` ``(E/W, F, H)`` and ``w_down`` ``(E/W, H, F)``. Build it on every rank
    of ``group`` at once (after ``init_process_group``), or from a full single-process layer with
    :meth:`from_moe`. ``forward(x)`` runs :func:`expert_parallel_moe` on this rank's tokens and
    keeps ``last_aux`` (a ``MoEAux``, losses over the global batch) and ``last_traffic`` (the
    ``(W, W)`` matrix of rows sent).

    Training: every rank calls ``backward`` through its ``y`` (the backward exchanges are
    collectives); then :meth:`all_reduce_router_grad` sums the router's gradient over the ranks.
    The expert weights' gradients need no communication: each rank holds the only copy.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, k: int, renormalize: bool = True, *,
                 impl: str | None = None, group=None, dtype=None, device=None):
        super().__init__()
        require_positive("hidden", hidden, integer=True)
        require_positive("intermediate", intermediate, integer=True)
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= num_experts:
            raise ValueError(f"k must be an int with 1 <= k <= E (the number of experts); got k={k!r}, E={num_experts}")
        if impl is not None and impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS} or None, got {impl!r}")
        world, rank = _require_group(group)
        num_local = experts_per_rank(num_experts, world)
        kw = dict(dtype=dtype, device=device)
        self.hidden, self.intermediate, self.num_experts, self.k = hidden, intermediate, num_experts, k
        self.renormalize, self.impl, self.group = renormalize, impl, group
        self.world_size, self.rank, self.first_expert = world, rank, rank * num_local
        self.router = nn.Linear(hidden, num_experts, bias=False, **kw)
        self.w_gate = nn.Parameter(torch.empty(num_local, intermediate, hidden, **kw))
        self.w_up = nn.Parameter(torch.empty(num_local, intermediate, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(num_local, hidden, intermediate, **kw))
        self.last_aux: reference.MoEAux | None = None
        self.last_traffic: torch.Tensor | None = None
        self.reset_parameters()

    @property
    def num_local_experts(self) -> int:
        return self.w_gate.shape[0]

    def reset_parameters(self) -> None:
        """``MoEFeedForward``'s initialisation; the router is then broadcast from rank 0 (a collective)."""
        self.router.reset_parameters()
        for w in (self.w_gate, self.w_up, self.w_down):
            nn.init.uniform_(w, -1.0 / math.sqrt(w.shape[-1]), 1.0 / math.sqrt(w.shape[-1]))
        src = 0 if self.group is None else dist.get_global_rank(self.group, 0)
        with torch.no_grad():
            dist.broadcast(self.router.weight, src=src, group=self.group)

    @classmethod
    def from_moe(cls, moe: MoEFeedForward, *, impl: str | None = None, group=None) -> "ExpertParallelMoE":
        """This rank's part of a single-process ``MoEFeedForward``: its router and its slice of
        experts (copies). ``moe`` must be the same on every rank (built from the same seed)."""
        if not isinstance(moe, MoEFeedForward):
            raise TypeError(f"moe must be an llmu.moe.layer.MoEFeedForward, got {type(moe).__name__}")
        if moe.capacity_factor is not None:
            raise ValueError(f"moe.capacity_factor must be None: the expert-parallel layer drops nothing, "
                             f"got capacity_factor={moe.capacity_factor!r}")
        w_gate, w_up = moe.gate_up()       # views of w_gate_up when the layer holds them fused
        layer = cls(moe.hidden, moe.intermediate, moe.num_experts, moe.k, moe.renormalize, impl=impl, group=group,
                    dtype=w_gate.dtype, device=w_gate.device)
        mine = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
        with torch.no_grad():
            layer.router.weight.copy_(moe.router.weight)
            for name, full in (("w_gate", w_gate), ("w_up", w_up), ("w_down", moe.w_down)):
                getattr(layer, name).copy_(full[mine])
        return layer

    def resolved_impl(self, x: torch.Tensor) -> str:
        """The local experts' path: ``impl``, or Triton when kernels compile and ``x`` is on the GPU."""
        if self.impl is not None:
            return self.impl
        from llmu import runtime

        return "triton" if (not runtime.interpreting() and x.is_cuda) else "torch"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, aux, traffic = expert_parallel_moe(x, self.router.weight, self.w_gate, self.w_up, self.w_down, self.k,
                                              renormalize=self.renormalize, impl=self.resolved_impl(x),
                                              group=self.group)
        self.last_aux, self.last_traffic = aux, traffic
        return y

    def all_reduce_router_grad(self) -> None:
        """Sum the router's gradient over the ranks (each rank's covers its own tokens only)."""
        if self.router.weight.grad is not None:
            dist.all_reduce(self.router.weight.grad, group=self.group)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts}, "
                f"k={self.k}, renormalize={self.renormalize}, experts {self.first_expert}.."
                f"{self.first_expert + self.num_local_experts - 1} of {self.num_experts} on rank {self.rank}, "
                f"impl={self.impl}")


# ----------------------------------------------------------------------------------------------
# For the notebook
# ----------------------------------------------------------------------------------------------


def demo(rank: int, world_size: int, tokens_per_rank: int = 32, hidden: int = 64, intermediate: int = 128,
         num_experts: int = 8, k: int = 2, seed: int = 0) -> dict:
    """One expert-parallel forward and backward, checked against the single-process layer.

    Run it with ``llmu.distributed.launch(demo, 2)``. Every rank builds the same
    ``MoEFeedForward`` and the same global batch from ``seed``, keeps its shard of
    ``tokens_per_rank`` tokens and its slice of experts, and runs both layers: the expert-parallel
    one on its shard, the single-process one on the whole batch. Returns a dict: ``traffic``
    (``(W, W)``, rows sent from rank ``s`` to rank ``d``), ``tokens_per_expert`` (global), and the
    largest absolute differences ``y``, ``dx``, ``d_experts`` (this rank's experts),
    ``d_router`` (after the all-reduce), ``lb_loss`` and ``z_loss``.
    """
    torch.manual_seed(seed)
    moe = MoEFeedForward(hidden, intermediate, num_experts, k, impl="torch")
    x_all = torch.randn(world_size * tokens_per_rank, hidden, generator=torch.Generator().manual_seed(seed + 1))
    dy_all = torch.randn(x_all.shape, generator=torch.Generator().manual_seed(seed + 2))
    mine = slice(rank * tokens_per_rank, (rank + 1) * tokens_per_rank)

    # The single-process layer on the global batch: loss = <y, dy> + the two aux losses
    x_ref = x_all.clone().requires_grad_()
    y_ref = moe(x_ref)
    ((y_ref * dy_all).sum() + moe.last_aux.lb_loss + moe.last_aux.z_loss).backward()

    # The expert-parallel layer on this rank's shard; every rank adds the (global) aux losses once
    layer = ExpertParallelMoE.from_moe(moe)
    x = x_all[mine].clone().requires_grad_()
    y = layer(x)
    ((y * dy_all[mine]).sum() + layer.last_aux.lb_loss + layer.last_aux.z_loss).backward()
    layer.all_reduce_router_grad()

    experts = slice(layer.first_expert, layer.first_expert + layer.num_local_experts)
    d_experts = max((getattr(layer, n).grad - getattr(moe, n).grad[experts]).abs().max().item()
                    for n in ("w_gate", "w_up", "w_down"))
    return {
        "traffic": layer.last_traffic,
        "tokens_per_expert": layer.last_aux.tokens_per_expert.cpu(),
        "y": (y - y_ref[mine]).abs().max().item(),
        "dx": (x.grad - x_ref.grad[mine]).abs().max().item(),
        "d_experts": d_experts,
        "d_router": (layer.router.weight.grad - moe.router.weight.grad).abs().max().item(),
        "lb_loss": abs(layer.last_aux.lb_loss.item() - moe.last_aux.lb_loss.item()),
        "z_loss": abs(layer.last_aux.z_loss.item() - moe.last_aux.z_loss.item()),
    }

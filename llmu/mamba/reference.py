"""Selective state spaces (Mamba) in PyTorch: discretisation, three scans, and the decode step.

A state space model maps an input sequence ``u_t`` to an output ``y_t`` through a hidden state
``x_t`` of ``N`` numbers per channel. In continuous time, for one channel::

    x'(s) = A x(s) + B u(s)          y(s) = C x(s)

with ``A`` diagonal (``N`` real numbers, negative so the state decays). Sampled with a step ``Δ``
it becomes a linear recurrence, one per channel ``d`` and state index ``n``::

    x_t = Ā_t x_{t-1} + B̄_t u_t         y_t = Σ_n C_t[n] x_t[n]

Mamba makes the SSM *selective*: ``Δ``, ``B`` and ``C`` depend on the input (one value per time
step, computed from ``u``), so the model chooses, token by token, what to write into its state and
what to forget. The price: the recurrence is no longer a convolution with a fixed kernel, so it has
to be computed as a **scan**.

Shapes and semantics follow ``selective_scan_ref`` published with the Mamba paper
(``mamba_ssm/ops/selective_scan_interface.py``):

- ``u`` ``(B, D, L)``: the input, batch ``B``, ``D`` channels, ``L`` time steps;
- ``delta`` ``(B, D, L)``: the step ``Δ`` (before ``delta_bias`` and softplus);
- ``A`` ``(D, N)``: real, ``<= 0`` (Mamba's ``A = -exp(A_log)`` is negative). The scans refuse
  a positive entry: the state would grow by ``exp(Δ A) > 1`` every step and overflow. ``A = 0``
  is allowed: a state that never forgets (``Ā = 1``, a running sum), the limit the exact
  zero-order hold (:func:`zoh_discretize`) handles too. The discretisation formulas themselves
  take any real ``A``: one step is well defined whatever its sign;
- ``B``, ``C``: ``(D, N)`` (time-invariant, an S4-like SSM), ``(B, N, L)`` (input-dependent, one
  vector per time step shared by all channels: Mamba), or ``(B, G, N, L)`` (``G`` groups of
  ``D / G`` consecutive channels, each group with its own vector);
- ``D`` ``(D,)`` optional skip connection, ``z`` ``(B, D, L)`` optional gate, ``delta_bias``
  ``(D,)`` optional, ``delta_softplus``: apply ``softplus`` to ``Δ + delta_bias``.

Then::

    Δ        = softplus(delta + delta_bias)               (or without softplus)
    Ā        = exp(Δ A)                                   (B, D, L, N)   zero-order hold for A
    B̄ u      = Δ B u                                      (B, D, L, N)   Euler-like, as the reference
    x_t      = Ā_t * x_{t-1} + (B̄ u)_t,   x_{-1} = 0
    y_t      = Σ_n x_t[n] C_t[n]
    out      = (y + D u) * silu(z)

The exact zero-order hold for ``B`` is ``B̄ = (exp(Δ A) - 1) / A · B`` (:func:`zoh_discretize`);
for small ``Δ A`` it is ``Δ B (1 + Δ A / 2 + ...)``, so ``Δ B`` is its first-order term. The
reference (and every Mamba checkpoint, which was trained with it) uses ``Δ B``; so do the scans here.

Everything is computed in float32; the output has ``u``'s dtype; the last state is float32.

The scans
---------
- :func:`selective_scan_sequential`: a Python loop over time, the specification.
- :func:`selective_scan_parallel`: the same recurrence as a parallel prefix scan with the
  operator :func:`combine`: ``ceil(log2 L)`` rounds of tensor operations (Hillis–Steele), or
  ``2 ceil(log2 L)`` rounds of less work (Blelloch). Differentiable: training uses it.
- :func:`selective_state_step`: one step of the recurrence for decoding, constant memory.
- ``llmu.mamba.kernels.selective_scan_triton``: the chunked Triton kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from llmu.checks import require_values

__all__ = [
    "check_scan_inputs",
    "check_A",
    "prepare_delta",
    "discretize",
    "zoh_discretize",
    "combine",
    "selective_scan_sequential",
    "selective_scan_parallel",
    "selective_state_step",
    "METHODS",
]


# ----------------------------------------------------------------------------------------------
# Checks and shapes
# ----------------------------------------------------------------------------------------------


def _is_tensor(name: str, x) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.is_complex():
        raise ValueError(f"{name} must be real, got dtype {x.dtype} (this course's SSMs are real-valued)")
    return x


def _check_bc(name: str, X: torch.Tensor, batch: int, dim: int, L: int, N: int) -> None:
    _is_tensor(name, X)
    if X.ndim == 2:
        if tuple(X.shape) != (dim, N):
            raise ValueError(f"{name} must have shape (D, N) = {(dim, N)} when time-invariant, got {tuple(X.shape)}")
    elif X.ndim == 3:
        if tuple(X.shape) != (batch, N, L):
            raise ValueError(f"{name} must have shape (B, N, L) = {(batch, N, L)}, got {tuple(X.shape)}")
    elif X.ndim == 4:
        g = X.shape[1]
        if X.shape[0] != batch or X.shape[2] != N or X.shape[3] != L:
            raise ValueError(f"{name} must have shape (B, G, N, L) = {(batch, 'G', N, L)}, got {tuple(X.shape)}")
        if g == 0 or dim % g:
            raise ValueError(f"{name} has {g} groups, which must divide the number of channels D = {dim}")
    else:
        raise ValueError(f"{name} must have 2, 3 or 4 dimensions ((D, N), (B, N, L) or (B, G, N, L)), "
                         f"got shape {tuple(X.shape)}")


def check_A(A: torch.Tensor, check_values: bool = True) -> None:
    """``A`` has no positive (or NaN) entry, unless ``check_values`` is False.

    It reads ``A`` back to the host (one small reduction, one wait for a GPU), once per call.
    ``MambaBlock`` passes ``check_values=False``: its ``A = -exp(A_log)`` is negative by construction,
    and its decode loop should not wait for the GPU at every token."""
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool, got {check_values!r}")
    if check_values and A.numel():
        require_values((~(A.amax() <= 0),  # also true for a NaN
                        "A must have no positive or NaN entry (Mamba's A = -exp(A_log) is negative): a positive "
                        "A makes the state grow by exp(delta * A) > 1 every step until it overflows; "
                        "A = 0 (no decay) is allowed"))


def check_scan_inputs(u, delta, A, B, C, D=None, z=None, delta_bias=None, *,
                      check_values: bool = True) -> tuple[int, int, int, int]:
    """Check a scan's inputs; return ``(batch, D, L, N)``.

    Shapes first, then (with ``check_values``) that ``A`` has no positive entry (:func:`check_A`).
    Raises ``ValueError`` (``TypeError`` for a non-tensor) naming the argument at fault."""
    _is_tensor("u", u)
    if u.ndim != 3:
        raise ValueError(f"u must have shape (B, D, L), got {tuple(u.shape)}")
    batch, dim, L = u.shape
    if L == 0 or batch == 0 or dim == 0:
        raise ValueError(f"u must have at least one sequence, channel and time step, got shape {tuple(u.shape)}")
    _is_tensor("delta", delta)
    if delta.shape != u.shape:
        raise ValueError(f"delta must have the shape of u {tuple(u.shape)}, got {tuple(delta.shape)}")
    _is_tensor("A", A)
    if A.ndim != 2 or A.shape[0] != dim or A.shape[1] == 0:
        raise ValueError(f"A must have shape (D, N) with D = {dim} and N >= 1, got {tuple(A.shape)}")
    N = A.shape[1]
    _check_bc("B", B, batch, dim, L, N)
    _check_bc("C", C, batch, dim, L, N)
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and (_is_tensor(name, t).shape != (dim,)):
            raise ValueError(f"{name} must have shape (D,) = ({dim},), got {tuple(t.shape)}")
    if z is not None and _is_tensor("z", z).shape != u.shape:
        raise ValueError(f"z must have the shape of u {tuple(u.shape)}, got {tuple(z.shape)}")
    check_A(A, check_values)
    return batch, dim, L, N


def _per_channel(X: torch.Tensor, dim: int) -> torch.Tensor:
    """``B`` or ``C`` in any of its forms as a float32 tensor broadcastable to ``(B, D, L, N)``."""
    X = X.float()
    if X.ndim == 2:                                    # (D, N): the same at every step
        return X[None, :, None, :]
    if X.ndim == 3:                                    # (B, N, L): shared by all channels
        return X.transpose(1, 2)[:, None]              # (B, 1, L, N)
    per_group = dim // X.shape[1]                      # (B, G, N, L): channel d is in group d // per_group
    return X.repeat_interleave(per_group, dim=1).transpose(2, 3)


def prepare_delta(delta: torch.Tensor, delta_bias=None, delta_softplus: bool = False) -> torch.Tensor:
    """``softplus(delta + delta_bias)`` in float32 (each part only when asked for).

    ``delta`` is ``(B, D, L)`` (a sequence) or ``(B, D)`` (one step); ``delta_bias`` ``(D,)`` has
    one value per channel."""
    delta = delta.float()
    if delta_bias is not None:
        bias = delta_bias.float()
        delta = delta + (bias[:, None] if delta.ndim == 3 else bias)
    if delta_softplus:
        delta = F.softplus(delta)
    return delta


# ----------------------------------------------------------------------------------------------
# Discretisation
# ----------------------------------------------------------------------------------------------


def discretize(delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, u: torch.Tensor):
    """``(Ā, B̄u)`` as the Mamba reference computes them, both ``(B, D, L, N)`` float32.

    ``Ā = exp(Δ A)`` is the exact zero-order hold for ``A``. ``B̄ u = Δ B u`` is the first-order
    (Euler-like) approximation of the zero-order hold ``(exp(Δ A) - 1) / A · B`` (see
    :func:`zoh_discretize`). ``delta`` is the final ``Δ`` (bias and softplus already applied)."""
    delta = delta.float()
    deltaA = torch.exp(delta[..., None] * A.float()[None, :, None, :])
    deltaB_u = (delta * u.float())[..., None] * _per_channel(B, u.shape[1])
    return deltaA, deltaB_u


def zoh_discretize(delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor):
    """The exact zero-order hold: ``(Ā, B̄)`` with ``Ā = exp(Δ A)`` and ``B̄ = (exp(Δ A) - 1) / A · B``.

    Holding ``u`` constant over a step of length ``Δ`` and integrating ``x' = A x + B u`` exactly
    gives ``x(Δ) = exp(Δ A) x(0) + ∫_0^Δ exp(s A) ds · B u``, and the integral is
    ``(exp(Δ A) - 1) / A`` (elementwise, ``A`` diagonal; its limit ``Δ`` where ``A = 0``). As
    ``Δ → 0``, ``B̄ = Δ B (1 + Δ A / 2 + O(Δ² A²))``: the reference's ``Δ B`` is the first-order term.

    ``delta`` ``(B, D, L)`` (the final ``Δ``), ``A`` ``(D, N)``, ``B`` in any of the scan's forms;
    returns two ``(B, D, L, N)`` float32 tensors."""
    delta = delta.float()
    Af = A.float()[None, :, None, :]
    dA = delta[..., None] * Af
    safe_A = torch.where(Af == 0, torch.ones_like(Af), Af)
    integral = torch.where(Af == 0, delta[..., None].expand_as(dA), torch.expm1(dA) / safe_A)
    return torch.exp(dA), integral * _per_channel(B, delta.shape[1])


def _finish(y: torch.Tensor, u: torch.Tensor, D, z) -> torch.Tensor:
    """``(y + D u) * silu(z)`` in float32, returned in ``u``'s dtype."""
    out = y
    if D is not None:
        out = out + u.float() * D.float()[:, None]
    if z is not None:
        out = out * F.silu(z.float())
    return out.to(u.dtype)


# ----------------------------------------------------------------------------------------------
# The sequential scan: the specification
# ----------------------------------------------------------------------------------------------


def selective_scan_sequential(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                              return_last_state=False, *, check_values: bool = True):
    """The selective scan as a loop over time (module docstring for shapes and the math).

    ``x_t = Ā_t * x_{t-1} + (B̄ u)_t``, ``y_t = Σ_n x_t[n] C_t[n]``, then ``(y + D u) * silu(z)``.
    Returns ``out`` ``(B, D, L)`` in ``u``'s dtype, and the last state ``(B, D, N)`` float32 when
    ``return_last_state``. ``check_values=False`` skips the check that ``A <= 0`` (:func:`check_A`)."""
    batch, dim, L, N = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, check_values=check_values)
    delta = prepare_delta(delta, delta_bias, delta_softplus)
    deltaA, deltaB_u = discretize(delta, A, B, u)
    Cc = _per_channel(C, dim).expand(batch, dim, L, N)
    x = u.new_zeros((batch, dim, N), dtype=torch.float32)
    ys = []
    for t in range(L):
        x = deltaA[:, :, t] * x + deltaB_u[:, :, t]     # the recurrence
        ys.append((x * Cc[:, :, t]).sum(-1))           # read the state out
    out = _finish(torch.stack(ys, dim=2), u, D, z)
    return (out, x) if return_last_state else out


# ----------------------------------------------------------------------------------------------
# The parallel scan
# ----------------------------------------------------------------------------------------------


def combine(left, right):
    """The scan operator on pairs: ``(a, b) ∘ (a', b') = (a a', a' b + b')``.

    A pair ``(a, b)`` stands for the affine map ``x ↦ a x + b``: one step of the recurrence is
    ``(Ā_t, (B̄u)_t)``. ``left ∘ right`` is "apply ``left``, then ``right``":
    ``a' (a x + b) + b' = (a a') x + (a' b + b')``. Composition of maps is associative, hence so is
    ``∘`` (it is *not* commutative: order in time matters), and the prefix
    ``e_0 ∘ e_1 ∘ ... ∘ e_t`` applied to ``x_{-1} = 0`` is ``x_t``: its ``b`` component. Any
    bracketing of the prefix gives the same result, which is what lets a parallel scan compute all
    prefixes in ``O(log L)`` rounds. ``left`` and ``right`` are ``(a, b)`` pairs of tensors (or
    numbers) that broadcast together; the identity is ``(1, 0)``."""
    a, b = left
    a2, b2 = right
    return a * a2, a2 * b + b2


def _hillis_steele(a: torch.Tensor, b: torch.Tensor, dim: int):
    """Inclusive scan of ``(a, b)`` pairs with :func:`combine` along ``dim`` (Hillis–Steele).

    Round ``k`` (offset ``s = 2**k``): every position ``t >= s`` combines the running prefix that
    ended at ``t - s`` (covering ``s`` elements) with its own; after ``ceil(log2 L)`` rounds
    position ``t`` holds ``e_0 ∘ ... ∘ e_t``. Positions ``t < s`` are already complete. Works for
    any ``L`` (no padding): each round only looks back. Work is ``O(L log L)`` combines (Blelloch's
    up-and-down sweep does ``O(L)`` in twice the rounds); all of it is out-of-place, so autograd
    differentiates through it."""
    L = a.shape[dim]
    s = 1
    while s < L:
        head_a, head_b = a.narrow(dim, 0, s), b.narrow(dim, 0, s)
        new_a, new_b = combine((a.narrow(dim, 0, L - s), b.narrow(dim, 0, L - s)),
                               (a.narrow(dim, s, L - s), b.narrow(dim, s, L - s)))
        a = torch.cat([head_a, new_a], dim=dim)
        b = torch.cat([head_b, new_b], dim=dim)
        s *= 2
    return a, b


def _blelloch(a: torch.Tensor, b: torch.Tensor, dim: int):
    """Inclusive scan of ``(a, b)`` pairs with :func:`combine` along ``dim`` (Blelloch).

    Pad to ``P = 2**k`` elements with the identity ``(1, 0)``, then two sweeps over a binary tree:

    - **up-sweep** (``k`` rounds): at stride ``s = 2, 4, ..., P`` the last element of every block
      of ``s`` becomes the total of its block: ``x[i] = x[i - s/2] ∘ x[i]``;
    - **down-sweep** (``k`` rounds): set the root to the identity; at stride ``s = P, ..., 2``
      every block's right half-total position receives ``parent ∘ left_total`` and its left one
      the parent's value, ``parent`` being the combination of everything before the block. After
      it, position ``t`` holds the *exclusive* prefix ``e_0 ∘ ... ∘ e_{t-1}``;
    - one more combine with ``e_t`` makes it inclusive.

    ``O(P)`` combines in ``2 log2 P`` rounds (Hillis–Steele: ``O(L log L)`` in ``log2 L``). Order
    matters (``∘`` is not commutative): the parent's prefix is always on the left."""
    L = a.shape[dim]
    P = 1 << max(0, (L - 1).bit_length())
    a0 = a.movedim(dim, 0)
    b0 = b.movedim(dim, 0)
    if P > L:                                                  # pad with the identity (1, 0)
        pad = (P - L,) + a0.shape[1:]
        a0 = torch.cat([a0, a0.new_ones(pad)])
        b0 = torch.cat([b0, b0.new_zeros(pad)])
    xa, xb = a0, b0
    s = 2
    while s <= P:                                              # up-sweep
        right = torch.arange(s - 1, P, s, device=a.device)
        left = right - s // 2
        na, nb = combine((xa[left], xb[left]), (xa[right], xb[right]))
        xa, xb = xa.index_copy(0, right, na), xb.index_copy(0, right, nb)
        s *= 2
    root = torch.tensor([P - 1], device=a.device)              # the root becomes the identity
    xa = xa.index_copy(0, root, xa.new_ones((1,) + xa.shape[1:]))
    xb = xb.index_copy(0, root, xb.new_zeros((1,) + xb.shape[1:]))
    s = P
    while s >= 2:                                              # down-sweep
        right = torch.arange(s - 1, P, s, device=a.device)
        left = right - s // 2
        parent = (xa[right], xb[right])                        # everything before this block
        left_total = (xa[left], xb[left])
        na, nb = combine(parent, left_total)                   # everything before the right half
        xa = xa.index_copy(0, left, parent[0]).index_copy(0, right, na)
        xb = xb.index_copy(0, left, parent[1]).index_copy(0, right, nb)
        s //= 2
    ia, ib = combine((xa, xb), (a0, b0))                       # exclusive -> inclusive
    return ia[:L].movedim(0, dim), ib[:L].movedim(0, dim)


#: The parallel scans :func:`selective_scan_parallel` offers.
METHODS = ("hillis_steele", "blelloch")


def selective_scan_parallel(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                            return_last_state=False, method: str = "hillis_steele", *, check_values: bool = True):
    """The selective scan as a parallel prefix scan: the same arguments and results as
    :func:`selective_scan_sequential`, computed in ``ceil(log2 L)`` rounds of tensor operations
    (``method="hillis_steele"``) or ``2 ceil(log2 L)`` rounds doing less work (``"blelloch"``).

    The elements ``(Ā_t, (B̄u)_t)`` are scanned with :func:`combine` along time; the ``b``
    component of prefix ``t`` is the state ``x_t`` (``x_{-1} = 0``). The products are grouped
    differently from the loop's, so float32 results differ in the last bits (and gradients too).
    ``check_values=False`` skips the check that ``A <= 0`` (:func:`check_A`)."""
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    batch, dim, L, N = check_scan_inputs(u, delta, A, B, C, D, z, delta_bias, check_values=check_values)
    delta = prepare_delta(delta, delta_bias, delta_softplus)
    deltaA, deltaB_u = discretize(delta, A, B, u)               # (B, D, L, N) each
    scan = _hillis_steele if method == "hillis_steele" else _blelloch
    _, x = scan(deltaA, deltaB_u, dim=2)                        # all the states x_t
    y = (x * _per_channel(C, dim)).sum(-1)
    out = _finish(y, u, D, z)
    return (out, x[:, :, -1]) if return_last_state else out


# ----------------------------------------------------------------------------------------------
# One step, for decoding
# ----------------------------------------------------------------------------------------------


def selective_state_step(state, u_t, delta_t, A, B_t, C_t, D=None, z_t=None, delta_bias=None,
                         delta_softplus=False, *, check_values: bool = True):
    """One step of the recurrence: ``(y_t, new_state)``, constant memory whatever the position.

    ``state`` ``(B, D, N)`` (float32, the ``x_{t-1}`` a scan's ``return_last_state`` gives),
    ``u_t``, ``delta_t``, ``z_t`` ``(B, D)``, ``A`` ``(D, N)``, ``B_t`` and ``C_t`` ``(B, N)`` or
    grouped ``(B, G, N)``. A time-invariant ``B`` ``(D, N)`` is the grouped case with ``G = D``:
    pass ``B.expand(batch, D, N)``. Returns ``y_t`` ``(B, D)`` in ``u_t``'s dtype and the new
    float32 state; ``state`` is not modified. ``A`` must be ``<= 0`` (:func:`check_A`;
    ``check_values=False`` skips that check, as a decode loop whose ``A`` is negative by
    construction does)."""
    if not isinstance(state, torch.Tensor) or state.ndim != 3:
        raise ValueError(f"state must be a tensor of shape (B, D, N), got {getattr(state, 'shape', state)}")
    batch, dim, N = state.shape
    for name, t in (("u_t", u_t), ("delta_t", delta_t)) + ((("z_t", z_t),) if z_t is not None else ()):
        if _is_tensor(name, t).shape != (batch, dim):
            raise ValueError(f"{name} must have shape (B, D) = {(batch, dim)}, got {tuple(t.shape)}")
    if _is_tensor("A", A).shape != (dim, N):
        raise ValueError(f"A must have shape (D, N) = {(dim, N)}, got {tuple(A.shape)}")
    per = []
    for name, X in (("B_t", B_t), ("C_t", C_t)):
        _is_tensor(name, X)
        if X.ndim == 2 and tuple(X.shape) == (batch, N):
            per.append(X.float()[:, None, :])                               # (B, 1, N)
        elif X.ndim == 3 and X.shape[0] == batch and X.shape[2] == N and X.shape[1] > 0 and dim % X.shape[1] == 0:
            per.append(X.float().repeat_interleave(dim // X.shape[1], dim=1))  # (B, D, N)
        else:
            raise ValueError(f"{name} must have shape (B, N) = {(batch, N)} or (B, G, N) with G dividing "
                             f"D = {dim}, got {tuple(X.shape)}")
    for name, t in (("D", D), ("delta_bias", delta_bias)):
        if t is not None and _is_tensor(name, t).shape != (dim,):
            raise ValueError(f"{name} must have shape (D,) = ({dim},), got {tuple(t.shape)}")
    check_A(A, check_values)
    Bc, Cc = per
    dt = prepare_delta(delta_t, delta_bias, delta_softplus)                # (B, D)
    dA = torch.exp(dt[..., None] * A.float())                               # Ā_t   (B, D, N)
    new_state = dA * state.float() + (dt * u_t.float())[..., None] * Bc     # x_t = Ā_t x_{t-1} + Δ B u
    y = (new_state * Cc).sum(-1)                                            # y_t = Σ_n x_t[n] C_t[n]
    if D is not None:
        y = y + D.float() * u_t.float()
    if z_t is not None:
        y = y * F.silu(z_t.float())
    return y.to(u_t.dtype), new_state

"""Speculative sampling in PyTorch: the accept/reject rule, the residual distribution, the bonus token.

A cheap *draft* proposes ``γ`` tokens ``x_1 .. x_γ`` after a context, each drawn from its
distribution ``q_i``; the *target* model scores the context and all ``γ`` tokens in one forward
pass, which gives its distributions ``p_1 .. p_{γ+1}`` at every proposed position plus one. Then,
left to right (Leviathan et al., 2023; Chen et al., 2023)::

    accept x_i  with probability  min(1, p_i(x_i) / q_i(x_i))
    at the first rejection:  draw the next token from  norm(max(0, p_i - q_i)),  stop
    if all γ are accepted:   draw a bonus token from p_{γ+1}

Every step emits between 1 and ``γ + 1`` tokens, and the tokens it emits are distributed *exactly*
as if the target had sampled them one at a time: for one position, a token ``x`` comes out either
accepted (``q(x) min(1, p(x)/q(x)) = min(q(x), p(x))``) or from the residual after a rejection
(``P(reject) * max(0, p(x) - q(x)) / sum_y max(0, p(y) - q(y))``; the rejection probability is
exactly that sum), and the two add up to ``p(x)``.

Randomness is passed in, not drawn here, so that the torch reference and the Triton kernel
(``llmu.spec.kernels``) can be compared on the same numbers:

- ``u`` ``(B, γ)``: one uniform in ``[0, 1)`` per proposed token. ``x_i`` is accepted when
  ``u_i * q_i(x_i) < p_i(x_i)`` (the same as ``u_i < p_i(x_i) / q_i(x_i)`` without a division;
  a token with ``p >= q`` is always accepted);
- ``r`` ``(B,)``: one uniform per sequence for the token drawn after the accepted prefix (from the
  residual, or the bonus from ``p_{γ+1}``), by **inverse CDF**: the smallest index ``j`` whose
  cumulative weight ``w_0 + ... + w_j`` exceeds ``r * sum(w)`` (weights need not be normalised).

:func:`speculative_sample` draws ``u`` and ``r`` from a generator and calls :func:`accept_reject`.
**Greedy** decoding is the special case of one-hot distributions (temperature 0): a proposed token
is accepted exactly when it is the target's argmax, and the emitted token after the accepted prefix
is the target's argmax there (:func:`greedy_accept`, which needs only the argmaxes).

A deterministic draft (n-gram lookup, a greedy draft model) is a draft whose ``q_i`` is one-hot on
the proposed token: :func:`one_hot_draft` builds it, and the rule above stays exact for sampling
(``x_i`` is then accepted with probability ``p_i(x_i)``, and the residual is ``p_i`` without
``x_i``).

Ragged batches and an external bonus token
------------------------------------------
A serving engine batches sequences that proposed different numbers of tokens (a prompt-lookup
draft finds a match for one sequence and nothing for another). Two keyword arguments say so:

- ``draft_lens`` ``(B,)`` int32/int64: sequence ``b`` proposed ``n_b = draft_lens[b]`` tokens,
  ``0 <= n_b <= γ``, where ``γ`` is now the *padded* width of the batch. The sequence's data are
  ``draft[b, :n_b]``, ``q[b, :n_b]``, ``u[b, :n_b]`` and ``p[b, :n_b + 1]``; everything after is
  **padding, never read and never checked**: it may hold anything (ids out of range such as -1,
  NaN). Its token after the accepted prefix comes from ``p[b, n_b]`` when all ``n_b`` are
  accepted, so a row with ``n_b = 0`` simply draws from ``p[b, 0]``: an ordinary sampling step.
  Row ``b`` of a ragged call is exactly the rectangular call on that row alone, cut to ``n_b``.
  With ``draft_lens`` the padded width may itself be 0 (``p`` ``(B, 1, V)``, ``q`` ``(B, 0, V)``: a
  batch in which no sequence proposed anything).
- ``bonus_token`` ``(B,)`` int32/int64 ids in ``[0, V)``: a token the engine sampled itself from
  the bonus distribution (with its own sampler, penalties, grammar...). A sequence that accepts
  all its proposals emits ``bonus_token[b]`` instead of drawing from ``p[b, n_b]``, which is then
  not read either (nor checked); ``r[b]`` goes unused for it. A sequence with a rejection ignores
  its ``bonus_token``.
"""

from __future__ import annotations

import torch

from llmu.checks import require_values

__all__ = ["INDEX_DTYPES", "accept_reject", "check_inputs", "greedy_accept", "inverse_cdf", "one_hot_draft",
           "speculative_sample"]


#: The dtypes ``draft_lens`` and ``bonus_token`` may have (those of the kernel's token ids).
INDEX_DTYPES = (torch.int32, torch.int64)


def _shape(t) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else type(t).__name__


def _check_index_tensor(name: str, t, b: int, what: str) -> None:
    """``t`` must be a ``(B,)`` int32/int64 tensor (``draft_lens``, ``bonus_token``)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of {what}, got {type(t).__name__}")
    if t.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must have dtype int32, int64; got {str(t.dtype).removeprefix('torch.')}")
    if t.shape != (b,):
        raise ValueError(f"{name} must be (B,) = {(b,)} {what}, got {_shape(t)}")


def check_inputs(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor | None = None,
                 r: torch.Tensor | None = None, *, draft_lens: torch.Tensor | None = None,
                 bonus_token: torch.Tensor | None = None, check_values: bool = True) -> tuple[int, int, int]:
    """Validate :func:`accept_reject`'s inputs; return ``(B, γ, V)``.

    Shapes, dtypes and devices first; then, with ``check_values``, what the values must be, read
    back to the host in one go (one wait for a GPU, whatever the number of checks):

    - ``draft_lens`` in ``[0, γ]``; ``bonus_token`` ids in ``[0, V)``;
    - ``draft`` ids in ``[0, V)``;
    - ``u`` and ``r`` in ``[0, 1)`` (uniforms: ``u >= 1`` would reject a token the rule accepts);
    - ``p`` and ``q`` probabilities: no negative, NaN or infinite entry (the usual mistake:
      logits passed instead of their softmax).

    Only what is read is checked: the padding after each sequence's ``draft_lens[b]`` proposals
    may hold anything, and so may ``p[b, n_b]`` (``p[:, γ]`` without ``draft_lens``) when
    ``bonus_token`` is given.

    Rows are *not* required to sum to 1: the step draws by inverse CDF, which normalises the
    weights itself, and a float16/bfloat16 row sums to 1 only within a tolerance that grows with
    ``V``, so any bound would be arbitrary. Checking values means one pass over ``p`` and ``q``,
    the size of the softmax that made them and small beside the target's forward pass;
    ``check_values=False`` skips it for a caller whose values are right by construction (the
    benchmark, which times the step alone).
    """
    for name, t in (("p", p), ("q", q)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.ndim != 3:
            raise ValueError(f"{name} must be a 3-D float tensor of probabilities, got "
                             f"{getattr(t, 'shape', type(t).__name__)} {getattr(t, 'dtype', '')}")
    b, g1, v = p.shape
    if g1 < 2 and not (g1 == 1 and draft_lens is not None):
        raise ValueError(f"p must hold gamma + 1 >= 2 distributions per sequence (dim 1), got {g1} "
                         "(a batch without proposals, gamma = 0, needs draft_lens)")
    gamma = g1 - 1
    if q.shape != (b, gamma, v):
        raise ValueError(f"q must be (B, gamma, V) = {(b, gamma, v)} for p of shape {tuple(p.shape)}, "
                         f"got {tuple(q.shape)}")
    if not isinstance(draft, torch.Tensor) or draft.is_floating_point() or draft.shape != (b, gamma):
        raise ValueError(f"draft must be (B, gamma) = {(b, gamma)} integer token ids, got "
                         f"{getattr(draft, 'shape', type(draft).__name__)}")
    for name, t, shape in (("u", u, (b, gamma)), ("r", r, (b,))):
        if t is not None and (not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.shape != shape):
            raise ValueError(f"{name} must be {shape} uniforms in [0, 1), got "
                             f"{getattr(t, 'shape', type(t).__name__)}")
    if draft_lens is not None:
        _check_index_tensor("draft_lens", draft_lens, b, "numbers of proposed tokens")
    if bonus_token is not None:
        _check_index_tensor("bonus_token", bonus_token, b, "token ids")
    named = [("p", p), ("q", q), ("draft", draft), ("u", u), ("r", r), ("draft_lens", draft_lens),
             ("bonus_token", bonus_token)]
    for name, t in named:
        if t is not None and t.device != p.device:
            raise ValueError(f"{name} is on {t.device} but p is on {p.device}; they must match")
    if not isinstance(check_values, bool):
        raise TypeError(f"check_values must be a bool, got {check_values!r}")
    if check_values:
        # what each sequence reads: proposals i < n_b, and p up to n_b (n_b - 1 with a bonus token);
        # None: everything
        n = None if draft_lens is None else draft_lens.long()
        live = None if n is None else torch.arange(gamma, device=p.device) < n[:, None]          # (B, γ)
        live_p = None
        if n is not None or bonus_token is not None:
            read = (torch.full((b,), gamma, device=p.device) if n is None else n) + (bonus_token is None)
            live_p = torch.arange(gamma + 1, device=p.device) < read[:, None]                   # (B, γ + 1)
        checks = []
        if n is not None:
            checks.append((((n < 0) | (n > gamma)).any(), f"draft_lens must be in [0, gamma] = [0, {gamma}]"))
        if bonus_token is not None:
            checks.append((((bonus_token < 0) | (bonus_token >= v)).any(),
                           f"bonus_token ids must be in [0, V) = [0, {v})"))
        checks.append((_any(((draft < 0) | (draft >= v)), live), f"draft token ids must be in [0, V) = [0, {v})"))
        for name, t, where in (("u", u, live), ("r", r, None)):
            if t is not None:  # ~(in range) is also true for NaN
                checks.append((_any(~((t >= 0) & (t < 1)), where), f"{name} must hold uniforms in [0, 1)"))
        for name, t, where in (("p", p, live_p), ("q", q, live)):
            if t.numel():
                lo, hi = torch.aminmax(t, dim=-1)            # per distribution: (B, γ + 1) or (B, γ)
                checks.append((_any(~(lo >= 0) | ~hi.isfinite(), where),
                               (f"{name} must hold probabilities: no negative, NaN or infinite entry "
                                "(softmax the logits first)")))
        require_values(*checks)
    return b, gamma, v


def _any(bad: torch.Tensor, where: torch.Tensor | None) -> torch.Tensor:
    """``bad.any()`` over the entries ``where`` says are read (all of them when None)."""
    return (bad if where is None else bad & where).any()


def inverse_cdf(weights: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """For each row of ``weights`` ``(B, V)`` (non-negative, not necessarily normalised) the smallest
    index ``j`` with ``cumsum(weights)[j] > r * sum(weights)``, ``(B,)`` int64. A row of zeros gives 0;
    ``r`` near 1 never runs past the last index with a positive weight."""
    w = weights.double()
    c = w.cumsum(dim=-1)
    total = c[:, -1:]
    idx = (c <= r.double()[:, None] * total).sum(dim=-1)
    # float rounding can put r * total at or above the last cumulative value: stay on a positive weight
    last = torch.where(w > 0, torch.arange(w.shape[-1], device=w.device), -1).amax(dim=-1).clamp(min=0)
    return torch.minimum(idx, last)


def accept_reject(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor,
                  r: torch.Tensor, *, draft_lens: torch.Tensor | None = None, bonus_token: torch.Tensor | None = None,
                  check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification step for a batch: ``(accepted (B,) int64, next_token (B,) int64)``.

    ``p`` ``(B, γ + 1, V)``: the target's probabilities at the ``γ`` proposed positions and one more;
    ``q`` ``(B, γ, V)``: the draft's probabilities the proposals were drawn from; ``draft`` ``(B, γ)``
    the proposed tokens; ``u`` ``(B, γ)`` and ``r`` ``(B,)`` uniforms (see the module docstring).
    Sequence ``b`` keeps ``draft[b, :accepted[b]]`` and then ``next_token[b]``: drawn from the
    residual at the first rejected position, or from ``p[b, γ]`` when all ``γ`` were accepted.

    ``draft_lens`` ``(B,)``: sequence ``b`` proposed only ``draft_lens[b]`` tokens (``0 .. γ``; the
    rest of its row is padding, never read), so ``γ`` above reads ``draft_lens[b]``.
    ``bonus_token`` ``(B,)``: the token a sequence emits when it accepts all its proposals, instead
    of one drawn from ``p``. (Module docstring, "Ragged batches".) Every argument is checked
    (:func:`check_inputs`; ``check_values=False`` skips the checks of values).
    """
    if u is None or r is None:
        raise ValueError("u (B, gamma) and r (B,) uniforms are required: speculative_sample draws them")
    b, gamma, _ = check_inputs(p, q, draft, u, r, draft_lens=draft_lens, bonus_token=bonus_token,
                               check_values=check_values)
    rows = torch.arange(b, device=p.device)
    # -- each sequence's number of proposals n (γ for all without draft_lens) and which are real
    n = torch.full((b,), gamma, device=p.device) if draft_lens is None else draft_lens.long()
    live = torch.arange(gamma, device=p.device) < n[:, None]
    idx = torch.where(live, draft.long(), 0)[..., None]  # padding may hold any id: look up token 0 there
    p_x = p[:, :gamma].gather(-1, idx)[..., 0].float()
    q_x = q.gather(-1, idx)[..., 0].float()
    # -- accept while u * q(x) < p(x); the number accepted is the length of the leading run
    ok = (u.float() * q_x < p_x) & live
    accepted = ok.long().cumprod(dim=-1).sum(dim=-1)
    # -- the distribution of the token after the prefix: residual at the rejection, else p[n]
    all_in = accepted == n
    bonus_row = p[rows, n].float()
    if gamma > 0:
        at = torch.minimum(accepted, n - 1).clamp(min=0)
        residual = (p[rows, at].float() - q[rows, at].float()).clamp(min=0)
        # (a residual with no mass cannot follow a rejection: u * q(x) < p(x) fails only when p(x) < q(x),
        # which leaves mass elsewhere; a rounding-level tie falls back to p)
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p[rows, at].float())
        weights = torch.where(all_in[:, None], bonus_row, residual)
    else:  # no sequence proposed anything: every one draws from p[:, 0]
        weights = bonus_row
    next_token = inverse_cdf(weights, r)
    if bonus_token is not None:  # every proposal accepted: the engine's own bonus token
        next_token = torch.where(all_in, bonus_token.long(), next_token)
    return accepted, next_token


def speculative_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                       generator: torch.Generator | None = None, *, draft_lens: torch.Tensor | None = None,
                       bonus_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept_reject` with ``u`` ``(B, γ)`` and then ``r`` ``(B,)`` drawn from ``generator``
    (on ``p``'s device); the same draws with or without ``draft_lens`` (padding gets its uniforms too)."""
    b, gamma, _ = check_inputs(p, q, draft, draft_lens=draft_lens, bonus_token=bonus_token,
                               check_values=False)  # accept_reject checks the values
    u = torch.rand(b, gamma, generator=generator, device=p.device)
    r = torch.rand(b, generator=generator, device=p.device)
    return accept_reject(p, q, draft, u, r, draft_lens=draft_lens, bonus_token=bonus_token)


def greedy_accept(target_argmax: torch.Tensor, draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy verification: ``target_argmax`` ``(B, γ + 1)`` (the target's argmax at each proposed
    position and one more), ``draft`` ``(B, γ)``. Returns ``(accepted, next_token)``: the number of
    leading proposals equal to the target's argmax, and the target's argmax right after them."""
    if not isinstance(target_argmax, torch.Tensor) or target_argmax.ndim != 2 or target_argmax.is_floating_point():
        raise ValueError(f"target_argmax must be (B, gamma + 1) integer token ids, got "
                         f"{getattr(target_argmax, 'shape', type(target_argmax).__name__)}")
    b, g1 = target_argmax.shape
    if not isinstance(draft, torch.Tensor) or draft.shape != (b, g1 - 1) or draft.is_floating_point():
        raise ValueError(f"draft must be (B, gamma) = {(b, g1 - 1)} integer token ids, got "
                         f"{getattr(draft, 'shape', type(draft).__name__)}")
    match = (draft.long() == target_argmax[:, :-1].long())
    accepted = match.long().cumprod(dim=-1).sum(dim=-1)
    return accepted, target_argmax.long().gather(-1, accepted[:, None])[:, 0]


def one_hot_draft(draft: torch.Tensor, vocab_size: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The draft distribution of a deterministic draft: ``(B, γ, V)``, probability 1 on each proposal."""
    if not isinstance(draft, torch.Tensor) or draft.ndim != 2 or draft.is_floating_point():
        raise ValueError(f"draft must be (B, gamma) integer token ids, got {getattr(draft, 'shape', type(draft).__name__)}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    if draft.numel() and (int(draft.min()) < 0 or int(draft.max()) >= vocab_size):
        raise ValueError(f"draft token ids must be in [0, vocab_size) = [0, {vocab_size})")
    q = torch.zeros(*draft.shape, vocab_size, dtype=dtype, device=draft.device)
    return q.scatter_(-1, draft.long()[..., None], 1.0)

"""Triton kernel of module 11: the accept/reject step of speculative sampling, fused, for a batch.

``accept_reject(p, q, draft, u, r)`` computes exactly what ``llmu.spec.reference.accept_reject``
computes (read its module docstring for the rule and for ``u`` and ``r``), in one launch with one
program per sequence. Program ``b`` does three things, for its ``n = γ`` proposals (``n =
draft_lens[b]`` in a ragged batch: the loop simply stops there, and the padding is never read):

1. **Accept.** A scalar loop over the ``n`` proposals: load ``x_i = draft[b, i]``, then the two
   numbers ``p[b, i, x_i]`` and ``q[b, i, x_i]``, and keep going while ``u[b, i] * q < p``
   (float32 products, as in the reference). ``accepted`` is the length of that leading run.
2. **Pick the distribution after the accepted prefix.** With ``i = accepted < n`` it is the
   residual ``max(0, p[b, i] - q[b, i])`` (computed tile by tile as it is read, never stored), or
   ``p[b, i]`` itself in the rare case the residual has no positive entry (as in the reference);
   with ``accepted == n`` it is the bonus distribution ``p[b, n]`` — unless the caller passed its
   own ``bonus_token``: then that token is the answer, and the row to sample is given length 0,
   so that the passes below read nothing.
3. **Sample by inverse CDF** with ``r[b]``: the smallest ``j`` whose cumulative weight exceeds
   ``r * total``. ``V`` (49,152 for SmolLM2) is read in tiles of ``BLOCK_V``. A first pass
   computes ``total``, a second pass walks the tiles again with ``tl.cumsum`` inside a tile plus a
   running ``carry`` from the tiles before, and keeps the first ``j`` with ``carry + cumsum[j] >
   r * total`` *and a positive weight* — so an index of zero weight is never picked, even where
   rounding would make a sum wobble. When nothing qualifies (``r = 1``, or rounding put ``r *
   total`` at or after the last cumulative value) the answer is the last index with a positive
   weight (found in the first pass), as in the reference; a row with no positive weight gives 0.

The probabilities are converted to float32 as they are loaded, so the accept test and the weights
are float32 and *bit-identical* to the reference's (no product feeds a sum: fused multiply-adds
cannot change a bit). The cumulative sums are **float64**, as in the reference's ``inverse_cdf``.
Why not float32: a float32 running sum resolves ``total * 2**-24`` at best and, added up
sequentially (numpy's ``cumsum``, which is what ``tl.cumsum`` runs in the interpreter), drifts by
up to ``n * 2**-24`` of the total over ``n`` terms — 2.4e-4 over a tile of 4096 — while SmolLM2's
49,152 buckets average 2e-5 of the total. In float32 the token drawn from a flat-ish row would
often not be the reference's for the same ``r``: statistically harmless (each bucket's *width* is
still right to about ``2**-24`` of the total) but impossible to test token for token. Float64
costs nothing that matters: some ``3 V`` additions per sequence next to the reads of ``V``
probabilities (for ``B = 32`` and SmolLM2's ``V``, 5 million: about ten microseconds even at a
consumer GPU's 1/64-rate float64, nothing on an H200). The kernel's token then
differs from the reference's only if ``r * total`` lies within about ``(V + BLOCK_V) * 2**-53``
(1e-11) of the total from a cumulative boundary (``tests/spec/test_kernels.py`` excludes exactly
those cases, and none occurs).

The napkin math
---------------
Per sequence the kernel reads ``n <= γ`` pairs of scalars and then at most two rows of ``V``
probabilities: ``p`` and ``q`` at the rejected position, or ``p[n]`` alone for the bonus (none with
the caller's bonus token; a third row, ``p`` again, only in the fallback), twice (two passes), the
second time mostly from L2. For ``B = 32`` sequences, ``V = 49,152``, bfloat16::

    rows read   B * 2 * V * 2 bytes   = 6.3 MB   (1.3 us at an H200's 4.8 TB/s)
    the target's verification forward (SmolLM2-135M, bf16):
      weights   135 M * 2 bytes       = 270 MB   (56 us), plus the logits it writes:
      logits    B * (γ+1) * V * 2     = 15.7 MB  (γ = 4)

Memory-bound and tiny next to the forward pass it follows. Its point is not bandwidth but the
shape of the work: written as a loop in PyTorch the step is ``γ + 1`` rounds of small launches,
each needing to know on the host whether the previous proposal was accepted (a synchronisation
per proposal); the vectorised reference avoids the syncs but still launches some twenty small
kernels and builds ``(B, V)`` float64 cumulative sums. Here it is one launch (after the
launcher's one check of the ids, below), and the number of accepted tokens stays on the device
until the engine wants it. (With one program per sequence
the long ``V`` loop is latency-bound on a GPU: at small ``B`` most SMs idle. That is fine for a
step that reads a few MB; splitting ``V`` across programs would need a second reduction.)

The launcher
------------
Shapes, the token-id range and the devices are checked by ``reference.check_inputs`` (the same
messages as the reference; the id range check reads ``draft``'s min and max back to the host,
one synchronisation per call, the price of refusing ids that would make the kernel read out of
bounds; ``draft_lens`` outside ``[0, γ]`` would too, and is refused the same way). On top of
that, ``llmu.checks.require_tensor``: every tensor on the kernel device, ``p`` and ``q``
float32/float16/bfloat16 (they may differ), ``draft``, ``draft_lens`` and ``bonus_token``
int32/int64, ``u`` and ``r`` float32 (``torch.rand``'s dtype; the reference compares in float32).
Without ``draft_lens`` or ``bonus_token`` the kernel is compiled without the code that reads them
(the constexpr switches ``HAS_LENS`` and ``HAS_BONUS``), so the rectangular call is the kernel it
always was. **Strides:** the kernel takes every tensor's strides as arguments, so non-contiguous
inputs (a slice of a larger probability tensor, a transposed view, an ``expand``-ed row) are read
in place, without a copy; rows are read fastest when ``V`` has stride 1, which is the usual layout.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmu.checks import FLOAT_DTYPES, require_power_of_two, require_tensor
from llmu.spec import reference

__all__ = ["accept_reject", "speculative_sample", "choose_block_v", "ID_DTYPES", "MAX_BLOCK_V"]

#: Token-id dtypes the kernel takes for ``draft``.
ID_DTYPES = (torch.int32, torch.int64)
#: The largest tile along ``V``: at 8 warps on a GPU, 16 values per thread (and their float64
#: running sums); twelve tiles for SmolLM2's 49,152. The same in the interpreter.
MAX_BLOCK_V = 4096


# ----------------------------------------------------------------------------------------------
# The kernel: one program per sequence
# ----------------------------------------------------------------------------------------------


@triton.jit
def _weights(p_row, q_row, offs, V, q_len, stride_pv, stride_qv):
    """One tile of the distribution after the prefix, float32, zero past ``V``: ``max(0, p - q)``
    when ``q_len == V`` (a residual), ``p`` when ``q_len == 0`` (``q`` is not read then). The
    switch is a length rather than a flag because a scalar flag and-ed into a mask is not a valid
    mask in Triton's interpreter."""
    w = tl.load(p_row + offs * stride_pv, mask=offs < V, other=0.0).to(tl.float32)
    use_q = offs < q_len
    qv = tl.load(q_row + offs * stride_qv, mask=use_q, other=0.0).to(tl.float32)
    return tl.where(use_q, tl.maximum(w - qv, 0.0), w)


@triton.jit
def _total(p_row, q_row, V, q_len, stride_pv, stride_qv, BLOCK_V: tl.constexpr):
    """First pass: ``(total, last)``, the float64 sum of the weights (accumulated exactly as the
    second pass does, so both agree to the bit) and the last index with a positive weight (-1 if none)."""
    total = tl.cast(0.0, tl.float64)
    last = -1
    for v0 in range(0, V, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        w = _weights(p_row, q_row, offs, V, q_len, stride_pv, stride_qv)
        total = tl.max(total + tl.cumsum(w.to(tl.float64), axis=0), axis=0)
        last = tl.maximum(last, tl.max(tl.where(w > 0, offs, -1), axis=0))
    return total, last


@triton.jit
def _accept_reject_kernel(
    p_ptr, q_ptr, draft_ptr, u_ptr, r_ptr, lens_ptr, bonus_ptr, acc_ptr, next_ptr,
    gamma, V,
    stride_pb, stride_pg, stride_pv,
    stride_qb, stride_qg, stride_qv,
    stride_db, stride_dg,
    stride_ub, stride_ug,
    stride_rb, stride_lb, stride_bb,
    BLOCK_V: tl.constexpr,
    HAS_LENS: tl.constexpr,       # draft_lens given: sequence b has its own number of proposals
    HAS_BONUS: tl.constexpr,      # bonus_token given: used instead of a draw from p[b, n]
):
    b = tl.program_id(0).to(tl.int64)
    p_seq = p_ptr + b * stride_pb
    q_seq = q_ptr + b * stride_qb

    # -- 0. this sequence's number of proposals: γ, or draft_lens[b] (the padding after it is never read)
    n = gamma
    if HAS_LENS:
        n = tl.load(lens_ptr + b * stride_lb).to(tl.int32)

    # -- 1. accept while u * q(x) < p(x): `alive` drops to 0 at the first rejection and stays there
    alive = 1
    accepted = 0
    for i in range(n):
        x = tl.load(draft_ptr + b * stride_db + i * stride_dg).to(tl.int64)
        px = tl.load(p_seq + i * stride_pg + x * stride_pv).to(tl.float32)
        qx = tl.load(q_seq + i * stride_qg + x * stride_qv).to(tl.float32)
        ui = tl.load(u_ptr + b * stride_ub + i * stride_ug)
        alive = alive * (ui * qx < px).to(tl.int32)
        accepted += alive

    # -- 2. the distribution after the prefix: the residual at the rejection, or p[n] (the bonus)
    residual = accepted < n
    at = tl.maximum(tl.minimum(accepted, n - 1), 0).to(tl.int64)   # (n = 0: no residual, q unread)
    p_row = p_seq + tl.where(residual, at, n).to(tl.int64) * stride_pg
    q_row = q_seq + at * stride_qg
    # the row's length: V, or 0 when the caller's bonus token replaces the draw (nothing is read)
    row_v = V
    if HAS_BONUS:
        row_v = tl.where(residual, V, 0)
    q_len = tl.where(residual, row_v, 0)        # row_v: subtract q (the residual); 0: p alone
    total, last = _total(p_row, q_row, row_v, q_len, stride_pv, stride_qv, BLOCK_V)
    if (q_len > 0) and (last < 0):
        # a residual with no positive entry (only through a rounding-level tie, or a proposal
        # with q(x) = 0): fall back to p at the rejected position, as the reference does
        q_len = tl.zeros_like(q_len)
        total, last = _total(p_row, q_row, row_v, q_len, stride_pv, stride_qv, BLOCK_V)

    # -- 3. inverse CDF: the first j with carry + cumsum[j] > r * total and a positive weight
    target = tl.load(r_ptr + b * stride_rb).to(tl.float64) * total
    carry = tl.cast(0.0, tl.float64)
    found = row_v
    for v0 in range(0, row_v, BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        w = _weights(p_row, q_row, offs, row_v, q_len, stride_pv, stride_qv)
        c = carry + tl.cumsum(w.to(tl.float64), axis=0)
        carry = tl.max(c, axis=0)
        hit = (w > 0) & (c > target)        # w > 0 is False past the row
        found = tl.minimum(found, tl.min(tl.where(hit, offs, row_v), axis=0))
    # nothing above r * total (rounding, or r >= 1): the last positive weight; a row of zeros: 0
    token = tl.where(found < row_v, found, tl.maximum(last, 0)).to(tl.int64)
    if HAS_BONUS:
        # every proposal accepted: the caller's bonus token
        token = tl.where(residual, token, tl.load(bonus_ptr + b * stride_bb).to(tl.int64))

    tl.store(acc_ptr + b, accepted.to(tl.int64))
    tl.store(next_ptr + b, token.to(tl.int64))


# ----------------------------------------------------------------------------------------------
# Launchers
# ----------------------------------------------------------------------------------------------


def _check(p, q, draft, *uniforms, draft_lens=None, bonus_token=None,
           check_values: bool = True) -> tuple[int, int, int]:
    """Types, dtypes and the kernel device first (so that a tensor on another device is refused
    before anything reads it), then the reference's checks, values included unless
    ``check_values`` is False; returns ``(B, γ, V)``. ``uniforms``: ``(u, r)``, or nothing when
    they are still to be drawn."""
    named = [("p", p, FLOAT_DTYPES), ("q", q, FLOAT_DTYPES), ("draft", draft, ID_DTYPES)]
    named += [(name, t, (torch.float32,)) for name, t in zip(("u", "r"), uniforms)]
    named += [(name, t, ID_DTYPES) for name, t in (("draft_lens", draft_lens), ("bonus_token", bonus_token))
              if t is not None]
    for name, t, dtypes in named:
        require_tensor(name, t, dtypes=dtypes)
    return reference.check_inputs(p, q, draft, *uniforms, draft_lens=draft_lens, bonus_token=bonus_token,
                                  check_values=check_values)


def choose_block_v(vocab_size: int) -> int:
    """The tile along ``V``: the vocabulary rounded up to a power of two (at least 16), at most
    :data:`MAX_BLOCK_V`."""
    return min(MAX_BLOCK_V, triton.next_power_of_2(max(int(vocab_size), 16)))


def accept_reject(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor, u: torch.Tensor, r: torch.Tensor,
                  *, draft_lens: torch.Tensor | None = None, bonus_token: torch.Tensor | None = None,
                  block_v: int | None = None, check_values: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One verification step for a batch, fused: ``(accepted (B,) int64, next_token (B,) int64)``.

    The arguments and the result are those of ``llmu.spec.reference.accept_reject``: ``p``
    ``(B, γ + 1, V)`` and ``q`` ``(B, γ, V)`` float32/float16/bfloat16 probabilities (not
    necessarily normalised), ``draft`` ``(B, γ)`` int32/int64 ids in ``[0, V)``, ``u`` ``(B, γ)``
    and ``r`` ``(B,)`` float32 uniforms, all on the kernel device; any strides. A ragged batch:
    ``draft_lens`` ``(B,)`` int32/int64, sequence ``b`` proposed ``draft_lens[b]`` in ``[0, γ]``
    tokens, the rest of its row is padding (never read, never checked; ``γ`` may then be 0). An
    engine's own bonus tokens: ``bonus_token`` ``(B,)`` int32/int64 ids in ``[0, V)``, emitted by a
    sequence that accepts all its proposals instead of a draw from ``p`` (the reference's module
    docstring, "Ragged batches"). ``block_v``: the tile along ``V`` (a power of two; default
    :func:`choose_block_v`), a knob for tests. The values are checked as ``reference.check_inputs``
    checks them (ids and lengths in range, uniforms in ``[0, 1)``, no negative or NaN
    probability), one wait for the GPU per call; ``check_values=False`` skips that, for a caller
    whose values are right by construction.
    """
    b, gamma, v = _check(p, q, draft, u, r, draft_lens=draft_lens, bonus_token=bonus_token,
                         check_values=check_values)
    block_v = choose_block_v(v) if block_v is None else require_power_of_two("block_v", block_v)
    accepted = torch.empty(b, dtype=torch.int64, device=p.device)
    next_token = torch.empty(b, dtype=torch.int64, device=p.device)
    if b == 0:
        return accepted, next_token
    # an argument not given is never read (HAS_LENS / HAS_BONUS are False): pass r in its place
    lens = r if draft_lens is None else draft_lens
    bonus = r if bonus_token is None else bonus_token
    _accept_reject_kernel[(b,)](
        p, q, draft, u, r, lens, bonus, accepted, next_token,
        gamma, v,
        *p.stride(), *q.stride(), *draft.stride(), *u.stride(), *r.stride(), *lens.stride(), *bonus.stride(),
        BLOCK_V=block_v, HAS_LENS=draft_lens is not None, HAS_BONUS=bonus_token is not None,
        num_warps=8 if block_v >= 4096 else 4,
    )
    return accepted, next_token


def speculative_sample(p: torch.Tensor, q: torch.Tensor, draft: torch.Tensor,
                       generator: torch.Generator | None = None, *, draft_lens: torch.Tensor | None = None,
                       bonus_token: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accept_reject` with ``u`` and ``r`` drawn from ``generator`` (on ``p``'s device), in
    the order ``reference.speculative_sample`` draws them: the same generator state gives the same
    numbers, hence (up to the rounding ties above) the same tokens."""
    b, gamma, _ = _check(p, q, draft, draft_lens=draft_lens, bonus_token=bonus_token,
                         check_values=False)  # accept_reject checks the values
    u = torch.rand(b, gamma, generator=generator, device=p.device, dtype=torch.float32)
    r = torch.rand(b, generator=generator, device=p.device, dtype=torch.float32)
    return accept_reject(p, q, draft, u, r, draft_lens=draft_lens, bonus_token=bonus_token)

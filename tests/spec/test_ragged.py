"""Ragged batches and external bonus tokens in ``accept_reject``, torch reference and Triton kernel.

A serving engine verifies sequences that proposed different numbers of tokens: ``draft_lens[b] =
n_b`` in ``[0, γ]``, the rest of each row padding; and it may sample the bonus token itself
(``bonus_token``), emitted when a sequence accepts all its ``n_b`` proposals. What is checked:

- the kernel equals the reference on ragged inputs: rows with ``n_b = 0`` and ``n_b = γ``,
  vocabularies that are not a multiple of the tile (1, 7, 100 with 16-wide tiles, 300 with 64,
  1000), three dtypes, with and without bonus tokens, a padded width of 0;
- **padding never leaks**: row ``b`` of a ragged batch is exactly the rectangular call on that row
  alone, cut to ``n_b``. The padding is built to change the answer if it were read ("misleading":
  padded proposals the target's argmax with ``u = 0``, which the rule always accepts, and padded
  target rows one-hot on another token; the test asserts that the same inputs *without*
  ``draft_lens`` do give other answers) or to be refused if it were checked ("invalid": ids -1 and
  ``V + 3``, NaN uniforms and probabilities, negative ones);
- ``draft_lens`` full is the rectangular call; ``n_b = 0`` draws from ``p[b, 0]`` (exactly, by
  the uniforms, and statistically); the bonus token is used exactly when every proposal is
  accepted (and ``p[b, n_b]`` is then never read);
- bad ``draft_lens`` / ``bonus_token`` are refused naming the argument.

Tokens are compared exactly. The one way the kernel's token could differ from the reference's is
the one described in ``test_kernels.py``: both sum the same float32 weights in float64 but in a
different order, so they may disagree only when ``r * total`` lies within ``tolerance(V)`` (about
``2 V * 2**-53`` of the total) of a cumulative boundary. Where the kernel is compared with the
reference, such rows are excluded and the test asserts there are under 1% of them (or none); for
a uniform ``r`` the chance is about ``2 V`` times that width, below 1e-10 here: none occurs. An
implementation compared with itself (ragged against rectangular) sums in one order: no tolerance.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmu import runtime
from llmu.spec import kernels, reference
from llmu.spec.stats import chi_square_pvalue

pytestmark = pytest.mark.kernels

DEV = runtime.kernel_device()
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
IMPLS = {"reference": reference.accept_reject, "triton": kernels.accept_reject}
PADDINGS = ["misleading", "invalid"]


# -- building cases ------------------------------------------------------------------------------


def dist(g, *shape, sharp=2.0):
    """Random probability rows (last dim V), float32, CPU: the softmax of ``sharp * randn``."""
    return torch.softmax(torch.randn(*shape, generator=g, device="cpu") * sharp, dim=-1)


def make(lens, gamma, v, *, dtype=torch.float32, id_dtype=torch.int64, padding="misleading", bonus=False,
         accept_all=(), seed=0):
    """``(p, q, draft, u, r, draft_lens, bonus_token)`` on the kernel device for a ragged batch.

    Row ``b`` has ``lens[b]`` real proposals drawn from ``q``; the rows in ``accept_all`` have
    ``q = p`` on them (so every real proposal is accepted). The padding after them is filled as
    ``padding`` says (module docstring). ``bonus``: also draw bonus token ids (else None)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    b = len(lens)
    n = torch.tensor(lens, dtype=torch.int64, device="cpu")
    p = dist(g, b, gamma + 1, v)
    q = dist(g, b, gamma, v, sharp=1.0)
    for row in accept_all:
        q[row] = p[row, :gamma]
    p, q = p.to(dtype), q.to(dtype)
    draft = (torch.multinomial(q.float().reshape(-1, v), 1, generator=g).reshape(b, gamma) if gamma
             else torch.zeros(b, 0, dtype=torch.int64, device="cpu"))
    u = torch.rand(b, gamma, generator=g, device="cpu")
    r = torch.rand(b, generator=g, device="cpu")
    bonus_token = torch.randint(0, v, (b,), generator=g, device="cpu") if bonus else None
    pos = torch.arange(gamma + 1, device="cpu")
    pad, pad_p = pos[None, :gamma] >= n[:, None], pos[None] > n[:, None]     # (B, γ), (B, γ + 1)
    if padding == "misleading":
        # values that would change the answer if read: the target's argmax, accepted whatever q
        # (u = 0), and target rows one-hot on the last token (a wrong bonus distribution)
        top = p[:, :gamma].float().argmax(-1)
        draft = torch.where(pad, top, draft)
        u = torch.where(pad, 0.0, u)
        p[pad_p] = torch.nn.functional.one_hot(torch.tensor(v - 1, device="cpu"), v).to(dtype)
        q[pad] = 1.0 / v
    else:
        # values the checks would refuse and the kernel could not read safely: never looked at
        draft = torch.where(pad, torch.where(pos[None, :gamma] % 2 == 0, -1, v + 3), draft)
        u = torch.where(pad, float("nan"), u)
        p[pad_p] = float("nan")
        q[pad] = -1.0
        if bonus:   # with an engine's bonus token p[b, n_b] is not read either
            p[torch.arange(b, device="cpu"), n] = float("nan")
    lens_t = n.to(id_dtype)
    return tuple(None if t is None else t.to(DEV) for t in (p, q, draft.to(id_dtype), u, r, lens_t, bonus_token))


def drawn_weights(p, q, lens, accepted):
    """``(B, V)`` float64: the weights each row's token was drawn from (the reference's rule, row by
    row): the residual at the first rejection (``p`` there if it has no mass), else ``p[b, n_b]``."""
    p, q = p.float().cpu(), q.float().cpu()
    rows = []
    for b, (n, a) in enumerate(zip(lens.tolist(), accepted.tolist())):
        if a < n:
            w = (p[b, a] - q[b, a]).clamp(min=0)
            rows.append(w if w.sum() > 0 else p[b, a])
        else:
            rows.append(p[b, n])
    return torch.stack(rows).double()


def tolerance(v, block_v=None):
    """Relative distance to a boundary within which the two float64 summation orders may disagree
    (the bound derived in ``test_kernels.py``: at most ``V`` additions for the reference's running
    sum, ``min(V, BLOCK_V)`` plus one per tile for the kernel's, and one rounding each for
    ``r * total``)."""
    block = kernels.choose_block_v(v) if block_v is None else block_v
    return (v + min(v, block) + math.ceil(v / block) + 4) * 2.0 ** -53


def near_boundary(p, q, lens, accepted, r, tol):
    """``(B,)`` bool: rows whose ``r * total`` lies within ``tol * total`` of a cumulative boundary
    (a superset of the rows whose token may flip between the two summation orders)."""
    w = drawn_weights(p, q, lens, accepted)
    c = w.cumsum(-1)
    total = c[:, -1:]
    t = r.double().cpu()[:, None] * total
    near = ((c[:, :-1] - t).abs() <= tol * total).any(-1)
    return near & w.isfinite().all(-1)          # a NaN row is one whose token is the bonus token


def check(p, q, draft, u, r, lens, bonus, *, block_v=None):
    """Kernel == reference on one ragged batch; return ``(rows, rows excluded, accepted)``."""
    acc_k, tok_k = kernels.accept_reject(p, q, draft, u, r, draft_lens=lens, bonus_token=bonus, block_v=block_v)
    acc_r, tok_r = reference.accept_reject(p, q, draft, u, r, draft_lens=lens, bonus_token=bonus)
    assert acc_k.dtype == tok_k.dtype == torch.int64 and acc_k.shape == tok_k.shape == (p.shape[0],)
    assert torch.equal(acc_k.cpu(), acc_r.cpu()), (acc_k, acc_r)
    assert (acc_r.cpu() <= lens.cpu()).all()
    skip = near_boundary(p, q, lens.cpu(), acc_r.cpu(), r, tolerance(p.shape[-1], block_v))
    if bonus is not None:
        skip &= acc_r.cpu() < lens.cpu()          # a bonus token is copied, never drawn
    same = tok_k.cpu() == tok_r.cpu()
    assert (same | skip).all(), f"kernel {tok_k.tolist()} reference {tok_r.tolist()} (lens {lens.tolist()})"
    return p.shape[0], int(skip.sum()), acc_r.cpu()


def cut(args, b, n):
    """Row ``b`` of ``(p, q, draft, u, r)`` alone, cut to its ``n`` proposals (a rectangular batch of one)."""
    p, q, draft, u, r = args
    return p[b:b + 1, :n + 1], q[b:b + 1, :n], draft[b:b + 1, :n], u[b:b + 1, :n], r[b:b + 1]


# -- the kernel against the reference ------------------------------------------------------------


@pytest.mark.parametrize("v,block_v", [(1, None), (7, None), (100, 16), (300, 64), (1000, None)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("bonus", [False, True], ids=["drawn", "bonus"])
def test_kernel_matches_reference_on_ragged_batches(v, block_v, dtype, bonus):
    # each case: a row with no proposal, a row with all γ, rows between; one row with q = p (all
    # accepted); int32 and int64 ids and lengths alternate, and so do the two kinds of padding
    k = v + DTYPES.index(dtype) + bonus
    gamma = 1 + k % 6
    lens = [0, gamma, gamma // 2, 1, gamma]
    id_dtype = torch.int32 if k % 2 else torch.int64
    args = make(lens, gamma, v, dtype=dtype, id_dtype=id_dtype, padding=PADDINGS[k % 2], bonus=bonus,
                accept_all=(4,), seed=k)
    n, n_skip, acc = check(*args, block_v=block_v)
    assert acc[0] == 0 and acc[4] == gamma
    assert n_skip <= 0.01 * n


def test_kernel_matches_reference_with_no_proposals_at_all():
    # padded width 0: p (B, 1, V), q (B, 0, V), draft and u (B, 0); every row draws from p[:, 0]
    for bonus in (False, True):
        args = make([0, 0, 0], 0, 130, padding="invalid", bonus=bonus, seed=3)
        _, n_skip, acc = check(*args, block_v=64)
        assert acc.tolist() == [0, 0, 0] and n_skip == 0


@settings(max_examples=8, deadline=None)
@given(data=st.data(), gamma=st.integers(0, 6), v=st.integers(1, 200), block_v=st.sampled_from([None, 16, 64]),
       dtype=st.sampled_from(DTYPES), id_dtype=st.sampled_from([torch.int32, torch.int64]),
       padding=st.sampled_from(PADDINGS), bonus=st.booleans(), seed=st.integers(0, 10_000))
def test_random_ragged_shapes(data, gamma, v, block_v, dtype, id_dtype, padding, bonus, seed):
    lens = data.draw(st.lists(st.integers(0, gamma), min_size=1, max_size=4))
    check(*make(lens, gamma, v, dtype=dtype, id_dtype=id_dtype, padding=padding, bonus=bonus, seed=seed),
          block_v=block_v)


# -- padding never leaks -------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("padding", PADDINGS)
@pytest.mark.parametrize("bonus", [False, True], ids=["drawn", "bonus"])
def test_ragged_rows_equal_each_row_alone_cut_to_its_length(impl, padding, bonus):
    gamma, v = 5, 50
    lens = [0, 5, 1, 3, 5, 2, 0, 4]
    # rows 1, 2, 3, 5, 7 accept everything they proposed: reading a padded proposal would accept it too
    p, q, draft, u, r, n, bonus_token = make(lens, gamma, v, padding=padding, bonus=bonus,
                                             accept_all=(1, 2, 3, 5, 7), seed=17)
    fn = IMPLS[impl]
    acc, tok = fn(p, q, draft, u, r, draft_lens=n, bonus_token=bonus_token)
    for b, nb in enumerate(lens):
        alone = cut((p, q, draft, u, r), b, nb)
        bonus_b = None if bonus_token is None else bonus_token[b:b + 1]
        if nb > 0:   # the rectangular call, no draft_lens
            want = fn(*alone, bonus_token=bonus_b)
        else:        # a rectangular batch of width 0 needs draft_lens; it draws from p[b, 0] (or takes the bonus)
            want = fn(*alone, draft_lens=n[b:b + 1], bonus_token=bonus_b)
            drawn = reference.inverse_cdf(p[b:b + 1, 0].cpu(), r[b:b + 1].cpu())
            assert want[1].tolist() == (bonus_b.tolist() if bonus else drawn.tolist())
        assert (int(acc[b]), int(tok[b])) == (int(want[0][0]), int(want[1][0])), f"row {b} (n = {nb})"
    assert [int(acc[b]) for b in (1, 2, 3, 5, 7)] == [lens[b] for b in (1, 2, 3, 5, 7)]
    if padding == "misleading":
        # the property has teeth: the same rows read in full (no draft_lens) accept their padding
        acc_full, tok_full = fn(p, q, draft, u, r, bonus_token=bonus_token)
        short = torch.tensor([nb < gamma for nb in lens], device=DEV)
        assert (acc_full > acc)[short & (acc == n)].all()
        assert not torch.equal(tok_full, tok)


@pytest.mark.parametrize("impl", IMPLS)
def test_full_lengths_are_the_rectangular_call(impl):
    gamma, v = 4, 90
    for id_dtype in (torch.int32, torch.int64):
        p, q, draft, u, r, n, _ = make([gamma] * 5, gamma, v, id_dtype=id_dtype, accept_all=(1,), seed=5)
        want = IMPLS[impl](p, q, draft, u, r)
        got = IMPLS[impl](p, q, draft, u, r, draft_lens=n)
        assert [t.tolist() for t in got] == [t.tolist() for t in want]


# -- rows without proposals ----------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_rows_without_proposals_take_p0_by_the_uniforms(impl):
    # exact: n_b = 0 gives accepted 0 and the inverse CDF of p[b, 0] at r[b]. Weights in units of
    # 1/16 and r at the 16 midpoints (k + 1/2) / 16: each token comes out exactly as many times as
    # its weight, zeros never (every number here is a small dyadic fraction: no rounding)
    w = torch.tensor([3.0, 0.0, 1.0, 5.0, 0.0, 7.0], device="cpu") / 16
    r = ((torch.arange(16, device="cpu") + 0.5) / 16).to(DEV)
    p = torch.full((16, 3, 6), 0.25, device="cpu")
    p[:, 0] = w
    q = torch.full((16, 2, 6), 1 / 6, device="cpu")
    p, q = p.to(DEV), q.to(DEV)
    draft = torch.zeros(16, 2, dtype=torch.int64, device=DEV)
    u = torch.zeros(16, 2, device=DEV)
    acc, tok = IMPLS[impl](p, q, draft, u, r, draft_lens=torch.zeros(16, dtype=torch.int32, device=DEV))
    assert acc.tolist() == [0] * 16
    assert torch.bincount(tok.cpu(), minlength=6).tolist() == [3, 0, 1, 5, 0, 7]
    assert torch.equal(tok.cpu(), reference.inverse_cdf(p[:, 0].cpu(), r.cpu()))


def test_rows_without_proposals_follow_p0_statistically():
    # 40,000 sequences, half without proposals (the others propose 2): the first emitted token of
    # the n_b = 0 rows must follow p[0]. Pearson's chi-square at a false-alarm rate of 1e-4 (the
    # seed is fixed, so the outcome is deterministic; 1e-4 is how unlucky a seed would have to be
    # for a correct rule to fail). The torch reference draws (the kernel equals it row for row:
    # the tests above), so 40,000 rows take milliseconds.
    g = torch.Generator(device="cpu").manual_seed(0)
    n_seq, v = 40_000, 6
    p0 = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1], device="cpu")
    p = torch.stack([p0, dist(g, v), dist(g, v)])[None].expand(n_seq, 3, v)
    q = dist(g, 1, 2, v).expand(n_seq, 2, v)
    draft = torch.multinomial(q[0], n_seq, replacement=True, generator=g).t()
    lens = torch.arange(n_seq, device="cpu") % 2 * 2                                    # 0, 2, 0, 2, ...
    acc, tok = reference.speculative_sample(p, q, draft, g, draft_lens=lens)
    first = torch.where(lens == 0, tok, torch.where(acc >= 1, draft[:, 0], tok))[lens == 0]
    assert (acc[lens == 0] == 0).all()
    counts = torch.bincount(first, minlength=v)
    assert counts[2] == 0                                                 # zero probability: never
    assert chi_square_pvalue(counts, p0) > 1e-4


# -- the engine's bonus token --------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_bonus_token_is_used_exactly_when_every_proposal_is_accepted(impl):
    gamma, v = 3, 40
    lens = [0, 3, 2, 3, 1, 3]
    p, q, draft, u, r, n, bonus = make(lens, gamma, v, bonus=True, accept_all=(1, 4), seed=8)
    p[5, 0, draft[5, 0].long()] = 0.0          # row 5: its first proposal is always rejected
    fn = IMPLS[impl]
    acc0, tok0 = fn(p, q, draft, u, r, draft_lens=n)                       # drawn from p[b, n_b]
    acc, tok = fn(p, q, draft, u, r, draft_lens=n, bonus_token=bonus)
    assert torch.equal(acc, acc0)
    all_in = acc == n
    assert all_in.tolist()[:2] == [True, True] and bool(all_in[4]) and not bool(all_in[5])
    assert (~all_in).any()
    assert torch.equal(tok[all_in], bonus.long()[all_in])                  # the bonus token, exactly then
    assert torch.equal(tok[~all_in], tok0[~all_in])                        # else the residual's draw
    # with a bonus token p[b, n_b] is never read: NaN there changes nothing (and is not refused)
    p_nan = p.clone()
    p_nan[torch.arange(len(lens), device=DEV), n.long()] = float("nan")
    got = fn(p_nan, q, draft, u, r, draft_lens=n, bonus_token=bonus)
    assert [t.tolist() for t in got] == [acc.tolist(), tok.tolist()]
    # and without draft_lens: the bonus replaces the draw from p[b, γ]
    acc_r, tok_r = fn(p, q, draft, u, r, bonus_token=bonus.to(torch.int32))
    acc_d, tok_d = fn(p, q, draft, u, r)
    assert torch.equal(acc_r, acc_d)
    assert torch.equal(tok_r, torch.where(acc_d == gamma, bonus.long(), tok_d))


def test_speculative_sample_with_ragged_lengths_and_bonus():
    # u (B, γ) then r (B,) from the generator, padding included: the kernel and the reference agree
    p, q, draft, _, _, n, bonus = make([2, 0, 4, 3], 4, 70, padding="invalid", bonus=True, seed=4)
    for bonus_token in (None, bonus):
        if bonus_token is None:
            p = p.nan_to_num(0.25)   # without a bonus token p[b, n_b] is read: give it values
        got_k = kernels.speculative_sample(p, q, draft, torch.Generator(DEV).manual_seed(3), draft_lens=n,
                                           bonus_token=bonus_token)
        got_r = reference.speculative_sample(p, q, draft, torch.Generator(DEV).manual_seed(3), draft_lens=n,
                                             bonus_token=bonus_token)
        g = torch.Generator(DEV).manual_seed(3)
        uu, rr = torch.rand(4, 4, generator=g, device=DEV), torch.rand(4, generator=g, device=DEV)
        want = reference.accept_reject(p, q, draft, uu, rr, draft_lens=n, bonus_token=bonus_token)
        assert [t.tolist() for t in got_r] == [t.tolist() for t in want]
        # kernel against reference: exact unless r * total is within rounding of a boundary (none here)
        assert not near_boundary(p, q, n.cpu(), want[0].cpu(), rr, tolerance(70)).any()
        assert [t.tolist() for t in got_k] == [t.tolist() for t in want]


# -- bad inputs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_draft_lens_and_bonus_token(impl, off_device):
    p, q, draft, u, r, n, bonus = make([1, 3], 3, 20, bonus=True, seed=0)
    fn = IMPLS[impl]
    other = off_device if impl == "triton" else torch.device("meta")
    where = f"draft_lens must be on {DEV.type}" if impl == "triton" else "draft_lens is on meta but p is on"
    where_bonus = f"bonus_token must be on {DEV.type}" if impl == "triton" else "bonus_token is on meta but p is on"

    def ar(**kw):
        return lambda: fn(p, q, draft, u, r, **{"draft_lens": n, "bonus_token": bonus, **kw})

    cases = [
        # draft_lens: type, dtype, shape, device, values
        (ar(draft_lens=[1, 3]), TypeError, "draft_lens must be a torch.Tensor"),
        (ar(draft_lens=n.float()), TypeError, "draft_lens must have dtype int32, int64; got float32"),
        (ar(draft_lens=n.bool()), TypeError, "draft_lens must have dtype int32, int64; got bool"),
        (ar(draft_lens=n.short()), TypeError, "draft_lens must have dtype int32, int64; got int16"),
        (ar(draft_lens=n[:1]), ValueError, r"draft_lens must be \(B,\) = \(2,\) numbers of proposed tokens"),
        (ar(draft_lens=n[:, None]), ValueError, r"draft_lens must be \(B,\) = \(2,\)"),
        (ar(draft_lens=n.to(other)), ValueError, where),
        (ar(draft_lens=n - 2), ValueError, r"draft_lens must be in \[0, gamma\] = \[0, 3\]"),
        (ar(draft_lens=n + 1), ValueError, r"draft_lens must be in \[0, gamma\] = \[0, 3\]"),
        # bonus_token: type, dtype, shape, device, values
        (ar(bonus_token=7), TypeError, "bonus_token must be a torch.Tensor"),
        (ar(bonus_token=bonus.double()), TypeError, "bonus_token must have dtype int32, int64; got float64"),
        (ar(bonus_token=bonus.repeat(2)), ValueError, r"bonus_token must be \(B,\) = \(2,\) token ids"),
        (ar(bonus_token=bonus.to(other)), ValueError, where_bonus),
        (ar(bonus_token=bonus + 20), ValueError, r"bonus_token ids must be in \[0, V\) = \[0, 20\)"),
        (ar(bonus_token=bonus - 20), ValueError, r"bonus_token ids must be in \[0, V\)"),
        # the rest is still checked where it is read: a real proposal out of range, a real u
        (lambda: fn(p, q, draft.clone().index_fill_(1, torch.tensor([0], device=DEV), 20), u, r, draft_lens=n),
         ValueError, r"draft token ids must be in \[0, V\) = \[0, 20\)"),
        (lambda: fn(p, q, draft, u.clone().index_fill_(1, torch.tensor([0], device=DEV), 1.0), r, draft_lens=n),
         ValueError, r"u must hold uniforms in \[0, 1\)"),
        (lambda: fn(p, q - 1, draft, u, r, draft_lens=n), ValueError, "q must hold probabilities"),
        # a batch of width 0 needs draft_lens
        (lambda: fn(p[:, :1], q[:, :0], draft[:, :0], u[:, :0], r), ValueError,
         r"p must hold gamma \+ 1 >= 2 .*needs draft_lens"),
    ]
    sample = kernels.speculative_sample if impl == "triton" else reference.speculative_sample
    cases += [
        (lambda: sample(p, q, draft, draft_lens=n[:1]), ValueError, r"draft_lens must be \(B,\)"),
        (lambda: sample(p, q, draft, draft_lens=n + 1), ValueError, r"draft_lens must be in \[0, gamma\]"),
        (lambda: sample(p, q, draft, draft_lens=n, bonus_token=bonus.float()), TypeError, "bonus_token must have"),
    ]
    for call, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            call()

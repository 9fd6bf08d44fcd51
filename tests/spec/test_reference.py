"""Module 11's torch reference: speculative sampling emits exactly the target's distribution.

**Statistical exactness.** The claim of speculative sampling is that the tokens it emits are
distributed exactly as the target's own samples, whatever the draft. It is checked here by
decoding many sequences at once with a small explicit target and draft: both are Markov chains
over ``V = 4 .. 8`` tokens (a distribution of the next token for each previous token), so the
target's ``p_2`` genuinely depends on the first token ``x_1``, as a language model's does, and the
draft's ``q_i`` depends on its own previous proposal. Each step the draft proposes ``γ`` tokens
sampled from its chain, the target's rows are looked up at the proposed contexts, and
``reference.accept_reject`` keeps a prefix and adds one token; sequences that emitted a single
token run a second step. Then:

- the first emitted token must follow ``p_1 = A[start]``;
- the first two must follow ``p_1(x) p_2(y | x) = A[start, x] A[x, y]`` (for ``γ = 1``, where the
  second token can come from the second step, as well as ``γ >= 2``);
- the same with ``q = p`` (every proposal accepted: acceptance rate exactly 1) and with a
  deterministic draft (``reference.one_hot_draft``: one-hot ``q``);
- the fraction of first proposals accepted must be ``sum_x min(p_1(x), q_1(x))``.

Distributions are compared with Pearson's chi-square goodness-of-fit test over the cells of
non-zero expected probability (cells of zero probability must stay empty: checked exactly), at a
false-alarm rate ``ALPHA = 1e-4`` per test; acceptance rates with the normal approximation of
the binomial, two-sided, at the same rate. scipy is not installed here, so the chi-square tail
probability is computed in closed form (the regularised upper incomplete gamma function of
half-integer order: a finite sum plus ``erfc`` for odd degrees of freedom; ``llmu.spec.stats.chi2_sf``, itself
checked against tabulated critical values). Every generator is seeded, so the outcome is
deterministic: ``ALPHA`` says how unlucky a seed would have to be for a correct implementation
to fail. With ``N = 200,000`` sequences the tests have power: a sampler that skips the residual
(draws from ``p`` after a rejection) or skips verification (emits the draft's tokens) fails the
same test at p-values far below ``1e-10`` (``test_chi_square_has_power``).

**Exact cases.** ``inverse_cdf`` at the edges (zeros, ``r = 0``, ``r`` just below 1, unnormalised
weights, a row of zeros) and over a grid of ``r`` that reproduces the weights exactly;
``greedy_accept`` by hand and against ``accept_reject`` with one-hot ``p`` and ``q``;
``one_hot_draft``; hand-computed accept/reject decisions; bad inputs (``ValueError`` naming the
argument). These are exact comparisons: integers, or float computations whose every operand is
a small dyadic fraction.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from llmu.spec import reference
from llmu.spec.stats import chi2_sf, chi_square_pvalue

ALPHA = 1e-4
N = 200_000
START = 0


def assert_fits(counts, probs):
    pvalue = chi_square_pvalue(counts, probs)
    assert pvalue > ALPHA, f"chi-square p-value {pvalue:.2e} below {ALPHA}"


def assert_rate(successes: int, n: int, rate: float):
    """Binomial count against its expectation (normal approximation, two-sided, ALPHA)."""
    z = NormalDist().inv_cdf(1 - ALPHA / 2)
    sd = math.sqrt(n * rate * (1 - rate))
    assert abs(successes - n * rate) <= z * sd, f"{successes}/{n} = {successes / n:.5f}, expected {rate:.5f}"


@pytest.mark.parametrize("x,df,want", [(3.841459, 1, 0.05), (6.634897, 1, 0.01), (5.991465, 2, 0.05),
                                       (7.814728, 3, 0.05), (13.276704, 4, 0.01), (18.307038, 10, 0.05),
                                       (50.892181, 30, 0.01), (67.504807, 50, 0.05), (124.342113, 100, 0.05)])
def test_chi2_sf_matches_tables(x, df, want):
    # critical values from the usual chi-square tables
    assert chi2_sf(x, df) == pytest.approx(want, rel=1e-3)


@pytest.mark.parametrize("df", [1, 2, 5, 8, 35, 63])
def test_chi2_sf_matches_the_integrated_density(df):
    # the upper tail of the density t^(k/2-1) e^(-t/2) / (2^(k/2) Gamma(k/2)), by Simpson's rule
    def density(t):
        return math.exp((df / 2 - 1) * math.log(t) - t / 2 - df / 2 * math.log(2) - math.lgamma(df / 2))

    for x in (0.5 * df + 0.1, df, 2.0 * df + 3):
        hi, n = x + 40 * math.sqrt(2 * df) + 60, 20_000
        h = (hi - x) / n
        tail = h / 3 * sum((1 if i in (0, n) else 4 if i % 2 else 2) * density(x + i * h) for i in range(n + 1))
        assert chi2_sf(x, df) == pytest.approx(tail, rel=1e-6, abs=1e-12)


# -- Markov chains for the target and the draft ----------------------------------------------------


def chain(v, seed, *, zeros=0.25, sharp=1.0):
    """A ``(V, V)`` transition matrix: row ``s`` is the next token's distribution after token ``s``;
    a fraction ``zeros`` of the entries are 0 (never a whole row)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.softmax(torch.randn(v, v, generator=g, dtype=torch.float64) * sharp, -1)
    drop = (torch.rand(v, v, generator=g) < zeros) & (w < w.amax(-1, keepdim=True))
    w = w.masked_fill(drop, 0.0)
    return w / w.sum(-1, keepdim=True)


def step(prev, gamma, target, draft_chain, g, *, deterministic=False):
    """One speculative step for every sequence after its last token ``prev`` ``(n,)``: the draft
    proposes ``γ`` tokens from its chain (or, ``deterministic``, its argmax each time, with a
    one-hot ``q``), the target's rows are read at the proposed contexts. Returns ``(draft,
    accepted, next_token)``."""
    n, v = prev.shape[0], target.shape[0]
    tokens, q_rows = [], []
    ctx = prev
    for _ in range(gamma):
        q_rows.append(draft_chain[ctx])
        x = draft_chain[ctx].argmax(-1) if deterministic else torch.multinomial(draft_chain[ctx], 1, generator=g)[:, 0]
        tokens.append(x)
        ctx = x
    draft = torch.stack(tokens, 1)
    q = reference.one_hot_draft(draft, v, torch.float64) if deterministic else torch.stack(q_rows, 1)
    p = target[torch.cat([prev[:, None], draft], 1)]                  # (n, γ + 1, V): A[prev], A[x_1], ...
    u = torch.rand(n, gamma, generator=g)
    r = torch.rand(n, generator=g)
    accepted, next_token = reference.accept_reject(p, q, draft, u, r)
    return draft, accepted, next_token


def first_two(gamma, target, draft_chain, seed, *, deterministic=False):
    """Decode ``N`` sequences from ``START`` until each has emitted two tokens: ``(tokens (N, 2),
    accepted in the first step (N,))``."""
    g = torch.Generator().manual_seed(seed)
    prev = torch.full((N,), START)
    draft, accepted, nxt = step(prev, gamma, target, draft_chain, g, deterministic=deterministic)
    first = torch.where(accepted >= 1, draft[:, 0], nxt)
    second = torch.where(accepted == 1, nxt, draft[:, min(1, gamma - 1)])
    # sequences that emitted one token only: their second token is the first of another step
    alone = accepted == 0
    d2, a2, n2 = step(first[alone], gamma, target, draft_chain, g, deterministic=deterministic)
    second[alone] = torch.where(a2 >= 1, d2[:, 0], n2)
    return torch.stack([first, second], 1), accepted


def joint_counts(tokens, v):
    return torch.bincount(tokens[:, 0] * v + tokens[:, 1], minlength=v * v).reshape(v, v)


def expected_joint(target):
    return target[START][:, None] * target


CASES = [  # (V, gamma, target seed, draft seed)
    pytest.param(4, 1, 1, 2, id="V4-g1"),
    pytest.param(5, 2, 3, 4, id="V5-g2"),
    pytest.param(6, 3, 5, 6, id="V6-g3"),
    pytest.param(8, 4, 7, 8, id="V8-g4"),
]


@pytest.mark.parametrize("v,gamma,ts,ds", CASES)
def test_emitted_tokens_follow_the_target(v, gamma, ts, ds):
    target, draft_chain = chain(v, ts), chain(v, ds, sharp=2.0)
    tokens, accepted = first_two(gamma, target, draft_chain, seed=100 + v)
    assert_fits(torch.bincount(tokens[:, 0], minlength=v), target[START])
    assert_fits(joint_counts(tokens, v), expected_joint(target))
    # the draft differs from the target: rejections, acceptances and (γ accepted) bonuses all occur
    assert accepted.min() == 0 and accepted.max() == gamma
    # and the first proposal is accepted at the rate sum_x min(p(x), q(x))
    rate = float(torch.minimum(target[START], draft_chain[START]).sum())
    assert_rate(int((accepted >= 1).sum()), N, rate)


@pytest.mark.parametrize("gamma", [1, 3])
def test_draft_equal_to_target_accepts_everything(gamma):
    v = 6
    target = chain(v, 11)
    tokens, accepted = first_two(gamma, target, target, seed=12)
    assert (accepted == gamma).all()                                  # acceptance rate exactly 1
    assert_fits(joint_counts(tokens, v), expected_joint(target))


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_deterministic_draft(gamma):
    # an n-gram-like draft: always proposes its chain's argmax, q one-hot; the output is still exact
    v = 7
    target, draft_chain = chain(v, 21), chain(v, 22, sharp=2.0)
    tokens, accepted = first_two(gamma, target, draft_chain, seed=23, deterministic=True)
    assert_fits(torch.bincount(tokens[:, 0], minlength=v), target[START])
    assert_fits(joint_counts(tokens, v), expected_joint(target))
    # a one-hot q accepts its proposal x with probability min(1, p(x) / 1) = p(x)
    x = int(draft_chain[START].argmax())
    assert_rate(int((accepted >= 1).sum()), N, float(target[START, x]))


def test_chi_square_has_power():
    # two wrong samplers must fail by far, through the statistic (no zero cells: every token possible)
    v, gamma = 6, 3
    target, draft_chain = chain(v, 5, zeros=0.0), chain(v, 6, sharp=2.0, zeros=0.0)
    g = torch.Generator().manual_seed(31)
    draft, accepted, _ = step(torch.full((N,), START), gamma, target, draft_chain, g)
    # (a) no verification: the draft's own first proposal
    assert chi_square_pvalue(torch.bincount(draft[:, 0], minlength=v), target[START]) < 1e-10
    # (b) after a rejection, draw from p instead of the residual max(0, p - q)
    from_p = reference.inverse_cdf(target[START].expand(N, v), torch.rand(N, generator=g))
    first = torch.where(accepted >= 1, draft[:, 0], from_p)
    assert chi_square_pvalue(torch.bincount(first, minlength=v), target[START]) < 1e-10


# -- accept_reject by hand -----------------------------------------------------------------------


def test_accept_reject_by_hand():
    # p(x=0) / q(x=0) = 0.5 / 0.75 = 2/3: accepted iff u * 0.75 < 0.5, i.e. u < 2/3; on rejection the
    # residual max(0, p - q) = [0, 0.25, 0] puts all its mass on token 1 whatever r
    p = torch.tensor([[[0.5, 0.5, 0.0], [0.25, 0.25, 0.5]]]).expand(4, 2, 3)
    q = torch.tensor([[[0.75, 0.25, 0.0]]]).expand(4, 1, 3)
    draft = torch.zeros(4, 1, dtype=torch.int32)
    u = torch.tensor([[0.0], [0.5], [0.6875], [0.9375]])
    r = torch.tensor([0.0, 0.5, 0.25, 0.9375])
    accepted, nxt = reference.accept_reject(p, q, draft, u, r)
    assert accepted.tolist() == [1, 1, 0, 0]
    # accepted rows draw the bonus from p_2 = [0.25, 0.25, 0.5]: r = 0 -> 0, r = 0.5 -> 2 (c = 0.5 is not > 0.5)
    assert nxt.tolist() == [0, 2, 1, 1]
    # a proposal with p >= q is always accepted, even for u just below 1 ...
    acc, _ = reference.accept_reject(p[:1], q[:1], torch.full((1, 1), 1), torch.tensor([[1 - 2 ** -24]]),
                                     torch.tensor([0.5]))
    assert acc.tolist() == [1]                                        # p(1) = 0.5 >= q(1) = 0.25
    # ... and one with p = 0 is always rejected, even for u = 0 (0 < 0 fails)
    acc, _ = reference.accept_reject(p[:1], q[:1].flip(-1).contiguous(), torch.full((1, 1), 2), torch.tensor([[0.0]]),
                                     torch.tensor([0.5]))
    assert acc.tolist() == [0]                                        # p(2) = 0, q(2) = 0.75


def test_accepted_is_the_leading_run():
    # proposals 0 and 2 would pass the test on their own, proposal 1 fails: only one is accepted
    v, gamma = 3, 3
    p = torch.full((1, gamma + 1, v), 1 / 3)
    q = torch.full((1, gamma, v), 1 / 3)
    q[0, 1] = torch.tensor([0.0, 1.0, 0.0])
    p[0, 1] = torch.tensor([0.5, 0.0, 0.5])
    accepted, nxt = reference.accept_reject(p, q, torch.tensor([[0, 1, 2]]), torch.full((1, 3), 0.5),
                                            torch.tensor([0.75]))
    assert accepted.tolist() == [1]
    assert nxt.tolist() == [2]                                        # residual at position 1: [0.5, 0, 0.5]


def test_residual_without_mass_falls_back_to_p():
    # q(x) = p(x) = 0 for the proposal (rejected: 0 < 0 fails) and q = p elsewhere: no residual mass
    p = torch.tensor([[[0.0, 0.25, 0.75], [1.0, 0.0, 0.0]]])
    accepted, nxt = reference.accept_reject(p, p[:, :1].clone(), torch.tensor([[0]]), torch.tensor([[0.5]]),
                                            torch.tensor([0.5]))
    assert accepted.tolist() == [0] and nxt.tolist() == [2]


def test_speculative_sample_draws_u_then_r():
    g = torch.Generator().manual_seed(0)
    target, draft_chain = chain(5, 1), chain(5, 2)
    p = target[torch.randint(0, 5, (64, 3), generator=g)]
    q = draft_chain[torch.randint(0, 5, (64, 2), generator=g)]
    draft = torch.randint(0, 5, (64, 2), generator=g)
    got = reference.speculative_sample(p, q, draft, torch.Generator().manual_seed(9))
    g = torch.Generator().manual_seed(9)
    u, r = torch.rand(64, 2, generator=g), torch.rand(64, generator=g)
    want = reference.accept_reject(p, q, draft, u, r)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    again = reference.speculative_sample(p, q, draft, torch.Generator().manual_seed(9))
    assert torch.equal(got[1], again[1])


# -- inverse_cdf ---------------------------------------------------------------------------------


def test_inverse_cdf_edges():
    below_one = 1 - 2 ** -24                                          # the largest float32 below 1
    w = torch.tensor([
        [0.0, 0.0, 1.0, 0.0],      # one positive weight: always it
        [0.0, 0.5, 0.5, 0.0],      # r = 0 -> the first positive weight (c = 0 is not > 0)
        [0.0, 0.5, 0.5, 0.0],      # r just below 1 -> the last positive weight, not the trailing zero
        [2.0, 6.0, 0.0, 0.0],      # unnormalised: total 8, r * total = 2 = c[0] -> index 1
        [2.0, 6.0, 0.0, 0.0],      # r * total = 1.6 < 2 -> index 0
        [0.0, 0.0, 0.0, 0.0],      # a row of zeros -> 0
        [1.0, 0.0, 0.0, 3.0],      # r = 1 (out of range) stays on the last positive weight
    ])
    r = torch.tensor([0.7, 0.0, below_one, 0.25, 0.2, 0.5, 1.0])
    assert reference.inverse_cdf(w, r).tolist() == [2, 1, 2, 1, 0, 0, 3]


def test_inverse_cdf_reproduces_the_weights_on_a_grid():
    # weights in units of 1/16 and r at the 16 midpoints (k + 1/2) / 16: each index is hit exactly
    # as many times as its weight, zeros never
    w = torch.tensor([3.0, 0.0, 1.0, 5.0, 0.0, 7.0])
    r = (torch.arange(16) + 0.5) / 16
    idx = reference.inverse_cdf(w.expand(16, -1), r)
    assert torch.bincount(idx, minlength=6).tolist() == [3, 0, 1, 5, 0, 7]
    assert torch.equal(reference.inverse_cdf((w / 16).expand(16, -1), r), idx)      # scale-free


# -- greedy --------------------------------------------------------------------------------------


def test_greedy_accept_by_hand():
    target = torch.tensor([[4, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
    draft = torch.tensor([[4, 5, 6], [9, 5, 6], [4, 5, 0]], dtype=torch.int32)
    accepted, nxt = reference.greedy_accept(target, draft)
    assert accepted.tolist() == [3, 0, 2]                             # all / first rejected / third
    assert nxt.tolist() == [7, 4, 6]                                  # bonus = last argmax
    assert accepted.dtype == nxt.dtype == torch.int64
    # γ = 0: no proposal, the target's argmax
    assert [t.tolist() for t in reference.greedy_accept(target[:, :1], draft[:, :0])] == [[0, 0, 0], [4, 4, 4]]


@pytest.mark.parametrize("seed", range(3))
def test_greedy_is_accept_reject_with_one_hot_distributions(seed):
    g = torch.Generator().manual_seed(seed)
    b, gamma, v = 64, 4, 5
    argmax = torch.randint(0, v, (b, gamma + 1), generator=g)
    draft = torch.where(torch.rand(b, gamma, generator=g) < 0.7, argmax[:, :gamma],
                        torch.randint(0, v, (b, gamma), generator=g))
    p = torch.nn.functional.one_hot(argmax, v).float()
    q = reference.one_hot_draft(draft, v)
    got = reference.accept_reject(p, q, draft, torch.rand(b, gamma, generator=g), torch.rand(b, generator=g))
    want = reference.greedy_accept(argmax, draft)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[0].min() == 0 and want[0].max() == gamma


def test_one_hot_draft():
    draft = torch.tensor([[2, 0], [1, 1]], dtype=torch.int32)
    q = reference.one_hot_draft(draft, 3)
    assert q.shape == (2, 2, 3) and q.dtype == torch.float32
    assert q.tolist() == [[[0, 0, 1], [1, 0, 0]], [[0, 1, 0], [0, 1, 0]]]
    assert reference.one_hot_draft(draft, 4, torch.bfloat16).dtype == torch.bfloat16
    assert reference.one_hot_draft(draft[:, :0], 3).shape == (2, 0, 3)


# -- bad inputs ----------------------------------------------------------------------------------


def test_bad_inputs():
    p = torch.full((2, 3, 5), 0.2)
    q = torch.full((2, 2, 5), 0.2)
    draft = torch.zeros(2, 2, dtype=torch.long)
    u, r = torch.rand(2, 2), torch.rand(2)
    ar = reference.accept_reject
    cases = [
        (lambda: ar(p[0], q, draft, u, r), "p must be a 3-D float tensor"),
        (lambda: ar(p.long(), q, draft, u, r), "p must be a 3-D float tensor"),
        (lambda: ar(p.tolist(), q, draft, u, r), "p must be a 3-D float tensor"),
        (lambda: ar(p, q[0], draft, u, r), "q must be a 3-D float tensor"),
        (lambda: ar(p[:, :1], q[:, :0], draft[:, :0], u[:, :0], r), r"p must hold gamma \+ 1 >= 2"),
        (lambda: ar(p, q[:, :1], draft, u, r), r"q must be \(B, gamma, V\) = \(2, 2, 5\)"),
        (lambda: ar(p, q[:1], draft, u, r), r"q must be \(B, gamma, V\)"),
        (lambda: ar(p, q, draft.float(), u, r), r"draft must be \(B, gamma\) = \(2, 2\) integer token ids"),
        (lambda: ar(p, q, draft[:, :1], u, r), r"draft must be \(B, gamma\)"),
        (lambda: ar(p, q, draft + 5, u, r), r"draft token ids must be in \[0, V\) = \[0, 5\)"),
        (lambda: ar(p, q, draft - 1, u, r), r"draft token ids must be in \[0, V\)"),
        (lambda: ar(p, q, draft, u[:, :1], r), r"u must be \(2, 2\) uniforms"),
        (lambda: ar(p, q, draft, (u * 4).long(), r), r"u must be \(2, 2\) uniforms"),
        (lambda: ar(p, q, draft, u, r[:1]), r"r must be \(2,\) uniforms"),
        (lambda: ar(p, q, draft, u.to("meta"), r), "u is on meta but p is on cpu"),
        (lambda: ar(p, q.to("meta"), draft, u, r), "q is on meta but p is on cpu"),
        (lambda: reference.speculative_sample(p, q, draft + 5), r"draft token ids must be in \[0, V\)"),
        (lambda: reference.greedy_accept(torch.zeros(2, 3), draft), r"target_argmax must be \(B, gamma \+ 1\)"),
        (lambda: reference.greedy_accept(torch.zeros(6, dtype=torch.long), draft), "target_argmax must be"),
        (lambda: reference.greedy_accept(torch.zeros(2, 3, dtype=torch.long), draft[:, :1]),
         r"draft must be \(B, gamma\) = \(2, 2\)"),
        (lambda: reference.greedy_accept(torch.zeros(2, 3, dtype=torch.long), draft.float()), "draft must be"),
        (lambda: reference.one_hot_draft(draft[0], 5), "draft must be .* integer token ids"),
        (lambda: reference.one_hot_draft(draft.float(), 5), "draft must be .* integer token ids"),
        (lambda: reference.one_hot_draft(draft + 5, 5), r"draft token ids must be in \[0, vocab_size\)"),
        (lambda: reference.one_hot_draft(draft, 0), "vocab_size must be a positive int"),
        (lambda: ar(p, q, draft, None, r), "u .* and r .* uniforms are required"),
        (lambda: ar(p, q, draft, u, None), "u .* and r .* uniforms are required"),
    ]
    for call, msg in cases:
        with pytest.raises(ValueError, match=msg):
            call()

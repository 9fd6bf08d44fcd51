"""Module 13's copying tasks (``llmu.mamba.tasks``) and the Blelloch picture (``llmu.mamba.picture``).

The generators: shapes, token ranges, data at distinct random positions (selective) or the first
positions (copying), targets only at the markers and equal to the data in order, seeded batches
reproducible, bad arguments refused. The loss and accuracy score the answer positions only.
The picture's rounds end in the recurrence's states.
"""

from __future__ import annotations

import math

import pytest
import torch

from llmu.mamba import tasks
from llmu.mamba.picture import blelloch_rounds, scan_figure


@pytest.mark.parametrize("make", [tasks.selective_copying_batch, tasks.copying_batch])
@pytest.mark.parametrize("context_len, n_data, n_symbols", [(16, 4, 8), (5, 5, 1), (33, 3, 16)])
def test_batch_layout(make, context_len, n_data, n_symbols):
    b = make(64, context_len, n_data, n_symbols, generator=1)
    T = context_len + n_data
    assert b.inputs.shape == b.targets.shape == (64, T) and b.answer.shape == (64, n_data)
    assert b.inputs.dtype == torch.long
    context, markers = b.inputs[:, :context_len], b.inputs[:, context_len:]
    assert (markers == tasks.marker_token(n_symbols)).all()
    # exactly n_data data tokens in the context, the rest noise; data ids in 1..n_symbols
    is_data = context != tasks.NOISE
    assert (is_data.sum(1) == n_data).all()
    assert context[is_data].min() >= 1 and context[is_data].max() <= n_symbols
    # the data tokens read left to right are the answer, which is the target at the markers
    assert torch.equal(context[is_data].view(64, n_data), b.answer)
    assert torch.equal(b.targets[:, context_len:], b.answer)
    assert (b.targets[:, :context_len] == tasks.IGNORE).all()
    assert torch.equal(b.mask, b.targets != tasks.IGNORE) and int(b.mask.sum()) == 64 * n_data
    assert b.inputs.max() < tasks.vocab_size(n_symbols)


def test_positions_fixed_for_copying_random_for_selective():
    fixed = tasks.copying_batch(200, 20, 4, 8, generator=0)
    assert (fixed.inputs[:, :4] != tasks.NOISE).all() and (fixed.inputs[:, 4:20] == tasks.NOISE).all()
    sel = tasks.selective_copying_batch(2000, 20, 4, 8, generator=0)
    where = (sel.inputs[:, :20] != tasks.NOISE).float()
    # every position is used, each about n_data / context_len = 1/5 of the time (binomial, 2000 rows: sd 0.009)
    assert where.mean(0).min() > 0.15 and where.mean(0).max() < 0.25
    # the data symbols are uniform over 1..8 (expected 1000 each of 8000; sd about 30)
    counts = torch.bincount(sel.answer.flatten(), minlength=9)[1:]
    assert counts.min() > 850 and counts.max() < 1150


def test_seeded_and_generator_advances():
    a = tasks.selective_copying_batch(8, 16, 4, 8, generator=5)
    b = tasks.selective_copying_batch(8, 16, 4, 8, generator=5)
    assert torch.equal(a.inputs, b.inputs)
    g = torch.Generator().manual_seed(5)
    first = tasks.selective_copying_batch(8, 16, 4, 8, generator=g)
    second = tasks.selective_copying_batch(8, 16, 4, 8, generator=g)
    assert torch.equal(first.inputs, a.inputs) and not torch.equal(first.inputs, second.inputs)


def test_loss_and_accuracy_score_answers_only():
    b = tasks.selective_copying_batch(4, 10, 3, 5, generator=2)
    V = tasks.vocab_size(5)
    perfect = torch.full((4, 13, V), -10.0)
    perfect.scatter_(2, b.targets.clamp(min=0)[..., None], 10.0)       # right at answers, anything elsewhere
    perfect[:, :10] = torch.randn(4, 10, V)                             # garbage on the context: not scored
    assert tasks.answer_accuracy(perfect, b) == 1.0
    assert tasks.answer_loss(perfect, b).item() < 1e-6
    uniform = torch.zeros(4, 13, V)
    assert math.isclose(tasks.answer_loss(uniform, b).item(), math.log(V), rel_tol=1e-6)
    wrong = perfect.clone()
    wrong[0, 10] = 0.0
    wrong[0, 10, 0] = 5.0                                               # one answer wrong of 12
    assert math.isclose(tasks.answer_accuracy(wrong, b), 11 / 12)


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_data"):
        tasks.selective_copying_batch(2, 3, 4, 8)
    with pytest.raises(ValueError, match="batch"):
        tasks.copying_batch(0, 8, 2, 8)
    with pytest.raises(ValueError, match="n_symbols"):
        tasks.copying_batch(2, 8, 2, 0)
    with pytest.raises(TypeError, match="generator"):
        tasks.copying_batch(2, 8, 2, 4, generator="seed")
    b = tasks.copying_batch(2, 8, 2, 4, generator=0)
    with pytest.raises(ValueError, match="logits"):
        tasks.answer_loss(torch.zeros(2, 9, 6), b)


@pytest.mark.parametrize("P", [1, 2, 8, 16])
def test_blelloch_rounds_end_in_the_states(P):
    g = torch.Generator().manual_seed(P)
    a, b = torch.rand(P, generator=g).tolist(), torch.randn(P, generator=g).tolist()
    rounds = blelloch_rounds(a, b)
    assert len(rounds) == 2 * int(math.log2(P)) + 3
    x, states = 0.0, []
    for at, bt in zip(a, b):
        x = at * x + bt
        states.append(x)
    assert [p[1] for p in rounds[-1].pairs] == pytest.approx(states, rel=1e-9, abs=1e-12)
    fig = scan_figure(rounds, len(rounds) - 1)
    assert len(fig.data) >= len(rounds)
    with pytest.raises(ValueError, match="upto"):
        scan_figure(rounds, len(rounds))
    with pytest.raises(ValueError, match="power-of-two"):
        blelloch_rounds([1.0] * 3, [0.0] * 3)

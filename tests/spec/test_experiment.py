"""``llmu.spec.experiment``: the recipe of notebook 11's graded experiment, and its figures.

- :func:`step_counts` reads a loop's steps back from its draft's calls: on the tiny model, for
  every draft, several ``gamma`` (0 included), budgets that end mid-step and sampling as well as
  greedy decoding, the counts equal the loop's own ``SpecStats`` exactly (integers: no tolerance);
- :func:`estimate_alpha` is the maximum of the likelihood ``alpha^passed (1 - alpha)^failed``
  (checked on a grid of 10,001 points: the grid's best is within its spacing of the estimate);
  :func:`best_gamma` is the argmax of :func:`modelled_speedup` (brute force over the candidates);
  the fit of the step cost finds a line it was given; bad inputs raise ``ValueError``;
- on SmolLM2 (slow): the figures the notebook and the module's docstring state, recomputed. A
  greedy prompt-lookup loop is deterministic given the target's greedy tokens, so the steps of
  every ``gamma`` are simulated from one generation per prompt (and checked against a recorded
  run of llmu's loop), and every sweep the notebook allows is scored from them.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from llmu import course
from llmu.models import tiny_llama
from llmu.models.sampling import SamplingParams
from llmu.spec import experiment as ex
from llmu.spec.decode import expected_tokens_per_step, speculative_generate
from llmu.spec.drafts import EarlyExitDraft, NGramDraft

PROMPT = [5, 9, 3, 7, 5, 9, 3]
NOTEBOOK = course.repo_root() / "solutions" / "11_speculative_decoding" / "11_speculative_decoding.ipynb"


# -- reading the steps back ---------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("new", [1, 2, 7, 23])
@pytest.mark.parametrize("gamma", [0, 1, 3, 6])
@pytest.mark.parametrize("kind", ["ngram", "exit1", "exit2"])
def test_step_counts_equal_the_loops_own(kind, gamma, new, temperature):
    model = tiny_llama(0)
    draft = NGramDraft() if kind == "ngram" else EarlyExitDraft(model, int(kind[-1]))
    recorder = ex.RecordingDraft(draft)
    out = speculative_generate(model, recorder, PROMPT, new, gamma=gamma,
                               params=SamplingParams(temperature=temperature, seed=11))
    proposed, accepted, emitted, call_of = ex.step_counts(PROMPT, out.tokens, recorder.calls)
    s = out.stats
    assert (proposed, accepted, emitted) == (s.proposed, s.accepted, s.emitted)
    assert sum(c is not None for c in call_of) == len(recorder.calls)


@pytest.mark.parametrize("gamma", [0, 2, 5])
def test_run_recorded_with_llmus_loop(gamma):
    model = tiny_llama(0)
    record = ex.run_recorded(ex.llmu_generate, model, NGramDraft(), PROMPT, 17, gamma)
    out = speculative_generate(model, NGramDraft(), PROMPT, 17, gamma=gamma)
    assert record.tokens == out.tokens and record.gamma == gamma
    assert (record.proposed, record.accepted, record.emitted) == (out.stats.proposed, out.stats.accepted, out.stats.emitted)
    assert record.steps == out.stats.steps and record.tokens_per_step == out.stats.tokens_per_step
    assert len(record.pass_s) == record.steps and record.total_s >= record.draft_s >= 0
    timed = [t for t in record.pass_s if t is not None]
    done, asked = 0, 0                    # llmu's loop asks the draft whenever the budget leaves room for a proposal
    for e in record.emitted:
        asked += min(gamma, 17 - done - 1) > 0
        done += e
    assert all(t > 0 for t in timed) and len(timed) == max(asked - 1, 0)


def test_a_loop_that_asks_twice_a_step_is_refused():
    def _asking_twice(model, draft, prompt, n, gamma):
        out = speculative_generate(model, draft, prompt, n, gamma=gamma).tokens
        draft.propose(prompt + out[:1], gamma, SamplingParams())   # a stray call with an old context
        return out

    with pytest.raises(ValueError, match="once a step"):
        ex.run_recorded(_asking_twice, tiny_llama(0), NGramDraft(), PROMPT, 9, 3)


def test_a_loop_that_returns_the_wrong_number_of_tokens_is_refused():
    with pytest.raises(ValueError, match="returned 8 tokens"):
        ex.run_recorded(lambda m, d, p, n, g: ex.llmu_generate(m, d, p, n - 1, g), tiny_llama(0), NGramDraft(), PROMPT, 9, 3)


def test_sweep_runs_each_prompt_and_gamma(smollm2_free_tokenizer):
    model, tokenizer = smollm2_free_tokenizer
    records = ex.sweep(ex.llmu_generate, model, tokenizer, [1, 3], prompts=["a", "b"], max_new_tokens=6)
    assert list(records) == [("a", 1), ("a", 3), ("b", 1), ("b", 3)]
    assert all(len(r.tokens) == 6 for r in records.values())
    with pytest.raises(ValueError, match="gammas must be ints"):
        ex.sweep(ex.llmu_generate, model, tokenizer, [1.5])


@pytest.fixture
def smollm2_free_tokenizer(monkeypatch):
    """The tiny model, and prompts "a" and "b" standing for :mod:`llmu.spec.prompts`' names."""
    import llmu.spec.prompts as prompts

    monkeypatch.setattr(prompts, "prompt_ids", lambda tokenizer, name: {"a": PROMPT, "b": [1, 2, 3, 1, 2]}[name])
    return tiny_llama(0), None


# -- the model ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(6))
def test_estimate_alpha_maximises_the_likelihood(seed):
    g = torch.Generator().manual_seed(seed)
    steps = int(torch.randint(1, 40, (1,), generator=g))
    proposed = torch.randint(0, 9, (steps,), generator=g).tolist()
    proposed[0] = max(proposed[0], 1)
    accepted = [int(torch.randint(0, p + 1, (1,), generator=g)) for p in proposed]
    alpha = ex.estimate_alpha(proposed, accepted)

    def loglik(a):
        return sum(x * math.log(a) if x else 0.0 for x in accepted) + sum(
            math.log1p(-a) for p, x in zip(proposed, accepted) if x < p)

    grid = [i / 10_000 for i in range(1, 10_000)]
    best = max(grid, key=loglik)
    assert abs(best - alpha) <= 1e-4 + 1e-12 or alpha in (0.0, 1.0)


def test_estimate_alpha_by_hand():
    assert ex.estimate_alpha([4, 4, 4], [4, 1, 0]) == 5 / 7
    assert ex.estimate_alpha([3, 3], [3, 3]) == 1.0
    assert ex.estimate_alpha([3, 3], [0, 0]) == 0.0
    assert ex.estimate_alpha([0, 2, 0], [0, 1, 0]) == 0.5                 # steps without proposals count for nothing
    assert ex.estimate_alpha((4,), (2,)) == 2 / 3                          # any sequence


@pytest.mark.parametrize("proposed, accepted, match", [
    ([1, 2], [1], "one entry per step"), ([2], [3], "cannot accept more"), ([-1], [0], "ints >= 0"),
    ([2.0], [1], "ints >= 0"), ([True], [0], "ints >= 0"), ([0, 0], [0, 0], "no step proposed"),
    ([], [], "no step proposed"), ("12", "01", "sequence of ints"), (torch.tensor([1]), [1], "sequence of ints"),
])
def test_estimate_alpha_bad_inputs(proposed, accepted, match):
    with pytest.raises(ValueError, match=match):
        ex.estimate_alpha(proposed, accepted)


def test_predicted_tokens_per_step_averages_the_steps():
    assert ex.predicted_tokens_per_step(0.5, [2, 2, 0]) == pytest.approx((1.75 + 1.75 + 1) / 3, abs=1e-15)
    assert ex.predicted_tokens_per_step(1.0, [3, 1]) == 3.0
    with pytest.raises(ValueError, match="one count per step"):
        ex.predicted_tokens_per_step(0.5, [])


@pytest.mark.parametrize("alpha", [0.0, 0.12, 0.5, 0.8, 0.968, 1.0])
@pytest.mark.parametrize("cost", [0.0, 0.05, 0.32, 1.0])
@pytest.mark.parametrize("slope", [0.0, 0.15, 0.5])
def test_best_gamma_is_the_argmax(alpha, cost, slope):
    speedups = {g: expected_tokens_per_step(alpha, g) / (1 + slope * g + cost * g) for g in ex.CANDIDATES}
    assert ex.modelled_speedup(alpha, 0, cost, slope) == 1.0
    for g, s in speedups.items():
        assert ex.modelled_speedup(alpha, g, cost, slope) == s
    top = max(speedups.values())
    assert ex.best_gamma(alpha, cost, slope) == min(g for g, s in speedups.items() if s == top)


def test_best_gamma_by_hand():
    assert ex.best_gamma(0.8, 0.25, 0.0) == 3                              # 1.44, 1.63, 1.69, 1.68 at 1..4
    assert ex.best_gamma(0.8, 0.25, 0.0, [8, 2, 4]) == 4
    assert ex.best_gamma(0.12, 0.32, 0.0) == 0                             # the early exit after 4 blocks
    assert ex.best_gamma(0.0, 0.0, 0.0, [3, 0, 5]) == 0 and ex.best_gamma(0.0, 0.0, 0.0, [4, 2]) == 2
    assert ex.best_gamma(1.0, 0.0, 0.1) == 8 and ex.best_gamma(1, 0, 0, range(3)) == 2
    assert ex.best_gamma(0.9, 0.0, 0.5) == 3


@pytest.mark.parametrize("args, match", [
    ((1.2, 0.0, 0.0), "alpha"), ((-0.1, 0.0, 0.0), "alpha"), ((float("nan"), 0.0, 0.0), "alpha"), ((True, 0.0, 0.0), "alpha"),
    ((0.5, -0.1, 0.0), "draft_cost"), ((0.5, float("inf"), 0.0), "draft_cost"), ((0.5, True, 0.0), "draft_cost"),
    ((0.5, 0.0, float("nan")), "slope"), ((0.5, 0.0, -1), "slope"), ((0.5, 0.0, 0.0, []), "gammas"),
    ((0.5, 0.0, 0.0, [1, -1]), "gammas"), ((0.5, 0.0, 0.0, [1.0, 2]), "gammas"), ((0.5, 0.0, 0.0, [True, 2]), "gammas"),
    ((0.5, 0.0, 0.0, "12"), "gammas"),
])
def test_best_gamma_bad_inputs(args, match):
    with pytest.raises(ValueError, match=match):
        ex.best_gamma(*args)


def test_modelled_speedup_bad_gamma():
    with pytest.raises(ValueError, match="gamma"):
        ex.modelled_speedup(0.5, -1, 0.0, 0.0)


def _record(proposed, pass_s, draft_s=0.0):
    n = len(proposed)
    return ex.Record([1], max(proposed), [0] * n, list(proposed), [0] * n, [1] * n, list(pass_s), draft_s, 1.0)


def test_fit_step_cost_finds_the_line_it_was_given():
    t1, s = 0.04, 0.12                    # 40 ms a one-token pass, 12% more per extra proposal
    rec = [_record([g] * 5, [9.9] + [t1 * (1 + s * g)] * 3 + [None]) for g in (1, 3, 6)]   # step 0 (prefill) ignored
    got_t1, got_s = ex.fit_step_cost(rec)
    assert got_t1 == pytest.approx(t1, rel=1e-12) and got_s == pytest.approx(s, rel=1e-10)
    assert ex.draft_cost([_record([2, 2], [None, None], draft_s=0.0004)], 0.05) == pytest.approx(0.0004 / 4 / 0.05)
    with pytest.raises(ValueError, match="two numbers of proposals"):
        ex.fit_step_cost([_record([2, 2, 2], [0.1, 0.1, None])])
    with pytest.raises(ValueError, match="proposals and a positive step time"):
        ex.draft_cost([_record([0], [None])], 0.05)


def test_recording_draft_needs_a_draft():
    with pytest.raises(TypeError, match="Draft"):
        ex.RecordingDraft(object())


# -- the figures of the notebook and of the module's docstring, on SmolLM2 ------------------------

def _greedy_steps(draft, prompt, greedy, gamma, new):
    """The steps of a greedy loop with a deterministic ``draft``, given the target's greedy tokens."""
    k, proposed, accepted, emitted = 0, [], [], []
    while k < new:
        g = min(gamma, new - k - 1)
        prop = draft.lookup(prompt + greedy[:k], g) if g > 0 else []
        n = 0
        while n < len(prop) and prop[n] == greedy[k + n]:
            n += 1
        proposed.append(len(prop)), accepted.append(n), emitted.append(n + 1)
        k += n + 1
    return proposed, accepted, emitted


def _naive(proposed, accepted):
    return sum(accepted) / sum(proposed)


def _prose(grade_id):
    return " ".join(course.cells_by_grade_id(NOTEBOOK)[grade_id].split())


@pytest.mark.slow
def test_the_stated_figures(smollm2):
    from llmu.spec.prompts import prompt_ids

    model, tokenizer = smollm2
    new, draft = ex.MAX_NEW_TOKENS, NGramDraft(3, 1)
    steps = {}
    for name in (*ex.PROMPTS, "story"):
        prompt = prompt_ids(tokenizer, name)
        greedy = speculative_generate(model, NGramDraft(), prompt, new, gamma=8).tokens
        for g in range(1, 9):
            steps[name, g] = _greedy_steps(draft, prompt, greedy, g, new)
        if name == "edit":      # the simulation is what a loop does: one recorded run of llmu's loop
            r = ex.run_recorded(ex.llmu_generate, model, NGramDraft(), prompt, new, 4)
            assert (r.proposed, r.accepted, r.emitted) == steps[name, 4] and r.tokens == greedy

    def tps(name, g):
        return sum(steps[name, g][2]) / len(steps[name, g][2])

    def pooled(name, gammas):
        return ([x for g in gammas for x in steps[name, g][0]], [x for g in gammas for x in steps[name, g][1]])

    def worst_miss(estimate, gammas):
        worst = 0.0
        for name in ex.PROMPTS:
            alpha = estimate(*pooled(name, gammas))
            for g in gammas:
                worst = max(worst, abs(ex.predicted_tokens_per_step(alpha, steps[name, g][0]) / tps(name, g) - 1))
        return worst

    allowed = [s for k in (3, 4) for s in itertools.combinations(range(1, 9), k) if max(s) >= 6]
    mle = [worst_miss(ex.estimate_alpha, s) for s in allowed]
    naive = [worst_miss(_naive, s) for s in allowed]
    assert max(mle) <= ex.TOLERANCE < min(naive)
    experiment_md = _prose("ex5_experiment_md")
    assert f"within {max(mle):.1%} over every sweep allowed here" in experiment_md                      # 11.6%
    assert f"miss by {min(naive):.0%} to {max(naive):.0%}" in experiment_md                              # 23% to 47%
    assert f"within **{ex.TOLERANCE:.0%}**" in experiment_md and f"at least **{ex.MIN_TOKENS_PER_STEP}**" in experiment_md
    assert f"($\\gamma = 2$ gives {tps('edit', 2):.2f}, $\\gamma = 3$ gives {tps('edit', 3):.2f})" in experiment_md
    assert tps("edit", 2) < ex.MIN_TOKENS_PER_STEP <= min(tps("edit", g) for g in range(3, 9))
    # the docstring: c + s below about 0.8 chooses gamma >= 3 on edit, whatever the sweep
    edit_alphas = [ex.estimate_alpha(*pooled("edit", s)) for s in allowed]
    assert min(ex.best_gamma(a, 0.8, 0.0) for a in edit_alphas) == 3
    assert "``c`` and ``s`` below about 0.8 chooses ``gamma >= 3``" in ex.__doc__
    story = pooled("story", (2, 4, 8))
    examined = sum(story[1]) + sum(a < p for p, a in zip(*story))
    assert f"accepted {sum(story[1])} times in {examined} examined" in ex.__doc__
    assert ex.best_gamma(ex.estimate_alpha(*story), 0.0, 0.1) == 0

    # the sweep of the solution, gamma 2, 4 and 8: the docstring's table and the model answer
    written = _prose("ex5_written")
    for name, line in (("edit", "edit       0.968 (91/94)"), ("summarise", "summarise  0.914 (85/93)")):
        counts = pooled(name, (2, 4, 8))
        alpha = ex.estimate_alpha(*counts)
        passed = sum(counts[1])
        assert f"{alpha:.3f} ({passed}/{round(passed / alpha)})" in line and line in ex.__doc__
        assert f"{alpha:.3f}" in written
        for g in (2, 4, 8):
            pred = ex.predicted_tokens_per_step(alpha, steps[name, g][0])
            row = (f"{g:<6d} {len(steps[name, g][2]):>2d}     {tps(name, g):.2f}         {pred:.2f} "
                   f"({pred / tps(name, g) - 1:+.0%})  {_naive(*steps[name, g][:2]):.2f}")
            assert row in ex.__doc__, row
    assert "(91 proposals accepted of 94 examined) and 0.914 on `summarise` (85 of 93)" in written
    assert ("0.93, 0.89 and 0.89 on `edit` at $\\gamma$ = 2, 4 and 8, and 0.86, 0.74 and 0.74 on `summarise`"
            in written)
    for name, g, want in (("edit", 8, "5.23 instead of 6.67 on `edit` at $\\gamma = 8$"),
                          ("summarise", 8, "3.26 instead of 5.00 on `summarise`")):
        pred = ex.predicted_tokens_per_step(_naive(*pooled(name, (2, 4, 8))), steps[name, g][0])
        assert f"{pred:.2f} instead of {tps(name, g):.2f}" in want and want in written
    s_alpha = ex.estimate_alpha(*pooled("summarise", (2, 4, 8)))
    assert (f"`summarise` at $\\gamma = 4$ ({ex.predicted_tokens_per_step(s_alpha, steps['summarise', 4][0]):.2f} "
            f"tokens per step predicted, {tps('summarise', 4):.2f} measured, +6%)") in written
    assert f"predicted slightly too few ({ex.predicted_tokens_per_step(s_alpha, steps['summarise', 8][0]):.2f} against 5.00)" in written
    e_alpha = ex.estimate_alpha(*pooled("edit", (2, 4, 8)))
    assert ex.best_gamma(e_alpha, 0.0, 0.15) == ex.best_gamma(s_alpha, 0.0, 0.15) == 8
    assert ex.best_gamma(s_alpha, 0.0, 0.3) == 6
    assert f"($\\gamma = 8$ gave {tps('edit', 8):.2f} tokens per step on `edit`)" in written
    lengths = [len(steps[n, g][2]) for n in ex.PROMPTS for g in (2, 4, 8)]
    assert f"a run holds {min(lengths)} to {max(lengths)} steps" in written

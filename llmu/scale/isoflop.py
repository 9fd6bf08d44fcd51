"""IsoFLOP profiles: a Chinchilla scaling law fitted from your own training runs (Hoffmann et al. 2022, approach 2).

``llmu.scale.chinchilla`` *uses* a fitted law. This module *makes* one, the way Hoffmann et al.'s
second approach did, at a scale this CPU trains in about a minute.

**An isoFLOP profile.** Fix a training budget of ``C`` FLOPs. Train models of several sizes ``N``,
each on the ``D = C / (6 N)`` tokens that the budget buys it (``C = 6·N·D``,
``llmu.scale.flops``), so that every run spends the same compute, and measure each one's final
held-out loss. Plotted against ``log N`` the losses form a valley: a model too small cannot hold
what the data teaches, however long it trains; a model too large sees too few tokens (takes too
few steps) to learn what it could hold. The bottom of the valley, ``N_opt(C)``, is the best size
for that budget. Repeat for several budgets: one valley each (Hoffmann et al., figure 3).

**Why a parabola in log N.** Near its minimum any smooth curve is a parabola (a Taylor expansion
to second order), and the valley is smooth and close to symmetric in ``x = ln N``: along
``D = C/(6N)`` the law ``L = E + A/N^α + B/D^β`` of ``llmu.scale.chinchilla`` reads
``E + A·e^(-αx) + B'·e^(βx)``, one falling and one rising exponential in ``x``, a convex curve.
So each profile is fitted with ``loss ≈ p₂x² + p₁x + p₀`` by least squares, and its vertex
``x* = -p₁ / (2 p₂)`` gives ``N_opt = e^(x*)`` (:func:`fit_parabola`). The fit uses every run of
the budget, so it places the minimum between the sizes trained, less noisily than the best run.

**The power laws.** With one ``N_opt`` per budget, fit a straight line in log-log,
``ln N_opt = ln k + a·ln C`` (:func:`fit_power_law`): ``N_opt = k·C^a``. The tokens follow from
the budget, ``D_opt = C / (6 N_opt) = C^(1-a) / (6k)``, so ``D_opt ∝ C^b`` with **a + b = 1**
exactly (a least-squares line through ``ln D = ln C - ln 6 - ln N`` is the same line turned
over). Hoffmann et al. found ``a = 0.49``, ``b = 0.51`` by this approach (their table 2; 0.50 and
0.50 by their approach 1): grow the model and the data equally, each as ``√C``. Kaplan et al.
(2020) had found ``a = 0.73``; Hoffmann et al. trace much of the gap to Kaplan's runs sharing one
learning-rate schedule, longer than most of them, so that short runs were measured before their
rate had decayed.

**Each run is trained to its own end.** Hence the schedule (module 04's
``llmu.training.loop.Trainer``): AdamW, a linear warmup over the first 10 % of the run's steps,
then a cosine down to 10 % of the peak rate at exactly the run's last step, the standard of
Chinchilla-style runs (Hoffmann et al. found that a cosine cycle more than 25 % longer than the
run leaves it measurably undertrained). One peak rate serves every size, and every run starts
from the same seed (the same data order and initialisation stream), so that the runs differ in
their size and length only.

**What is counted.** ``N`` is the matmul parameter count, ``llmu.scale.flops.matmul_parameters``:
the weights that multiply activations, without the embedding table, a lookup that does no
arithmetic (the untied LM head counts). Chinchilla counted all parameters, which at 70 B differs
by under 1 %; here the 256-row embedding is a third of a model (4,096 of 12,336 parameters at
hidden 16), so counting it would break ``C = 6·N·D``. The budget is ``6·N·D``; attention's scores
and weighted sums add ``6·n_layers·d_attn·(T + 1)`` per token (``llmu.scale.flops``), 6 to 14 %
more at the 64-byte context used here (:attr:`IsoRun.flops_with_attention`), left out of the
budget as in the ``6ND`` rule.

**The data.** The training text is ``llmu.data.text("luke_kjv")`` (135 KB of the King James
Gospel of Luke, read as bytes: vocabulary 256), its last 10 % held out and never trained on. A
run's loss is the mean next-byte loss (nats per byte) on the same 128 consecutive windows of 64
bytes of that held-out tail (8,192 bytes: 8 batches of 16), measured once, after the last step.

**What this CPU shows** (the figures are in the source, above :data:`BUDGETS`). Thirteen runs
of one-layer models of 4 K to 40 K parameters, at 1.5e10, 3e10 and 6e10 FLOPs, train in about
45 s on one thread. Each budget gives a valley with its bottom inside the sizes trained; ``N_opt``
grows from about 7 K to 10.5 K to 13.5 K parameters, at about 45 tokens per parameter (more than
Chinchilla's 20, which counted all parameters, at a scale a million times larger), and
``a`` comes out between 0.38 and 0.53 over three seeds. The valleys are noisy: at this size a
run's loss moves by up to 0.18 nats from one seed to the next, and a budget range of 4x pins the
exponent no closer than that.

**What a GPU would show.** Hoffmann et al. spanned 6e18 to 3e21 FLOPs, a range of 500x, with
models of 70 M to 16 B parameters. With budgets a million times this grid's (1e16 to 1e17 FLOPs a
run, a few GPU-hours for a grid), the optimum would move to millions of parameters, where the
embedding and the LM head no longer dominate the count and a run's seed matters less; and several
decades of ``C`` would pin the exponent. One would expect ``a`` near Chinchilla's 0.5; this module
has not measured it.

**The reference fitting functions** (:func:`fit_parabola`, :func:`fit_power_law`,
:func:`fit_isoflop`) are what the notebook's learner writes again.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch

from llmu.checks import require_int, require_positive
from llmu.data import byte_tokens, text as shipped_text
from llmu.models import LlamaConfig, byte_llama_config, make_trainable
from llmu.scale.flops import matmul_parameters, train_step_flops
from llmu.training.loop import TokenWindows, TrainConfig, Trainer
from llmu.training.runs import heldout_loss

__all__ = ["BUDGETS", "SIZES", "BATCH", "SEQ_LEN", "HEAD_DIM", "PEAK_LR", "WARMUP_FRACTION", "TEXT", "HELDOUT",
           "EVAL_WINDOWS", "TOKENS_PER_PARAMETER_RANGE", "MIN_STEPS", "IsoRun", "isoflop_grid", "run_grid",
           "group_by_budget", "Vertex", "fit_parabola", "fit_power_law", "IsoFlopFit", "fit_isoflop"]

# ----------------------------------------------------------------------------------------------
# The measured defaults
# ----------------------------------------------------------------------------------------------
#
# Measured on the course's 2-core CPU, one torch thread, the machine shared with other jobs:
#
#     runs = run_grid(isoflop_grid(), seed=S); fit = fit_isoflop(runs)
#
# Held-out loss (nats per byte) of each run, seeds 0 / 1 / 2; N in matmul parameters; "-": a size
# outside TOKENS_PER_PARAMETER_RANGE at that budget, not trained.
#
#   budget   8x1 (3,864)     16x1 (8,240)    24x1 (13,128)   32x1 (24,672)   48x1 (40,080)   N_opt
#   1.5e10   2.08/2.06/2.06  2.06/1.98/2.00  2.04/2.04/2.05  2.24/2.34/2.33  -               7.5K/7.2K/7.1K
#   3e10     2.03/2.08/2.05  1.82/1.80/1.79  1.80/1.81/1.80  1.92/2.09/2.00  2.22/2.22/2.19  10.7K/10.4K/10.7K
#   6e10     -               1.68/1.69/1.73  1.66/1.66/1.67  1.69/1.77/1.70  1.95/2.01/1.91  13.5K/12.3K/14.8K
#
# a = 0.42 / 0.38 / 0.53 (b = 0.58 / 0.62 / 0.47): N_opt grows with C for every seed, and every
# vertex lies inside its sizes. The 13 runs took 46 s / 52 s of wall-clock time for seeds 0 / 1
# (44 s / 46 s of CPU time; seed 2 ran beside another job: 54 s of CPU time). The optimum sits at
# about 45 tokens per (matmul) parameter. A check beyond the grid, at 1.2e11 FLOPs (sizes 16x1 to
# 64x1): the fits of seeds 0 / 1 predicted N_opt = 18.0K / 16.1K, the parabola through the runs
# put it at 18.3K / 18.3K; they predicted a lowest loss of 1.46 / 1.52 where the runs reached
# 1.58 / 1.56 (the pure power law in C runs ahead of a loss that levels off).
#
# Noise: a run's loss moves by up to 0.18 nats from seed to seed (32x1 at 3e10), so the valleys
# are noisy and the lowest budget's is shallow on its left (8x1 only 0.04 above the bottom for
# seed 0); the parabola, fitted to all of a budget's runs, is steadier than its lowest run, and
# the exponent lands within about 0.07 of 0.45 over three seeds: a budget range of 4x pins ``a``
# no closer. Tried and dropped: PEAK_LR = 5e-3 (losses 0.05 to 0.1 higher, and seed 0's lowest
# budget has no valley: its 8x1 run is its lowest), lower budgets (at 1e10 the 8x1 model is no
# wall and the vertex can leave the sizes), heads of 16 channels (16x1 for 593 steps at 5e-3:
# 1.97 over four seeds, against 1.91 with heads of 8), two-layer models (about twice the time per
# token, no clearly lower loss at these budgets), and a wider window, tokens_per_parameter =
# (1.5, 700): 16 runs, 8x1 at 6e10 alone 2,529 steps, a = 0.45 / 0.47 for seeds 0 / 1, about
# 60 s of CPU time (estimated from the per-step times). The largest run, 16x1 at 6e10, reads the
# 121 KB training text 10 times over; in a longer one (16x1, 1,975 steps, 17 passes, at 5e-3)
# the held-out loss still fell over the last eighth of the run: no sign of memorising.

#: The FLOP budgets of the default grid, a factor of 2 apart.
BUDGETS = (1.5e10, 3e10, 6e10)
#: The model sizes, ``(hidden, layers)`` of ``llmu.models.byte_llama_config`` with heads of
#: :data:`HEAD_DIM` channels: one layer, widths 8 to 64, ``N`` = 3,864 to 69,824 matmul parameters
#: (64x1 joins from 8.8e10 FLOPs on, where it gets 3 tokens per parameter).
SIZES = ((8, 1), (16, 1), (24, 1), (32, 1), (48, 1), (64, 1))
#: Windows per step and bytes per window: 1,024 tokens a step.
BATCH = 16
SEQ_LEN = 64
#: Channels per attention head: 8, so that even hidden 8 has a head.
HEAD_DIM = 8
#: AdamW's peak learning rate, the same for every size; the warmup's share of a run's steps.
PEAK_LR = 1e-2
WARMUP_FRACTION = 0.1
#: The shipped text trained on, the share of it held out, and the held-out windows scored.
TEXT = "luke_kjv"
HELDOUT = 0.1
EVAL_WINDOWS = 128
#: The window of ``D/N`` that :func:`isoflop_grid` trains at each budget, around the ~45 measured
#: at the optimum: 4 or 5 sizes a budget, from about 3 times smaller than ``N_opt`` to 3 times larger.
TOKENS_PER_PARAMETER_RANGE = (3.0, 400.0)
#: The fewest steps :func:`isoflop_grid` plans a run for: a shorter run would be mostly warmup, and
#: rounding ``D`` to whole steps would move its FLOPs by more than ``1 / (2·MIN_STEPS) = 2.5 %``.
MIN_STEPS = 20


# ----------------------------------------------------------------------------------------------
# The grid: which runs spend which budget
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class IsoRun:
    """One run of an isoFLOP grid: a model ``config``, planned for ``budget`` FLOPs as ``steps``
    optimizer steps of ``batch`` windows of ``seq_len`` tokens.

    ``params`` is ``N``, the matmul parameters (module docstring); ``tokens`` is ``D``;
    ``flops = 6·N·D`` is what the run spends, the budget up to rounding ``D`` to whole steps.
    ``loss`` (held-out nats per byte after the last step) and ``seconds`` (wall-clock time of
    training and evaluation) are ``None`` until :func:`run_grid` has trained the run.
    """

    config: LlamaConfig
    budget: float
    params: int
    steps: int
    batch: int
    seq_len: int
    loss: float | None = None
    seconds: float | None = None

    @property
    def tokens(self) -> int:
        return self.steps * self.batch * self.seq_len

    @property
    def flops(self) -> float:
        """``6·N·D``: the compute this run spends, the quantity its budget fixes."""
        return 6.0 * self.params * self.tokens

    @property
    def flops_with_attention(self) -> int:
        """The run's model FLOPs with attention's scores and weighted sums too
        (``llmu.scale.flops.train_step_flops`` per step)."""
        return self.steps * train_step_flops(self.config, self.batch, self.seq_len)

    @property
    def tokens_per_parameter(self) -> float:
        return self.tokens / self.params


def _size_config(index: int, size, head_dim: int, seq_len: int) -> LlamaConfig:
    """``sizes[index]`` as a byte-level ``LlamaConfig``: a config as it is, or ``(hidden, layers)``."""
    if isinstance(size, LlamaConfig):
        config = size
    elif isinstance(size, (tuple, list)) and len(size) == 2:
        hidden, layers = size
        config = byte_llama_config(hidden, layers, max_len=seq_len, head_dim=head_dim)
    else:
        raise TypeError(f"sizes[{index}] must be a (hidden, layers) pair or an llmu LlamaConfig, got {size!r}")
    if config.vocab_size != 256:
        raise ValueError(f"sizes[{index}]: the runs train on bytes, so vocab_size must be 256, "
                         f"got {config.vocab_size}")
    if config.max_position_embeddings < seq_len:
        raise ValueError(f"sizes[{index}]: max_position_embeddings ({config.max_position_embeddings}) is "
                         f"shorter than seq_len ({seq_len})")
    return config


def _budgets(budgets) -> list[float]:
    if not isinstance(budgets, (Sequence, np.ndarray)) or isinstance(budgets, str) or not len(budgets):
        raise TypeError(f"budgets must be a non-empty sequence of FLOP counts, got {budgets!r}")
    values = [float(require_positive(f"budgets[{i}]", c)) for i, c in enumerate(budgets)]
    if len(set(values)) != len(values):
        raise ValueError(f"budgets must be distinct, got {list(budgets)}")
    return values


def isoflop_grid(budgets: Sequence[float] = BUDGETS, sizes: Sequence = SIZES, *,
                 tokens_per_parameter: tuple[float, float] | None = TOKENS_PER_PARAMETER_RANGE, batch: int = BATCH,
                 seq_len: int = SEQ_LEN, head_dim: int = HEAD_DIM, min_steps: int = MIN_STEPS) -> list[IsoRun]:
    """Plan an isoFLOP grid: for every budget ``C`` in ``budgets`` and every model in ``sizes``,
    the run that spends ``C = 6·N·D`` (untrained :class:`IsoRun` objects, by budget, then size).

    ``sizes`` holds ``(hidden, layers)`` pairs (``llmu.models.byte_llama_config`` with heads of
    ``head_dim`` channels and room for ``seq_len`` positions) or ready byte-level configs. A run
    takes ``batch · seq_len`` tokens a step, so ``D`` is a whole number of steps,
    ``steps = round(C / (6·N·batch·seq_len))``, and ``6·N·D`` is within ``1 / (2·steps)`` of
    ``C`` (2.5 % at ``min_steps = 20``).

    ``tokens_per_parameter = (low, high)`` keeps only the runs with ``low <= D/N <= high``
    (``None``: every pair). A size far from a budget's optimum is a point high on one wall of its
    valley: it adds little to the fit, and at the small end it is the dearest run of the grid (the
    smallest model takes the most steps). So each budget trains the sizes around its own optimum,
    as Hoffmann et al.'s grids did, and the window slides to larger models as the budget grows.

    ValueError for a kept run with fewer than ``min_steps`` steps (raise the budget or drop the
    size) and for a budget that keeps no run at all.
    """
    values = _budgets(budgets)
    if tokens_per_parameter is not None:
        if not isinstance(tokens_per_parameter, (tuple, list)) or len(tokens_per_parameter) != 2:
            raise TypeError(f"tokens_per_parameter must be a (low, high) pair or None, got {tokens_per_parameter!r}")
        low, high = (require_positive(f"tokens_per_parameter[{i}]", v) for i, v in enumerate(tokens_per_parameter))
        if low > high:
            raise ValueError(f"tokens_per_parameter must be (low, high) with low <= high, got {tokens_per_parameter!r}")
    if not isinstance(sizes, Sequence) or isinstance(sizes, str) or not sizes:
        raise TypeError(f"sizes must be a non-empty sequence of (hidden, layers) pairs or configs, got {sizes!r}")
    require_positive("batch", batch, integer=True)
    require_positive("seq_len", seq_len, integer=True)
    require_positive("head_dim", head_dim, integer=True)
    require_positive("min_steps", min_steps, integer=True)
    configs = [_size_config(i, size, head_dim, seq_len) for i, size in enumerate(sizes)]
    plan = []
    for c in values:
        kept = 0
        for config in configs:
            n = matmul_parameters(config)
            if tokens_per_parameter is not None and not low <= c / (6 * n * n) <= high:
                continue                                      # D/N = C / (6N²): far from this budget's valley
            steps = round(c / (6 * n * batch * seq_len))     # D = C / (6N), in whole steps
            if steps < min_steps:
                raise ValueError(f"budgets: {c:.3g} FLOPs buy {config.name} (N = {n:,}) only {steps} steps of "
                                 f"{batch}x{seq_len} tokens, fewer than min_steps={min_steps}: raise the budget "
                                 "or drop the size")
            plan.append(IsoRun(config, c, n, steps, batch, seq_len))
            kept += 1
        if not kept:
            raise ValueError(f"budgets: no size has between {low} and {high} tokens per parameter at {c:.3g} FLOPs "
                             "(tokens_per_parameter): add sizes, or widen the range")
    return plan


# ----------------------------------------------------------------------------------------------
# Training the grid
# ----------------------------------------------------------------------------------------------

def run_grid(plan: Sequence[IsoRun], *, seed: int = 0, text: str = TEXT, heldout: float = HELDOUT,
             peak_lr: float = PEAK_LR, warmup_fraction: float = WARMUP_FRACTION, eval_windows: int = EVAL_WINDOWS,
             threads: int = 1, callback: Callable[[IsoRun], object] | None = None) -> list[IsoRun]:
    """Train every run of ``plan`` (from :func:`isoflop_grid`) and return them with their held-out
    ``loss`` and ``seconds`` filled in, in the plan's order.

    Each run: fresh weights (``llmu.models.make_trainable``, seeded with ``seed``), module 04's
    ``Trainer`` (AdamW, gradient clipping at 1, weight decay 0.1) on random windows of the first
    ``1 - heldout`` of ``llmu.data.text(text)`` (``TokenWindows``, seeded with ``seed``), with a
    warmup over ``warmup_fraction`` of the run's steps and a cosine from ``peak_lr`` to
    ``peak_lr / 10`` at its last step; then the mean loss over the first ``eval_windows`` windows
    of the held-out tail, or as many as it holds (``llmu.training.runs.heldout_loss``). Torch runs on ``threads`` threads
    meanwhile (restored after): on one thread a seed gives the same losses, bit for bit.
    ``callback`` gets each finished run, to print or plot progress.
    """
    if not isinstance(plan, Sequence) or not plan:
        raise TypeError(f"plan must be a non-empty sequence of IsoRun (from isoflop_grid), got {plan!r}")
    for i, run in enumerate(plan):
        if not isinstance(run, IsoRun):
            raise TypeError(f"plan[{i}] must be an IsoRun (from isoflop_grid), got {type(run).__name__}")
    seed = require_int("seed", seed, 0)
    if not isinstance(heldout, numbers.Real) or isinstance(heldout, bool) or not 0 < heldout < 1:
        raise ValueError(f"heldout must be a fraction in (0, 1), got {heldout!r}")
    require_positive("peak_lr", peak_lr)
    if not isinstance(warmup_fraction, numbers.Real) or isinstance(warmup_fraction, bool) \
            or not 0 <= warmup_fraction < 1:
        raise ValueError(f"warmup_fraction must be a fraction in [0, 1), got {warmup_fraction!r}")
    require_positive("eval_windows", eval_windows, integer=True)
    require_positive("threads", threads, integer=True)
    if callback is not None and not callable(callback):
        raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")

    # 1. the text's bytes, split once: the training stream, then the held-out tail
    tokens = byte_tokens(shipped_text(text))
    cut = int(tokens.numel() * (1 - heldout))
    train_tokens, test_tokens = tokens[:cut], tokens[cut:]

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    done = []
    try:
        for run in plan:
            start = time.perf_counter()
            # 2. a schedule that ends with the run: warmup, then cosine to peak/10 at its last step
            schedule = TrainConfig(total_steps=run.steps, batch_size=run.batch, peak_lr=peak_lr,
                                   min_lr=peak_lr / 10, warmup=round(warmup_fraction * run.steps))
            # 3. the same seed for every run: same initialisation stream, same data order
            model = make_trainable(run.config, seed=seed)
            trainer = Trainer(model, TokenWindows(train_tokens, run.seq_len, seed=seed), schedule)
            trainer.train(run.steps)
            # 4. the loss that goes on the profile: held-out bytes, always the same windows
            loss = heldout_loss(model, test_tokens, run.seq_len, windows=eval_windows)
            done.append(replace(run, loss=loss, seconds=time.perf_counter() - start))
            if callback is not None:
                callback(done[-1])
    finally:
        torch.set_num_threads(before)
    return done


# ----------------------------------------------------------------------------------------------
# The fits (what the learner writes again)
# ----------------------------------------------------------------------------------------------

def _reals(name: str, values) -> np.ndarray:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)):
        raise TypeError(f"{name} must be a sequence of numbers, got {type(values).__name__}")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{name}[{i}] must be a number, got {v!r}")
        if not math.isfinite(v):
            raise ValueError(f"{name}[{i}] must be finite, got {v!r}")
    return np.asarray(values, dtype=np.float64)


class Vertex(NamedTuple):
    """The lowest point of a fitted parabola: where (``log_n``) and how low (``loss``)."""

    log_n: float
    loss: float


def fit_parabola(log_n: Sequence[float], loss: Sequence[float]) -> Vertex:
    """Least-squares parabola ``loss ≈ p₂·x² + p₁·x + p₀`` through the points ``(log_n, loss)``
    of one isoFLOP profile; returns its vertex, ``x* = -p₁ / (2 p₂)`` and the parabola's value
    there (module docstring).

    ``log_n`` in any base (the vertex comes back in the same). ValueError for fewer than 3
    points, fewer than 3 distinct sizes, or a parabola that opens downwards or is flat
    (``p₂ <= 0``): such a profile has no minimum, no valley, to report.
    """
    x, y = _reals("log_n", log_n), _reals("loss", loss)
    if len(x) != len(y):
        raise ValueError(f"log_n and loss must have the same length, got {len(x)} and {len(y)}")
    if len(x) < 3:
        raise ValueError(f"fit_parabola needs at least 3 points (a parabola has 3 coefficients), got {len(x)}")
    if len(np.unique(x)) < 3:
        raise ValueError(f"log_n needs at least 3 distinct values to fix a parabola, got {sorted(set(x.tolist()))}")
    p2, p1, p0 = np.polyfit(x, y, 2)       # least squares on the columns x², x, 1
    if not p2 > 0:
        raise ValueError(f"the fitted parabola opens downwards or is flat (x² coefficient {p2:.3g}): "
                         "the losses have no minimum inside these sizes, no valley")
    x_min = -p1 / (2 * p2)
    return Vertex(float(x_min), float(p0 - p1 * p1 / (4 * p2)))


def fit_power_law(budgets: Sequence[float], values: Sequence[float]) -> tuple[float, float]:
    """``(k, a)`` of ``value ≈ k · budget**a``, by least squares on the straight line
    ``ln value = ln k + a · ln budget`` (log-log). Every budget and value must be positive, and
    at least 2 budgets distinct."""
    c, v = _reals("budgets", budgets), _reals("values", values)
    if len(c) != len(v):
        raise ValueError(f"budgets and values must have the same length, got {len(c)} and {len(v)}")
    for name, array in (("budgets", c), ("values", v)):
        if (array <= 0).any():
            i = int(np.argmax(array <= 0))
            raise ValueError(f"{name}[{i}] must be positive (a power law is a line in log-log), got {array[i]!r}")
    if len(np.unique(c)) < 2:
        raise ValueError(f"fit_power_law needs at least 2 distinct budgets, got {c.tolist()}")
    a, ln_k = np.polyfit(np.log(c), np.log(v), 1)
    return float(math.exp(ln_k)), float(a)


def group_by_budget(runs: Sequence[IsoRun]) -> dict[float, list[IsoRun]]:
    """The trained runs of a grid, one isoFLOP profile per budget: ``{budget: runs by size}``,
    budgets ascending, ``N`` ascending within each."""
    if not isinstance(runs, Sequence) or not runs:
        raise TypeError(f"runs must be a non-empty sequence of IsoRun (from run_grid), got {runs!r}")
    profiles: dict[float, list[IsoRun]] = {}
    for i, run in enumerate(runs):
        if not isinstance(run, IsoRun):
            raise TypeError(f"runs[{i}] must be an IsoRun (from run_grid), got {type(run).__name__}")
        if run.loss is None:
            raise ValueError(f"runs[{i}] ({run.config.name} at {run.budget:.3g} FLOPs) has no loss: "
                             "train the plan with run_grid first")
        profiles.setdefault(run.budget, []).append(run)
    return {c: sorted(profiles[c], key=lambda r: r.params) for c in sorted(profiles)}


@dataclass(frozen=True)
class IsoFlopFit:
    """What :func:`fit_isoflop` found: per budget, the vertex of its profile (``n_opt``, the
    ``d_opt = C / (6·n_opt)`` it implies, ``loss_opt``), and the power laws through them:
    ``N_opt = n_coefficient · C**a``, ``D_opt = d_coefficient · C**b`` (``a + b = 1``), and
    ``loss_opt ≈ loss_coefficient · C**loss_exponent``."""

    budgets: tuple[float, ...]
    n_opt: tuple[float, ...]
    d_opt: tuple[float, ...]
    loss_opt: tuple[float, ...]
    n_coefficient: float
    a: float
    d_coefficient: float
    b: float
    loss_coefficient: float
    loss_exponent: float

    def predict(self, flops: float) -> tuple[float, float]:
        """``(N_opt, D_opt)`` at a budget of ``flops``, from the power laws: an extrapolation
        beyond the budgets measured, as any prediction of a scaling law is."""
        c = float(require_positive("flops", flops))
        return self.n_coefficient * c ** self.a, self.d_coefficient * c ** self.b

    def predict_loss(self, flops: float) -> float:
        """The lowest held-out loss the fit expects at ``flops``: the vertices' losses fitted as a
        pure power law in ``C``. A local description only: it falls forever, while a real loss
        levels off at the entropy of the text (Chinchilla's ``E``), which a saturating law
        ``E + k·C^-γ`` would need more budgets than three to pin down."""
        c = float(require_positive("flops", flops))
        return self.loss_coefficient * c ** self.loss_exponent


def fit_isoflop(runs: Sequence[IsoRun]) -> IsoFlopFit:
    """Hoffmann et al.'s approach 2 on a trained grid (module docstring): a parabola in ``ln N``
    through each budget's losses (:func:`fit_parabola`), its vertex ``N_opt(C)``, and power laws
    through the vertices (:func:`fit_power_law`).

    Needs at least 2 budgets, each with at least 3 sizes, and each vertex inside the sizes its
    budget trained: a vertex beyond the smallest or the largest size is an extrapolation, not a
    measured valley (ValueError naming the budget: add a size on that side).
    """
    profiles = group_by_budget(runs)
    if len(profiles) < 2:
        raise ValueError(f"runs must cover at least 2 budgets to fit a power law, got {len(profiles)}")
    budgets, n_opt, loss_opt = [], [], []
    for c, profile in profiles.items():
        log_n = [math.log(run.params) for run in profile]
        try:
            vertex = fit_parabola(log_n, [run.loss for run in profile])
        except ValueError as error:
            raise ValueError(f"runs at budget {c:.3g}: {error}") from None
        if not log_n[0] <= vertex.log_n <= log_n[-1]:
            raise ValueError(f"runs at budget {c:.3g}: the parabola's minimum, N = {math.exp(vertex.log_n):,.0f}, "
                             f"lies outside the sizes trained ({profile[0].params:,.0f} to {profile[-1].params:,.0f}): "
                             "add a size on that side")
        budgets.append(c)
        n_opt.append(math.exp(vertex.log_n))
        loss_opt.append(vertex.loss)
    d_opt = [c / (6 * n) for c, n in zip(budgets, n_opt)]
    n_coefficient, a = fit_power_law(budgets, n_opt)
    d_coefficient, b = fit_power_law(budgets, d_opt)
    loss_coefficient, loss_exponent = fit_power_law(budgets, loss_opt)
    return IsoFlopFit(tuple(budgets), tuple(n_opt), tuple(d_opt), tuple(loss_opt), n_coefficient, a,
                      d_coefficient, b, loss_coefficient, loss_exponent)

"""Whole-model comparisons on a machine that other work shares: interleaved calls, paired ratios.

A whole-model benchmark (the tokens/s of a generation, say) calls each provider a few times, and
each call takes seconds. Meanwhile the load of the machine changes: a figure measured one minute
and another measured ten minutes later differ by the load as much as by the providers. Two habits
make a comparison hold anyway (:func:`interleave`):

* **interleave**: after a warm-up round, round ``r`` calls every provider once, always in the same
  order (``A, B, A, B, ...`` for two), so a busy minute slows all of them alike;
* **pair**: the ratio of round ``r``, ``ratio_r = A_r / B_r``, compares two calls made side by side.
  The comparison is the median of these ratios over the rounds; their spread (min..max, and the
  20th..80th percentiles) says how sure it is. When ``min <= 1 <= max`` some round had A ahead
  and another had B ahead: the two are **not distinguishable** here (``overlaps_1``). One round has
  no spread at all, and counts as not distinguishable.

The median of the ratios is not the ratio of the medians: a busy round slows both of its calls,
which lowers both figures and leaves their ratio almost where it was.

What a call returns: a number (its figure for that call, such as tokens/s), or a dict of named
figures (``{"decode_tokens_per_s": 61.0, "prefill_tokens_per_s": 480.0}``). In a dict,
``"output"`` is what the call produced (token ids): with ``check=`` it is compared with the
reference provider's output of the same round, and a provider that computed something else has a
mismatch (the benchmark reports an error, not a speed: a fast wrong answer is no result);
``"info"`` is anything else to keep per round. :func:`timed` makes a call whose figure is its wall
time in seconds and whose output is what the function returned.

The 1-minute load average (``os.getloadavg()``) at the start and at the end goes with the result:
above the number of cores, other processes competed for them, and every figure is slower than
the machine can do (the ratios much less so).
"""

from __future__ import annotations

import math
import numbers
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from llmu.bench.runner import _summary

__all__ = ["Paired", "interleave", "timed", "first_difference", "format_ratio", "load_average", "spread",
           "PAIRED_FIELDS"]

#: The keys :meth:`Paired.row_fields` adds to a result row, besides the figure and ``ms`` keys:
#: the paired ratio over the base provider ``ratio_to`` (``None`` on the base's own row) with its
#: spread, whether that spread includes 1, ``speedup`` (the ratio's median, 1 on the base's own row
#: or without a base), the rounds, and the load average at start and end.
PAIRED_FIELDS = ("ratio", "ratio_min", "ratio_max", "ratio_p20", "ratio_p80", "ratio_to", "ratio_overlaps_1", "speedup",
                 "rounds", "load_avg_start", "load_avg_end")

#: Keys of a call's dict that are not figures.
OUTPUT, INFO = "output", "info"
#: The name of the figure of a call that returns a bare number.
VALUE = "value"


def load_average() -> float | None:
    """The 1-minute load average of the machine (``None`` where the platform has none)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def spread(values: Iterable[float]) -> dict:
    """``median``, ``min``, ``max``, ``p20``, ``p80`` and ``n`` of ``values`` (percentiles
    interpolated between the sorted values, as numpy's default does)."""
    s = _summary([float(v) for v in values])
    return {"median": s["ms"], "min": s["ms_min"], "max": s["ms_max"], "p20": s["ms_p20"], "p80": s["ms_p80"],
            "n": s["n_samples"]}


def first_difference(expected, got, levels: Sequence[str] = (), _where: str = "") -> str | None:
    """Where ``got`` first differs from ``expected``, or ``None`` when they are equal.

    Lists and tuples (and tensors, via ``tolist()``) are compared item by item, nested ones level
    by level; ``levels`` names the levels for the message: with ``("request", "token")`` a
    difference reads ``"request 3, token 17: 512 instead of 77"``.
    """
    expected, got = _plain(expected), _plain(got)
    if isinstance(expected, (list, tuple)) and isinstance(got, (list, tuple)):
        level = levels[0] if levels else "item"
        for i, (e, g) in enumerate(zip(expected, got)):
            why = first_difference(e, g, levels[1:], f"{_where}{', ' if _where else ''}{level} {i}")
            if why:
                return why
        if len(got) != len(expected):
            where = f"{_where}: " if _where else ""
            return f"{where}{len(got)} {level}s instead of {len(expected)}"
        return None
    if got == expected:
        return None
    return f"{_where or 'output'}: {got!r} instead of {expected!r}"


def _plain(x):
    return x.tolist() if hasattr(x, "tolist") and not isinstance(x, (list, tuple, str, bytes)) else x


def timed(fn: Callable[[], object]) -> Callable[[], dict]:
    """A call for :func:`interleave` whose figure ``"seconds"`` is the wall time of ``fn()`` and
    whose ``"output"`` is what ``fn`` returned. (On a GPU, ``fn`` must wait for its work itself:
    turning its result into Python numbers, as token ids are, does.)"""
    if not callable(fn):
        raise TypeError(f"timed needs a function, got {type(fn).__name__}")

    def call() -> dict:
        start = time.perf_counter()
        out = fn()
        return {"seconds": time.perf_counter() - start, OUTPUT: out}

    return call


@dataclass
class Paired:
    """What :func:`interleave` measured: every round's figures, outputs and what they compare to.

    ``samples[name][figure]``: one value per round; ``outputs[name]``/``info[name]``: one per round
    (``None`` where the call gave none); ``order``: the names of the timed calls in the order they
    were made; ``mismatches[name]``: why ``name``'s output differs from ``reference``'s.
    """

    names: tuple[str, ...]
    base: str | None
    reference: str | None
    figure: str
    rounds: int
    warmup: int
    samples: dict[str, dict[str, list[float]]]
    outputs: dict[str, list]
    info: dict[str, list]
    order: list[str]
    mismatches: dict[str, str]
    load_avg_start: float | None
    load_avg_end: float | None

    def _figure(self, name: str, figure: str | None) -> str:
        if name not in self.samples:
            raise ValueError(f"no provider {name!r}; measured: {', '.join(self.names)}")
        figure = self.figure if figure is None else figure
        if figure not in self.samples[name]:
            raise ValueError(f"{name!r} has no figure {figure!r}; it has {', '.join(self.samples[name])}")
        return figure

    def stats(self, name: str, figure: str | None = None) -> dict:
        """Median, min, max, p20, p80 and n of ``name``'s ``figure`` over the rounds."""
        figure = self._figure(name, figure)
        return spread(self.samples[name][figure])

    def ratios(self, name: str, figure: str | None = None, *, over: str | None = None) -> list[float]:
        """The paired ratios of ``name`` over the base (or over provider ``over``), ``name_r / base_r``,
        one per round."""
        base = over if over is not None else self.base
        if base is None:
            raise ValueError("no base provider: pass base= to interleave() to get ratios")
        if base not in self.samples:
            raise ValueError(f"over={base!r} is not one of the providers: {', '.join(self.samples)}")
        figure = self._figure(name, figure)
        self._figure(base, figure)
        out = []
        for r, (a, b) in enumerate(zip(self.samples[name][figure], self.samples[base][figure])):
            if b == 0:
                raise ValueError(f"{base!r}'s {figure} is 0 in round {r + 1}: no ratio over it")
            out.append(a / b)
        return out

    def ratio(self, name: str, figure: str | None = None, *, over: str | None = None) -> dict | None:
        """The median and spread of :meth:`ratios`, with ``overlaps_1`` (``min <= 1 <= max``, or
        a single round); ``None`` for the base itself or when there is no base. ``over``: another
        provider to divide by, in place of the base."""
        base = over if over is not None else self.base
        if base is None or name == base:
            return None
        values = self.ratios(name, figure, over=base)
        out = spread(values)
        out["overlaps_1"] = len(values) < 2 or out["min"] <= 1.0 <= out["max"]
        return out

    def row_fields(self, name: str, figure: str | None = None, *, key: str | None = None,
                   rate: bool = True) -> dict:
        """The keys a result row of ``name`` takes from this measurement.

        ``ms``, ``ms_min``, ``ms_max``, ``ms_p20``, ``ms_p80``, ``n_samples``: from ``figure``,
        a rate (things per second: ``ms = 1000 / rate``, so the slowest round gives ``ms_max``)
        or, with ``rate=False``, seconds (``ms = 1000 * seconds``); ``key``, ``key_min``,
        ``key_max``: the figure's own median and range under the name ``key`` (as
        ``"tokens_per_s"``); then :data:`PAIRED_FIELDS`; and ``status="error"`` with the reason
        when ``name``'s output differed from the reference's.
        """
        figure = self._figure(name, figure)
        s = self.stats(name, figure)
        if rate:
            inv = {k: (1e3 / v if v > 0 else None) for k, v in s.items() if k != "n"}
            ms = {"ms": inv["median"], "ms_min": inv["max"], "ms_max": inv["min"], "ms_p20": inv["p80"],
                  "ms_p80": inv["p20"]}
        else:
            ms = {"ms": 1e3 * s["median"], "ms_min": 1e3 * s["min"], "ms_max": 1e3 * s["max"],
                  "ms_p20": 1e3 * s["p20"], "ms_p80": 1e3 * s["p80"]}
        out = {**ms, "n_samples": s["n"]}
        if key is not None:
            out.update({key: s["median"], f"{key}_min": s["min"], f"{key}_max": s["max"]})
        r = self.ratio(name, figure) if self.base is not None and figure in self.samples[self.base] else None
        out.update(ratio=None, ratio_min=None, ratio_max=None, ratio_p20=None, ratio_p80=None,
                   ratio_to=self.base if figure in self.samples.get(self.base, {}) else None,
                   ratio_overlaps_1=None, rounds=self.rounds, load_avg_start=self.load_avg_start,
                   load_avg_end=self.load_avg_end)
        out["speedup"] = 1.0  # the base's own, or with no base: the row is its own reference
        if r is not None:
            out.update(ratio=r["median"], ratio_min=r["min"], ratio_max=r["max"], ratio_p20=r["p20"],
                       ratio_p80=r["p80"], ratio_overlaps_1=r["overlaps_1"], speedup=r["median"])
        if name in self.mismatches:
            out.update(status="error", reason=self.mismatches[name])
        return out

    def report(self, figure: str | None = None) -> str:
        """A few lines to print: each provider's median (min..max), its paired ratio over the base
        with the ratio's min..max and whether that includes 1, the outputs that differed, and the
        load average."""
        figure = self.figure if figure is None else figure
        width = max(len(n) for n in self.names)
        lines = [f"{figure}, median (min..max) of {self.rounds} interleaved round{'s' if self.rounds != 1 else ''}"
                 + (f"; ratio = {figure} / {self.base}'s, round by round" if self.base else "")
                 + f"; load average {_load(self.load_avg_start)} -> {_load(self.load_avg_end)}"]
        for name in self.names:
            if figure not in self.samples[name]:
                continue
            s = self.stats(name, figure)
            text = f"  {name:<{width}}  {s['median']:.4g} ({s['min']:.4g}..{s['max']:.4g})"
            r = self.ratio(name, figure) if self.base and figure in self.samples[self.base] else None
            if r is not None:
                text += f"  x{format_ratio(r['median'])} ({format_ratio(r['min'])}..{format_ratio(r['max'])})"
                if r["overlaps_1"]:
                    text += ", not distinguishable from 1"
            elif name == self.base:
                text += "  (base of the ratios)"
            if name in self.mismatches:
                text += f"  OUTPUT DIFFERS: {self.mismatches[name]}"
            lines.append(text)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()


def format_ratio(value: float) -> str:
    """A ratio as the reports print it: two decimals below 10 (1.004 reads ``1.00``, not ``1``),
    one below 100, none above."""
    return f"{value:.2f}" if abs(value) < 10 else f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def _load(value) -> str:
    return "?" if value is None else f"{value:.2f}"


def _check_count(name: str, value, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < low:
        raise ValueError(f"{name} must be >= {low}, got {value}")
    return int(value)


def _figures(name: str, got, rnd: int) -> tuple[dict[str, float], object, object]:
    """(figures, output, info) of what call ``name`` returned in round ``rnd``."""
    where = f"{name!r} (round {rnd})" if rnd else f"{name!r} (warm-up)"
    if isinstance(got, numbers.Real) and not isinstance(got, bool):
        got = {VALUE: got}
    if not isinstance(got, Mapping):
        raise TypeError(f"{where} returned {type(got).__name__}: a call must return a number or a dict of "
                        f"figures (wrap a function in llmu.bench.paired.timed to use its seconds)")
    figures = {}
    for k, v in got.items():
        if k in (OUTPUT, INFO):
            continue
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise TypeError(f"{where}: figure {k!r} is {type(v).__name__}, not a number "
                            f"(put other things under {OUTPUT!r} or {INFO!r})")
        if not math.isfinite(v):
            raise ValueError(f"{where}: figure {k!r} is {v}, not a finite number")
        figures[str(k)] = float(v)
    if not figures:
        raise ValueError(f"{where} returned no figure, only {sorted(got)}")
    return figures, got.get(OUTPUT), got.get(INFO)


def interleave(calls: Mapping[str, Callable[[], object]], repeats: int = 5, *, warmup: int = 1,
               base: str | None = None, figure: str | None = None, check: bool | Iterable[str] = False,
               reference: str | None = None,
               compare: Callable[[object, object], str | None] = first_difference) -> Paired:
    """Call every function of ``calls`` once per round, in order, for ``repeats`` rounds after
    ``warmup`` rounds whose results are dropped; return the :class:`Paired` measurement.

    ``calls``: name -> function of no argument returning a number or a dict of figures (see the
    module's docstring). ``base``: the provider every ratio divides by (with two calls and no
    ``base``, the second: the ratio is first / second; with more, no ratios unless named).
    ``figure``: the figure :meth:`Paired.ratio` and :meth:`Paired.report` use by default (the first
    figure of the first call otherwise). ``check``: ``True`` (every provider) or the names whose
    ``"output"`` must equal ``reference``'s (default: the base, else the first provider) in the
    same round, compared by ``compare(expected, got) -> why they differ, or None``
    (:func:`first_difference`); the first difference of each is in ``Paired.mismatches``.
    """
    if not isinstance(calls, Mapping):
        raise TypeError(f"calls must be a dict of name -> function, got {type(calls).__name__}")
    if not calls:
        raise ValueError("calls is empty: nothing to compare")
    for name, fn in calls.items():
        if not isinstance(name, str):
            raise TypeError(f"call names must be str, got {name!r}")
        if not callable(fn):
            raise TypeError(f"calls[{name!r}] must be a function of no argument, got {type(fn).__name__}")
    repeats = _check_count("repeats", repeats, 1)
    warmup = _check_count("warmup", warmup, 0)
    names = tuple(calls)
    if base is None and len(names) == 2:
        base = names[1]
    if base is not None and base not in calls:
        raise ValueError(f"base {base!r} is not one of the calls: {', '.join(names)}")
    if isinstance(check, bool):
        checked = [n for n in names] if check else []
    elif isinstance(check, (str, bytes)) or not isinstance(check, Iterable):
        raise TypeError(f"check must be True, False or a list of call names, got {check!r}")
    else:
        checked = list(check)
        unknown = [n for n in checked if n not in calls]
        if unknown:
            raise ValueError(f"check names {', '.join(map(repr, unknown))}, not among the calls: {', '.join(names)}")
    reference = reference if reference is not None else (base if base is not None else names[0])
    if reference not in calls:
        raise ValueError(f"reference {reference!r} is not one of the calls: {', '.join(names)}")
    if not callable(compare):
        raise TypeError(f"compare must be a function (expected, got) -> str or None, got {type(compare).__name__}")

    load_start = load_average()
    for _ in range(warmup):
        for name, fn in calls.items():
            _figures(name, fn(), 0)
    samples: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    outputs: dict[str, list] = {n: [] for n in names}
    info: dict[str, list] = {n: [] for n in names}
    order: list[str] = []
    mismatches: dict[str, str] = {}
    for rnd in range(1, repeats + 1):
        for name, fn in calls.items():
            figures, out, extra = _figures(name, fn(), rnd)
            order.append(name)
            if rnd > 1 and set(figures) != set(samples[name]):
                raise ValueError(f"{name!r} returned figures {sorted(figures)} in round {rnd}, "
                                 f"{sorted(samples[name])} before")
            for k, v in figures.items():
                samples[name].setdefault(k, []).append(v)
            outputs[name].append(out)
            info[name].append(extra)
        want = outputs[reference][-1]
        for name in checked:
            if name == reference or name in mismatches:
                continue
            if want is None or outputs[name][-1] is None:
                missing = reference if want is None else name
                raise ValueError(f"check: {missing!r} returned no {OUTPUT!r} to compare in round {rnd}")
            why = compare(want, outputs[name][-1])
            if why:
                mismatches[name] = f"output differs from {reference}'s in round {rnd}: {why}"
    first = samples[names[0]]
    figure = figure if figure is not None else next(iter(first))
    if not any(figure in s for s in samples.values()):
        raise ValueError(f"figure {figure!r} was returned by no call; figures: {sorted(first)}")
    return Paired(names=names, base=base, reference=reference if checked else None, figure=figure,
                  rounds=repeats, warmup=warmup, samples=samples, outputs=outputs, info=info, order=order,
                  mismatches=mismatches, load_avg_start=load_start, load_avg_end=load_average())

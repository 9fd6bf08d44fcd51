"""Checks that the notebooks' test cells call, with failure messages that teach.

Each check states one property. When it fails it raises :class:`CheckFailed` (an
``AssertionError``, which is what nbgrader counts as a failed test) whose message says which
property broke, by how much and where, and what to look at next::

    check_close(my_softmax(x), torch.softmax(x, -1), what="softmax of a row with large scores",
                hint="subtract the row maximum before exp()")
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .errors import CheckFailed
from .own_work import check_own_work

__all__ = [
    "CheckFailed",
    "check",
    "check_close",
    "check_equal",
    "check_finite",
    "check_shape",
    "check_dtype",
    "check_own_work",
    "check_raises",
    "passed",
]


def _fail(what: str, detail: str, hint: str | None) -> None:
    msg = f"{what}: {detail}"
    if hint:
        msg += f"\n  Look at: {hint}"
    raise CheckFailed(msg)


def check(condition: bool, what: str, hint: str | None = None, detail: str = "does not hold") -> None:
    """Fail with ``what`` (and ``hint``) unless ``condition`` is true."""
    if not bool(condition):
        _fail(what, detail, hint)


def _as_tensor(x, what: str, role: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except Exception:  # noqa: BLE001
        _fail(what, f"the {role} value is a {type(x).__name__}, not something that converts to a tensor", None)
        raise  # unreachable


def check_shape(x, shape: Sequence[int], what: str, hint: str | None = None) -> None:
    """``x`` is a tensor of exactly ``shape``."""
    if not isinstance(x, torch.Tensor):
        _fail(what, f"expected a torch.Tensor, got {type(x).__name__}", hint or "did the function return its result?")
    if tuple(x.shape) != tuple(shape):
        _fail(what, f"shape {tuple(x.shape)}, expected {tuple(shape)}", hint)


def check_dtype(x: torch.Tensor, dtype: torch.dtype, what: str, hint: str | None = None) -> None:
    if not isinstance(x, torch.Tensor):
        _fail(what, f"expected a torch.Tensor, got {type(x).__name__}", hint)
    if x.dtype != dtype:
        _fail(what, f"dtype {x.dtype}, expected {dtype}", hint)


def check_finite(x, what: str, hint: str | None = None) -> None:
    """Every element is finite (no inf, no NaN)."""
    t = _as_tensor(x, what, "actual")
    bad = ~torch.isfinite(t)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        _fail(what, f"{int(bad.sum())} non-finite value(s), the first at index {idx}: {t[idx].item()}",
              hint or "an overflow in exp(), or a division by zero")


def check_close(
    actual,
    expected,
    what: str,
    *,
    atol: float = 1e-5,
    rtol: float = 1e-5,
    hint: str | None = None,
) -> None:
    """``actual`` matches ``expected`` elementwise within ``atol + rtol * |expected|``.

    The failure message gives the shapes when they differ, otherwise the largest error, where it
    is, both values there, and how many elements are out of tolerance.
    """
    a = _as_tensor(actual, what, "actual")
    e = _as_tensor(expected, what, "expected")
    if a.shape != e.shape:
        _fail(what, f"shape {tuple(a.shape)}, expected {tuple(e.shape)}", hint)
    a64 = a.detach().to("cpu", torch.float64)
    e64 = e.detach().to("cpu", torch.float64)
    if a64.numel() == 0:
        return
    nan_a, nan_e = torch.isnan(a64), torch.isnan(e64)
    if (nan_a & ~nan_e).any():
        idx = tuple(int(i) for i in (nan_a & ~nan_e).nonzero()[0])
        _fail(what, f"NaN at index {idx} where {e64[idx].item():.6g} was expected", hint)
    same_inf = torch.isinf(a64) & torch.isinf(e64) & (torch.sign(a64) == torch.sign(e64))
    diff = (a64 - e64).abs()
    diff = torch.where(same_inf | (nan_a & nan_e), torch.zeros_like(diff), diff)
    tol = atol + rtol * e64.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    bad = diff > tol
    if bad.any():
        flat = int(torch.argmax(torch.where(bad, diff, torch.zeros_like(diff))))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), a64.shape)) if a64.ndim else ()
        _fail(
            what,
            f"{int(bad.sum())} of {a64.numel()} values out of tolerance (atol={atol:g}, rtol={rtol:g}); "
            f"largest error {diff[idx].item():.3g} at index {idx}: got {a64[idx].item():.6g}, "
            f"expected {e64[idx].item():.6g}",
            hint,
        )


def check_equal(actual, expected, what: str, hint: str | None = None) -> None:
    """Exact equality: tensors elementwise (and same shape), anything else with ``==``."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        a = _as_tensor(actual, what, "actual")
        e = _as_tensor(expected, what, "expected")
        if a.shape != e.shape:
            _fail(what, f"shape {tuple(a.shape)}, expected {tuple(e.shape)}", hint)
        ne = a.cpu() != e.cpu()
        if ne.any():
            idx = tuple(int(i) for i in ne.nonzero()[0])
            _fail(what, f"{int(ne.sum())} of {a.numel()} values differ, the first at index {idx}: "
                        f"got {a.cpu()[idx].item()}, expected {e.cpu()[idx].item()}", hint)
        return
    if actual != expected:
        _fail(what, _difference(actual, expected), hint)


#: How many items a mismatch message shows on each side of the first difference.
WINDOW = 3
#: A value longer than this (as repr) is shortened in messages.
SHORT_REPR = 80


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= SHORT_REPR else text[:SHORT_REPR - 4] + " ..."


def _window(seq, i: int) -> str:
    lo, hi = max(0, i - WINDOW), min(len(seq), i + WINDOW + 1)
    items = ", ".join(_short(x) for x in seq[lo:hi])
    return ("[..., " if lo else "[") + items + (", ...]" if hi < len(seq) else "]")


def _difference(actual, expected) -> str:
    """Where two unequal values differ, in a few lines whatever their size: for sequences and
    strings the first differing index with a few items around it, for dicts the keys."""
    sequence = (list, tuple, str, bytes)
    if isinstance(actual, sequence) and isinstance(expected, sequence) and type(actual) is type(expected):
        first = next((i for i, (a, e) in enumerate(zip(actual, expected)) if a != e), min(len(actual), len(expected)))
        where = f"first difference at index {first}"
        if len(actual) != len(expected):
            where = f"length {len(actual)}, expected {len(expected)}; " + where
        if isinstance(actual, (str, bytes)):
            lo = max(0, first - 20)
            dots = "..." if lo else ""
            return (f"{where}: got {dots}{_short(actual[lo:first + 20])}, "
                    f"expected {dots}{_short(expected[lo:first + 20])}")
        return f"{where}: got {_window(actual, first)}, expected {_window(expected, first)}"
    if isinstance(actual, dict) and isinstance(expected, dict):
        missing, extra = [k for k in expected if k not in actual], [k for k in actual if k not in expected]
        if missing or extra:
            return (f"keys differ: missing {_short(missing[:WINDOW * 2])}" + (" ..." if len(missing) > 2 * WINDOW else "")
                    + f", unexpected {_short(extra[:WINDOW * 2])}" + (" ..." if len(extra) > 2 * WINDOW else ""))
        key = next(k for k in expected if actual[k] != expected[k])
        return f"at key {key!r}: got {_short(actual[key])}, expected {_short(expected[key])}"
    return f"got {_short(actual)}, expected {_short(expected)}"


def check_raises(
    fn: Callable[[], object],
    exceptions: type[BaseException] | tuple[type[BaseException], ...],
    what: str,
    hint: str | None = None,
) -> BaseException:
    """Calling ``fn()`` raises one of ``exceptions``; return the exception."""
    try:
        fn()
    except exceptions as exc:  # noqa: PERF203
        return exc
    except Exception as exc:  # noqa: BLE001
        names = exceptions.__name__ if isinstance(exceptions, type) else " or ".join(e.__name__ for e in exceptions)
        _fail(what, f"raised {type(exc).__name__}({exc}) instead of {names}", hint)
    names = exceptions.__name__ if isinstance(exceptions, type) else " or ".join(e.__name__ for e in exceptions)
    _fail(what, f"returned normally; it should raise {names}", hint)
    raise AssertionError  # unreachable


def passed(what: str) -> None:
    """Print a one-line confirmation at the end of a test cell."""
    print(f"✓ {what}")

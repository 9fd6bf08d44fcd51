"""llmu.grading: every check passes on good input and, on bad input, fails with a CheckFailed whose
message names the property (``what``) and carries the hint, since that message is what a learner
reads in a failed test cell."""

from __future__ import annotations

import math

import pytest
import torch

from llmu.grading import (
    CheckFailed,
    check,
    check_close,
    check_dtype,
    check_equal,
    check_finite,
    check_raises,
    check_shape,
    passed,
)

HINT = "look at the row maximum"


def _fails(fn, what: str, *fragments: str) -> str:
    with pytest.raises(CheckFailed) as info:
        fn()
    msg = str(info.value)
    assert msg.startswith(what + ":"), f"the message must open with the property: {msg!r}"
    assert f"Look at: {HINT}" in msg, f"the hint is missing: {msg!r}"
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def test_checkfailed_is_an_assertion_error():
    # nbgrader counts any exception as a failed test; AssertionError is the idiomatic one.
    assert issubclass(CheckFailed, AssertionError)


def test_check():
    check(True, what="always")
    check(1 + 1 == 2, what="arithmetic")
    _fails(lambda: check(False, what="rows sum to one", hint=HINT), "rows sum to one", "does not hold")
    _fails(lambda: check(0, what="custom", hint=HINT, detail="sum was 0.7"), "custom", "sum was 0.7")


def test_check_shape():
    check_shape(torch.zeros(2, 3), (2, 3), what="shape")
    _fails(lambda: check_shape(torch.zeros(2, 3), (3, 2), what="output shape", hint=HINT),
           "output shape", "(2, 3)", "(3, 2)")
    msg = _fails(lambda: check_shape(None, (3,), what="output shape", hint=HINT), "output shape", "NoneType")
    assert "torch.Tensor" in msg


def test_check_dtype():
    check_dtype(torch.zeros(2, dtype=torch.bfloat16), torch.bfloat16, what="dtype")
    _fails(lambda: check_dtype(torch.zeros(2), torch.float16, what="output dtype", hint=HINT),
           "output dtype", "torch.float32", "torch.float16")
    _fails(lambda: check_dtype([1.0], torch.float32, what="output dtype", hint=HINT), "output dtype", "list")


def test_check_finite():
    check_finite(torch.randn(10), what="finite")
    check_finite([1.0, 2.0], what="finite list")
    x = torch.tensor([[0.0, 1.0], [math.inf, math.nan]])
    _fails(lambda: check_finite(x, what="softmax of large scores", hint=HINT),
           "softmax of large scores", "2 non-finite", "(1, 0)")


def test_check_finite_default_hint_explains():
    with pytest.raises(CheckFailed, match="overflow in exp"):
        check_finite(torch.tensor([math.nan]), what="finite")


def test_check_close():
    x = torch.randn(4, 5)
    check_close(x, x.clone(), what="identical")
    check_close(x + 1e-7, x, what="within tolerance")
    check_close(torch.tensor([math.inf, -math.inf, math.nan]), torch.tensor([math.inf, -math.inf, math.nan]),
                what="matching inf and nan")
    check_close(0.25, 0.25, what="python floats")
    check_close(torch.zeros(0), torch.zeros(0), what="empty")
    y = x.clone()
    y[2, 3] += 0.5
    _fails(lambda: check_close(y, x, what="my_softmax matches torch.softmax", hint=HINT),
           "my_softmax matches torch.softmax", "1 of 20 values out of tolerance", "(2, 3)", "largest error 0.5")
    _fails(lambda: check_close(torch.zeros(3), torch.zeros(4), what="same shape", hint=HINT),
           "same shape", "(3,)", "(4,)")
    _fails(lambda: check_close(torch.tensor([math.nan]), torch.tensor([1.0]), what="no NaN", hint=HINT),
           "no NaN", "NaN at index (0,)")
    _fails(lambda: check_close(torch.tensor([math.inf]), torch.tensor([-math.inf]), what="signed inf", hint=HINT),
           "signed inf")


def test_check_close_tolerances_are_applied():
    check_close(torch.tensor([1.001]), torch.tensor([1.0]), what="loose", atol=0, rtol=1e-2)
    with pytest.raises(CheckFailed, match="atol=0, rtol=1e-05"):
        check_close(torch.tensor([1.001]), torch.tensor([1.0]), what="tight", atol=0, rtol=1e-5)


def test_check_equal():
    check_equal(torch.arange(3), torch.arange(3), what="tensors")
    check_equal("abc", "abc", what="strings")
    check_equal([1, 2], [1, 2], what="lists")
    _fails(lambda: check_equal(torch.tensor([1, 2, 4]), torch.tensor([1, 2, 3]), what="token ids", hint=HINT),
           "token ids", "1 of 3 values differ", "(2,)", "got 4, expected 3")
    _fails(lambda: check_equal(torch.arange(3), torch.arange(4), what="lengths", hint=HINT), "lengths", "(3,)", "(4,)")
    _fails(lambda: check_equal("Paris", "Lyon", what="the answer", hint=HINT), "the answer", "'Paris'", "'Lyon'")


def test_check_raises():
    def bad():
        raise ValueError("temperature must be positive")

    exc = check_raises(bad, ValueError, what="T=0 raises")
    assert isinstance(exc, ValueError)
    check_raises(bad, (TypeError, ValueError), what="either")
    _fails(lambda: check_raises(lambda: 1, ValueError, what="T=0 is rejected", hint=HINT),
           "T=0 is rejected", "returned normally", "ValueError")
    _fails(lambda: check_raises(lambda: 1 / 0, (ValueError, TypeError), what="T=0 is rejected", hint=HINT),
           "T=0 is rejected", "ZeroDivisionError", "ValueError or TypeError")


def test_check_without_hint_has_no_hint_line():
    with pytest.raises(CheckFailed) as info:
        check(False, what="plain")
    assert "Look at" not in str(info.value)


def test_passed_prints_the_property(capsys):
    passed("softmax rows sum to one")
    assert "softmax rows sum to one" in capsys.readouterr().out


def test_a_long_mismatch_shows_the_first_difference_and_a_window_not_the_whole_value():
    """Token ids of a learner's tokenizer (01 ex2): 210 ids, one wrong. The message names the index
    and shows a few ids around it, never the whole list."""
    got = list(range(210))
    want = got[:100] + [7] + got[101:]
    with pytest.raises(CheckFailed) as info:
        check_equal(got, want, what="encode(text)", hint=HINT)
    message = str(info.value)
    assert "first difference at index 100" in message
    assert "got [..., 97, 98, 99, 100, 101, 102, 103, ...]" in message
    assert "expected [..., 97, 98, 99, 7, 101, 102, 103, ...]" in message
    assert len(message) < 300 and "150" not in message
    with pytest.raises(CheckFailed, match=r"length 2, expected 3; first difference at index 2"):
        check_equal([1, 2], [1, 2, 3], what="ids")
    with pytest.raises(CheckFailed, match=r"first difference at index 150: got \.\.\.'x+'"):
        check_equal("x" * 300, "x" * 150 + "y" + "x" * 149, what="text")
    with pytest.raises(CheckFailed, match=r"at key 'b': got 2, expected 3"):
        check_equal({"a": 1, "b": 2}, {"a": 1, "b": 3}, what="counts")
    with pytest.raises(CheckFailed, match=r"keys differ: missing \['b'\], unexpected \['a'\]"):
        check_equal({"a": 1}, {"b": 1}, what="counts")
    long_value = {"merge": "x" * 500}
    with pytest.raises(CheckFailed) as info:
        check_equal(3, long_value, what="value")
    assert len(str(info.value)) < 200

"""The exception every graded check raises."""

from __future__ import annotations


class CheckFailed(AssertionError):
    """A graded property does not hold. The message explains which one and what to look at."""

"""95% intervals for held-out accuracies: over a test set's prompts, and over seeds.

- `wilson`: the Wilson score interval of a proportion (k of n prompts right): unlike the normal
  approximation it stays inside [0, 1] and is honest near 0 and 1, where the arithmetic tasks'
  accuracies sit. It assumes independent 0/1 scores, which greedy exact-answer accuracy on
  distinct prompts gives.
- `over_seeds`: the mean of per-seed accuracies with a Student-t interval, the spread that
  training itself adds (initialisation, warm start, sampling) on top of the test set's.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

Z95 = 1.959963984540054  # the standard normal's 97.5% quantile
# Student t's 97.5% quantiles for 1..10 degrees of freedom (more: the normal's).
_T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def wilson(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval (lo, hi) for `successes` of `n`."""
    if n <= 0 or not 0 <= successes <= n:
        raise ValueError(f"need 0 <= successes <= n and n > 0, got {successes} of {n}")
    p, z2 = successes / n, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z / (1 + z2 / n) * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n))
    # At 0 or n the interval's end is exactly 0 or 1, which rounding would miss.
    lo = 0.0 if successes == 0 else max(0.0, centre - half)
    return lo, 1.0 if successes == n else min(1.0, centre + half)


def accuracy_interval(accuracy: float, n: int) -> tuple[float, float]:
    """`wilson` for an accuracy measured as the mean of n 0/1 scores."""
    return wilson(int(round(accuracy * n)), n)


def over_seeds(values: Sequence[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of per-seed values and its 95% Student-t interval (lo = hi =
    mean for one seed, which has no spread to measure)."""
    if not values:
        raise ValueError("no values to average")
    n = len(values)
    mean = sum(values) / n
    if n == 1:
        return mean, mean, mean
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    t = _T95[n - 2] if n - 1 <= len(_T95) else Z95
    half = t * sd / math.sqrt(n)
    return mean, mean - half, mean + half


def fmt(lo: float, hi: float) -> str:
    """An interval as printed: "[0.912, 0.957]"."""
    return f"[{lo:.3f}, {hi:.3f}]"

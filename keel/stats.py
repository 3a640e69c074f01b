"""The statistics every tool reports, each computed one way."""
from __future__ import annotations

import math
import statistics
from typing import Sequence

# two-sided 95 % Student t critical values by degrees of freedom (conservative between entries)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262,
        10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 25: 2.060, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t95(df: int) -> float:
    """Two-sided 95 % Student t critical value for `df` degrees of freedom."""
    if df <= 0:
        return math.inf
    if df > 120:
        return 1.960
    return _T95[max(k for k in _T95 if k <= df)]


def mean_ci95(values: Sequence[float]) -> tuple[float, list[float]]:
    """The mean and its 95 % confidence interval (Student t): where the mean of many more
    replicas would fall. One value: [mean, mean]."""
    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, [mean, mean]
    half = t95(len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, [mean - half, mean + half]


def range95(values: Sequence[float]) -> list[float]:
    """The 2.5 % and 97.5 % points of `values` (linear interpolation): where one more run
    would fall, not where the mean is (that is `mean_ci95`)."""
    ys = sorted(values)
    if len(ys) == 1:
        return [ys[0], ys[0]]

    def q(p: float) -> float:
        k = p * (len(ys) - 1)
        i = int(k)
        return ys[i] if i + 1 >= len(ys) else ys[i] + (ys[i + 1] - ys[i]) * (k - i)
    return [q(0.025), q(0.975)]

"""Seeded draws the workload is made of: popularity, lengths, sizes and delays."""

from __future__ import annotations

import math
import random


def zipf_weights(n: int, s: float) -> list[float]:
    w = [1.0 / (k ** s) for k in range(1, n + 1)]
    total = sum(w)
    return [x / total for x in w]


def geometric(rng: random.Random, mean: float, cap: int) -> int:
    """1, 2, ... with P(n) = p (1-p)^(n-1), mean 1/p, capped."""
    if mean <= 1:
        return 1
    p = 1.0 / mean
    u = 1.0 - rng.random()  # (0, 1]
    n = 1 + int(math.log(u) / math.log(1.0 - p))
    return max(1, min(n, cap))


def lognormal_mean(rng: random.Random, mean: float, sigma: float) -> float:
    """A lognormal draw whose mean (not median) is `mean`."""
    if mean <= 0:
        return 0.0
    mu = math.log(mean) - sigma * sigma / 2
    return rng.lognormvariate(mu, sigma)


def lognormal_median(rng: random.Random, median: float, sigma: float) -> float:
    return rng.lognormvariate(math.log(max(median, 1e-9)), sigma)

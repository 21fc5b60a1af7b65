"""Student's t distribution for integer degrees of freedom in closed form (Abramowitz & Stegun 26.7.3–4), a float64
reference for the statistics tests that shares no code with scipy."""

from __future__ import annotations

import math


def two_sided_mass(t: float, df: int) -> float:
    """P(|T| ≤ t) for T ~ Student t with ``df`` degrees of freedom, t ≥ 0."""
    theta = math.atan(t / math.sqrt(df))
    c, s = math.cos(theta), math.sin(theta)
    if df % 2:  # odd: 2/π (θ + sinθ (cosθ + 2/3 cos³θ + 2·4/(3·5) cos⁵θ + …)), the series ending at cos^(df−2)
        term, total = c, 0.0
        for k in range(1, (df - 1) // 2 + 1):
            total += term
            term *= c * c * (2 * k) / (2 * k + 1)
        return 2 / math.pi * (theta + s * total)
    term, total = 1.0, 0.0  # even: sinθ (1 + 1/2 cos²θ + 1·3/(2·4) cos⁴θ + …), ending at cos^(df−2)
    for k in range(df // 2):
        total += term
        term *= c * c * (2 * k + 1) / (2 * k + 2)
    return s * total


def cdf(t: float, df: int) -> float:
    return 0.5 + math.copysign(two_sided_mass(abs(t), df), t) / 2


def quantile_975(df: int) -> float:
    """The t whose two-sided tail is 0.05, by bisection of the closed form."""
    lo, hi = 0.0, 1000.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if two_sided_mass(mid, df) < 0.95 else (lo, mid)
    return lo


def mean_interval(values: list[float]) -> list[float]:
    """The 95% Student t interval of the mean, by hand."""
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    half = quantile_975(n - 1) * sd / math.sqrt(n)
    return [mean - half, mean + half]

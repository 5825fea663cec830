"""Small statistics helpers shared by the model and endpoint profilers (no numpy needed)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from clusteropt_cli.core.profile.report import Spread


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0–100) with linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    rank = (len(data) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    return float(data[low] + (data[high] - data[low]) * (rank - low))


def spread(values: Sequence[float]) -> Spread:
    """Median, p10/p90, min/max and count of repeated measurements."""
    return Spread(median=percentile(values, 50), p10=percentile(values, 10), p90=percentile(values, 90),
                  min=float(min(values)), max=float(max(values)), n=len(values))


def latency_summary(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99/mean of a latency sample ({} when empty)."""
    if not values:
        return {}
    return {"p50": percentile(values, 50), "p90": percentile(values, 90), "p99": percentile(values, 99),
            "mean": float(sum(values) / len(values))}


def non_finite_problems(values: dict[str, float | None]) -> list[str]:
    """'FLAG must be a finite number (got inf)' for each flag whose value is inf or nan (None: not given)."""
    return [f"{flag} must be a finite number (got {value})" for flag, value in values.items()
            if value is not None and not math.isfinite(value)]


def positive_number(value: object) -> float | None:
    """A finite positive number from a report or recipe field, else None (missing, malformed, hostile: a bool, a
    string, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) and value > 0 else None

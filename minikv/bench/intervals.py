"""95% intervals for accuracies measured over a few prompts, so a table says what its cells support.

    wilson(hits, n)              Wilson's score interval for a share of 0/1 outcomes
    bootstrap(scores)            percentile bootstrap over instances, for scores that are not 0/1
    interval(scores)             the one of the two that fits: scores in percent (0-100)
    mean_interval(scores_by_task) the mean over tasks, instances resampled within each task

Wilson, not the normal approximation: with 20 prompts and 20 hits the normal interval is [100, 100];
Wilson's is [83.9, 100], which is what 20 prompts can tell. The bootstrap is seeded, so a table
rebuilt from the same JSON shows the same intervals.
"""
from __future__ import annotations

import math
import random

Z95 = 1.959963984540054


def wilson(hits: float, n: int, z: float = Z95) -> tuple[float, float]:
    """(low, high) in [0, 1] for `hits` successes in `n` trials."""
    if n <= 0:
        raise ValueError("an interval needs at least one trial")
    if not 0 <= hits <= n:
        raise ValueError(f"{hits} hits in {n} trials")
    p = hits / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, centre - half), min(1.0, centre + half)


def bootstrap(scores: list[float], resamples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of `scores`."""
    if not scores:
        raise ValueError("an interval needs at least one score")
    rng, n = random.Random(seed), len(scores)
    means = sorted(sum(rng.choices(scores, k=n)) / n for _ in range(resamples))
    tail = (1 - level) / 2
    return means[int(tail * (resamples - 1))], means[int(math.ceil((1 - tail) * (resamples - 1)))]


def interval(scores: list[float]) -> tuple[float, float]:
    """95% interval of the mean of per-instance scores in percent: Wilson when every score is 0 or
    100 (each instance a hit or a miss), else the bootstrap."""
    if all(s in (0, 100) for s in scores):
        lo, hi = wilson(sum(s == 100 for s in scores), len(scores))
        return 100 * lo, 100 * hi
    return bootstrap(scores)


def mean_interval(scores_by_task: dict[str, list[float]], resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% interval of the mean over tasks of each task's mean score, instances resampled within
    each task (tasks are fixed; their instances are the sample)."""
    tasks = [v for v in scores_by_task.values() if v]
    if not tasks:
        raise ValueError("an interval needs at least one score")
    rng = random.Random(seed)
    means = sorted(sum(sum(rng.choices(v, k=len(v))) / len(v) for v in tasks) / len(tasks) for _ in range(resamples))
    return means[int(0.025 * (resamples - 1))], means[int(math.ceil(0.975 * (resamples - 1)))]

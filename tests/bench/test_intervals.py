import random

import pytest

from minikv.bench.intervals import bootstrap, interval, mean_interval, wilson


def test_wilson_matches_published_values():
    # Wilson (1927) / Newcombe (1998), 95%: 0 of 10 -> [0, 0.2775]; 20 of 20 -> [0.8389, 1]; 5 of 10 -> [0.2366, 0.7634]
    assert wilson(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson(20, 20) == pytest.approx((0.8389, 1.0), abs=1e-4)
    assert wilson(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)


def test_wilson_covers_the_true_share_about_95_percent_of_the_time():
    rng, p, n, covered = random.Random(1), 0.8, 20, 0
    for _ in range(2000):
        lo, hi = wilson(sum(rng.random() < p for _ in range(n)), n)
        covered += lo <= p <= hi
    assert 0.92 <= covered / 2000 <= 0.98


def test_interval_uses_wilson_for_hits_and_bootstrap_otherwise():
    assert interval([100.0] * 20) == pytest.approx((83.89, 100.0), abs=0.01)
    lo, hi = interval([25.0, 50.0, 75.0, 100.0] * 5)  # multi-answer scores: bootstrap
    assert lo < 62.5 < hi and hi - lo < 40
    assert bootstrap([50.0] * 7) == (50.0, 50.0)


def test_mean_interval_narrows_with_more_instances():
    few = mean_interval({"a": [0.0, 100.0] * 3, "b": [100.0] * 6})
    many = mean_interval({"a": [0.0, 100.0] * 30, "b": [100.0] * 60})
    assert few[0] < 75 < few[1] and many[0] < 75 < many[1]
    assert many[1] - many[0] < few[1] - few[0]


def test_refusals():
    with pytest.raises(ValueError):
        wilson(3, 0)
    with pytest.raises(ValueError):
        wilson(4, 3)
    with pytest.raises(ValueError):
        bootstrap([])

"""Hypothesis profiles for kernel checks, in one place (tests/conftest.py loads one).

deadline=None: the first call of a kernel compiles (GPU) or is slow (interpreter). "ci" is the
default: few examples, so that a kernel test file stays under a minute on 2 CPU cores under the
interpreter. HYPOTHESIS_PROFILE=dev for a thorough local run; "mutation" is ci without shrinking.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings

PROFILES = {"ci": 30, "dev": 300}  # name -> examples per property

for _name, _examples in PROFILES.items():
    settings.register_profile(_name, max_examples=_examples, deadline=None,
                              suppress_health_check=[HealthCheck.too_slow])
# tools/mutation.py: the ci examples, without shrinking (a mutant is killed by its first failing
# example; shrinking it only costs time)
settings.register_profile("mutation", settings.get_profile("ci"), phases=[Phase.explicit, Phase.reuse, Phase.generate])


def load_profile(name: str | None = None) -> str:
    """Load profile `name` (default: $HYPOTHESIS_PROFILE, else "ci") for every property that
    follows; returns its name."""
    name = name or os.environ.get("HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(name)
    return name

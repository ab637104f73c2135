"""Hypothesis profiles for kernel checks, in one place: `import minikv.testing` loads one
(`load_at_import`), and tests/conftest.py, and a script may load another (`load_profile`).

deadline=None: the first call of a kernel compiles (GPU) or is slow (interpreter). "ci" is the
default: few examples, so that a kernel test file stays under a minute on 2 CPU cores under the
interpreter. HYPOTHESIS_PROFILE=dev for a thorough local run; "mutation" is ci without shrinking.
"""
from __future__ import annotations

import os

from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import InvalidArgument

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
    name = name or os.environ.get("HYPOTHESIS_PROFILE") or "ci"
    settings.load_profile(name)
    return name


def load_at_import() -> None:
    """What `import minikv.testing` loads: the profile $HYPOTHESIS_PROFILE names, else "ci" (30
    examples per property, not hypothesis's 100), unless a profile of your own is loaded already,
    which stays. A name not registered yet (your own profile, registered later) is left for you to
    load."""
    current = getattr(settings, "get_current_profile_name", lambda: settings._current_profile)()
    if os.environ.get("HYPOTHESIS_PROFILE") or current == "default":
        try:
            load_profile()
        except InvalidArgument:
            pass

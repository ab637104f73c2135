"""A policy defined outside minikv, for tests/test_plugins.py (not a test module: pytest leaves it alone)."""
from dataclasses import dataclass

import minikv
from minikv.policies.full import Full


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class Everything(Full):
    """Full KV under another name: a policy from outside the package."""

    name = "everything_plugin"

"""minikv.testing: the checks minikv's own tests run, public for your policies and kernels.

    check_policy(spec_or_class)   the policy contract matrix (policies.py; docs/extending.md)
"""
from .models import FAMILIES, tiny_model
from .policies import PolicyContractError, check_policy

__all__ = ["FAMILIES", "PolicyContractError", "check_policy", "tiny_model"]

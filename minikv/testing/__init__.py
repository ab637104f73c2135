"""The checks minikv's own tests run, public for your policies and kernels.

`check_policy(spec_or_class)` runs the policy contract matrix (policies.py; docs/extending.md).
Test your own kernel against minikv's reference: `check_kernel(op, fn)` draws the
operation's inputs with hypothesis, runs fn and the reference, and fails naming the input and
the error; `strategies(op)` hands out the same inputs for tests of one's own; the tolerances
(tolerances.py) and hypothesis profiles (profiles.py) are those minikv's own tests use.

Needs hypothesis (the `test` extra: pip install 'minikv[test]').
"""
try:
    import hypothesis  # noqa: F401
except ImportError:
    raise ImportError("minikv.testing needs hypothesis: pip install 'minikv[test]' (or pip install hypothesis)") from None

from .models import FAMILIES, tiny_model
from .policies import check_policy
from .recorder import PolicyContractError
from .kernels import Case, check, check_kernel, strategies
from .profiles import PROFILES, load_profile
from .tolerances import REL_RMS, TOLERANCES, assert_close, default_device, error_report, random_tensor, relative_rms

__all__ = ["FAMILIES", "PolicyContractError", "check_policy", "tiny_model", "Case", "check", "check_kernel",
           "strategies", "PROFILES", "load_profile", "REL_RMS", "TOLERANCES", "assert_close", "default_device",
           "error_report", "random_tensor", "relative_rms"]

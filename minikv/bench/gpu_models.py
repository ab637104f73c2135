"""The models gpu-check runs its policy and speed parts on: the real ones where their weights are
here, else random-weight models of their exact shapes.

The GPU machine that is lent carries no weights (docs/gpu.md, "The lent machine": at most 64 MiB
travel, SmolLM2's GGUF alone is 98 MB, and nothing can be fetched there). What gpu-check asks of
a model, that backend=triton computes what backend=eager computes and how long a token takes at
a context length, depends on the model's shapes and dtype, not on what its weights learned; so
where `load(name)` cannot find the weights, `weightless(name)` builds the same architecture with
random weights, and random token ids stand in for the text. The output says which one ran.

    model, ids, source = model_for("smollm2", "cuda", "bfloat16")   # source: "weights" or "random"
    model = weightless("qwen2.5-coder-0.5b", "cuda", "bfloat16")
"""
from __future__ import annotations

import torch

from ..config import ModelConfig
from ..models import build_model

# config.json of the real models (Hugging Face's, as minikv's GGUF import writes them for
# smollm2; tests/bench/test_gpu_models.py holds them to the real tensors' shapes)
SHAPES = {
    "smollm2": {  # SmolLM2-135M-Instruct
        "model_type": "llama", "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536,
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "hidden_act": "silu",
    },
    "qwen2.5-coder-0.5b": {  # Qwen2.5-Coder-0.5B-Instruct
        "model_type": "qwen2", "vocab_size": 151936, "hidden_size": 896, "intermediate_size": 4864,
        "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "hidden_act": "silu", "use_sliding_window": False,
    },
}


def weightless(name_or_config: str | dict, device, dtype: torch.dtype, seed: int = 0):
    """A model of SHAPES[name] (or of a config dict) with random weights in `dtype` on `device`:
    PyTorch's default initialisation (uniform with bound 1/sqrt(fan_in) in the projections,
    standard normal embeddings), drawn on the device itself, so that half a billion parameters
    cost a fraction of a second on a GPU."""
    raw = SHAPES[name_or_config] if isinstance(name_or_config, str) else name_or_config
    cfg = ModelConfig.from_dict(raw, source=f"gpu_models {name_or_config if isinstance(name_or_config, str) else 'config'}")
    with torch.random.fork_rng(devices=[]):  # the CPU's generator restored after; a GPU's stays seeded
        torch.manual_seed(seed)
        with torch.device(device):
            model = build_model(cfg)
    return model.to(dtype).eval()


def random_ids(vocab_size: int, n: int, seed: int = 0) -> list[int]:
    """n token ids drawn uniformly from the vocabulary (the prompt of a random-weight model)."""
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def model_for(name: str | dict, device, dtype: str):
    """(model, ids(n) -> n prompt token ids, source): the real model and its text where
    `load(name)` finds the weights (source "weights"), else `weightless(name)` and random ids
    (source "random", the reason printed); a config dict: `weightless` of it."""
    from ..loading import load, parse_dtype
    from .common import text_ids

    if isinstance(name, dict):
        model = weightless(name, device, parse_dtype(dtype))
        return model, lambda n: random_ids(model.cfg.vocab_size, n), "random"
    try:
        model, tokenizer = load(name, device=device, dtype=dtype, progress=False)
        return model, lambda n: text_ids(tokenizer, n), "weights"
    except (ModuleNotFoundError, FileNotFoundError) as err:  # the model's package or file is not here
        print(f"{name}: no weights here ({str(err).splitlines()[0]}): random weights of its exact shapes, "
              f"{dtype}, random token ids", flush=True)
    model = weightless(name, device, parse_dtype(dtype))
    return model, lambda n: random_ids(model.cfg.vocab_size, n), "random"

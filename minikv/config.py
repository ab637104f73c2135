"""ModelConfig: the few numbers minikv needs, read from a Hugging Face config.json.

Four families share one dataclass. The fields that only one family uses (Pythia's parallel
residual, Mistral's sliding window, Qwen2's q/k/v bias) are plain flags, so model code reads
`if cfg.parallel_residual:` instead of checking architecture names.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt_neox")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # one of SUPPORTED_MODEL_TYPES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int = 0  # channels of a head that RoPE rotates; = head_dim except Pythia
    norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q, k, v projections (Qwen2, Pythia)
    attention_out_bias: bool = False  # bias on the output projection (Pythia)
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral: each query sees the last `sliding_window` keys
    parallel_residual: bool = False  # Pythia: x + attn(ln1(x)) + mlp(ln2(x))
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    @property
    def family(self) -> str:
        return "gpt_neox" if self.model_type == "gpt_neox" else "llama"

    @property
    def n_groups(self) -> int:
        # query heads per KV head (GQA); 1 is plain multi-head attention
        return self.n_heads // self.n_kv_heads

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported architecture model_type={model_type!r} "
                f"(architectures={raw.get('architectures')}); minikv supports: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        if model_type == "gpt_neox":
            return _gpt_neox(raw)
        return _llama_like(raw, model_type)


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _require(raw: dict, *keys: str) -> None:
    missing = [k for k in keys if k not in raw]
    if missing:
        raise ValueError(f"config.json of a {raw.get('model_type')} model lacks {missing}")


def _rope_params(raw: dict) -> tuple[float, dict | None]:
    # transformers v5 moved rope_theta into a `rope_parameters` dict; v4 files keep them apart
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return float(theta), scaling


def _llama_like(raw: dict, model_type: str) -> ModelConfig:
    _require(raw, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    n_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or raw["hidden_size"] // n_heads
    theta, scaling = _rope_params(raw)
    window = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a sliding_window they do not use
    return ModelConfig(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=head_dim,
        norm_eps=raw.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=model_type == "qwen2" or raw.get("attention_bias", False),
        attention_out_bias=model_type != "qwen2" and raw.get("attention_bias", False),
        mlp_bias=raw.get("mlp_bias", False),
        sliding_window=window,
        hidden_act=raw.get("hidden_act", "silu"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_eos_ids(raw),
    )


def _gpt_neox(raw: dict) -> ModelConfig:
    _require(raw, "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    n_heads = raw["num_attention_heads"]
    head_dim = raw["hidden_size"] // n_heads
    theta, scaling = _rope_params(raw)
    pct = raw.get("rotary_pct", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    return ModelConfig(
        model_type="gpt_neox",
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rope_theta=float(raw.get("rotary_emb_base", theta)),
        rope_scaling=scaling,
        rotary_dim=int(head_dim * pct),
        norm_eps=raw.get("layer_norm_eps", 1e-5),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", True),
        attention_out_bias=raw.get("attention_bias", True),
        mlp_bias=True,
        parallel_residual=raw.get("use_parallel_residual", True),
        hidden_act=raw.get("hidden_act", "gelu"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_eos_ids(raw),
    )

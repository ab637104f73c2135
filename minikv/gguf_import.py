"""GGUF -> a safetensors directory in a cache folder, converted once and reused.

`import_gguf(path)` converts a llama- or qwen2-architecture GGUF (the bundled SmolLM2 is one) into a
directory that `load_model` reads (config.json, model.safetensors, tokenizer files). What the GGUF
says, in Hugging Face's terms (config, names, dequantized and unpermuted tensors), comes from
gguf_to_hf.py, which checks the file, its metadata and its tensor shapes before anything is written.
The conversion streams: the safetensors header is written from the tensor index first, then
each tensor as it is dequantized, so one float32 tensor is in memory at a time, not the model.

The cache (~/.cache/minikv, or $MINIKV_CACHE) is keyed by the file's path, size, mtime and a
hash of its header and tensor index, so a file replaced in place is imported again. A
directory is built under a `tempfile.mkdtemp` name, fsynced, stamped with a completion marker
written last, and renamed into place; reuse checks the marker and the size of every file it
lists (a file truncated or replaced since is imported again). Temporary directories left by a
killed import are swept by the next one. An entry that is a symbolic link (to a folder of one's
own) is used through the link, and replaced by a real folder when it needs importing again.
"""
from __future__ import annotations

import errno
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

from .gguf_check import GGUFHeader, check_gguf
from .gguf_to_hf import gguf_config, gguf_tensors, hf_shapes, open_gguf

CACHE_FORMAT = 2  # bump when the converted files change: old cache entries are then not reused
MARKER = "minikv-import.json"  # written last: a directory without it is not a finished import
OWNER = ".owner"  # in a temporary directory: "host pid" of the import writing it
TMP_SUFFIX = ".importing"
STALE_AFTER_S = 3600  # a temporary directory nothing was written to for this long is abandoned


def cache_dir() -> Path:
    root = os.environ.get("MINIKV_CACHE")
    path = Path(root) if root else Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "minikv"
    if path.is_symlink() and not path.exists():  # exists() follows the link: it dangles, or loops
        raise ValueError(f"the model cache {path} is a symbolic link to {os.readlink(path)}, which "
                         f"{'loops' if _loops(path) else 'does not exist'}; "
                         f"{'point MINIKV_CACHE at' if root else 'remove it, or set MINIKV_CACHE to'} a directory")
    if path.exists() and not path.is_dir():
        raise ValueError(f"the model cache {path} is a file, not a directory; "
                         f"{'point MINIKV_CACHE at' if root else 'move it, or set MINIKV_CACHE to'} a directory")
    return path


def _loops(path: Path) -> bool:
    try:
        path.resolve(strict=True)
    except RuntimeError:  # Python < 3.13: "Symlink loop"
        return True
    except OSError as err:
        return err.errno == errno.ELOOP
    return False


def cache_write_error(err: OSError, where: Path) -> OSError:
    """What a failed write into the cache directory `where` says: the directory (not a temporary
    name inside it) and what to do; a full disk and a read-only cache by name."""
    if err.errno == errno.ENOSPC:
        return OSError(err.errno, f"no space left on the device to write the model cache {where}: free some "
                                  "space, or set MINIKV_CACHE to a directory on another disk")
    if err.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return OSError(err.errno, f"cannot write the model cache {where} ({err.strerror}): set MINIKV_CACHE to a "
                                  "directory you can write")
    return err


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


# -- the cache ---------------------------------------------------------------------------------


def source_stamp(path: Path, header: GGUFHeader) -> dict:
    """What a cached conversion was made from; reused only while all of it still holds."""
    st = path.stat()
    return {"format": CACHE_FORMAT, "source": str(path.resolve()), "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "header_sha256": header.sha256}


def is_complete(out_dir: Path, stamp: dict) -> bool:
    """The marker says the entry was made from what `stamp` describes, and every file it lists
    still has the size it had when the import finished (entries made before the marker listed
    files are trusted on the stamp alone)."""
    try:
        marker = json.loads((out_dir / MARKER).read_text())
        files = marker.pop("files", {})
        return marker == stamp and all((out_dir / name).stat().st_size == size for name, size in files.items())
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _marker(tmp: Path, stamp: dict) -> str:
    """The completion marker: the stamp, and the size of every file it vouches for."""
    files = {f.name: f.stat().st_size for f in sorted(tmp.iterdir()) if f.name not in (MARKER, OWNER)}
    return json.dumps({**stamp, "files": files})


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
    try:
        return _write_import(reader, path, cfg, shapes, stamp, out_dir, progress)
    except OSError as err:
        raise cache_write_error(err, out_dir.parent) from None


def _write_import(reader, path: Path, cfg: dict, shapes: dict, stamp: dict, out_dir: Path, progress: bool) -> Path:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    sweep_stale_imports(out_dir.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", suffix=TMP_SUFFIX, dir=out_dir.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared by several users
        (tmp / OWNER).write_text(_owner())
        _convert(reader, path, cfg, shapes, tmp, progress)
        (tmp / OWNER).unlink()
        (tmp / MARKER).write_text(_marker(tmp, stamp))  # last: a directory without it is no import
        for file in tmp.iterdir():
            _fsync(file)
        _fsync(tmp)
        if out_dir.is_symlink():  # a link to someone's folder: replaced by ours, the folder left alone
            out_dir.unlink()
        elif out_dir.exists() and not is_complete(out_dir, stamp):
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

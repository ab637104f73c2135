"""Atomic saves: every file minikv writes (compare.json, --json outputs, figures, the model cache)
goes through here, so a failed or interrupted write (a full disk, Ctrl-C, SIGTERM, SIGKILL)
leaves the previous file whole, never a truncated one.

    with atomic_open(path, "w") as f:   # f is a temporary file in path's directory
        f.write(text)                   # on success: flushed, fsynced, renamed onto path
    atomic_write(path, text_or_bytes)

The temporary file lives in the same directory as `path` (a rename is atomic only within one file
system), is fsynced before the rename (else a crash can leave the new name pointing at an empty
file), and is removed when anything goes wrong. A write error names the file it was for.
"""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_open(path, mode: str = "w", encoding: str | None = "utf-8"):
    """A file object for a new version of `path`; it replaces `path` only when the block ends
    without an exception. mode "w" (text) or "wb" (bytes)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a whole file: mode 'w' or 'wb', got {mode!r}")
    named = Path(path)
    path = named.resolve() if named.is_symlink() else named  # a link keeps pointing at the new file
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise _naming(err, named) from None
    try:
        with os.fdopen(fd, mode, encoding=encoding if mode == "w" else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a saved file is as open() makes it
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise _naming(err, named) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def atomic_write(path, data: str | bytes) -> None:
    """Replace `path` with `data` (str: UTF-8 text), atomically."""
    with atomic_open(path, "wb" if isinstance(data, bytes) else "w") as f:
        f.write(data)


def fsync_dir(directory) -> None:
    """Make a rename in `directory` durable (where the platform lets a directory be opened)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on a directory; the rename itself is done
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _naming(err: OSError, path: Path) -> OSError:
    """The error, saying which file could not be written (the temporary name is no use to anyone)."""
    if str(path) in str(err):
        return err
    return type(err)(err.errno, f"cannot write {path}: {err.strerror or err}")

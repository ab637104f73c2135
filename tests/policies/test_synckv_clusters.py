"""SyncKV's offline clustering (Sec. 4.1, App. B.1): Eq. 1 on hand-made sets, K-means, planted
clusters recovered from synthetic attention, the file round trip and its errors. The clustering
is offline arithmetic on small host tensors, no kernel or tier: built on the CPU (CPU_ONLY)."""
import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies.synckv.clusters import (SimilarityMeter, cluster_layer, find_clustering, kmeans, make_document,
                                             overlap, weights_sha256)


def test_overlap_coefficient_eq1():
    a = torch.tensor([[0, 1, 2, 3], [5, 6, -1, -1]])
    b = torch.tensor([[2, 3, 4, 5]])
    o = overlap(a, b, 10)
    assert o[0, 0] == 0.5  # {2, 3} of 4
    assert o[1, 0] == 0.5  # {5} of min(2, 4)
    assert torch.equal(torch.diagonal(overlap(a, a, 10)), torch.ones(2, dtype=torch.float64))


def test_kmeans_separates_obvious_groups_and_is_deterministic():
    g = torch.Generator().manual_seed(0)
    pts = torch.cat([torch.randn(5, 2, generator=g) * 0.1 + c for c in (torch.tensor([0., 0.]), torch.tensor([5., 5.]),
                                                                         torch.tensor([0., 9.]))])
    labels, centroids = kmeans(pts, 3, seed=1)
    groups = {tuple(sorted(torch.nonzero(labels == j).flatten().tolist())) for j in range(3)}
    assert groups == {(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14)}
    again, _ = kmeans(pts, 3, seed=1)
    assert torch.equal(labels, again)
    with pytest.raises(ValueError):
        kmeans(pts, 16)


def planted_attention(groups, L=240, steps=40, focus=30, seed=0):
    """Per step, each planted group of heads attends to its own random focus tokens (a strong
    bump on them, plus noise per head): heads of one group share most of their top-k, heads of
    different groups share only what chance gives. -> (steps, H, L) scores."""
    g = torch.Generator().manual_seed(seed)
    H = sum(len(m) for m in groups)
    out = torch.empty(steps, H, L)
    for t in range(steps):
        for members in groups:
            bump = torch.zeros(L)
            bump[torch.randperm(L, generator=g)[:focus]] = 3.0
            for h in members:
                out[t, h] = bump + torch.randn(L, generator=g)
    return out


@pytest.mark.parametrize("groups", [[[0, 3, 5], [1, 2, 7], [4, 6]], [[0, 1], [2, 3]], [[0, 2, 4, 6], [1, 3, 5, 7]]])
def test_clustering_recovers_planted_clusters(groups):
    H = sum(len(m) for m in groups)
    meter = SimilarityMeter(1, H)
    for scores in planted_attention(groups):
        meter.add(0, scores.topk(32, dim=-1).indices, scores.shape[-1])
    S = meter.mean()[0]
    result = cluster_layer(S, len(groups), seed=0)
    assert sorted(result["clusters"]) == sorted(sorted(m) for m in groups)
    assert all(r in c for r, c in zip(result["r_heads"], result["clusters"]))
    # the R-head is the member whose row of D = max(S) - S is nearest the cluster's mean row
    D = S.max() - S
    for members, r in zip(result["clusters"], result["r_heads"]):
        dist = torch.linalg.vector_norm(D[members] - D[members].mean(0), dim=1)
        assert members[int(dist.argmin())] == r
    one = cluster_layer(S, 1)
    assert one["clusters"] == [list(range(H))] and len(one["r_heads"]) == 1


def test_document_round_trip_and_lookup(tmp_path):
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                      n_heads=6, n_kv_heads=3, head_dim=16, max_position_embeddings=4096, rotary_dim=16)
    S = torch.tensor([[[1.0, 0.9, 0.2], [0.9, 1.0, 0.3], [0.2, 0.3, 1.0]]] * 2)
    doc = make_document(cfg, name="tiny", weights="abc", S=S, corpus={"docs": 1})
    assert set(doc["clusterings"]) == {"1", "2", "3"}
    assert doc["clusterings"]["2"][0]["clusters"] == [[0, 1], [2]]
    path = tmp_path / "c.json"
    import json

    path.write_text(json.dumps(doc))
    layers, file = find_clustering(cfg, 2, str(path))
    assert layers == doc["clusterings"]["2"] and file == path
    path.write_text("{}")
    with pytest.raises(ValueError, match="not a SyncKV clustering file"):
        find_clustering(cfg, 2, str(path))


def test_weights_digest_is_over_the_tensors_not_the_file_bytes(tmp_path):
    """Two imports of the same weights differ in the safetensors header (its metadata has no
    fixed order): the digest sees only names, dtypes, shapes and values."""
    from safetensors.torch import save_file

    tensors = {"b.weight": torch.arange(6.0).view(2, 3), "a.weight": torch.ones(4, dtype=torch.bfloat16)}
    digests = []
    for name, meta in [("one", {"format": "pt", "source": "x"}), ("two", {"source": "y"})]:
        (tmp_path / name).mkdir()
        save_file(tensors, str(tmp_path / name / "model.safetensors"), metadata=meta)
        digests.append(weights_sha256(tmp_path / name))
    assert digests[0] == digests[1]
    (tmp_path / "three").mkdir()
    save_file({**tensors, "a.weight": torch.full((4,), 2.0, dtype=torch.bfloat16)},
              str(tmp_path / "three" / "model.safetensors"))
    assert weights_sha256(tmp_path / "three") != digests[0]

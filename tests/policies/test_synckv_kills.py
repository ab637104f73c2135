"""SyncKV's clustering steps against their definitions, where mutation testing (docs/mutation.md)
found wrong implementations the other tests pass: Eq. 1 on sets of one token, Eq. 2 as a mean
over steps (per layer, in float64), K-means on heads whose rows of D coincide (App. B.1: two heads
that attend alike), and the best of K-means' restarts. Offline arithmetic on small host tensors;
and the counts behind Mem% and the transfers, from what the heads read; a lone R-head under
the union; prefill's output; two-head layers."""
import pytest
import torch

from minikv.policies import make
from minikv.policies.synckv.clusters import SimilarityMeter, cluster_layer, kmeans, least_agreeing_layers, overlap

from ..fixtures import DEVICE
from . import test_synckv_paper as paper
from .test_synckv import write_clusters
from .test_synckv_paper import CFG as PAPER_CFG
from .test_synckv_paper import CLUSTERS as PAPER_CLUSTERS


def test_overlap_of_single_tokens_and_empty_sets_eq1():
    """|A ∩ B| / min(|A|, |B|): a one-token set inside another overlaps it fully; an empty set
    overlaps nothing (0, not 0/0)."""
    a = torch.tensor([[3, -1, -1], [-1, -1, -1]])
    b = torch.tensor([[3, 4, 5], [6, -1, -1]])
    o = overlap(a, b, 8)
    assert o.dtype == torch.float64
    assert o.tolist() == [[1.0, 0.0], [0.0, 0.0]]


def test_similarity_is_the_mean_of_eq1_over_steps_per_layer():
    """Eq. 2: S = the mean over the steps added to a layer of Eq. 1 between its heads' sets;
    a layer no step reached is all zero. Summed in float64: over a corpus's thousands of steps a
    float32 sum drifts (here: ten steps of 1/3)."""
    steps = [torch.tensor([[0, 1], [1, 2]]), torch.tensor([[0, 1], [0, 1]]), torch.tensor([[4, -1], [5, 6]])]
    meter = SimilarityMeter(4, 2)
    for index in steps:
        meter.add(0, index, 8)
    meter.add(1, steps[0], 8)
    for _ in range(10):
        meter.add(3, torch.tensor([[0, 1, 2], [2, 3, 4]]), 8)
    S = meter.mean()
    assert S.dtype == torch.float64
    # per step, the off-diagonal overlap: 1/2, 1, 0 -> mean 1/2; layer 1 saw the first step alone
    assert S[0].tolist() == [[1.0, 0.5], [0.5, 1.0]]
    assert S[1].tolist() == [[1.0, 0.5], [0.5, 1.0]]
    assert S[2].tolist() == [[0.0, 0.0], [0.0, 0.0]]
    assert abs(float(S[3, 0, 1]) - 1 / 3) < 1e-15


def test_clustering_heads_that_attend_alike():
    """Two heads with the same row of D (they chose the same tokens at every step), clustered
    into as many clusters as heads (the clustering file holds every N_r up to Hkv): k-means++
    runs out of distinct points and an empty cluster takes the farthest point; the result is
    still a partition of the heads, each R-head in its cluster (at N_r = 4, one cluster stays
    empty: three distinct rows make three clusters)."""
    S = torch.tensor([[1.0, 1.0, 0.2, 0.1], [1.0, 1.0, 0.2, 0.1], [0.2, 0.2, 1.0, 0.3], [0.1, 0.1, 0.3, 1.0]],
                     dtype=torch.float64)
    for n_r in (3, 4):
        result = cluster_layer(S, n_r)
        assert result["clusters"] == [[0, 1], [2], [3]]
        assert result["r_heads"][1:] == [2, 3] and result["r_heads"][0] in (0, 1)
    labels, centroids = kmeans(torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]), 3)
    assert labels[0] == labels[1] and labels[2] == labels[3] and labels[0] != labels[2]
    assert centroids.shape == (3, 2)


def inertia(points, labels, centroids):
    return float((points.double() - centroids[labels]).square().sum())


def test_kmeans_keeps_the_best_restart():
    """Of its restarts, K-means returns the one of least inertia: never worse than its first
    restart (restarts=1, the same seed), and better on some seeds where that one is a local
    minimum. Points in the unit square, as the rows of D = max(S) - S are."""
    g = torch.Generator().manual_seed(0)
    points = torch.rand(24, 2, generator=g, dtype=torch.float64)
    better = 0
    for seed in range(12):
        best = inertia(points, *kmeans(points, 5, seed=seed))
        first = inertia(points, *kmeans(points, 5, seed=seed, restarts=1))
        assert best <= first + 1e-12
        better += best < first - 1e-9
    assert better > 0


@pytest.fixture(scope="module")
def paper_clusters(tmp_path_factory):
    """test_synckv_paper's layer: 4 KV heads in two clusters, each with an NR-head."""
    return write_clusters(tmp_path_factory.mktemp("synckv_kills") / "c.json", PAPER_CFG, PAPER_CLUSTERS, n_r=2)


@pytest.mark.parametrize("nr_reads, offload", [("cluster", True), ("union", True), ("cluster", False)])
def test_what_each_tier_holds_and_what_moved(paper_clusters, nr_reads, offload):
    """Mem% and the transfers (Table 3's columns) from what the heads read: every step, the
    device holds the R-heads' full KV and what the NR-heads read (counted from attended_indices);
    the host bank the prompt and the generated tokens past the window; the slots reserved are
    the budget per NR-head (N_r sets of k = budget - window - m + 1 under the union); the tokens
    fetched are, per NR-head, the new members of the dynamic sets it reads."""
    spec = (f"synckv:wide_layers=0,n_r=2,budget=16,window=4,m=3,rho=0.5,nr_reads={nr_reads},offload={offload},"
            f"clusters={paper_clusters}")
    T, steps, max_len = 40, 10, 64
    policy = make(spec).bind(PAPER_CFG, device=DEVICE, dtype=torch.float32, max_len=max_len)
    layer = policy.layers[0]
    Hkv, Hr, Hn = PAPER_CFG.n_kv_heads, len(layer.r_heads), len(layer.nr_heads)
    before_any = policy.stats()  # nothing stored, nothing anticipated yet
    assert (before_any["mem_percent"], before_any["tokens_fetched_per_anticipation"]) == (0.0, 0.0)
    g = torch.Generator().manual_seed(3)
    H, D = PAPER_CFG.n_heads, PAPER_CFG.head_dim
    layer.prefill(torch.randn(1, H, T, D, generator=g).to(DEVICE), torch.randn(1, Hkv, T, D, generator=g).to(DEVICE),
                  torch.randn(1, Hkv, T, D, generator=g).to(DEVICE), None)
    k = policy.budget - policy.ring
    slots = (2 * k if nr_reads == "union" else k) + policy.ring
    assert layer.allocated_device_tokens() == (Hr * max_len + Hn * (slots if offload else max_len)) / Hkv
    assert layer.allocated_host_tokens() == (Hn * max_len / Hkv if offload else 0)
    assert layer.aux_bytes() == (Hr * max_len, 0)  # `selectable`: one bool per R-head and token
    fetched = 0
    for _ in range(steps):
        before = [set(d) - {-1} for d in layer.dynamic]
        layer.decode(*(torch.randn(1, n, 1, D, generator=g).to(DEVICE) for n in (H, Hkv, Hkv)), None)
        L = layer.length
        rows = layer.attended_indices().tolist()
        nr_read = sum(len(set(rows[h]) - {-1}) for h in layer.nr_heads)
        assert layer.nr_read() == nr_read
        assert layer.device_tokens() == (Hr * L + nr_read) / Hkv
        assert layer.resident_tokens() == (layer.device_tokens() if offload else L)
        assert layer.host_tokens() == (Hn * max(T, layer.start) / Hkv if offload else 0)
        new = [len(set(d) - {-1} - b) for d, b in zip(layer.dynamic, before)]
        fetched += sum(new[c] for own in layer.nr_cluster for c in layer.read_clusters(own)) if offload else 0
        assert layer.fetched == fetched
        policy.end_step()
    assert fetched > 0 or not offload
    s = policy.stats()
    assert s["tokens_fetched"] == fetched
    assert s["tokens_fetched_per_anticipation"] == (fetched / layer.anticipations / Hn if fetched else 0.0)
    assert s["mem_percent"] == 100.0 * layer.resident_tokens() / layer.length


# a cluster of its R-head alone before one with NR-heads: under the union its sets are read
LONE_FIRST = [{"clusters": [[0], [1, 2, 3]], "r_heads": [0, 2]}] * 2


@pytest.mark.parametrize("spec, union", [(paper.SPEC, True),
                                         (paper.SPEC.replace("synckv:paper", "synckv:wide_layers=0,nr_reads=cluster,window=0,"
                                                                            "exclude_static=false,n_r=2"),
                                          False)])
def test_a_lone_r_head_still_chooses_for_the_union(tmp_path, monkeypatch, spec, union):
    """Algorithm 1 with a cluster of one head (its R-head) first: under the union (lines 23-24)
    the NR-heads of the other cluster read its sets too, so its anticipation counts; with own-cluster
    reads it serves nobody, and the cluster after it still anticipates. Step by step against
    test_synckv_paper's transcription."""
    monkeypatch.setattr(paper, "CLUSTERS", LONE_FIRST)
    clusters = write_clusters(tmp_path / "c.json", PAPER_CFG, LONE_FIRST, n_r=2)
    for got, want, diff, dyn, paper_dyn in paper.run(clusters, spec, union=union):
        assert got == want and diff < 1e-5
        if union:
            assert dyn == paper_dyn
        else:
            assert dyn[1] == paper_dyn[1]


def test_prefill_is_dense_attention_over_the_prompt(paper_clusters):
    """Algorithm 1 line 10: the prompt is attended in full (the selection comes after)."""
    policy = make(f"{paper.SPEC},clusters={paper_clusters}").bind(PAPER_CFG, device=DEVICE, dtype=torch.float32,
                                                                    max_len=41)
    g = torch.Generator().manual_seed(5)
    H, Hkv, D, T = PAPER_CFG.n_heads, PAPER_CFG.n_kv_heads, PAPER_CFG.head_dim, 40
    q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    out = policy.layers[0].prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None).cpu()
    G = PAPER_CFG.n_groups
    for h in range(H):
        scores = q[0, h] @ k[0, h // G].T / D ** 0.5 + torch.full((T, T), float("-inf")).triu(1)
        torch.testing.assert_close(out[0, h], torch.softmax(scores, -1) @ v[0, h // G])
    one = torch.randn(1, H, 1, D, generator=g).to(DEVICE), torch.randn(1, Hkv, 1, D, generator=g).to(DEVICE)
    policy.layers[0].decode(one[0], one[1], one[1], None)  # token 41 of max_len 41
    with pytest.raises(ValueError, match=r"outgrew max_len \(41 tokens\)"):
        policy.layers[0].decode(one[0], one[1], one[1], None)


def test_least_agreeing_layers_of_two_heads():
    """Two KV heads (Qwen2.5-Coder-0.5B): the mean of S off the diagonal is S[0, 1]."""
    S = torch.tensor([[[1.0, 0.6], [0.6, 1.0]], [[1.0, 0.2], [0.2, 1.0]], [[1.0, 0.4], [0.4, 1.0]]])
    assert least_agreeing_layers(S, 1) == [1]
    assert least_agreeing_layers(S, 2) == [1, 2]

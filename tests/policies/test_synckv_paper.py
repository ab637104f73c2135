"""synckv:paper against SyncKV's Algorithm 1, transcribed here independently of the library.

`paper_algorithm_1` is Algorithm 1 of "SyncKV: A Syncopated Scheduling Approach to KV Cache
Compression" line by line, in plain PyTorch (its own softmax, top-k and attention; nothing from
minikv), plus only the decisions docs/design.md states where the paper is silent: the recent
window (the last `window` tokens, read by every head, left only at a selection point), the
candidates of a selection being the tokens before it and not in the cluster's static set, and a
KV head's attention max-pooled over its GQA group (App. B.1). The policy
`synckv:preset=paper,backend=reference` must match it step by step: what every KV head reads,
the dynamic sets, the output. Lines 23-24 read the union over every cluster's sets: an
implementation where a non-representative head reads its own cluster's sets (minikv's default,
nr_reads=cluster) fails, and the test shows it does."""
import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE
from .test_synckv import write_clusters

# 4 KV heads, 2 query heads each; two clusters, each with a non-representative head
CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64, n_layers=1,
                  n_heads=8, n_kv_heads=4, head_dim=8, max_position_embeddings=4096, rotary_dim=8)
CLUSTERS = [{"clusters": [[0, 1], [2, 3]], "r_heads": [0, 3]}]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    return write_clusters(tmp_path_factory.mktemp("synckv_paper") / "c.json", CFG, CLUSTERS, n_r=2)


def pooled_attention(q_heads, keys):
    """A KV head's attention over `keys` (L, D): softmax(q K^T / sqrt(d)) of each of its query
    heads q_heads (G, D), max-pooled over them (App. B.1) -> (L,)."""
    return torch.softmax(q_heads @ keys.T / math.sqrt(keys.shape[1]), dim=-1).amax(0)


def top(scores, candidates, k):
    """argTop_k of scores over the candidate tokens, best first."""
    candidates = list(candidates)
    if not candidates or k == 0:
        return []
    order = torch.tensor([float(scores[t]) for t in candidates]).argsort(descending=True, stable=True)
    return [candidates[i] for i in order[:k].tolist()]


def attend(q_heads, keys, values, tokens):
    """Dense attention of q_heads (G, D) over the listed tokens -> (G, D)."""
    t = torch.tensor(sorted(tokens))
    p = torch.softmax(q_heads @ keys[t].T / math.sqrt(keys.shape[1]), dim=-1)
    return p @ values[t]


class PaperAlgorithm1:
    """Algorithm 1 for one layer: lines 13-17 at prefill, lines 22-35 at each decode step."""

    def __init__(self, clusters, r_heads, k, rho, m, window, G, union=True):
        self.clusters, self.r_heads, self.m, self.W, self.G, self.union = clusters, r_heads, m, window, G, union
        self.k_dyn = math.floor((1 - rho) * k + 1e-9)  # under Eq. 6
        self.k = k
        self.I_S, self.I_D = [], []
        self.t = 0

    def q_of(self, q, h):
        return q[h * self.G:(h + 1) * self.G]

    def prefill(self, q_last, K, V):
        # q_last (Hq, D), K, V (Hkv, T, D)
        T = K.shape[1]
        self.K, self.V = K, V
        self.start = max(0, T + 1 - self.W)  # the window: the last W tokens as of the next step
        for g, h_r in enumerate(self.r_heads):  # lines 13-17
            A = pooled_attention(self.q_of(q_last, h_r), K[h_r])
            I_0 = top(A, range(self.start), self.k)  # line 15 (Eq. 3)
            k_static = self.k - self.k_dyn
            self.I_S.append(I_0[:k_static])  # line 16 (Eq. 4)
            self.I_D.append(I_0[k_static:])

    def decode(self, q, k, v):
        # q (Hq, D), k, v (Hkv, D) -> out (Hq, D), reads {KV head: tokens}
        self.t += 1
        self.K = torch.cat((self.K, k[:, None]), 1)
        self.V = torch.cat((self.V, v[:, None]), 1)
        L = self.K.shape[1]
        window = set(range(self.start, L))
        out, reads = torch.empty_like(q), {}
        for g, members in enumerate(self.clusters):
            for h in members:
                if h in self.r_heads:  # line 22: full KV
                    reads[h] = set(range(L))
                elif self.union:  # line 23: the union over g = 1..N_r
                    reads[h] = set().union(*(set(s) | set(d) for s, d in zip(self.I_S, self.I_D))) | window
                else:
                    reads[h] = set(self.I_S[g]) | set(self.I_D[g]) | window
                out[h * self.G:(h + 1) * self.G] = attend(self.q_of(q, h), self.K[h], self.V[h], reads[h])  # line 24
        if self.t % self.m == 0:  # line 26: anticipation
            self.start = max(self.start, L + 1 - self.W)
            for g, h_r in enumerate(self.r_heads):  # lines 27-31 (Eqs. 5-6)
                A = pooled_attention(self.q_of(q, h_r), self.K[h_r])
                self.I_D[g] = top(A, [t for t in range(self.start) if t not in self.I_S[g]], self.k_dyn)
        return out, reads  # else lines 33-35: I_D unchanged


def run(clusters, spec, union, T=80, steps=12, seed=0):
    """Drive the policy and the transcription with the same random q, k, v; -> per decode step,
    (the policy's reads, the transcription's reads, max |output difference|)."""
    policy = make(f"{spec},clusters={clusters}").bind(CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    layer = policy.layers[0]
    paper = PaperAlgorithm1(CLUSTERS[0]["clusters"], CLUSTERS[0]["r_heads"], policy.k_static + policy.k_dyn,
                            policy.rho, policy.m, policy.window, CFG.n_groups, union=union)
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)  # the transcription: on the CPU
    paper.prefill(q[0, :, -1], k[0], v[0])
    assert [sorted(s) for s in layer.static] == [sorted(s) for s in paper.I_S]
    rows = []
    for _ in range(steps):
        q, k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
        out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)[0, :, 0].cpu()
        want, reads = paper.decode(q[0, :, 0], k[0, :, 0], v[0, :, 0])
        got = layer.attended_indices()
        got = [set(range(layer.length))] * Hkv if got is None else [set(r) - {-1} for r in got.tolist()]
        rows.append((got, [reads[h] for h in range(Hkv)], float((out - want).abs().max()),
                     [sorted(t for t in d if t >= 0) for d in layer.dynamic], [sorted(d) for d in paper.I_D]))
        policy.end_step()
    return rows


SPEC = "synckv:paper,n_r=2,budget=16,window=4,m=3,rho=0.5,backend=reference"


def test_paper_preset_is_algorithm_1_with_the_union(clusters):
    """Every step: each KV head reads what lines 22-24 say, the dynamic sets are lines 26-35's,
    the output is attention over exactly those tokens."""
    for got, want, diff, dyn, paper_dyn in run(clusters, SPEC, union=True):
        assert got == want
        assert dyn == paper_dyn
        assert diff < 1e-5


def test_own_cluster_reads_are_not_algorithm_1(clusters):
    """The check has teeth: minikv's default reads (own cluster) differ from line 23's union,
    and the transcription's own-cluster variant is what nr_reads=cluster does."""
    spec = SPEC.replace("synckv:paper", "synckv:wide_layers=0,nr_reads=cluster")
    rows = run(clusters, spec, union=True)
    assert any(got != want for got, want, *_ in rows)
    for got, want, diff, dyn, paper_dyn in run(clusters, spec, union=False):
        assert got == want and dyn == paper_dyn and diff < 1e-5


def test_the_preset_sets_the_papers_rules():
    p = make("synckv:paper,budget=256")
    assert (p.wide_layers, p.nr_reads, p.budget, p.preset) == (0, "union", 256, "paper")
    assert make("synckv:preset=paper").nr_reads == "union"
    with pytest.raises(ValueError, match="preset=paper sets nr_reads=union"):
        make("synckv:paper,nr_reads=cluster")

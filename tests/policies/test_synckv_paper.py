"""synckv:paper against SyncKV's Algorithm 1, transcribed here independently of the library.

`PaperAlgorithm1` is Algorithm 1 of "SyncKV: A Syncopated Scheduling Approach to KV Cache
Compression" line by line, in float64 PyTorch (its own softmax, top-k and attention; nothing from
minikv): Eq. 3's I_0 the top k of the R-head's attention from the last prompt token over the
whole prompt, Eq. 4's split by rho, lines 22-24 (R-heads over their full KV, NR-heads over the
union of every cluster's static and dynamic sets and nothing else: no recent window), lines 26-35
(every m-th step, Eq. 6's top k_dyn of the R-head's whole attention vector, the current token and
the static tokens included; the other steps keep the sets, Eq. 8), with a KV head's attention
max-pooled over its GQA group (App. B.1). N_r is the paper's: 2 on a Llama model (Sec. 5.1).
The policy `synckv:paper,backend=reference` must match it at every step of every layer: what
every KV head reads, the dynamic sets, the output.

minikv's own decisions, which the default takes (a recent window read by every head and left
only at a selection point; dynamic sets chosen among the tokens not static; an NR-head reading
its own cluster's sets), are switches of the same transcription (`window`, `exclude_static`,
`union`), so the tests also show that each is a different rule from the paper's."""
import json
import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE
from .test_synckv import write_clusters

# 4 KV heads, 2 query heads each, two layers; two clusters per layer, each with a non-representative
# head in layer 0, one of three heads and one lone R-head in layer 1
CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64, n_layers=2,
                  n_heads=8, n_kv_heads=4, head_dim=8, max_position_embeddings=4096, rotary_dim=8)
CLUSTERS = [{"clusters": [[0, 1], [2, 3]], "r_heads": [0, 3]},
            {"clusters": [[0, 2, 3], [1]], "r_heads": [2, 1]}]
SPEC = "synckv:paper,budget=16,m=3,rho=0.5,backend=reference"  # k = 16: 8 static, 8 dynamic per cluster


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    return write_clusters(tmp_path_factory.mktemp("synckv_paper") / "c.json", CFG, CLUSTERS, n_r=2)


def pooled_attention(q_heads, keys):
    """A KV head's attention over `keys` (L, D): softmax(q K^T / sqrt(d)) of each of its query
    heads q_heads (G, D), max-pooled over them (App. B.1) -> (L,), in float64."""
    logits = q_heads.double() @ keys.double().T / math.sqrt(keys.shape[1])
    p = torch.exp(logits - logits.max(-1, keepdim=True).values)
    return (p / p.sum(-1, keepdim=True)).amax(0)


def top(scores, candidates, k):
    """argTop_k of scores over the candidate tokens, best first (a sort of (score, token) pairs)."""
    return [t for _, t in sorted(((-float(scores[t]), t) for t in candidates))[:k]]


def attend(q_heads, keys, values, tokens):
    """Dense attention of q_heads (G, D) over the listed tokens, in float64 -> (G, D)."""
    t = torch.tensor(sorted(tokens))
    logits = q_heads.double() @ keys[t].double().T / math.sqrt(keys.shape[1])
    p = torch.exp(logits - logits.max(-1, keepdim=True).values)
    return (p / p.sum(-1, keepdim=True)) @ values[t].double()


class PaperAlgorithm1:
    """Algorithm 1 for one layer: lines 13-17 at prefill, lines 22-35 at each decode step.
    window=0, exclude_static=False, union=True: the paper's. window=W > 0: minikv's recent window
    (the last W tokens as of the next step, left only at a selection point, read by every head,
    not a candidate until it leaves); exclude_static: candidates of Eq. 6 not static; union=False:
    an NR-head reads its own cluster's sets."""

    def __init__(self, clusters, r_heads, k, rho, m, G, window=0, exclude_static=False, union=True):
        self.clusters, self.r_heads, self.m, self.G = clusters, r_heads, m, G
        self.W, self.exclude_static, self.union = window, exclude_static, union
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
        self.start = max(0, T + 1 - self.W) if self.W else T  # window=0: every prompt token is a candidate
        for g, h_r in enumerate(self.r_heads):  # lines 13-17
            A = pooled_attention(self.q_of(q_last, h_r), K[h_r])
            I_0 = top(A, range(self.start), self.k)  # line 15 (Eq. 3)
            k_static = self.k - self.k_dyn
            self.I_S.append(I_0[:k_static])  # line 16 (Eq. 4)
            self.I_D.append(I_0[k_static:])

    def decode(self, q, k, v):
        # q (Hq, D), k, v (Hkv, D) -> out (Hq, D) float64, reads {KV head: tokens}
        self.t += 1
        self.K = torch.cat((self.K, k[:, None]), 1)
        self.V = torch.cat((self.V, v[:, None]), 1)
        L = self.K.shape[1]
        window = set(range(self.start, L)) if self.W else set()
        out, reads = torch.empty(q.shape, dtype=torch.float64), {}
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
            self.start = max(self.start, L + 1 - self.W) if self.W else L
            for g, h_r in enumerate(self.r_heads):  # lines 27-31 (Eqs. 5-6)
                A = pooled_attention(self.q_of(q, h_r), self.K[h_r])  # line 28: over all L tokens
                candidates = [t for t in range(self.start) if not (self.exclude_static and t in self.I_S[g])]
                self.I_D[g] = top(A, candidates, self.k_dyn)  # line 29
        return out, reads  # else lines 33-35: I_D unchanged


def run(clusters, spec, union, T=40, steps=12, seed=0, layers=None):
    """Drive the policy's layers and one transcription per layer with the same random q, k, v;
    -> per layer and decode step, (the policy's reads, the transcription's reads, max |output
    difference|, the policy's dynamic sets, the transcription's)."""
    layers = CLUSTERS if layers is None else layers
    policy = make(f"{spec},clusters={clusters}").bind(CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    k = policy.k_static + policy.k_dyn
    papers = [PaperAlgorithm1(c["clusters"], c["r_heads"], k, policy.rho, policy.m, CFG.n_groups,
                              window=policy.window, exclude_static=policy.exclude_static, union=union)
              for c in layers]
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    for layer, paper in zip(policy.layers, papers):
        q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
        layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)  # the transcription: on the CPU
        paper.prefill(q[0, :, -1], k[0], v[0])
        assert [sorted(s) for s in layer.static] == [sorted(s) for s in paper.I_S]
    rows = []
    for _ in range(steps):
        for layer, paper in zip(policy.layers, papers):
            q, k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
            out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)[0, :, 0].cpu()
            want, reads = paper.decode(q[0, :, 0], k[0, :, 0], v[0, :, 0])
            got = layer.attended_indices()
            got = [set(range(layer.length))] * Hkv if got is None else [set(r) - {-1} for r in got.tolist()]
            rows.append((got, [reads[h] for h in range(Hkv)], float((out.double() - want).abs().max()),
                         [sorted(t for t in d if t >= 0) for d in layer.dynamic], [sorted(d) for d in paper.I_D]))
        policy.end_step()
    return rows


def test_paper_preset_is_algorithm_1(clusters):
    """Every step of both layers: each KV head reads what lines 22-24 say (no window: not even the
    new token for an NR-head), the dynamic sets are lines 26-35's, the output is attention over
    exactly those tokens; the sets do move, and at least one takes a static or a new token."""
    rows = run(clusters, SPEC, union=True)
    for got, want, diff, dyn, paper_dyn in rows:
        assert got == want
        assert dyn == paper_dyn
        assert diff < 1e-5
    assert len({str(dyn) for *_, dyn in rows}) > 4  # anticipations changed the sets
    new_tokens = [any(t >= 40 for d in dyn for t in d) for *_, dyn in rows]
    assert any(new_tokens)  # Eq. 6 over the whole vector: a generated token was chosen


def test_the_preset_takes_the_papers_n_r_from_the_model(tmp_path):
    """Sec. 5.1: N_r = 2 on Llama models, 1 on Qwen; a model of 2 KV heads takes 1 (2 would make
    every head an R-head), a size given beside the preset stays."""
    def bound(model_type, n_kv, spec="synckv:paper"):
        cfg = ModelConfig(model_type=model_type, vocab_size=64, hidden_size=64, intermediate_size=64, n_layers=1,
                          n_heads=8, n_kv_heads=n_kv, head_dim=8, max_position_embeddings=4096, rotary_dim=8)
        path = tmp_path / f"{model_type}{n_kv}.json"
        write_clusters(path, cfg, [{"clusters": [list(range(n_kv))], "r_heads": [0]}], n_r=1)
        doc = json.loads(path.read_text())  # and N_r = 2: head 0 alone, the others with head 1
        doc["clusterings"]["2"] = [{"clusters": [[0], list(range(1, n_kv))], "r_heads": [0, 1]}]
        path.write_text(json.dumps(doc))
        policy = make(f"{spec},budget=16,m=3,clusters={path}").bind(cfg, device=DEVICE, dtype=torch.float32,
                                                                      max_len=64)
        return len(policy.layers[0].r_heads)
    assert bound("llama", 4) == 2 and bound("mistral", 4) == 2 and bound("gpt_neox", 8) == 2
    assert bound("qwen2", 4) == 1 and bound("llama", 2) == 1
    assert bound("llama", 4, "synckv:paper,n_r=1") == 1


def test_the_defaults_decisions_are_not_algorithm_1(clusters):
    """The check has teeth: a recent window, dynamic sets kept apart from the static ones, or an
    NR-head reading its own cluster's sets each read other tokens than lines 22-29 at some step;
    and each is the transcription with that decision switched on."""
    base = "synckv:wide_layers=0,n_r=2,budget=16,m=3,rho=0.5,backend=reference"
    paper = run(clusters, SPEC, union=True, seed=1)
    for decision, kw in [("window=4,nr_reads=union,exclude_static=false", dict(union=True)),
                         ("window=0,nr_reads=union,exclude_static=true", dict(union=True)),
                         ("window=0,nr_reads=cluster,exclude_static=false", dict(union=False))]:
        mine = run(clusters, f"{base},{decision}", **kw, seed=1)
        assert any(a[0] != b[0] or a[3] != b[3] for a, b in zip(mine, paper)), decision
        for got, want, diff, dyn, paper_dyn in mine:  # (a lone R-head's sets serve nobody in its own cluster)
            assert got == want and diff < 1e-5 and (dyn == paper_dyn or not kw["union"]), decision


def test_the_preset_sets_the_papers_rules():
    p = make("synckv:paper,budget=256")
    assert (p.wide_layers, p.nr_reads, p.window, p.exclude_static, p.n_r, p.budget, p.preset) == \
        (0, "union", 0, False, None, 256, "paper")
    assert (p.rho, p.m) == (0.5, 5)  # "m was set at 5 ... the static ratio rho was set to 0.5"
    assert make("synckv:preset=paper").nr_reads == "union"
    with pytest.raises(ValueError, match="preset=paper sets nr_reads=union"):
        make("synckv:paper,nr_reads=cluster")
    with pytest.raises(ValueError, match="preset=paper sets window=0"):
        make("synckv:paper,window=32")

"""icecache:paper against IceCache's Algorithm 1 (the decode loop) and Algorithms 3-4 (page
selection), transcribed here independently of the library, given the library's DCI tree.

`PaperIceCache` follows Algorithm 1's decode loop: when the last page holds s - 1 tokens, the
oldest window page leaves the GPU (lines 16-17) before the new token is appended (line 20), the
pages are selected (line 22) and attention runs (line 25); only then are the tokens of the page
that left inserted into the tree (lines 26-36), so that step neither reads them in the window nor
can select them. PAGE-SELECT (Algorithm 3) is transcribed with an exact QUERY (Algorithm 4 with a
field of view covering every node and every child scanned: the exact top keys by q.k, which the
MIPS transform of Eqs. 2-3 orders as the distance does), FIND-PAGE-INDEX as the pages in order of
their best key, and the GQA union as minikv's round-robin merge of the group's lists (Sec. 4.2,
docs/design.md). What pages are is the tree's: the test reads each key's page from the index
(`forest.page_of`), and checks the rest: which tokens each KV head reads at each step and the
output over them. The default order (the page leaves after attention) fails it."""
import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=1,
                  n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=4096, rotary_dim=8)
P, SINK, WINDOW, K = 4, 4, 8, 3
SPEC = (f"icecache:paper,page_size={P},sink={SINK},window={WINDOW},budget={SINK + WINDOW + K * P},skip_layers=0,"
        "fov=100000,prop=1.0,backend=reference")


class PaperIceCache:
    def __init__(self, G):
        self.G, self.n_sink, self.n_window = G, SINK // P, WINDOW // P
        self.left = 0  # pages that left the window (lines 16-17), candidates 0 .. left - 1
        self.indexed = 0  # of them, those in the tree (lines 26-36 ran for them)

    def leaves(self, L):
        """Lines 16-17 for the token that makes the length L: the last page reaches s tokens with
        the window's pages all in use -> the oldest window page leaves first."""
        return L % P == 0 and L > self.n_sink * P and L // P - (self.n_sink + self.left) >= self.n_window

    def prefill(self, K_, V_):
        self.K, self.V = K_, V_
        for L in range(1, K_.shape[1] + 1):
            self.left += self.leaves(L)
        self.indexed = self.left  # lines 6-10: the tokens between sink and window, indexed

    def page_select(self, q, forest):
        """Algorithm 3 per query head with an exact QUERY, merged per group -> per KV head a set."""
        first = self.n_sink * P  # tree id a is token first + a
        ids = torch.arange(self.indexed * P)
        out = []
        for m in range(self.K.shape[0]):
            lists = []
            for j in range(self.G):
                scores = (self.K[m, first + ids] @ q[m * self.G + j]).tolist()  # Algorithm 4: exact q.k
                best = {}
                for page, s in zip(forest.page_of[m, ids].tolist(), scores):  # FIND-PAGE-INDEX
                    best[page] = max(best.get(page, -math.inf), s)
                lists.append(sorted(best, key=lambda p: (-best[p], p))[:K])
            merged = []
            for r in range(K):  # the group's lists round-robin, first K distinct
                for lst in lists:
                    if r < len(lst) and lst[r] not in merged:
                        merged.append(lst[r])
            out.append(merged[:K])
        return out

    def decode(self, q, k, v, forest):
        L = self.K.shape[1] + 1
        if self.leaves(L):  # lines 16-17: before the append and the attention
            self.left += 1
        self.K = torch.cat((self.K, k[:, None]), 1)  # line 20
        self.V = torch.cat((self.V, v[:, None]), 1)
        pages = self.page_select(q, forest) if self.indexed else [[] for _ in range(self.K.shape[0])]  # line 22
        first = self.n_sink * P
        out, reads = torch.empty_like(q), []
        for m in range(self.K.shape[0]):
            in_pages = [first + a for a in range(self.indexed * P) if int(forest.page_of[m, a]) in pages[m]]
            tokens = list(range(min(L, first))) + in_pages + list(range((self.n_sink + self.left) * P, L))
            reads.append(set(tokens))
            t = torch.tensor(sorted(tokens))
            qg = q[m * self.G:(m + 1) * self.G]
            out[m * self.G:(m + 1) * self.G] = torch.softmax(qg @ self.K[m, t].T / math.sqrt(q.shape[1]), -1) @ self.V[m, t]  # line 25
        self.indexed = self.left  # lines 26-36: the page that left goes into the tree now
        return out, reads, pages


def run(spec, T=150, steps=20, seed=0):
    policy = make(spec).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    layer = policy.layers[0]
    paper = PaperIceCache(CFG.n_groups)
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)  # the transcription: on the CPU
    paper.prefill(k[0], v[0])
    rows = []
    for _ in range(steps):
        q, k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
        left_before = paper.left
        out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)[0, :, 0].cpu()
        want, reads, pages = paper.decode(q[0, :, 0], k[0, :, 0], v[0, :, 0], layer.forest)
        got = [set(r) - {-1} for r in layer.attended_indices().tolist()]
        chosen = [set(p for p in row if p >= 0) for row in layer.selection.tolist()]
        rows.append((got, reads, chosen, [set(p) for p in pages], float((out - want).abs().max()),
                     paper.left > left_before))
        policy.end_step()
    return rows


def test_paper_preset_is_algorithm_1_offload_before_attention():
    rows = run(SPEC)
    assert sum(left for *_, left in rows) >= 3  # steps where a page left the window
    for got, want, chosen, paper_pages, diff, _ in rows:
        assert chosen == paper_pages  # Algorithm 3 given the tree
        assert got == want  # what each KV head read: sink, selected pages, window
        assert diff < 1e-5


def test_offload_after_attention_is_not_algorithm_1():
    """The check has teeth: the default order reads the leaving page one step longer."""
    rows = run(SPEC.replace("icecache:paper", "icecache:window_offload=after"))
    assert any(got != want for got, want, *_, left in rows if left)


def test_the_preset_sets_the_papers_rules():
    assert make("icecache:paper,budget=512").window_offload == "before"
    with pytest.raises(ValueError, match="preset=paper sets window_offload=before"):
        make("icecache:paper,window_offload=after")
    with pytest.raises(ValueError, match="window_offload=before needs window >= 2 \\* page_size"):
        make("icecache:paper,window=16,page_size=16")

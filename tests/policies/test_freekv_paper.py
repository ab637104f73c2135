"""freekv:paper against FreeKV's selection, speculation and correction, transcribed here
independently of the library.

`PaperFreeKV` follows the FreeKV text ("Method", Key Designs 1-2) with its own page digest and
page score, nothing from minikv: each page summarised by "min-max pooled keys (similar to
Quest)", a page's weight for query head h Quest's bound P_h[n] = sum_d max(q_d min_d, q_d max_d)
(scaled by 1/sqrt(d), minikv's decision where the text is vague), the page score of KV head m
sum_j softmax(P_{(m-1)G+j}) / G, its top K pages; step t attends with the pages selected with
q_{t-1} (speculative retrieval), and a KV head whose C = mean over its group of cos(q_t, q_{t-1})
is below tau takes q_t's selection before attention (fine-grained correction). Around it, only
the paging docs/design.md states: sink pages and the last `window` tokens are always read (the
window ring of window / P full pages and the partly filled last one), and a full window page
becomes a candidate after attention. `freekv:preset=paper,backend=reference` must read exactly
these tokens at every step and return attention over them; ArkVale's box and plain Quest
(selection with q_t at every step) do not."""
import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                  n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=4096, rotary_dim=8)
P, SINK, WINDOW, K, TAU = 4, 4, 4, 3, 0.9
SPEC = f"freekv:paper,page_size={P},sink={SINK},window={WINDOW},budget={SINK + WINDOW + P + K * P},tau={TAU}"


class PaperFreeKV:
    def __init__(self, G, speculative=True):
        self.G, self.speculative = G, speculative
        self.n_sink, self.n_window = SINK // P, WINDOW // P + 1
        self.n_cand = 0  # pages that left the window: candidates 0 .. n_cand - 1

    def grow(self, L):
        """The paging: after token L - 1, a full window ring gives its oldest page up."""
        if L % P == 0 and L > self.n_sink * P and L // P - (self.n_sink + self.n_cand) >= self.n_window:
            self.n_cand += 1

    def page_keys(self, m, c):
        a = (self.n_sink + c) * P
        return self.K[m, a:a + P]  # (P, D)

    def select(self, q):
        """Group-consistent selection for q (Hq, D) -> per KV head, its top-K candidate pages."""
        out = []
        for m in range(self.K.shape[0]):
            lo = torch.stack([self.page_keys(m, c).amin(0) for c in range(self.n_cand)])  # min-max pooled keys
            hi = torch.stack([self.page_keys(m, c).amax(0) for c in range(self.n_cand)])  # (n, D)
            score = 0
            for j in range(self.G):  # sum_j softmax(P_{(m-1)G+j}) / G
                qh = q[m * self.G + j]
                P_h = torch.maximum(qh * lo, qh * hi).sum(-1) / math.sqrt(qh.shape[0])  # Quest's bound, (n,)
                score = score + torch.softmax(P_h, -1) / self.G
            out.append(set(score.topk(min(K, self.n_cand)).indices.tolist()))
        return out

    def prefill(self, q_last, K, V):
        q_last, K, V = q_last.double(), K.double(), V.double()  # the transcription's arithmetic: float64
        self.K, self.V = K, V
        for L in range(1, K.shape[1] + 1):
            self.grow(L)
        self.next = self.select(q_last) if self.n_cand else [set() for _ in range(K.shape[0])]
        self.prev_q = q_last

    def decode(self, q, k, v):
        """q (Hq, D), k, v (Hkv, D) -> out (Hq, D) float64, reads per KV head, corrected heads."""
        q, k, v = q.double(), k.double(), v.double()
        self.K = torch.cat((self.K, k[:, None]), 1)
        self.V = torch.cat((self.V, v[:, None]), 1)
        L, Hkv = self.K.shape[1], self.K.shape[0]
        self.choosing = self.n_cand > K  # fewer candidates than K: all of them are read, whatever q
        if not self.speculative:
            held = self.select(q) if self.n_cand else [set() for _ in range(Hkv)]
            corrected = []
        else:
            held = self.next  # speculative retrieval: the pages chosen with q_{t-1}
            cos = torch.nn.functional.cosine_similarity(q, self.prev_q, dim=-1, eps=1e-8)  # (Hq,)
            corrected = [m for m in range(Hkv) if float(cos[m * self.G:(m + 1) * self.G].mean()) < TAU]
            if corrected and self.n_cand:
                now = self.select(q)
                held = [now[m] if m in corrected else held[m] for m in range(Hkv)]
        out, reads = torch.empty_like(q), []
        for m in range(Hkv):
            tokens = list(range(min(L, self.n_sink * P)))
            tokens += [(self.n_sink + c) * P + i for c in sorted(held[m]) for i in range(P)]
            tokens += list(range((self.n_sink + self.n_cand) * P, L))
            reads.append(set(tokens))
            t = torch.tensor(tokens)
            qg = q[m * self.G:(m + 1) * self.G]
            out[m * self.G:(m + 1) * self.G] = torch.softmax(qg @ self.K[m, t].T / math.sqrt(q.shape[1]), -1) @ self.V[m, t]
        self.grow(L)  # after attention
        if self.speculative:  # the next step's pages, selected with q_t
            self.next = self.select(q) if self.n_cand else [set() for _ in range(Hkv)]
            self.prev_q = q
        return out, reads, corrected


def drifting_queries(g, steps, H, D):
    """Consecutive queries that mostly stay close (cos ~ 0.95) and sometimes jump, per head."""
    q = torch.randn(H, D, generator=g)
    out = []
    for _ in range(steps):
        eps = torch.tensor([0.05, 0.3, 3.0])[torch.randint(3, (H, 1), generator=g)]  # cos ~ 1, 0.96, 0.3
        q = 2 * q / q.norm(dim=-1, keepdim=True) + eps * 2 * torch.randn(H, D, generator=g) / math.sqrt(D)
        out.append(q.clone())
    return out


def run(spec, speculative=True, T=61, steps=30, seed=0):
    """Each step, every layer with its own drifting queries and random k, v; -> per step and
    layer (the policy's reads, the transcription's, max |output difference|, the corrected
    heads, the policy's count of them, the transcription's)."""
    policy = make(spec).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    papers = [PaperFreeKV(CFG.n_groups, speculative) for _ in policy.layers]
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    qs = [drifting_queries(g, T + steps, H, D) for _ in policy.layers]
    for layer, paper, ql in zip(policy.layers, papers, qs):
        q = torch.stack(ql[:T], 1)[None]  # (1, H, T, D)
        k, v = torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
        layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)  # the transcription: on the CPU
        paper.prefill(q[0, :, -1], k[0], v[0])
    rows = []
    for t in range(steps):
        for layer, paper, ql in zip(policy.layers, papers, qs):
            q = ql[T + t][None, :, None]
            k, v = torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
            before = layer.corrected_heads
            out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)[0, :, 0].cpu()
            want, reads, corrected = paper.decode(q[0, :, 0], k[0, :, 0], v[0, :, 0])
            got = [set(r) - {-1} for r in layer.attended_indices().tolist()]
            counted = len(corrected) if paper.choosing else 0  # the library counts only where it chooses
            rows.append((got, reads, float((out.double() - want).abs().max()), corrected,
                         layer.corrected_heads - before, counted))
        policy.end_step()
    return rows


def test_paper_preset_is_speculation_with_correction_over_min_max_pages():
    rows = run(SPEC + ",backend=reference")
    corrected = [n for *_, n in rows]
    assert sum(n > 0 for n in corrected) >= 3 and sum(n == 0 for n in corrected) >= 3  # both kinds of step
    for got, want, diff, _, n_corrected, n_paper in rows:
        assert got == want
        assert diff < 1e-5
        assert n_corrected == n_paper


@pytest.mark.parametrize("other", ["digest=arkvale", "digest=quant2", "speculative=off"])
def test_other_rules_are_not_the_papers(other):
    """The check has teeth: ArkVale's box, the coded keys, or selecting with q_t at every step
    read other pages than the transcription at some step."""
    spec = SPEC.replace("freekv:paper", f"freekv:{other}") + ",backend=reference"
    assert any(got != want for got, want, *_ in run(spec))


def test_plain_quest_is_the_transcription_without_speculation():
    for got, want, diff, *_ in run(SPEC.replace("freekv:paper", "freekv:paper,speculative=off"), speculative=False):
        assert got == want and diff < 1e-5


def test_the_preset_sets_the_papers_rules():
    p = make("freekv:paper,budget=512")  # the paper's rules at another size
    assert (p.digest, p.speculative, p.rescore, p.group_reduce, p.budget) == ("minmax", True, 0, "softmax_mean", 512)
    assert make("freekv:paper").budget == 2048  # "Budget B was fixed at 2048"
    assert make("freekv:paper,budget=256").budget == 256  # a size given equal to the default stays given
    assert make("freekv").budget == 256  # the default's departure (docs/design.md)
    with pytest.raises(ValueError, match="preset=paper sets digest=minmax"):
        make("freekv:paper,digest=arkvale")

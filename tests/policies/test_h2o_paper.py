"""h2o:paper against H2O's Algorithm 1 with Section 4's recent window, transcribed here
independently of the library.

`PaperH2O` is Algorithm 1 (the H2 eviction algorithm) of "H2O: Heavy-Hitter Oracle for Efficient
Generative Inference of Large Language Models" (Zhang et al., NeurIPS 2023,
https://arxiv.org/abs/2306.14048) for one layer, with its own data structures (per KV head, a list
of cached tokens and a dict of accumulated scores F) and float64 arithmetic: at step i the new
token joins, G_i = S_{i-1} + {i}, each query head attends over G_i, F of every token of G_i grows
by the attention it received, and the cache drops to k tokens: the `window` most recent (Section
4) and, of the others, those of largest F, the heavy hitters (equivalently, Algorithm 1 evicts
u = argmax_v F(G_i - {v}), the token of smallest F). Only the decisions docs/design.md states are
added: k = budget - 1 (the budget counts G_i), eviction after attending, a KV head's F summing its
query heads' attention, window = (budget - 1) // 2 by default, and the prompt attended whole, its
tokens scored by the column sums of that causal attention, then evicted once. `h2o:paper,
backend=reference` must read the same tokens, keep the same ones and return the same attention at
every step of every layer."""
import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                  n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=4096, rotary_dim=8)


def softmax(logits):
    p = torch.exp(logits - logits.max(-1, keepdim=True).values)
    return p / p.sum(-1, keepdim=True)


class PaperH2O:
    def __init__(self, budget, window, G):
        self.k_cache, self.window, self.G = budget - 1, window, G
        self.K, self.V = {}, {}  # token -> (Hkv, D) float64
        self.S, self.F = None, None  # per KV head: cached tokens in order, token -> accumulated score

    def evict(self, m):
        """Keep the window's most recent tokens and, of the others, the k - window of largest F
        (equal F: the earlier token stays)."""
        S, F = self.S[m], self.F[m]
        if len(S) <= self.k_cache:
            return
        recent = S[len(S) - self.window:] if self.window else []
        others = sorted((t for t in S if t not in recent), key=lambda t: (-F[t], t))
        kept = set(recent) | set(others[:self.k_cache - len(recent)])
        self.S[m] = [t for t in S if t in kept]
        self.F[m] = {t: F[t] for t in self.S[m]}

    def prefill(self, q, k, v):
        # q (Hq, T, D), k, v (Hkv, T, D) -> out (Hq, T, D) float64
        q, k, v = q.double(), k.double(), v.double()
        Hq, T, D = q.shape
        Hkv = k.shape[0]
        for t in range(T):
            self.K[t], self.V[t] = k[:, t], v[:, t]
        mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
        out = torch.empty(Hq, T, D, dtype=torch.float64)
        self.S, self.F = [list(range(T)) for _ in range(Hkv)], [dict.fromkeys(range(T), 0.0) for _ in range(Hkv)]
        for h in range(Hq):
            w = softmax(q[h] @ k[h // self.G].T / math.sqrt(D) + mask)  # (T, T) causal
            out[h] = w @ v[h // self.G]
            for j in range(T):
                self.F[h // self.G][j] += float(w[:, j].sum())  # the column sum
        for m in range(Hkv):
            self.evict(m)
        return out

    def decode(self, i, q, k, v):
        """Token i with q (Hq, D), k, v (Hkv, D) -> (out (Hq, D) float64, G_i per KV head)."""
        q = q.double()
        self.K[i], self.V[i] = k.double(), v.double()
        Hkv, D = k.shape[0], q.shape[1]
        out, G_i = torch.empty(q.shape, dtype=torch.float64), []
        for m in range(Hkv):
            self.S[m] = self.S[m] + [i]  # G_i = S_{i-1} + {i}
            self.F[m][i] = 0.0
            G_i.append(list(self.S[m]))
            keys = torch.stack([self.K[t][m] for t in self.S[m]])
            values = torch.stack([self.V[t][m] for t in self.S[m]])
            for h in range(m * self.G, (m + 1) * self.G):
                w = softmax(keys @ q[h] / math.sqrt(D))
                out[h] = w @ values
                for t, w_t in zip(self.S[m], w.tolist()):
                    self.F[m][t] += w_t  # F accumulates the attention each token received
            self.evict(m)  # S_i: down to k tokens, after attending
        return out, G_i


def run(spec, T=30, steps=30, seed=0):
    """Drive the policy's layers and one transcription per layer with the same random q, k, v;
    -> per layer and step: (what the policy read, G_i, what it kept, S_i, max |output difference|)."""
    policy = make(f"{spec},backend=reference").bind(CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    papers = [PaperH2O(policy.budget, policy.window, CFG.n_groups) for _ in policy.layers]
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    rows = []
    for layer, paper in zip(policy.layers, papers):
        q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
        pos = torch.arange(T)[None]
        out = layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), pos.to(DEVICE))[0].cpu()
        want = paper.prefill(q[0], k[0], v[0])
        kept = [sorted(r[:layer.n]) for r in layer.pos.tolist()]
        rows.append((None, None, kept, [sorted(s) for s in paper.S], float((out.double() - want).abs().max())))
    for i in range(T, T + steps):
        for layer, paper in zip(policy.layers, papers):
            q, k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
            out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), torch.tensor([[i]], device=DEVICE))[0, :, 0].cpu()
            want, G_i = paper.decode(i, q[0, :, 0], k[0, :, 0], v[0, :, 0])
            read = [sorted(r) for r in layer.attended_indices().tolist()]
            kept = [sorted(r[:layer.n]) for r in layer.pos.tolist()]
            rows.append((read, [sorted(g_) for g_ in G_i], kept, [sorted(s) for s in paper.S],
                         float((out.double() - want).abs().max())))
        policy.end_step()
    return rows


# a prompt longer than the cache (evicted once at prefill, its column sums then weigh) and one
# shorter (the decode steps' attention alone decides), each with the window at half the cache, none
# (Algorithm 1 alone) and most of it
@pytest.mark.parametrize("T", [30, 6])
@pytest.mark.parametrize("spec", ["h2o:paper,budget=12", "h2o:paper,budget=12,window=0", "h2o:paper,budget=12,window=9"])
def test_paper_preset_is_algorithm_1(spec, T):
    """Every step of both layers: G_i read, S_i kept and the output are the transcription's; heavy
    hitters older than the window do stay (not only the window's tokens)."""
    rows = run(spec, T=T)
    for read, G_i, kept, S_i, diff in rows:
        assert read == G_i
        assert kept == S_i
        assert diff < 1e-5
    window = make(spec).window
    old = [t for *_, S_i, _ in rows[2:] for s in S_i for t in s if t < s[-1] - window - 5]
    assert old  # tokens well before the window are kept for their accumulated attention


def test_the_preset_is_the_defaults():
    p = make("h2o:paper,budget=12")
    assert (p.budget, p.window) == (12, 5)  # k = 11: 5 recent tokens, 6 heavy hitters
    assert (make("h2o:paper").budget, make("h2o:paper").window) == (make("h2o").budget, make("h2o").window)

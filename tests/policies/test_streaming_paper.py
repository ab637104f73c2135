"""streaming:paper against the lazy-pruning paper's Algorithm 1 on StreamingLLM's Start+Recent
cache, transcribed here independently of the library.

`PaperStreaming` is Algorithm 1 of "Efficient KV Cache Management for Long-Context LLM
Inference: Lazy Pruning, Slack, and Staged Eviction" line by line, with its own data structures
and float64 arithmetic (its own RoPE, softmax and attention; nothing from minikv): C = S + W (Eq.
1, extra budget B = 0), H = C + sigma (Eq. 7); after a token is attended, nothing while R = 0,
L <= C or the overflow L - C < R (Eqs. 5-6), else L* = C (delta = 0) or min(max(L - delta, C), H)
(Eq. 8), keeping the first S tokens and the last L* - S (line 17), renumbered 0..L*-1 (Eq. 3's
compaction, RoPE re-aligned: Eq. 4). The cache holds pre-RoPE keys and token ids; a key is
rotated at its cache position whenever it is read. Only the decisions docs/design.md states are
added: the prune runs after the step's attention (StreamingLLM's loop), and the new token and its
query sit at the cache position the token takes. `streaming:paper,backend=reference` must hold the
same tokens at the same cache positions (its keys: RoPE of the pre-RoPE key at the position) and
return the same attention, at every step of every layer, the prompt included (fed whole, read as
token-by-token decoding would)."""
import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                  n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=4096, rotary_dim=8)


def rope(x, positions):
    """RoPE of x (..., n, D) at integer positions (n,), rotate-half layout (channel i pairs with
    i + D/2), theta 10000, in float64."""
    D = x.shape[-1]
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))  # (D/2,)
    angles = torch.as_tensor(positions, dtype=torch.float64)[:, None] * inv_freq  # (n, D/2)
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = x[..., :D // 2].double(), x[..., D // 2:].double()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


class PaperStreaming:
    """Algorithm 1 for one layer: a list of cached tokens (id, pre-RoPE key, value) in cache order."""

    def __init__(self, S, W, R, sigma, delta, G):
        self.S, self.W, self.R, self.sigma, self.delta, self.G = S, W, R, sigma, delta, G
        self.ids, self.keys, self.values = [], [], []  # keys: pre-RoPE, (Hkv, D) each
        self.events = []  # tokens dropped by each prune

    def step(self, t, q, k, v):
        """Token t with pre-RoPE q (Hq, D), k, v (Hkv, D) -> attention output (Hq, D) float64."""
        self.ids.append(t)
        self.keys.append(k.double())
        self.values.append(v.double())
        L = len(self.ids)
        K = rope(torch.stack(self.keys, 1), range(L))  # (Hkv, L, D): each key at its cache position
        V = torch.stack(self.values, 1)
        qc = rope(q[:, None], [L - 1])[:, 0]  # the query at the new token's cache position
        out = torch.empty(q.shape, dtype=torch.float64)
        for h in range(q.shape[0]):
            logits = K[h // self.G] @ qc[h] / math.sqrt(q.shape[1])
            p = torch.exp(logits - logits.max())
            out[h] = (p / p.sum()) @ V[h // self.G]
        self.prune()
        return out

    def prune(self):
        C = self.S + self.W  # line 1 (Eqs. 1-2, B = 0)
        H = C + self.sigma  # line 1 (Eq. 7)
        L = len(self.ids)  # line 2
        if self.R == 0 or L <= C or L - C < self.R:  # lines 3-11
            return
        target = C if self.delta == 0 else min(max(L - self.delta, C), H)  # lines 12-16 (Eq. 8)
        keep = list(range(min(self.S, target))) + list(range(L - (target - min(self.S, target)), L))  # line 17
        self.events.append(L - target)
        self.ids = [self.ids[i] for i in keep]  # line 18: renumbered 0..target-1
        self.keys = [self.keys[i] for i in keep]
        self.values = [self.values[i] for i in keep]


# (S, W, R, sigma, delta): the hard cap H binds (delta < R - sigma); Max_Drop binds (C < L - delta
# < H); the drop reaches C (delta > R); no Max_Drop (delta = 0: down to C); plain StreamingLLM (R = 1)
CASES = [(2, 10, 6, 1, 3), (2, 10, 6, 3, 4), (2, 10, 6, 3, 8), (2, 10, 6, 3, 0), (2, 10, 1, 0, 0)]


def run(S, W, R, sigma, delta, T=30, steps=40, seed=0):
    """Drive the policy's layers and one transcription per layer with the same random pre-RoPE q, k
    and v; -> per layer and step (prompt tokens included): (the layer, the policy's cache length, its keys
    (Hkv, n, D), its values, the transcription's cached ids, max |output difference|)."""
    spec = f"streaming:paper,sink={S},window={W},R={R},slack={sigma},max_drop={delta},backend=reference"
    policy = make(spec).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    papers = [PaperStreaming(S, W, R, sigma, delta, CFG.n_groups) for _ in policy.layers]
    g = torch.Generator().manual_seed(seed)
    H, Hkv, D = CFG.n_heads, CFG.n_kv_heads, CFG.head_dim
    rows, pre = [], [{} for _ in policy.layers]  # per layer: token id -> (pre-RoPE k, v)
    for i, (layer, paper) in enumerate(zip(policy.layers, papers)):
        q, k, v = torch.randn(H, T, D, generator=g), torch.randn(Hkv, T, D, generator=g), torch.randn(Hkv, T, D, generator=g)
        pos = torch.arange(T)
        out = layer.prefill(rope(q, pos).float()[None].to(DEVICE), rope(k, pos).float()[None].to(DEVICE),
                            v[None].to(DEVICE), pos[None].to(DEVICE))[0].cpu()  # the prompt at 0..T-1
        for t in range(T):
            want = paper.step(t, q[:, t], k[:, t], v[:, t])
            pre[i][t] = k[:, t], v[:, t]
            cache = (layer.n, layer.k[0, :, :layer.n].cpu().clone(), layer.v[0, :, :layer.n].cpu().clone(), list(paper.ids)) \
                if t == T - 1 else (None, None, None, None)  # the cache after the prompt
            rows.append((i, *cache, float((out[:, t].double() - want).abs().max())))
    for t in range(T, T + steps):
        for i, (layer, paper) in enumerate(zip(policy.layers, papers)):
            q, k, v = torch.randn(H, D, generator=g), torch.randn(Hkv, D, generator=g), torch.randn(Hkv, D, generator=g)
            at = [len(paper.ids)]  # the cache position the new token takes
            out = layer.decode(rope(q[:, None], at).float()[None].to(DEVICE), rope(k[:, None], at).float()[None].to(DEVICE),
                               v[None, :, None].to(DEVICE), None)[0, :, 0].cpu()
            want = paper.step(t, q, k, v)
            pre[i][t] = k, v
            rows.append((i, layer.n, layer.k[0, :, :layer.n].cpu().clone(), layer.v[0, :, :layer.n].cpu().clone(), list(paper.ids),
                         float((out.double() - want).abs().max())))
        policy.end_step()
    return rows, pre, papers


@pytest.mark.parametrize("S, W, R, sigma, delta", CASES)
def test_paper_preset_is_algorithm_1(S, W, R, sigma, delta):
    """Every step of both layers: the cache holds the tokens Algorithm 1 keeps, slot i holding
    RoPE of the token's pre-RoPE key at i (renumbered), its value, and attention over them."""
    rows, pre, papers = run(S, W, R, sigma, delta)
    for layer, n, keys, values, ids, diff in rows:
        assert diff < 1e-5
        if n is None:  # a prompt token before the last: its output only
            continue
        assert n == len(ids)
        want_k = rope(torch.stack([pre[layer][t][0] for t in ids], 1), range(n))
        want_v = torch.stack([pre[layer][t][1] for t in ids], 1)
        torch.testing.assert_close(keys.double(), want_k, rtol=1e-5, atol=1e-5)
        assert torch.equal(values, want_v.float())
    # the case's rule did act: prunes in the prompt and after it, each of its own size
    C, H = S + W, S + W + sigma
    drops = papers[0].events
    assert len(drops) >= 3
    expect = {(6, 1, 3): C + R - H, (6, 3, 4): 4, (6, 3, 8): R, (6, 3, 0): R, (1, 0, 0): 1}[(R, sigma, delta)]
    assert set(drops) == {expect}


def test_the_defaults_are_the_papers_worked_example():
    """Sec. 3.4's (S, W, R, sigma, delta) = (4, 2044, 32, 16, 32): C = 2048, H = 2064; the preset
    is the defaults."""
    p, default = make("streaming:paper"), make("streaming")
    for policy in (p, default):
        assert (policy.sink, policy.window, policy.R, policy.slack, policy.max_drop) == (4, 2044, 32, 16, 32)
    assert p.budget == 2048 + 32  # attention reads at most C + R tokens

"""h2o: the Heavy-Hitter Oracle, a recent window plus the tokens of largest accumulated attention.

Paper: "H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models"
(Z. Zhang, Y. Sheng, T. Zhou, T. Chen, L. Zheng, R. Cai, Z. Song, Y. Tian, C. Ré, C. Barrett,
Z. Wang, B. Chen; NeurIPS 2023; https://arxiv.org/abs/2306.14048).

Algorithm 1 (the H2 eviction algorithm) keeps a cache S of k tokens. At step i the new token joins,
G_i = S_{i-1} + {i}; the query attends over G_i; every token's score F accumulates the attention
it received; then the token u of G_i with the smallest accumulated score leaves, S_i = G_i - {u}.
Section 4 adds the recent window: the `window` most recent tokens are never evicted, the others
are the heavy hitters. Each KV head keeps its own set. Where to read what:

    H2OLayer.decode    store token i, attend over G_i (_attend), accumulate (F), evict (_evict)
    H2OLayer._attend   the attention weights: computed densely (backend=reference), or recovered
                       from the kernel's log-sum-exp, w = exp(q.k * scale - lse) (eager, triton)
    H2OLayer._evict    keep the window most recent and the largest accumulated scores of the rest
    H2OLayer.prefill   the prompt attended whole, scores = the column sums of its attention, then
                       one eviction down to the cache size (as the authors' code, h2o_hf, does)

Decisions (the paper is silent): the budget counts what attention reads, G_i, new token included,
so the cache keeps k = budget - 1 between steps; eviction runs after attending, as in Algorithm 1.
The window defaults to half the cache, (budget - 1) // 2, as the paper's experiments split it
evenly between recent tokens and heavy hitters. GQA: a KV head's accumulated score sums the
attention of the query heads of its group (the mass the group put on the token; the ranking is
the mean's). window=0 is Algorithm 1 alone, where even
the new token may leave. The prefill does not replay Algorithm 1 token by token: prompts longer
than the cache keep what full attention over the prompt valued, so prefill and token-by-token
decoding differ once the prompt is longer than budget - 1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..kernels.decode_attention import decode_attention
from .contract import LayerKV, Policy, dense_attention, param
from .registry import register

PREFILL_CHUNK = 256  # queries per block when summing the prompt's attention: bounds the score matrix


class H2OLayer(LayerKV):
    def __init__(self, policy: "H2O", index: int):
        super().__init__(policy, index)
        cfg, p = policy.cfg, policy
        cap = p.capacity  # budget, capped by the context: G_i at its largest
        self.k = torch.zeros(1, cfg.n_kv_heads, cap, cfg.head_dim, dtype=p.dtype, device=p.tiers.device)
        self.v = torch.zeros_like(self.k)
        self.pos = torch.full((cfg.n_kv_heads, cap), -1, dtype=torch.int64, device=p.tiers.device)  # slot -> token
        self.score = torch.zeros(cfg.n_kv_heads, cap, dtype=torch.float32, device=p.tiers.device)  # F, accumulated
        self.n = 0  # tokens kept per KV head (every head keeps as many)
        self.evicted = 0
        self._read: torch.Tensor | None = None  # (Hkv, n) the tokens the last decode step read

    # -- the prompt --------------------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D); positions (1, T)
        T, Hkv = k.shape[2], k.shape[1]
        out = dense_attention(q, k, v)
        score = torch.zeros(Hkv, T, dtype=torch.float32, device=k.device)
        for start in range(0, T, PREFILL_CHUNK):  # column sums of the causal attention, by blocks of queries
            qs = q[:, :, start:start + PREFILL_CHUNK]
            w = causal_weights(qs, k, positions[:, start:start + PREFILL_CHUNK], positions)  # (Hq, c, T)
            score += w.sum(dim=1).view(Hkv, -1, T).sum(dim=1)  # pooled over the group (module docstring)
        keep = self._keep(score, positions[0].expand(Hkv, T))  # (Hkv, n)
        self._store(k[0], v[0], positions[0].expand(Hkv, T), score, keep)
        return out

    # -- Algorithm 1, one step ---------------------------------------------------------------------
    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D); positions (1, 1)
        n = self.n
        self.k[:, :, n] = k[:, :, 0]  # G_i = S_{i-1} + {i}
        self.v[:, :, n] = v[:, :, 0]
        self.pos[:, n] = positions[0, 0]
        self.score[:, n] = 0.0
        out, w = self._attend(q[:, :, 0], n + 1)  # out (1, Hq, D), w (Hq, n + 1)
        Hkv = self.k.shape[1]
        self.score[:, :n + 1] += w.view(Hkv, -1, n + 1).sum(dim=1)  # F += this step's attention, pooled
        self._read = self.pos[:, :n + 1].clone()
        self.n = n + 1
        if self.n > self.policy.keep:  # evict after attending, down to k = budget - 1 tokens
            keep = self._keep(self.score[:, :self.n], self.pos[:, :self.n])
            self._store(self.k[0, :, :self.n], self.v[0, :, :self.n], self.pos[:, :self.n], self.score[:, :self.n], keep)
        return out[:, :, None]

    def _attend(self, q, n):
        """q (1, Hq, D) over slots [0, n) -> (out (1, Hq, D), attention weights (Hq, n) float32)."""
        k, v = self.k[:, :, :n], self.v[:, :, :n]
        backend = self.policy.backend
        if backend == "reference":
            w = causal_weights(q[:, :, None], k, None, None)[:, 0]  # (Hq, n), every slot visible
            G = q.shape[1] // k.shape[1]
            vf = v[0].float().repeat_interleave(G, dim=0)  # (Hq, n, D): query head h reads KV head h // G
            return torch.einsum("hn,hnd->hd", w, vf)[None].to(q.dtype), w
        lengths = torch.tensor([n], device=q.device)
        out, lse = decode_attention(q, k, v, lengths, return_lse=True, backend=backend)
        return out, weights_from_lse(q, k, lse[0])

    def _keep(self, score, pos):
        """score, pos (Hkv, n) -> (Hkv, m) the slots to keep, m = min(n, budget - 1): the window
        most recent tokens and, of the others, the largest accumulated scores (equal scores: the
        earlier token stays)."""
        p = self.policy
        Hkv, n = score.shape
        if n <= p.keep:
            return torch.arange(n, device=score.device).expand(Hkv, n)
        recent = pos >= pos.amax(dim=1, keepdim=True) - p.window + 1  # (Hkv, n): the window, never evicted
        ranked = score.masked_fill(recent, float("inf"))  # the window first, then the heavy hitters
        order = torch.sort(ranked, dim=1, descending=True, stable=True).indices
        return order[:, :p.keep].sort(dim=1).values  # slots in token order

    def _store(self, k, v, pos, score, keep):
        """k, v (Hkv, n, D), pos and score (Hkv, n), keep (Hkv, m): the kept tokens into slots [0, m)."""
        m = keep.shape[1]
        idx = keep[:, :, None].expand(-1, -1, k.shape[-1])
        self.k[0, :, :m] = torch.gather(k, 1, idx)  # gather makes copies: the slots may overlap the source
        self.v[0, :, :m] = torch.gather(v, 1, idx)
        self.pos[:, :m] = torch.gather(pos, 1, keep)
        self.score[:, :m] = torch.gather(score, 1, keep)
        self.evicted += pos.shape[1] - m
        self.n = m

    # -- what the layer reports ----------------------------------------------------------------------
    def device_tokens(self) -> int:
        return self.n

    def allocated_device_tokens(self) -> int:
        return self.k.shape[2]

    def aux_bytes(self) -> tuple[int, int]:
        return self.pos.numel() * 8 + self.score.numel() * 4, 0

    def attended_indices(self) -> torch.Tensor | None:
        return self._read


def causal_weights(q, k, q_pos, k_pos):
    """The attention weights of q (1, Hq, T, D) over k (1, Hkv, L, D), float32 -> (Hq, T, L); key j
    visible to query i when k_pos[j] <= q_pos[i] (positions None: every key visible)."""
    G = q.shape[1] // k.shape[1]
    kq = k[0].float().repeat_interleave(G, dim=0)  # (Hq, L, D)
    logits = torch.einsum("htd,hld->htl", q[0].float(), kq) / math.sqrt(q.shape[-1])
    if q_pos is not None:
        logits = logits.masked_fill(k_pos[0][None, None, :] > q_pos[0][None, :, None], float("-inf"))
    return torch.softmax(logits, dim=-1)


def weights_from_lse(q, k, lse):
    """The attention weights a kernel used, recovered from its log-sum-exp: q (1, Hq, D), k (1,
    Hkv, n, D), lse (Hq,) float32 -> (Hq, n), w = exp(q.k / sqrt(D) - lse), what attention_topk does."""
    G = q.shape[1] // k.shape[1]
    logits = torch.einsum("hgd,hnd->hgn", q[0].float().view(k.shape[1], G, -1), k[0].float()) / math.sqrt(q.shape[-1])
    return torch.exp(logits.reshape(q.shape[1], -1) - lse[:, None])


@register
@dataclass(eq=False, kw_only=True)
class H2O(Policy):
    """Heavy-Hitter Oracle (Zhang et al., NeurIPS 2023): a recent window plus the tokens of largest
    accumulated attention, evicted after attending."""

    name = "h2o"
    max_batch = 1
    kernels = ("decode_attention",)  # the weights come from its log-sum-exp (H2OLayer._attend)

    budget: int = param(256, "most tokens per KV head per layer that attention reads, the new token included: "
                             "the cache keeps budget - 1 between steps; capped by the context", low=2)
    window: int | None = param(None, "most recent tokens never evicted, the rest of the cache being heavy hitters "
                                     "(none: half of it, (budget - 1) // 2, the paper's even split; 0: Algorithm 1 "
                                     "alone)", low=0)

    # the contract matrix's data (checks.PolicyChecks, "What check_policy reads")
    covering_spec = "h2o:budget=1000000"
    small_spec, small_budget = "h2o:budget=24,window=8", 24
    stats_keys = ("budget", "window", "tokens_evicted")
    offloads = False
    prefill_equals_decoding = False

    def __post_init__(self):
        super().__post_init__()
        if self.window is None:
            self.window = (self.budget - 1) // 2
        if self.window > self.budget - 1:
            raise ValueError(f"policy 'h2o': window must be <= budget - 1 = {self.budget - 1} (the cache keeps "
                             f"budget - 1 tokens between steps), got {self.window}")

    def validate(self, cfg) -> None:
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("h2o does not combine with a sliding-window model (Mistral) shorter than max_len")

    def make_layer(self, index: int) -> H2OLayer:
        self.capacity = min(self.budget, self.max_len)
        self.keep = self.capacity - 1 if self.budget <= self.max_len else self.max_len  # k, capped by the context
        return H2OLayer(self, index)

    def stats(self) -> dict:
        s = super().stats()
        s.update({"budget": self.budget, "window": self.window,
                  "tokens_evicted": sum(layer.evicted for layer in self.layers) / len(self.layers)})
        return s

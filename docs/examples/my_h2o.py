"""myh2o: H2O written outside minikv, as docs/extending.md builds it.

"H2O: Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models" (Zhang et
al., NeurIPS 2023, https://arxiv.org/abs/2306.14048), Algorithm 1 with Section 4's recent window:
each KV head keeps `window` recent tokens and the tokens of largest accumulated attention; a step
attends over the kept tokens and the new one, adds the attention each token received to its
score, then evicts down to budget - 1. The prompt is attended whole and evicted once, by the
column sums of its attention. minikv ships the same algorithm as `h2o` (minikv/policies/h2o.py).

    python -m minikv.generate --import docs/examples/my_h2o.py --policy myh2o:budget=64 --prompt "..."
    python docs/examples/my_h2o.py          # minikv.testing.check_policy on it, with h2o_oracle
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

import minikv
from minikv.kernels.decode_attention import decode_attention
from minikv.policies import LayerKV, Policy, param


class MyH2OLayer(LayerKV):
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D); positions (1, T)
        T, Hkv, G = k.shape[2], k.shape[1], q.shape[1] // k.shape[1]
        logits = q[0].float() @ k[0].float().repeat_interleave(G, 0).transpose(1, 2) / math.sqrt(q.shape[-1])
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        w = torch.softmax(logits.masked_fill(causal, float("-inf")), dim=-1)  # (Hq, T, T) attention weights
        out = (w @ v[0].float().repeat_interleave(G, 0)).to(q.dtype)[None]  # (1, Hq, T, D)
        self.k, self.v = k[0], v[0]  # (Hkv, n, D): the kept tokens of each KV head
        self.pos = positions[0].expand(Hkv, T)  # (Hkv, n) their positions
        self.score = w.sum(dim=1).view(Hkv, G, T).sum(dim=1)  # (Hkv, n): column sums, over the group
        self.evict()
        return out

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D): token i joins, G_i = S_{i-1} + {i}
        self.k, self.v = torch.cat([self.k, k[0]], 1), torch.cat([self.v, v[0]], 1)
        self.pos = torch.cat([self.pos, positions[0].expand(self.k.shape[0], 1)], 1)
        self.score = torch.cat([self.score, self.score.new_zeros(self.k.shape[0], 1)], 1)
        n = self.k.shape[1]
        out, lse = decode_attention(q[:, :, 0], self.k[None], self.v[None], torch.tensor([n]), return_lse=True,
                                    backend=self.policy.backend)
        # the attention weights, from the kernel's log-sum-exp: w = exp(q.k / sqrt(D) - lse)
        G = q.shape[1] // self.k.shape[0]
        logits = torch.einsum("hd,hnd->hn", q[0, :, 0].float(), self.k.float().repeat_interleave(G, 0))
        w = torch.exp(logits / math.sqrt(q.shape[-1]) - lse[0, :, None])  # (Hq, n)
        self.score = self.score + w.view(-1, G, n).sum(dim=1)  # F += this step's attention
        self.read = self.pos  # what this step attended, new token included
        self.evict()  # after attending
        return out[:, :, None]

    def evict(self):
        """Keep the window most recent tokens and the largest scores of the rest: budget - 1 in all."""
        p, n = self.policy, self.k.shape[1]
        if n <= p.budget - 1:
            return
        recent = self.pos > self.pos.amax(dim=1, keepdim=True) - p.window
        ranked = torch.sort(self.score.masked_fill(recent, float("inf")), dim=1, descending=True, stable=True)
        keep = ranked.indices[:, :p.budget - 1].sort(dim=1).values  # (Hkv, budget - 1), in token order
        rows = keep[:, :, None].expand(-1, -1, self.k.shape[2])
        self.k, self.v = self.k.gather(1, rows), self.v.gather(1, rows)
        self.pos, self.score = self.pos.gather(1, keep), self.score.gather(1, keep)

    def device_tokens(self) -> int:
        return self.k.shape[1] if hasattr(self, "k") else 0

    def attended_indices(self):
        return getattr(self, "read", None)


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class MyH2O(Policy):
    """H2O written outside minikv (docs/extending.md): recent window plus heavy hitters."""

    name = "myh2o"
    kernels = ("decode_attention",)  # the operation it runs with its backend (so triton is checked too)
    budget: int = param(256, "most tokens attention reads per KV head, the new one included", low=2)
    window: int | None = param(None, "most recent tokens never evicted (none: half the cache)", low=0)

    # what minikv.testing.check_policy reads (docs/extending.md, "What check_policy needs")
    covering_spec = "myh2o:budget=1000000"
    small_spec, small_budget = "myh2o:budget=24,window=8", 24
    stats_keys = ("tokens_kept",)

    def __post_init__(self):
        super().__post_init__()
        self.window = (self.budget - 1) // 2 if self.window is None else self.window
        if self.window > self.budget - 1:
            raise ValueError(f"policy 'myh2o': window must be <= budget - 1, got window={self.window}")

    def validate(self, cfg):
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("myh2o does not combine with a sliding-window model")

    def make_layer(self, index):
        return MyH2OLayer(self, index)

    def stats(self):
        return {**super().stats(), "tokens_kept": self._mean(lambda layer: layer.device_tokens())}


def h2o_oracle(step):
    """Algorithm 1 with Section 4's window, transcribed on its own for check_policy(oracle=...):
    each KV head's cache S maps a token to its accumulated score F, in float64. Returns, at each
    decode step, G_i = S_{i-1} + {i}, the tokens that step's attention reads."""
    p, s = step.params, step.state
    Hkv, n, _ = step.k.shape
    G = step.q.shape[0] // Hkv
    read = None
    if step.prefill:  # the prompt attends itself; F = the attention each token received, over the group
        F = step.attention().sum(dim=1)  # (Hq, n): column sums
        s["S"] = [{t: F[m * G:(m + 1) * G, t].sum().item() for t in range(n)} for m in range(Hkv)]
    else:  # G_i = S_{i-1} + {i}; attend; F += this step's attention
        for S in s["S"]:
            S[n - 1] = 0.0
        read = [sorted(S) for S in s["S"]]
        w = step.attention(torch.tensor(read))[:, 0]  # (Hq, |G_i|)
        for m, S in enumerate(s["S"]):
            for j, t in enumerate(read[m]):
                S[t] += w[m * G:(m + 1) * G, j].sum().item()
    for S in s["S"]:  # S_i = G_i - {u}: the smallest F outside the window leaves, down to budget - 1
        while len(S) > p["budget"] - 1:
            old = [t for t in S if t <= max(S) - p["window"]]
            S.pop(min(old, key=lambda t: (S[t], -t)))  # equal scores: the later token leaves
    return read


if __name__ == "__main__":
    from minikv.testing import check_policy

    for check, where in check_policy(MyH2O, oracle=h2o_oracle).items():
        print(f"{check}: {', '.join(map(str, where))}")

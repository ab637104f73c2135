"""mysnapkv: SnapKV written outside minikv, with its oracle, as docs/extending.md builds them.

"SnapKV: LLM Knows What You Are Looking for Before Generation" (Y. Li et al., NeurIPS 2024,
https://arxiv.org/abs/2404.14469), Listing 1: at the end of the prompt, the attention of its last
`window` queries (the observation window) votes for the tokens before them; the votes, summed over
the window's queries and pooled over neighbouring positions (an average of width `kernel`, so that
a token's neighbours come with it), pick the `capacity - window` tokens kept beside the window.
Decoding compresses nothing: every new token is kept.

GQA: the paper's code repeats K and V for every query head, each keeping its own tokens; here a
KV head keeps one set for its group, voted by the sum of its query heads' votes.

Listing 1's steps are the policy's methods (observation, causal, votes, group, keep), so that a
variant replaces one: docs/extending.md plants four bugs that way, each legal under the contract,
and `snapkv_oracle`, the listing transcribed on its own, catches every one.

    python -m minikv.generate --import docs/examples/my_snapkv.py --policy mysnapkv:capacity=64 --prompt "..."
    python docs/examples/my_snapkv.py          # check_policy with the oracle
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

import minikv
from minikv.kernels.decode_attention import decode_attention
from minikv.policies import LayerKV, Policy, param


class MySnapKVLayer(LayerKV):
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D); positions (1, T): the prompt attends itself whole
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        T, Hkv = k.shape[2], k.shape[1]
        if T > self.policy.capacity:
            keep = self.policy.keep(q[0], k[0])  # (Hkv, capacity) rows of the prompt
        else:
            keep = torch.arange(T, device=k.device).expand(Hkv, T)
        rows = keep[:, :, None].expand(-1, -1, k.shape[-1])
        self.k, self.v = k[0].gather(1, rows), v[0].gather(1, rows)  # (Hkv, n, D): the kept tokens
        self.pos = positions[0][keep]  # (Hkv, n) their positions
        return out

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D): the new token is kept, then attends with the rest
        self.k, self.v = torch.cat([self.k, k[0]], 1), torch.cat([self.v, v[0]], 1)
        self.pos = torch.cat([self.pos, positions[0].expand(self.k.shape[0], 1)], 1)
        n = torch.tensor([self.k.shape[1]], device=q.device)
        out = decode_attention(q[:, :, 0], self.k[None], self.v[None], n, backend=self.policy.backend)
        return out[:, :, None]

    def device_tokens(self) -> int:
        return self.k.shape[1] if hasattr(self, "k") else 0

    def attended_indices(self):
        return self.pos


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class MySnapKV(Policy):
    """SnapKV written outside minikv (docs/extending.md): the prompt's observation window votes."""

    name = "mysnapkv"
    kernels = ("decode_attention",)
    capacity: int = param(1024, "most prompt tokens kept per KV head, the window included", low=2)
    window: int = param(32, "the observation window: the prompt's last tokens, which vote and are kept", low=1)
    kernel: int = param(5, "width of the average pooling of the votes (odd)", low=1)

    # what minikv.testing.check_policy reads: its runs decode 40 tokens after an 80-token
    # prompt, and SnapKV keeps every one of them beside the capacity
    covering_spec = "mysnapkv:capacity=1000000"
    small_spec, small_budget = "mysnapkv:capacity=24,window=8,kernel=5", 24 + 40
    stats_keys = ("tokens_kept",)

    def __post_init__(self):
        super().__post_init__()
        if self.window >= self.capacity:
            raise ValueError(f"policy 'mysnapkv': window must be < capacity, got window={self.window}")
        if self.kernel % 2 == 0:
            raise ValueError(f"policy 'mysnapkv': kernel must be odd, got kernel={self.kernel}")

    def validate(self, cfg):
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("mysnapkv does not combine with a sliding-window model")

    def make_layer(self, index):
        return MySnapKVLayer(self, index)

    def stats(self):
        return {**super().stats(), "tokens_kept": self._mean(lambda layer: layer.device_tokens())}

    # -- Listing 1, step by step -------------------------------------------------------------------
    def keep(self, q, k):
        """q (Hq, T, D), k (Hkv, T, D) of the prompt -> (Hkv, capacity): the rows kept, in order."""
        T, w = k.shape[1], self.window
        votes = self.group(self.votes(self.observation(q, k)))  # (Hkv, T - w)
        pooled = F.avg_pool1d(votes, self.kernel, stride=1, padding=self.kernel // 2)  # (Hkv, T - w)
        top = pooled.topk(self.capacity - w, dim=1).indices.sort(dim=1).values
        return torch.cat([top, torch.arange(T - w, T, device=k.device).expand(k.shape[0], w)], dim=1)

    def observation(self, q, k):
        """(Hq, window, T): the attention of the window's queries over every key of the prompt."""
        T, w, G = k.shape[1], self.window, q.shape[0] // k.shape[0]
        logits = q[:, T - w:].float() @ k.float().repeat_interleave(G, 0).transpose(1, 2) / math.sqrt(q.shape[-1])
        return torch.softmax(logits.masked_fill(self.causal(w, T, k.device), float("-inf")), dim=-1)

    def causal(self, w, T, device):
        """(w, T) bool, True where a key comes after the query: window query i sits at T - w + i."""
        return torch.ones(w, T, dtype=torch.bool, device=device).triu(T - w + 1)

    def votes(self, attention):
        """(Hq, window, T) -> (Hq, T - window): the attention each earlier token received, summed
        over the window's queries."""
        return attention[:, :, :attention.shape[2] - self.window].sum(dim=1)

    def group(self, votes):
        """(Hq, n) -> (Hkv, n): a KV head's votes, the sum over its query heads (h reads h // G)."""
        return votes.view(self.cfg.n_kv_heads, -1, votes.shape[1]).sum(dim=1)


def snapkv_oracle(step):
    """Listing 1 transcribed on its own, for check_policy(oracle=...): in float64, a loop where the
    paper says "for each". At the prefill it decides each KV head's kept tokens; at each decode
    step it answers what attention reads: those, and every token since."""
    p, s = step.params, step.state
    Hkv, n, _ = step.k.shape
    G = step.q.shape[0] // Hkv
    if not step.prefill:
        s["kept"] = [kept + [n - 1] for kept in s["kept"]]  # the new token is kept
        return s["kept"]
    T, w, half = n, p["window"], p["kernel"] // 2
    if T <= p["capacity"]:
        s["kept"] = [list(range(T)) for _ in range(Hkv)]
        return None
    window = step.attention()[:, T - w:]  # (Hq, w, T): the observation window's queries, causal
    s["kept"] = []
    for m in range(Hkv):  # each KV head: the votes of its G query heads, over the window's queries
        votes = window[m * G:(m + 1) * G, :, :T - w].sum(dim=(0, 1)).tolist()  # (T - w,)
        pooled = [sum(votes[j + d] for d in range(-half, half + 1) if 0 <= j + d < T - w) / p["kernel"]
                  for j in range(T - w)]  # zero padding at the ends, divided by the width
        top = sorted(range(T - w), key=lambda j: -pooled[j])[:p["capacity"] - w]
        s["kept"].append(sorted(top) + list(range(T - w, T)))
    return None


if __name__ == "__main__":
    from minikv.testing import check_policy

    for check, where in check_policy(MySnapKV, oracle=snapkv_oracle).items():
        print(f"{check}: {', '.join(map(str, where))}")

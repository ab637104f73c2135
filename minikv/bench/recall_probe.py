"""The attention-recall probe: how much of full attention's mass a policy's reads hold.

A RecallProbe wraps each layer of a bound policy, keeps a shadow copy of every key (after RoPE,
at its absolute position), and after each decode step computes softmax(q k^T / sqrt(d)) per
query head over all tokens so far, then sums that head's mass on the indices its KV head read,
as the layer reports them:

    layer.attended_indices() -> (Hkv, n) int64 absolute token indices the last decode step read
                                per KV head (-1 pads), or None when the layer read everything

Recall is the mean over query heads, over the layers that report indices, and over decode steps.
The oracle at budget b is the best any selection of b tokens per KV head could do: per KV head the
b tokens with the most attention summed over its GQA group (full attention's queries). Used by
`bench recall` (research/attention_recall.py) and `bench compare` (compare_run.py).
"""
from __future__ import annotations

import math

import torch

from ..policies.contract import Policy


def renumbers_positions(policy: Policy) -> bool:
    """True when the model rotates this policy's q and k at positions other than the absolute ones
    (streaming's cache positions): then q . k of the shadow copy would mean nothing."""
    own = getattr(type(policy), "rope_positions", None)
    return own is not None and own is not getattr(Policy, "rope_positions", None)


class RecallProbe:
    """Measures attention recall of `policy` (unbound) while it decodes, and the oracle recall at
    `oracle_budgets`. Attach before the policy is bound (generate() binds it)."""

    def __init__(self, policy: Policy, oracle_budgets=()):
        if renumbers_positions(policy):
            raise ValueError(f"policy {policy.name!r} renumbers positions; attention recall needs absolute ones")
        self.policy = policy
        self.budgets = sorted(set(oracle_budgets))
        self.keys: dict[int, torch.Tensor] = {}  # layer -> (Hkv, max_len, D), the cache's dtype
        self.sum, self.count = 0.0, 0  # policy recall over (step, layer)
        self.oracle_sum = {b: 0.0 for b in self.budgets}
        self.oracle_count = 0
        make_layer = policy.make_layer
        policy.make_layer = lambda i: self.wrap(make_layer(i))  # bind() builds the layers through it

    @property
    def recall(self) -> float | None:
        return self.sum / self.count if self.count else None

    @property
    def oracle(self) -> dict[int, float]:
        return {b: s / self.oracle_count for b, s in self.oracle_sum.items()} if self.oracle_count else {}

    def wrap(self, layer):
        prefill, decode = layer.prefill, layer.decode

        def probed_prefill(q, k, v, positions):
            out = prefill(q, k, v, positions)
            self.remember(layer.index, k, positions)
            return out

        def probed_decode(q, k, v, positions):
            out = decode(q, k, v, positions)
            self.remember(layer.index, k, positions)
            self.measure(layer, q, int(positions[0, -1]) + 1)
            return out

        layer.prefill, layer.decode = probed_prefill, probed_decode
        return layer

    def remember(self, index: int, k: torch.Tensor, positions: torch.Tensor) -> None:
        # k (1, Hkv, T, D), positions (1, T) absolute, -1 for padding
        if k.shape[0] != 1:
            raise ValueError("attention recall follows one sequence (batch size 1)")
        if index not in self.keys:
            Hkv, D = k.shape[1], k.shape[3]
            # the keys as the cache holds them (exact; float32 only for the product): at 16k tokens a
            # float32 shadow of a bfloat16 model doubles what each compared row costs
            self.keys[index] = torch.zeros(Hkv, self.policy.max_len, D, dtype=k.dtype, device=k.device)
        keep = positions[0] >= 0
        self.keys[index][:, positions[0, keep]] = k[0][:, keep]

    def measure(self, layer, q: torch.Tensor, n: int) -> None:
        # q (1, Hq, 1, D); the keys of tokens 0 .. n-1 are in the shadow copy
        indices = layer.attended_indices() if hasattr(layer, "attended_indices") else None
        if indices is None and not self.budgets:
            return
        p = full_attention_probs(q[0, :, 0].float(), self.keys[layer.index][:, :n].float())  # (Hq, n)
        if indices is not None:
            self.sum += attended_mass(p, indices).mean().item()
            self.count += 1
        if self.budgets:
            G = q.shape[1] // self.keys[layer.index].shape[0]
            for b, mass in zip(self.budgets, oracle_mass(p, G, self.budgets)):
                self.oracle_sum[b] += mass
            self.oracle_count += 1


def full_attention_probs(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    # q (Hq, D), keys (Hkv, n, D) -> softmax(q k^T / sqrt(D)) (Hq, n); query head h reads KV head h // G
    Hq, D = q.shape
    G = Hq // keys.shape[0]
    scores = torch.einsum("kgd,knd->kgn", q.view(-1, G, D), keys) / math.sqrt(D)
    return scores.softmax(dim=-1).reshape(Hq, -1)


def attended_mass(p: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    # p (Hq, n), indices (Hkv, m) int64, -1 pads -> mass per query head (Hq,)
    Hq, n = p.shape
    indices = indices.to(p.device)
    if indices.dim() != 2 or Hq % indices.shape[0]:
        raise ValueError(f"attended_indices must be (n_kv_heads, m), got {tuple(indices.shape)} for {Hq} query heads")
    if indices.numel() and int(indices.max()) >= n:
        raise ValueError(f"attended index {int(indices.max())} beyond the {n} tokens seen")
    read = torch.zeros(indices.shape[0], n + 1, dtype=p.dtype, device=p.device)
    read.scatter_(1, torch.where(indices < 0, n, indices), 1.0)  # padding lands in the spare column
    G = Hq // indices.shape[0]
    return (p * read[:, :n].repeat_interleave(G, dim=0)).sum(dim=-1)


def oracle_mass(p: torch.Tensor, G: int, budgets: list[int]) -> list[float]:
    # p (Hq, n) -> per budget b: mean over query heads of the mass on the top-b tokens of the group sum
    Hq, n = p.shape
    grouped = p.view(Hq // G, G, n)
    order = grouped.sum(dim=1).argsort(dim=-1, descending=True)  # (Hkv, n)
    ranked = grouped.gather(2, order[:, None, :].expand(-1, G, -1)).cumsum(dim=-1)  # (Hkv, G, n)
    return [1.0 if b >= n else ranked[:, :, b - 1].mean().item() for b in budgets]

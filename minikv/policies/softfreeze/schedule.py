"""softfreeze's Algorithm 1, one layer at a time, as the paper writes it: the reference.

Paper: "Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery" (Metinov et al., arXiv
2025, https://arxiv.org/abs/2512.11221), Algorithm 1 with Eqs. 2-3. `softfreeze:backend=reference`
runs this; schedule_fast.py is the same step for all layers at once (the default), held to this
one by tests/policies/test_softfreeze_schedule.py.

    Algorithm 1                                          here
    line 1   Attn(Q_i, A)                                Algorithm1Layer.attend (gather A, dense)
    line 2   s_j for j in A (Eq. 2)                      Algorithm1Layer.attend (the same pass;
                                                         score=attention: attention_share)
    line 3   j outside the window of the last K, s_j < tau   Algorithm1Layer.step
    line 4   c_j <- c_j + 1 (within the last W steps)    Algorithm1Layer.count_detections
    line 5   d_j = floor(sqrt(c_j) / k) (Eq. 3)          freeze_duration
    line 6-7 d_j > 0: move (K_j, V_j) from A to F        Algorithm1Layer.freeze
    line 10-13 j in F: d_j <- d_j - 1; d_j <= 0: restore Algorithm1Layer.step, .restore

State per layer, indexed by token j (0 .. n_tok-1): the device rows `kv` (the active cache A),
the host rows `kv_host` (the frozen storage F), `active` (j in A), `c` (c_j), `d` (d_j, the
timer of a frozen token, 0 while active), `frozen_at` (step of j's last freeze, for the window
reset of the recovery ladder).

Decisions (docs/design.md): a token frozen in a step keeps its timer that step (lines 10-15 skip
it: read literally they would decrement it at once, and a d = 1 freeze would do nothing), so a
token frozen at step t with d_j = d is absent from the attentions of steps t+1 .. t+d.
score="raw" compares Eq. 2 as it is with tau, score="relative" s_j / mean(s) over A, and
score="attention" (the default, not the paper's) |A| times the largest softmax weight a head
gives j (attention_share). Lines 3-15 of every layer run after the model's last layer (SoftFreeze.end_step): a
layer's result is first read by its own next attention, so nothing changes.
"""
from __future__ import annotations

import torch

from ...kernels.attention_relevance import attention_relevance
from ..contract import LayerKV, dense_attention
from .accounting import Algorithm1LayerStats


def attention_share(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """score="attention" (minikv's, not the paper's): s_j = |A| * max over query heads h of
    softmax_h(q_h . k_j / sqrt(D)), the weight of the head that reads j most, against an even
    spread (1 = the mean weight). Eq. 2's |q_h . k_j| ranks the other way on SmolLM2 (the keys a
    head ignores have large negative q.k; docs/softfreeze.md), and a mean over heads freezes for
    all what one head needs. q (1, Hq, D), k (1, Hkv, |A|, D) -> (|A|,) float32."""
    p = attention_weights(q, k)  # (Hkv, G, |A|)
    return p.amax(dim=(0, 1)) * p.shape[2]


def attention_weights(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """softmax_h(q_h . k_j / sqrt(D)) of every query head h, grouped by the KV head it reads:
    q (1, Hq, D), k (1, Hkv, |A|, D) -> (Hkv, Hq / Hkv, |A|) float32."""
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k.shape[1]
    qg = q[0].float().reshape(Hkv, Hq // Hkv, D)  # query heads grouped by the KV head they read
    scores = torch.bmm(qg, k[0].float().transpose(1, 2)).div_(D**0.5)  # (Hkv, G, |A|), in place: the same bits
    return torch.softmax(scores, dim=-1)


def freeze_duration(c: torch.Tensor, k: float) -> torch.Tensor:
    """Eq. 3: d_j = floor(sqrt(c_j) / k), for counts c (n,) int64 -> (n,) int64."""
    return torch.floor(torch.sqrt(c.double()) / k).long()


class Algorithm1Layer(Algorithm1LayerStats, LayerKV):
    """One layer of softfreeze, run as Algorithm 1 reads."""

    def __init__(self, policy, index: int):
        super().__init__(policy, index)
        N, Hkv, D, dev = policy.max_len, self.cfg.n_kv_heads, self.cfg.head_dim, policy.tiers.device
        self.kv = torch.empty((N, 2, Hkv, D), dtype=policy.dtype, device=dev)  # A: K and V of token j in row j
        self.kv_host = torch.empty((N, 2, Hkv, D), dtype=policy.dtype, pin_memory=policy.tiers.pin)  # F
        self.active = torch.zeros(N, dtype=torch.bool, device=dev)  # j in A
        self.c = torch.zeros(N, dtype=torch.int64, device=dev)  # c_j (with W: every detection so far)
        self.d = torch.zeros(N, dtype=torch.int64, device=dev)  # d_j of a frozen token, 0 while active
        self.frozen_at = torch.full((N,), -1, dtype=torch.int64, device=dev)
        W = policy.history  # the steps of each token's last W detections, a ring indexed by c_j
        self.seen = torch.full((N, W), -W - 1, dtype=torch.int64, device=dev) if W else None
        self.n_tok = 0  # tokens seen, active or frozen
        self.freezes = self.thaws = 0  # moves made by lines 7 and 13 (recovery is counted by the policy)

    # -- the contract: store the new tokens, then lines 1-2 ------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D)
        T = k.shape[2]
        self.kv[:T] = torch.stack((k[0], v[0]), dim=1).transpose(0, 2)  # (T, 2, Hkv, D)
        self.active[:T] = True
        self.n_tok = T
        # the prefill forward generates the first token; with judge_prompt (the paper's reading)
        # it is Algorithm 1's first step, which judges the prompt by the last position's query
        if self.policy.judge_prompt:
            self.policy.scores[self.index] = self.attend(q[:, :, -1])[1]
        return dense_attention(q, k, v)

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D): token n_tok joins A
        j = self.n_tok
        self.kv[j] = torch.cat((k, v))[:, :, 0]  # (2, Hkv, D)
        self.active[j] = True
        self.n_tok += 1
        out, self.policy.scores[self.index] = self.attend(q[:, :, 0])
        return out[:, :, None]

    def attend(self, q):
        """Lines 1-2: Attn(Q_i, A) and s_j (Eq. 2) for j in A, in one pass over the gathered
        active rows. q (1, Hq, D) -> out (1, Hq, D), s (|A|,) in the order of active_tokens()."""
        A = self.active_tokens()
        k = self.kv[A, 0].transpose(0, 1)[None]  # (1, Hkv, |A|, D)
        v = self.kv[A, 1].transpose(0, 1)[None]
        out, s = attention_relevance(q, k, v, None, backend="eager")  # the kernel's reference
        return out, (attention_share(q, k) if self.policy.score == "attention" else s[0])

    # -- lines 3-15, run by the policy after the last layer ------------------------------------
    def step(self, s: torch.Tensor, now: int) -> None:
        """Lines 3-15 of Algorithm 1 at step `now`; s (|A|,) the relevance of the active tokens."""
        p, A = self.policy, self.active_tokens()
        tau = p.tau * s.mean() if p.score == "relative" else p.tau
        low = A[(s < tau) & (A < self.n_tok - p.window)]  # line 3: outside the last K, s_j < tau
        c = self.count_detections(low, now)  # line 4
        d = freeze_duration(c, p.softness)  # line 5
        to_freeze, d = low[d > 0], d[d > 0]  # line 6
        F = self.frozen_tokens()  # frozen before this step: only these count down
        self.d[to_freeze] = d
        self.frozen_at[to_freeze] = now
        self.freeze(to_freeze)  # line 7
        self.freezes += len(to_freeze)
        self.d[F] -= 1  # line 11
        due = F[self.d[F] <= 0]  # line 12
        self.restore(due)  # line 13
        self.thaws += len(due)

    def count_detections(self, tok: torch.Tensor, now: int) -> torch.Tensor:
        """Line 4 for tokens tok (m,) detected at step now -> their c_j (m,): every detection,
        or with a history W (the paper's window for c_j) those of the last W steps."""
        W = self.policy.history
        if W is not None:
            self.seen[tok, self.c[tok] % W] = now
        self.c[tok] += 1
        return self.c[tok] if W is None else (self.seen[tok] > now - W).sum(dim=1)

    # -- moving K/V between the tiers (line 7, line 13; the recovery ladder uses them too) -----
    def freeze(self, tok: torch.Tensor) -> None:
        """Move tokens tok (f,) from A (device) to F (host)."""
        self.kv_host[tok.cpu()] = self.policy.tiers.to_host(self.kv[tok], fresh=True)
        self.kv[tok] = float("nan")  # the device row is free: reading it now would show
        self.active[tok] = False

    def restore(self, tok: torch.Tensor) -> None:
        """Move frozen tokens tok (r,) from F back to A, bit for bit."""
        self.kv[tok] = self.policy.tiers.to_device(self.kv_host[tok.cpu()], fresh=True)
        self.active[tok] = True
        self.d[tok] = 0

    # -- what the policy, the recovery ladder and the tests ask ---------------------------------
    def active_tokens(self) -> torch.Tensor:
        return self.active[: self.n_tok].nonzero()[:, 0]

    def frozen_tokens(self) -> torch.Tensor:
        return (~self.active[: self.n_tok]).nonzero()[:, 0]

    def active_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (Hkv, |A|, D) of the active tokens, in the order of active_tokens()."""
        A = self.active_tokens()
        return self.kv[A, 0].transpose(0, 1), self.kv[A, 1].transpose(0, 1)

    def frozen_kv(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (Hkv, f, D) of frozen tokens tok (f,), as the host tier holds them."""
        return self.kv_host[tok, 0].transpose(0, 1), self.kv_host[tok, 1].transpose(0, 1)

    def timers(self) -> torch.Tensor:
        """(n_tok,) each token's remaining d_j after the last step (0: active)."""
        return self.d[: self.n_tok]

    def counts(self) -> torch.Tensor:
        """(n_tok,) c_j (with a history window: every detection so far)."""
        return self.c[: self.n_tok].clone()

    def unfreeze_where(self, mask: torch.Tensor) -> int:
        """Restore the frozen tokens where mask (n_tok,) is true; returns how many."""
        tok = (mask & ~self.active[: self.n_tok]).nonzero()[:, 0]
        self.restore(tok)
        return len(tok)

    def clear_counts(self) -> None:
        self.c.zero_()
        if self.seen is not None:
            self.seen.fill_(-self.policy.history - 1)

    def truncate(self, n_keep: int) -> None:
        """Forget tokens n_keep .. n_tok - 1 (all active: call after a full reset)."""
        assert not self.frozen_tokens().numel(), "truncate after full_reset"
        self.active[n_keep:] = False
        self.c[n_keep:] = 0
        self.frozen_at[n_keep:] = -1
        if self.seen is not None:
            self.seen[n_keep:] = -self.policy.history - 1
        self.n_tok = n_keep

    n_act = property(lambda self: int(self.active[: self.n_tok].sum()))
    n_frozen = property(lambda self: self.n_tok - self.n_act)

    def device_tokens(self) -> int:  # (the other tiers' figures: accounting.Algorithm1LayerStats)
        return self.n_act

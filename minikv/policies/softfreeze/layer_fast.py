"""One layer of softfreeze over the stacked tiers of schedule_fast.py (FreezeTiers): the fast
form's answer to the policy contract. The readable twin is schedule.Algorithm1Layer, with the
same methods; the policy, the recovery ladder and the tests use either through them."""
from __future__ import annotations

import torch

from ...kernels.attention_relevance import attention_relevance
from ..contract import LayerKV, dense_attention
from .schedule import attention_share, attention_weights
from .schedule_fast import NOT_FROZEN


def attention_with_share(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Lines 1-2 with score="attention" in one pass over K: the softmax weights that
    schedule.attention_share scores by are the attention's own, so out = weights . V and s_j =
    |A| * max_h weight_hj come from one product with K (attention_relevance's Eq. 2 is not
    needed, nor a second product for the score). q (1, Hq, D); k, v (1, Hkv, |A|, D) -> out
    (1, Hq, D) in q's dtype, s (|A|,) float32."""
    p = attention_weights(q, k)  # (Hkv, G, |A|)
    out = torch.bmm(p, v[0].float()).view(q.shape)  # (Hkv, G, D) -> (1, Hq, D)
    return (out if out.dtype == q.dtype else out.to(q.dtype)), p.amax(dim=(0, 1)) * p.shape[2]


def _stacked(name: str, doc: str):
    """A per-layer view of one of the stacked FreezeTiers tensors (index 0 = the layer axis)."""
    return property(lambda self: getattr(self.state, name)[self.index], doc=doc)


def _counter(name: str):
    """A per-layer int kept in a list of FreezeTiers."""
    def set_(self, value):
        getattr(self.state, name)[self.index] = value
    return property(lambda self: getattr(self.state, name)[self.index], set_)


class FastAlgorithm1Layer(LayerKV):
    """The fast form of schedule.Algorithm1Layer: one layer's view of the policy's stacked tiers
    (schedule_fast.FreezeTiers), which run lines 3-15 for all layers at once."""

    state = property(lambda self: self.policy.state)  # the FreezeTiers of all layers
    n_act = _counter("n_act")  # active tokens: slots [0, n_act) of k, v
    n_tok = _counter("n_tok")  # tokens seen: token indices [0, n_tok), active or frozen
    n_frozen = _counter("n_frozen")
    freezes = _counter("freezes")
    thaws = _counter("thaws")
    kv = _stacked("kv", "(cap, 2, Hkv, D) the active tokens' K and V, token-major")
    kv_host = _stacked("kv_host", "(max_len, 2, Hkv, D) frozen tokens by token index")
    count = _stacked("count", "(max_len,) c_j of frozen tokens (with W: detections so far)")
    thaw_at = _stacked("thaw_at", "(max_len,) the step at whose end a frozen token comes back")
    frozen_at = _stacked("frozen_at", "(max_len,) the step of each token's last freeze")
    seen = property(lambda self: None if self.state.seen is None else self.state.seen[self.index])
    slots = property(lambda self: self.state.slots[:, self.index])  # (2, cap): slot_tok, slot_count
    slot_tok = property(lambda self: self.state.slots[0, self.index])  # (cap,) token of each active slot
    slot_count = property(lambda self: self.state.slots[1, self.index])  # (cap,) its c_j
    cap = property(lambda self: self.state.cap)

    # -- the contract ----------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D)
        self.state.fill(self.index, k[0], v[0])
        # with judge_prompt, Algorithm 1 runs on the prefill's forward (at end_step) with the
        # last prompt position's query
        if self.policy.judge_prompt:
            self.policy.scores[self.index] = self.attend(q[:, :, -1])[1]
        return dense_attention(q, k, v)

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D); the token's position is n_tok
        self.state.append(self.index, k, v)
        # Algorithm 1 lines 1-2 in one pass; lines 3-15 run for all layers at once in end_step
        out, self.policy.scores[self.index] = self.attend(q[:, :, 0])
        return out[:, :, None]

    def attend(self, q):
        """Lines 1-2: attention over the active slots and s_j (Eq. 2). q (1, Hq, D) -> out
        (1, Hq, D), s (n_act,) in slot order. (FreezeTiers' per-layer views are made once per
        growth: this runs 30 times a step, and fresh views cost more than the product)."""
        state, l = self.state, self.index
        a = state.n_act[l]
        k, v = state.k_of[l].narrow(2, 0, a), state.v_of[l].narrow(2, 0, a)
        if self.policy.score == "attention" and self.policy.backend == "eager":
            return attention_with_share(q, k, v)
        out, s = attention_relevance(q, k, v, None, backend=self.policy.backend)  # None: all a slots
        # score="attention" on triton reads K a second time (the kernel computes Eq. 2 only)
        return out, (attention_share(q, k) if self.policy.score == "attention" else s[0])

    def device_tokens(self) -> int:
        return self.n_act

    def host_tokens(self) -> int:
        return self.n_frozen

    def allocated_device_tokens(self) -> int:
        return self.cap

    def allocated_host_tokens(self) -> int:
        return self.kv_host.shape[0]  # preallocated for max_len tokens: a frozen token never waits

    def aux_bytes(self) -> tuple[int, int]:
        # per-token bookkeeping on the device: counts, timers, freeze steps, history ring, slot
        # maps, host-copy flags
        parts = [self.count, self.thaw_at, self.frozen_at, self.seen, self.slots, self.state.on_host[self.index]]
        return sum(t.numel() * t.element_size() for t in parts if t is not None), 0

    # -- what the policy, the recovery ladder and the tests ask (as Algorithm1Layer) --------
    def active_tokens(self) -> torch.Tensor:
        return self.slot_tok[: self.n_act]

    def frozen_tokens(self) -> torch.Tensor:
        return (self.thaw_at[: self.n_tok] != NOT_FROZEN).nonzero()[:, 0]

    def active_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (Hkv, n_act, D) of the active tokens, in the order of active_tokens()."""
        kv = self.kv[: self.n_act]
        return kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)

    def frozen_kv(self, tok: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V (Hkv, f, D) of frozen tokens tok (f,), as the host tier holds them."""
        return self.kv_host[tok, 0].transpose(0, 1), self.kv_host[tok, 1].transpose(0, 1)

    def timers(self) -> torch.Tensor:
        """(n_tok,) each token's remaining d_j after the last step (0: active)."""
        thaw = self.thaw_at[: self.n_tok]
        return torch.where(thaw == NOT_FROZEN, 0, thaw - (self.policy.steps - 1))  # thaw_at = t + d

    def counts(self) -> torch.Tensor:
        """c_j of every token (n_tok,): with a history window, all detections so far."""
        if self.policy.history is not None:
            return self.count[: self.n_tok].clone()
        c = self.count[: self.n_tok].clone()
        c[self.slot_tok[: self.n_act]] = self.slot_count[: self.n_act]
        return c

    def unfreeze_where(self, mask: torch.Tensor) -> int:
        """Restore the frozen tokens where mask (n_tok,) is true; returns how many."""
        return self.state.restore(self.index, (mask & (self.thaw_at[: self.n_tok] != NOT_FROZEN)).nonzero()[:, 0])

    def clear_counts(self) -> None:
        self.count.zero_()
        self.slot_count.zero_()
        if self.seen is not None:
            self.seen.fill_(-self.policy.history - 1)

    def truncate(self, n_keep: int) -> None:
        """Forget tokens n_keep .. n_tok - 1 (all active: call after a full reset)."""
        assert self.n_frozen == 0, "truncate after full_reset"
        self.state.remove_slots(self.index, (self.slot_tok[: self.n_act] >= n_keep).nonzero()[:, 0])
        self.n_tok = n_keep
        self.count[n_keep:] = 0
        self.frozen_at[n_keep:] = -1
        self.state.on_host[self.index, n_keep:] = False  # the next tokens at these indices are new
        if self.seen is not None:
            self.seen[n_keep:] = -self.policy.history - 1

"""softfreeze: Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery (ASR-KF-EGR).

Paper: "Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery: Sublinear Memory Growth for
Efficient LLM Inference" (A. Metinov, G. M. Kudakeeva, B. uulu Nursultan, G. D. Kabaeva; arXiv
preprint, 2025; https://arxiv.org/abs/2512.11221). Read beside Sections 3.2-3.6 and Algorithm 1.

Every generation step, in every layer, each active token j gets a relevance (Eq. 2)

    s_j = 1/H * sum_h |q_h . k_j^(h)|          (raw dot products, no 1/sqrt(d); GQA: k of h's group)

Tokens outside the last `window` (the paper's K) with s_j < tau are counted (c_j += 1) and get a
freeze duration d_j = floor(sqrt(c_j) / softness) (Eq. 3, the paper's k). d_j > 0 moves the
token's K/V to the host tier: attention stops reading it for d_j steps, then it comes back, bit
for bit, and is judged again. Counts persist (optionally only the last `history` steps count, the
paper's W), so a token that keeps being irrelevant is frozen longer, sublinearly.

Decision (DESIGN.md): a token frozen in a step is not decremented in that same step. Algorithm 1
read literally decrements it at once (lines 10-15 run over all of F), so a d = 1 freeze would thaw
before any attention skipped it. Here a token frozen at step t with duration d is absent from the
attentions of steps t+1 .. t+d and restored at the end of step t+d; we store that as thaw_at = t+d
instead of a countdown, which is the same schedule without touching every timer every step.

Data layout, one sequence (max_batch = 1), per layer:
    kv        (cap, 2, Hkv, D)  device: keys (kv[:, 0]) and values (kv[:, 1]) of the *active*
                                tokens, contiguous in slots [0, n_act), any order (attention is
                                order-free); cap grows by doubling. k, v are its (1, Hkv, cap, D)
                                views. One buffer, token-major, so every move of a token's K and V
                                is one contiguous row of 2 * Hkv * D values: freezing and thawing
                                are row gathers (index_select / index_copy_), not strided ones.
    slot_tok  (cap,)            device: the token index (= position) held by each active slot
    slot_count (cap,)           device: c_j of the token in each active slot (slot_tok and
                                slot_count are the two rows of one (2, cap) tensor, `slots`, so
                                that moving a slot's bookkeeping is one op)
    kv_host   (max_len, 2, Hkv, D)  host: frozen tokens, addressed by token index (views k_host,
                                v_host (Hkv, max_len, D))
    count, thaw_at, frozen_at (max_len,)  device: per-token state of frozen tokens
Per step and layer, when nothing freezes or thaws, the schedule is a handful of vector ops and
one nonzero(); a restore check runs only from the earliest thaw step on (next_thaw).
Freezing swap-removes slots (the last active slots fill the holes: O(frozen), not O(active));
restoring appends. No Python loop runs over tokens.

Relevance scale, and the defaults tau = 2.0, softness (k) = 4. Eq. 2 is unscaled, so tau = 0.5
depends on the model's q.k magnitudes. On SmolLM2-135M the raw s_j of a chat generation have
median ~37 (1% ~10, 99% ~117): tau = 0.5 never fires, not once (`python -m minikv.bench memory
--relevance-stats`). So `score="relative"` (the default, the one deviation from Eq. 2) divides s_j
by the mean s over the layer's active tokens in that step, a scale-free rule for any model;
`score="raw"` is Eq. 2 literally. Relative s_j has quantiles 10% 0.56, 50% 0.96, 90% 1.48: tau =
0.5 freezes almost nothing (~1% compression over 500 tokens), tau = 2.0 means "below twice the
mean interaction", which is nearly every token (relative q99 ~2.1) but not the heavy hitters
(attention sinks, the tokens the query is about).

Why k = 4 and not the paper's "typically k = 2". Eq. 3 gives d > 0 only from c = k^2 detections
on, so k sets the evidence a token needs before its first freeze and how slowly d grows after it.
With a long prompt every prompt token is judged from the prefill on, so all of the filler reaches
c = k^2 together, at step k^2 - 1. With k = 2 that is step 3: on the passkey task (Table 2, ~1,500
tokens of filler) nearly all filler, the key included in some layers, freezes right before SmolLM2
copies the key, and it answers "The pass key is" and ends its turn (full KV passes). Lowering tau
does not fix it (tau = 1.0 fails too, 0.5 passes but compresses ~1%), nor does k = 3 (the first
freeze at step 8 lands inside the 5 digits: "4418"). With k = 4 the first freeze is at step 15;
by then the model's own attention has scored the tokens it is copying as relevant (they stop
collecting detections), and retrieval keeps working after the mass freeze: with 96% of the
prompt frozen, the answer goes on "... Remember it. The pass key is 44181", the same 24 tokens as
full KV. Measured on SmolLM2 (greedy, 1 thread, 500 new tokens; compression at the end of the
generation as Table 1, and averaged over the steps):
    k = 2, tau = 1.5 (the old default): Table 1 prompt 60% (mean 61%); passkey fails
    k = 3, tau = 1.5 or 2.0:            passkey fails ("4418", "44182": the freeze at step 8)
    k = 4, tau = 1.5:                   Table 1 prompt 52% (below the paper's 55-67%); passkey passes
    k = 4, tau = 2.0 (default):         Table 1 prompt 66% (mean 52%), steam-engine prompt 82% (46%),
                                        dragon-story prompt 51% (52%); TPOT 1.20x full KV;
                                        passkey passes at depths 3/60, 30/60, 45/60, 50/60 of the
                                        filler with four different keys (the depths where full KV
                                        passes; SmolLM2-135M itself fails at 8/60 and 15/60)
    k = 4, tau = 2.5:                   81%, 81%, 64%, passkey passes, but the steam-engine
                                        generation degenerates into punctuation soup
    k = 3.5, tau = 2.0:                 47%, 60%, 51%; passkey passes
The end value swings with the d = 1 cycles (many tokens freeze on the same steps), so read it
beside the mean. The gentler schedule costs compression (d = 1 until c = 4k^2 = 64: a token frozen
with d = 1 is back, and judged, every other step), which the higher tau wins back: relative s_j
has its 99% quantile near 2, so tau = 2 flags all but the heaviest hitters and the schedule, not
the threshold, sets most of the compression. The window K = 32 and the history W (None: counts
never expire) are the paper's; a finite W only lowers c_j, so it can only lower compression.

Entropy-Guided Recovery (Section 3.6 sketches it as future work; this is minikv's design).
After every forward the model calls end_step(logits) with the next-token logits. Rule for a
spike: with at least `egr_window` previous entropies H (nats) of this generation, the step's
entropy exceeds their mean by more than max(egr_z * std, egr_min). Each spike climbs one rung:
    1 soft_reset()    unfreeze tokens whose remaining timer is > 1
    2 window_reset()  unfreeze tokens frozen in the last `reset_steps` steps
    3 full_reset()    unfreeze everything and clear every count and timer
    4 rewalk()        full reset, then drop the KV of the last `rewalk_tokens` generated tokens and
                      return StepAction(rewind=n): the generation loop regenerates them
Further spikes stay on rung 4; `egr_calm` steps without a spike bring the ladder back to the
bottom. Rewalk guard: at most `max_rewalks` per generation, and none until the generation has
gone past the position of the previous rewalk (the regenerated tokens never trigger another
one); a refused rewalk runs full_reset() instead.
"""
from __future__ import annotations

import math

import torch

from ..kernels.attention_relevance import attention_relevance
from .base import LayerKV, Policy, StepAction, dense_attention, register

NOT_FROZEN = torch.iinfo(torch.int64).max  # thaw_at of a token that is not frozen


class SoftFreezeLayer(LayerKV):
    def __init__(self, policy: "SoftFreeze", index: int):
        super().__init__(policy, index)
        cfg, dev, N = policy.cfg, policy.tiers.device, policy.max_len
        self.Hkv, self.D = cfg.n_kv_heads, cfg.head_dim
        self.cap = 0
        self.n_act = 0  # active tokens: slots [0, n_act) of k, v
        self.n_tok = 0  # tokens seen: token indices [0, n_tok), active or frozen
        self.n_frozen = 0
        self.next_thaw = NOT_FROZEN  # earliest thaw_at of a frozen token: no restore check before it
        self.freezes = self.thaws = 0  # tokens moved by Algorithm 1 (recovery counted by the policy)
        self.kv = self.slots = self.slot_tok = self.slot_count = None
        self.kv_host = torch.empty((N, 2, self.Hkv, self.D), dtype=policy.dtype, pin_memory=policy.tiers.pin)
        # c_j lives beside the active slot (slot_count), so the per-step update is one add; a
        # frozen token's count waits in count by token index and comes back with it
        self.count = torch.zeros(N, dtype=torch.int64, device=dev)
        self.thaw_at = torch.full((N,), NOT_FROZEN, dtype=torch.int64, device=dev)
        self.frozen_at = torch.full((N,), -1, dtype=torch.int64, device=dev)  # step of the last freeze
        W = policy.history
        # with a history window W: the steps of each token's last W detections (a ring indexed by
        # the running count), so that c_j counts only those within W steps; -W - 1 marks empty
        self.seen = torch.full((N, W), -W - 1, dtype=torch.int64, device=dev) if W else None
        self.lengths = torch.zeros(1, dtype=torch.int64, device=dev)

    # -- the contract ----------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D)
        T = k.shape[2]
        self._reserve(T + 64)
        self.kv[:T, 0] = k[0].transpose(0, 1)  # (T, Hkv, D)
        self.kv[:T, 1] = v[0].transpose(0, 1)
        self.slot_tok[:T] = torch.arange(T, device=k.device)
        self.slot_count[:T] = 0
        self.n_act = self.n_tok = T
        out = dense_attention(q, k, v)
        # the prefill forward generates the first token: Algorithm 1 runs on it with the last
        # prompt position's query (the attention output of this call is not needed)
        _, s = attention_relevance(q[:, :, -1], self.k, self.v, self._lengths(), backend=self.policy.backend)
        self.schedule(s[0, :T], self.policy.steps)
        return out

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D); the token's position is n_tok
        self._reserve(self.n_act + 1)
        a = self.n_act
        self.kv[a, 0] = k[0, :, 0]
        self.kv[a, 1] = v[0, :, 0]
        self.slot_tok[a] = self.n_tok
        self.slot_count[a] = 0
        self.n_act += 1
        self.n_tok += 1
        # Algorithm 1 line 1 (attention over the active cache A) and line 2 (s_j, Eq. 2), one pass
        # read only the active slots: the buffer's capacity past them (it grows by doubling) is empty
        a = self.n_act
        out, s = attention_relevance(q[:, :, 0], self.k[:, :, :a], self.v[:, :, :a], self._lengths(),
                                     backend=self.policy.backend)
        self.schedule(s[0], self.policy.steps)
        return out[:, :, None]

    def device_tokens(self) -> int:
        return self.n_act

    def host_tokens(self) -> int:
        return self.n_frozen

    def allocated_device_tokens(self) -> int:
        return self.cap

    def allocated_host_tokens(self) -> int:
        return self.kv_host.shape[0]  # preallocated for max_len tokens: a frozen token never waits

    def aux_bytes(self) -> tuple[int, int]:
        # per-token bookkeeping on the device: counts, timers, freeze steps, history ring, slot maps
        parts = [self.count, self.thaw_at, self.frozen_at, self.seen, self.slot_tok, self.slot_count]
        return sum(t.numel() * t.element_size() for t in parts if t is not None), 0

    # -- Algorithm 1 -----------------------------------------------------------------------
    def schedule(self, s: torch.Tensor, now: int) -> None:
        """Lines 3-15 of Algorithm 1 at step `now`, given s (n_act,) over the active slots."""
        p = self.policy
        n = self.n_act
        if p.relevance_log is not None:
            p.relevance_log.append(s.detach().float().cpu())
        tau = p.tau * s.mean() if p.score == "relative" else p.tau  # relative: s_j / mean(s) < tau
        # line 3: outside the sliding window of the last K tokens, below tau
        low = (s < tau) & (self.slot_tok[:n] < self.n_tok - p.window)  # (n,)
        if p.history is None:
            c = self.slot_count[:n]
            c += low  # line 4, all slots at once
            # line 6: d_j > 0 exactly when c_j >= c_min (= ceil(k^2)), so d is only computed for those
            slots = (low & (c >= p.c_min)).nonzero()[:, 0]  # (f,)
            c = c[slots]
        else:
            slots = low.nonzero()[:, 0]
            c = self._detect(self.slot_tok[slots], now)  # line 4 within the last W steps
            slots, c = slots[c >= p.c_min], c[c >= p.c_min]
        if len(slots):
            tok, counts = self.slots[:, slots]  # (f,) token indices and their c_j
            d = p.duration[c]  # line 5, Eq. 3 (tabulated)
            # a token frozen now thaws at the end of step now + d: lines 10-15 skip it this step
            self.thaw_at[tok] = now + d
            self.frozen_at[tok] = now
            if p.history is None:
                self.count[tok] = counts  # (with W, count is the ring pointer)
            self.next_thaw = min(self.next_thaw, now + int(d.min()))
            self.freezes += len(tok)
            self._freeze(slots, tok)  # line 7
        if now >= self.next_thaw:
            # lines 10-14: the frozen tokens whose timer has run out at step now
            due = (self.thaw_at[: self.n_tok] <= now).nonzero()[:, 0]  # (r,) token indices
            self.thaws += len(due)
            self._restore(due)  # line 13

    def _detect(self, tok: torch.Tensor, now: int) -> torch.Tensor:
        """With a history window W: record a detection of tokens `tok` at step `now` and return
        their c_j, the detections within the last W steps."""
        W = self.policy.history
        self.seen[tok, self.count[tok] % W] = now  # count: detections so far, the ring's pointer
        self.count[tok] += 1  # token indices are unique, so += through an index is exact
        return (self.seen[tok] > now - W).sum(dim=1)

    # -- moving K/V between the tiers --------------------------------------------------------
    def _remove_slots(self, slots: torch.Tensor) -> None:
        """Drop active slots `slots`, closing the holes with the last active slots (O(removed))."""
        n, m = self.n_act, self.n_act - len(slots)
        keep = torch.ones(n, dtype=torch.bool, device=slots.device)
        keep[slots] = False
        holes = slots[slots < m]  # removed slots inside the new length...
        fill = keep[m:].nonzero()[:, 0] + m  # ...and as many kept slots past it
        self.kv.index_copy_(0, holes, self.kv.index_select(0, fill))
        self.slots[:, holes] = self.slots[:, fill]
        self.n_act = m

    def _freeze(self, slots: torch.Tensor, tok: torch.Tensor) -> None:
        """Move active slots `slots` (holding tokens `tok`) to the host tier."""
        tiers, host_tok = self.policy.tiers, tok.cpu()
        self.kv_host.index_copy_(0, host_tok, tiers.to_host(self.kv.index_select(0, slots), fresh=True))  # (f, 2, Hkv, D)
        self._remove_slots(slots)
        self.n_frozen += len(tok)

    def _restore(self, tok: torch.Tensor) -> int:
        """Bring frozen tokens `tok` back from the host tier, appended after the active slots."""
        r = len(tok)
        if r:
            tiers, host_tok = self.policy.tiers, tok.cpu()
            self._reserve(self.n_act + r)
            a, b = self.n_act, self.n_act + r
            self.kv[a:b] = tiers.to_device(self.kv_host.index_select(0, host_tok), fresh=True)  # (r, 2, Hkv, D)
            self.slot_tok[a:b] = tok
            if self.policy.history is None:
                self.slot_count[a:b] = self.count[tok]
            self.thaw_at[tok] = NOT_FROZEN
            self.n_act = b
            self.n_frozen -= r
        frozen = self.thaw_at[: self.n_tok]
        self.next_thaw = int(frozen.min()) if self.n_frozen else NOT_FROZEN
        return r

    def _reserve(self, n: int) -> None:
        if n <= self.cap:
            return
        cap = min(self.policy.max_len, max(n, 2 * self.cap))
        kv = torch.empty((cap, 2, self.Hkv, self.D), dtype=self.policy.dtype, device=self.policy.tiers.device)
        slots = torch.empty((2, cap), dtype=torch.int64, device=kv.device)
        if self.cap:
            a = self.n_act
            kv[:a] = self.kv[:a]
            slots[:, :a] = self.slots[:, :a]
        self.kv, self.slots, self.cap = kv, slots, cap
        self.slot_tok, self.slot_count = slots  # the rows, as views

    # views of the two buffers: (1, Hkv, cap, D) as attention takes them, (Hkv, max_len, D) on the host
    k = property(lambda self: self.kv[:, 0].transpose(0, 1)[None])
    v = property(lambda self: self.kv[:, 1].transpose(0, 1)[None])
    k_host = property(lambda self: self.kv_host[:, 0].transpose(0, 1))
    v_host = property(lambda self: self.kv_host[:, 1].transpose(0, 1))


    def _lengths(self) -> torch.Tensor:
        return self.lengths.fill_(self.n_act)

    # -- recovery primitives (the policy's rungs call these on every layer) -----------------
    def frozen_tokens(self) -> torch.Tensor:
        return (self.thaw_at[: self.n_tok] != NOT_FROZEN).nonzero()[:, 0]

    def counts(self) -> torch.Tensor:
        """c_j of every token (n_tok,): with a history window, all detections so far."""
        if self.policy.history is not None:
            return self.count[: self.n_tok].clone()
        c = self.count[: self.n_tok].clone()
        c[self.slot_tok[: self.n_act]] = self.slot_count[: self.n_act]
        return c

    def unfreeze_where(self, mask: torch.Tensor) -> int:
        """Restore the frozen tokens where mask (n_tok,) is true; returns how many."""
        return self._restore((mask & (self.thaw_at[: self.n_tok] != NOT_FROZEN)).nonzero()[:, 0])

    def clear_counts(self) -> None:
        self.count.zero_()
        self.slot_count.zero_()
        if self.seen is not None:
            self.seen.fill_(-self.policy.history - 1)

    def truncate(self, n_keep: int) -> None:
        """Forget tokens n_keep .. n_tok - 1 (all active: call after a full reset)."""
        assert self.n_frozen == 0, "truncate after full_reset"
        self._remove_slots((self.slot_tok[: self.n_act] >= n_keep).nonzero()[:, 0])
        self.n_tok = n_keep
        self.count[n_keep:] = 0
        self.frozen_at[n_keep:] = -1
        if self.seen is not None:
            self.seen[n_keep:] = -self.policy.history - 1


@register
class SoftFreeze(Policy):
    """ASR-KF-EGR: sublinear soft freezing of low-relevance tokens to the host tier, with an
    entropy-guided recovery ladder."""

    name = "softfreeze"
    max_batch = 1

    def __init__(self, *, window: int = 32, tau: float = 2.0, softness: float = 4.0, history: int | None = None,
                 score: str = "relative", egr: bool = True, egr_window: int = 16, egr_z: float = 3.0,
                 egr_min: float = 1.0, egr_calm: int = 8, reset_steps: int = 8, rewalk_tokens: int = 4,
                 max_rewalks: int = 2, backend: str = "eager"):
        super().__init__(backend=backend)
        if not (isinstance(window, int) and window >= 0):
            raise ValueError(f"window (the paper's K, recent tokens never frozen) must be an int >= 0, got {window!r}")
        if not (isinstance(tau, (int, float)) and tau >= 0):
            raise ValueError(f"tau (relevance threshold) must be >= 0, got {tau!r}")
        if not (isinstance(softness, (int, float)) and softness > 0):
            raise ValueError(f"softness (the paper's k in Eq. 3) must be > 0, got {softness!r}")
        if history is not None and not (isinstance(history, int) and history >= 1):
            raise ValueError(f"history (the paper's W, steps) must be None or an int >= 1, got {history!r}")
        if score not in ("raw", "relative"):
            raise ValueError(f"score must be 'raw' (Eq. 2 as is) or 'relative' (s_j / mean s), got {score!r}")
        for name, value, low in (("egr_window", egr_window, 2), ("egr_calm", egr_calm, 1), ("reset_steps", reset_steps, 1),
                                 ("rewalk_tokens", rewalk_tokens, 1), ("max_rewalks", max_rewalks, 0)):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not (egr_z >= 0 and egr_min >= 0):
            raise ValueError(f"egr_z and egr_min must be >= 0, got {egr_z!r}, {egr_min!r}")
        self.window, self.tau, self.softness, self.history, self.score = window, float(tau), float(softness), history, score
        self.egr, self.egr_window, self.egr_z, self.egr_min, self.egr_calm = egr, egr_window, egr_z, egr_min, egr_calm
        self.reset_steps, self.rewalk_tokens, self.max_rewalks = reset_steps, rewalk_tokens, max_rewalks
        # Eq. 3 gives d_j > 0 from c_j = c_min on: the smallest c with floor(sqrt(c) / k) >= 1
        self.c_min = next(c for c in range(1, 10**9) if math.floor(math.sqrt(c) / self.softness) >= 1)
        self.relevance_log: list | None = None  # set to a list to collect every raw s (benchmarks)

    def validate(self, cfg) -> None:
        if cfg.sliding_window is not None:
            raise ValueError("softfreeze does not support sliding-window attention (cfg.sliding_window is set)")

    def bind(self, cfg, **kwargs) -> "SoftFreeze":
        super().bind(cfg, **kwargs)
        # Eq. 3 tabulated, d = floor(sqrt(c) / k), one lookup per step instead of five ops. A count
        # grows at most once a step, and the steps of a generation are at most max_len plus the
        # tokens its (at most max_rewalks) rewalks regenerate
        c = torch.arange(self.max_len + self.max_rewalks * self.rewalk_tokens + 1, dtype=torch.float64)
        self.duration = torch.floor(torch.sqrt(c) / self.softness).long().to(self.tiers.device)
        self.entropies: list[float] = []  # H of each step's next-token distribution, nats
        self.level = 0  # the ladder's current rung, 0 = calm
        self.calm = 0  # steps since the last spike
        self.prompt_len = 0
        self.rewalk_mark = -1  # position of the last rewalk; none again until past it
        self.trajectory: list[tuple[int, list[int]]] = []  # (tokens, active per layer) after each step
        self.counters = dict(spikes=0, soft_resets=0, window_resets=0, full_resets=0, rewalks=0,
                             rewalks_refused=0, rewalked_tokens=0, recovered_tokens=0)
        return self

    def make_layer(self, index: int) -> SoftFreezeLayer:
        return SoftFreezeLayer(self, index)

    # -- per step ----------------------------------------------------------------------------
    def end_step(self, logits: torch.Tensor | None = None) -> StepAction | None:
        now = self.steps  # index of the step that just ran (0 = prefill)
        super().end_step(logits)
        if now == 0:
            self.prompt_len = self.layers[0].n_tok
        self.trajectory.append((self.layers[0].n_tok, [layer.n_act for layer in self.layers]))
        if logits is None:
            return None
        logp = torch.log_softmax(logits[0].float(), dim=-1)  # (V,)
        H = float(-(logp.exp() * logp).sum())
        spike = self.is_spike(H)
        self.entropies.append(H)
        if not (self.egr and spike):
            self.calm += 1
            if self.calm >= self.egr_calm:
                self.level = 0
            return None
        self.counters["spikes"] += 1
        self.calm = 0
        self.level = min(self.level + 1, 4)
        return self.climb(self.level, now)

    def is_spike(self, H: float) -> bool:
        """A spike: H above the mean of the last egr_window entropies by max(egr_z * std, egr_min)."""
        past = self.entropies[-self.egr_window:]
        if len(past) < self.egr_window:
            return False
        mean = sum(past) / len(past)
        std = math.sqrt(sum((h - mean) ** 2 for h in past) / (len(past) - 1))
        return H > mean + max(self.egr_z * std, self.egr_min)

    def climb(self, rung: int, now: int) -> StepAction | None:
        if rung == 1:
            self.soft_reset(now)
        elif rung == 2:
            self.window_reset(now)
        elif rung == 3:
            self.full_reset()
        else:
            n = self.rewalk()
            return StepAction(rewind=n) if n else None
        return None

    # -- the recovery ladder (Section 3.6) ---------------------------------------------------
    def soft_reset(self, now: int | None = None) -> int:
        """SR: unfreeze the tokens whose remaining timer d_j is > 1 (at the end of step now)."""
        now = self.steps - 1 if now is None else now
        n = sum(layer.unfreeze_where(layer.thaw_at[: layer.n_tok] - now > 1) for layer in self.layers)
        self.counters["soft_resets"] += 1
        self.counters["recovered_tokens"] += n
        return n

    def window_reset(self, now: int | None = None) -> int:
        """WR: unfreeze the tokens frozen in the last reset_steps steps (steps now-N+1 .. now)."""
        now = self.steps - 1 if now is None else now
        n = sum(layer.unfreeze_where(layer.frozen_at[: layer.n_tok] > now - self.reset_steps) for layer in self.layers)
        self.counters["window_resets"] += 1
        self.counters["recovered_tokens"] += n
        return n

    def full_reset(self) -> int:
        """FR: unfreeze every token and clear every count and timer."""
        n = 0
        for layer in self.layers:
            n += layer.unfreeze_where(torch.ones(layer.n_tok, dtype=torch.bool, device=layer.count.device))
            layer.clear_counts()
        self.counters["full_resets"] += 1
        self.counters["recovered_tokens"] += n
        return n

    def rewalk(self) -> int:
        """RR: full reset, then forget the KV of the last rewalk_tokens generated tokens and
        return how many (0, after a full reset only, when the guard refuses)."""
        position = self.layers[0].n_tok - 1  # the position just decoded
        n = min(self.rewalk_tokens, self.layers[0].n_tok - self.prompt_len)
        self.full_reset()
        if n <= 0 or self.counters["rewalks"] >= self.max_rewalks or position <= self.rewalk_mark:
            self.counters["rewalks_refused"] += 1
            return 0
        for layer in self.layers:
            layer.truncate(layer.n_tok - n)
        del self.entropies[-n:]  # the entropies of the abandoned tokens
        self.rewalk_mark = position
        self.counters["rewalks"] += 1
        self.counters["rewalked_tokens"] += n
        return n

    # -- accounting --------------------------------------------------------------------------
    def stats(self) -> dict:
        out = super().stats()
        total = self._mean(lambda layer: layer.n_tok)
        out.update(self.counters)
        out.update(
            total_tokens=total,
            compression=1 - out["device_tokens"] / total if total else 0.0,
            freezes=sum(layer.freezes for layer in self.layers),
            thaws=sum(layer.thaws for layer in self.layers),
            entropy_last=self.entropies[-1] if self.entropies else float("nan"),
        )
        return out

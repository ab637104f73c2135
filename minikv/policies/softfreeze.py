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

Where the state lives (softfreeze_schedule.py): the K/V and bookkeeping of all layers, stacked
with a leading layer axis (FreezeTiers). Each layer's attention reads its active slots and records
its s_j; after the last layer, end_step runs lines 3-15 of Algorithm 1 for all layers at once
(schedule_all: one comparison over a (layers, slots) tensor, the moves as a few row gathers over
the stacked buffers), which decides and moves exactly what running it layer by layer would
(schedule_layer, the per-layer reference it is tested against). Deferring a layer's step to the
end of the forward changes nothing: its result is first read by the same layer's next attention.
Both tiers are token-major, (tokens, 2, Hkv, D) per layer, so a move is one contiguous row.
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
from dataclasses import dataclass

import torch

from ..kernels.attention_relevance import attention_relevance
from .base import LayerKV, Policy, StepAction, dense_attention, param, register
from .softfreeze_schedule import NOT_FROZEN, FreezeTiers

def _stacked(name: str, doc: str):
    """A per-layer view of one of the stacked FreezeTiers tensors (index 0 = the layer axis)."""
    return property(lambda self: getattr(self.state, name)[self.index], doc=doc)


def _counter(name: str):
    """A per-layer int kept in a list of FreezeTiers."""
    def set_(self, value):
        getattr(self.state, name)[self.index] = value
    return property(lambda self: getattr(self.state, name)[self.index], set_)


class SoftFreezeLayer(LayerKV):
    """One layer's view of the policy's stacked tiers (softfreeze_schedule.FreezeTiers)."""

    def __init__(self, policy: "SoftFreeze", index: int):
        super().__init__(policy, index)
        self.lengths = torch.zeros(1, dtype=torch.int64, device=policy.tiers.device)

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
    # views as attention takes them, (1, Hkv, cap, D), and of the host tier, (Hkv, max_len, D)
    k = property(lambda self: self.kv[:, 0].transpose(0, 1)[None])
    v = property(lambda self: self.kv[:, 1].transpose(0, 1)[None])
    k_host = property(lambda self: self.kv_host[:, 0].transpose(0, 1))
    v_host = property(lambda self: self.kv_host[:, 1].transpose(0, 1))

    # -- the contract ----------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D)
        T = k.shape[2]
        self.state.fill(self.index, k[0], v[0])
        out = dense_attention(q, k, v)
        # the prefill forward generates the first token: Algorithm 1 runs on it (at end_step)
        # with the last prompt position's query (the attention output of this call is not needed)
        _, s = attention_relevance(q[:, :, -1], self.k, self.v, self._lengths(), backend=self.policy.backend)
        self.policy.scores[self.index] = s[0, :T]
        return out

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D); the token's position is n_tok
        state, l = self.state, self.index
        a = state.append(l, k, v)  # active slots, the new token's included
        # Algorithm 1 line 1 (attention over the active cache A) and line 2 (s_j, Eq. 2), one pass
        # read only the active slots: the buffer's capacity past them is empty. Lines 3-15 run
        # for all layers at once in end_step, on the scores kept here. (The per-layer views are
        # FreezeTiers', made once: this runs 30 times a step, and the properties above build
        # theirs anew on every call)
        out, s = attention_relevance(q[:, :, 0], state.k_of[l].narrow(2, 0, a), state.v_of[l].narrow(2, 0, a),
                                     None, backend=self.policy.backend)  # None: all a slots
        self.policy.scores[l] = s[0]
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
        # per-token bookkeeping on the device: counts, timers, freeze steps, history ring, slot
        # maps, host-copy flags
        parts = [self.count, self.thaw_at, self.frozen_at, self.seen, self.slots, self.state.on_host[self.index]]
        return sum(t.numel() * t.element_size() for t in parts if t is not None), 0

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


@register
@dataclass(eq=False, kw_only=True)
class SoftFreeze(Policy):
    """ASR-KF-EGR: sublinear soft freezing of low-relevance tokens to the host tier, with an
    entropy-guided recovery ladder."""

    name = "softfreeze"
    max_batch = 1

    window: int = param(32, "the paper's K: the most recent tokens, never frozen", low=0)
    tau: float = param(2.0, "relevance threshold: a token with s_j < tau is counted (Eq. 2)", low=0)
    # k > 2^16 would need over 2^32 detections before a first freeze, more than any context
    # holds: the bound keeps c_min's arithmetic finite and loses no behaviour
    softness: float = param(4.0, "the paper's k in Eq. 3: d_j = floor(sqrt(c_j) / k)", above=0, high=2.0**16)
    history: int | None = param(None, "the paper's W: only the last W steps' detections count (none: all; "
                                      "capped by the context)", low=1)
    score: str = param("relative", "raw (Eq. 2 as is) or relative (s_j / mean s over the layer)",
                       choices=("raw", "relative"))
    egr: bool = param(True, "entropy-guided recovery on spikes of the next-token entropy")
    egr_window: int = param(16, "past entropies a spike is judged against", low=2)
    egr_z: float = param(3.0, "a spike: entropy above the mean by egr_z standard deviations...", low=0)
    egr_min: float = param(1.0, "...and by at least egr_min nats", low=0)
    egr_calm: int = param(8, "steps without a spike that bring the ladder back to its bottom", low=1)
    reset_steps: int = param(8, "window reset: unfreeze the tokens frozen in the last reset_steps steps", low=1)
    rewalk_tokens: int = param(4, "rewalk: generated tokens dropped and generated anew (capped by the context)",
                               low=1)
    max_rewalks: int = param(2, "most rewalks per generation", low=0)

    def __post_init__(self):
        super().__post_init__()
        # Eq. 3 gives d_j > 0 from c_j = c_min on: the smallest c with floor(sqrt(c) / k) >= 1,
        # about k^2 (computed, not searched for: a huge k would make a search spin)
        c = max(1, math.floor(self.softness**2) - 1)
        while math.floor(math.sqrt(c) / self.softness) < 1:
            c += 1
        self.c_min = c
        self.declared_history = self.history  # bind caps it by the context
        self.relevance_log: list | None = None  # set to a list to collect every raw s (benchmarks)

    def validate(self, cfg) -> None:
        if cfg.sliding_window is not None:
            raise ValueError("softfreeze does not support sliding-window attention (cfg.sliding_window is set)")

    def bind(self, cfg, **kwargs) -> "SoftFreeze":
        super().bind(cfg, **kwargs)
        # Eq. 3 tabulated, d = floor(sqrt(c) / k), one lookup per step instead of five ops. A count
        # grows at most once a step, and every step that does not rewind adds a token, so between
        # two resets of the counts (full_reset, which every rewalk runs first) a count reaches at
        # most max_len: the table's size follows the context, whatever rewalk_tokens and max_rewalks
        c = torch.arange(self.max_len + 1, dtype=torch.float64)
        # for the same reason a history of W >= max_len steps counts every detection: it is
        # `none`, without the (layers, max_len, W) table of detection steps
        W = self.declared_history
        self.history = None if W is None or W >= self.max_len else W
        self.duration = torch.floor(torch.sqrt(c) / self.softness).long().to(self.tiers.device)
        self.state = FreezeTiers(self, cfg.n_layers)  # the tiers and Algorithm 1's state of every layer
        self.scores: list[torch.Tensor | None] = [None] * cfg.n_layers  # each layer's s_j of this forward
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
        self.run_schedule(now)
        super().end_step(logits)
        if now == 0:
            self.prompt_len = self.layers[0].n_tok
        self.trajectory.append((self.layers[0].n_tok, list(self.state.n_act)))  # (n_act of every layer)
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

    def run_schedule(self, now: int) -> None:
        """Lines 3-15 of Algorithm 1 for every layer, on the scores its attention recorded in
        this forward (the layers' tokens move only now, after the last layer has read them)."""
        if all(s is None for s in self.scores):
            return  # no forward since the last step
        if any(s is None for s in self.scores):
            raise RuntimeError("softfreeze: end_step after a forward that skipped some layers")
        self.state.schedule_all(self.scores, now)
        self.scores = [None] * len(self.layers)

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

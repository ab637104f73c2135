"""streaming: StreamingLLM's Start+Recent cache with Lazy Pruning, Slack and Max_Drop.

Paper: "Efficient KV Cache Management for Long-Context LLM Inference: Lazy Pruning, Slack, and
Staged Eviction" (anonymous authors, under review; no public link yet), on top of "Efficient
Streaming Language Models with Attention Sinks" (StreamingLLM; G. Xiao, Y. Tian, B. Chen, S. Han,
M. Lewis; ICLR 2024; https://arxiv.org/abs/2309.17453).

Each layer keeps its keys (after RoPE) and values in one preallocated buffer of L tokens: the S
sink tokens, then a contiguous block of the most recent ones. Where to read what:

    prune_target                  Algorithm 1: C = S + W (Eq. 1, extra budget B = 0), H = C +
                                  slack (Eq. 7); nothing until the overflow L - C reaches R (Eqs.
                                  5-6; R = 0 never prunes), then keep C tokens, or
                                  min(max(L - max_drop, C), H) with Max_Drop (Eq. 8)
    StreamingLayer._compact       lines 17-18: keep the sinks and the latest tokens; the recent
                                  block moves left and its keys rotate by one constant delta
                                  (Eq. 4, kernels/rope_delta)
    StreamingLayer.decode         store at slot L, attend, then prune (_after_step)
    schedule, _streaming_prefill  the prompt, attended as if fed one token at a time
    Streaming.rope_positions      where the model rotates a new q and k: the slot L it takes

The plain StreamingLLM baseline is R = 1, slack = 0, max_drop = 0.

The defaults are the paper's rules (`streaming:paper` is `streaming`). Decisions (docs/design.md,
"streaming"): a new key is rotated once, at its cache position, never at its absolute position
and back; invariant, tested near p = 10^7: slot i holds RoPE(k_pre, i).
Pruning runs after attention, at the end of each layer's step, so attention reads at most C + R
tokens: that is `budget`, and budget=N sets window = N - sink - R. The prefill replays Algorithm
1 (it depends on lengths only), so a long prompt is never read whole by a short cache.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from ..kernels.decode_attention import decode_attention
from ..kernels.rope_delta import rope_delta
from .contract import LayerKV, Policy, dense_attention, param
from .registry import register

PREFILL_CHUNK = 256  # queries per block of the streaming prefill: bounds its score matrix


def prune_target(L: int, sink: int, window: int, R: int, slack: int, max_drop: int) -> int:
    """Algorithm 1: the cache length to prune to after observing length L (L itself: no prune)."""
    C = sink + window  # line 1 (Eq. 1-2 with extra budget B = 0)
    H = C + slack  # line 1 (Eq. 7): the hard cap of a staged prune
    if R == 0:  # lines 3-5: pruning disabled
        return L
    if L <= C:  # lines 6-8: within the soft capacity
        return L
    if L - C < R:  # lines 9-11: overflow (Eq. 5) below the lazy allowance R (Eq. 6)
        return L
    if max_drop == 0:  # lines 12-16 (Eq. 8)
        return C
    return min(max(L - max_drop, C), H)


@lru_cache(maxsize=64)
def schedule(T: int, sink: int, window: int, R: int, slack: int, max_drop: int):
    """Token-by-token replay of Algorithm 1 over T tokens fed into an empty cache.

    Returns (lengths, final, drops): lengths[t] is the cache length while token t attends (its
    own KV included), final the length after the last prune, drops the tokens dropped by each
    prune event in order. Pure function of lengths: the prefill and the tests both use it."""
    lengths, drops, n = [], [], 0
    for _ in range(T):
        n += 1  # line 2: the new token's KV is appended, attention reads n tokens
        lengths.append(n)
        target = prune_target(n, sink, window, R, slack, max_drop)
        if target < n:
            drops.append(n - target)
        n = target
    return tuple(lengths), n, tuple(drops)


class StreamingLayer(LayerKV):
    def __init__(self, policy: "Streaming", index: int):
        super().__init__(policy, index)
        B, cfg, p = policy.batch_size, policy.cfg, policy
        shape = (B, cfg.n_kv_heads, p.capacity, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=p.dtype, device=p.tiers.device)  # slot i: RoPE(k_pre, i)
        self.v = torch.zeros(shape, dtype=p.dtype, device=p.tiers.device)
        self.n = 0  # cache length L
        self.events = 0  # prune events (Algorithm 1 reaching line 17)
        self.dropped = 0  # tokens dropped over all events
        self.max_dropped = 0  # most tokens dropped by one event
        self.moves = 0  # physical compactions (a prefill replays many events, moves once)

    # -- Algorithm 1 -----------------------------------------------------------------------
    def _record(self, drops) -> None:
        self.events += len(drops)
        self.dropped += sum(drops)
        self.max_dropped = max([self.max_dropped, *drops])

    def _rotate(self, x, delta, out=None):
        p = self.policy
        return rope_delta(x, delta, p.inv_freq, out=out, backend=p.backend)

    def _compact(self, target: int) -> None:
        """Lines 17-18: keep slots [0, S) and the last target - S, moved to [S, target) and
        rotated by the constant delta target - L (Eq. 4)."""
        p, L = self.policy, self.n
        S = min(p.sink, target)
        n_recent, src = target - S, L - (target - S)
        delta = target - L  # < 0: every recent token moves left by the number dropped
        if n_recent > 0:
            dst_k, dst_v = self.k[:, :, S:target], self.v[:, :, S:target]
            src_k, src_v = self.k[:, :, src:L], self.v[:, :, src:L]
            if src >= target:  # disjoint ranges: rotate straight into place
                self._rotate(src_k, delta, out=dst_k)
                dst_v.copy_(src_v)
            else:  # overlapping ranges (the usual case, drop < window): through a scratch buffer
                scratch = p.scratch[:, :, :n_recent]
                self._rotate(src_k, delta, out=scratch)
                dst_k.copy_(scratch)
                dst_v.copy_(scratch.copy_(src_v))
        self.n = target
        self.moves += 1

    def _after_step(self) -> None:
        p = self.policy
        target = prune_target(self.n, p.sink, p.window, p.R, p.slack, p.max_drop)
        if target < self.n:
            self._record([self.n - target])
            self._compact(target)

    # -- the contract ----------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (B, Hq, T, D); k, v (B, Hkv, T, D) rotated at positions (B, T) = 0..T-1
        p = self.policy
        B, Hq, T, D = q.shape
        if self.n != 0:
            raise RuntimeError("streaming: prefill runs once, on an empty cache")
        if not torch.equal(positions, torch.arange(T, device=positions.device).expand(B, T)):
            raise ValueError("streaming: the prompt must sit at positions 0..T-1 (one sequence, no padding)")
        lengths, final, drops = schedule(T, p.sink, p.window, p.R, p.slack, p.max_drop)
        if lengths[-1] == T:  # nothing pruned before the last query: plain causal attention
            out = dense_attention(q, k, v)
        else:
            out = self._streaming_prefill(q, k, v, lengths)
        # the cache after the replay: sinks, then the last final - S tokens shifted to S..final-1
        S = min(p.sink, final)
        n_recent = final - S
        self.k[:, :, :S] = k[:, :, :S]
        self.v[:, :, :S] = v[:, :, :S]
        shift = final - T  # cache position - absolute position of the recent block
        if n_recent:
            if shift:
                self._rotate(k[:, :, T - n_recent:], shift, out=self.k[:, :, S:final])
            else:
                self.k[:, :, S:final] = k[:, :, T - n_recent:]
            self.v[:, :, S:final] = v[:, :, T - n_recent:]
        self.n = final
        self._record(drops)
        self.moves += bool(drops)
        return out

    def _streaming_prefill(self, q, k, v, lengths):
        """Attention of every prompt token as token-by-token streaming would compute it."""
        p = self.policy
        B, Hq, T, D = q.shape
        Hkv, G = k.shape[1], Hq // k.shape[1]
        S = min(p.sink, T)
        dev = q.device
        lens = torch.tensor(lengths, device=dev)  # (T,)
        t_idx = torch.arange(T, device=dev)
        first = t_idx - lens + 1  # (T,) oldest token in the cache at step t (before sinks split off)
        # query t sits at cache position lens[t] - 1; sinks sit at their absolute positions
        q_cache = self._rotate(q, lens - 1 - t_idx)  # (B, Hq, T, D)
        out = torch.empty_like(q)
        scale = D ** -0.5
        k_sink, v_sink = k[:, :, :S].float(), v[:, :, :S].float()  # (B, Hkv, S, D)
        for a in range(0, T, PREFILL_CHUNK):
            b = min(a + PREFILL_CHUNK, T)
            lo = max(S, int(first[a]) + S)  # first - 1 + S + 1: oldest recent key any query here reads
            qa = q[:, :, a:b].float().reshape(B, Hkv, G, b - a, D)
            qs = q_cache[:, :, a:b].float().reshape(B, Hkv, G, b - a, D)
            kr, vr = k[:, :, lo:b].float(), v[:, :, lo:b].float()  # (B, Hkv, b - lo, D)
            s_sink = qs @ k_sink[:, :, None].transpose(-1, -2) * scale  # (B, Hkv, G, b-a, S)
            s_rec = qa @ kr[:, :, None].transpose(-1, -2) * scale  # (B, Hkv, G, b-a, b-lo)
            tq = t_idx[a:b, None]  # (b-a, 1)
            j_sink = torch.arange(S, device=dev)[None]
            j_rec = torch.arange(lo, b, device=dev)[None]
            # sinks are seen once they exist; a recent key while it is among the last lens - S
            see_sink = j_sink <= tq
            see_rec = (j_rec <= tq) & (j_rec >= first[a:b, None] + S)
            scores = torch.cat((s_sink.masked_fill(~see_sink, float("-inf")),
                                s_rec.masked_fill(~see_rec, float("-inf"))), dim=-1)
            probs = scores.softmax(dim=-1)  # every row sees >= 1 key: itself or sink 0
            o = probs[..., :S] @ v_sink[:, :, None] + probs[..., S:] @ vr[:, :, None]  # (B, Hkv, G, b-a, D)
            out[:, :, a:b] = o.reshape(B, Hq, b - a, D).to(q.dtype)
        return out

    def decode(self, q, k, v, positions):
        # q (B, Hq, 1, D); k, v (B, Hkv, 1, D) rotated at cache position n (`rope_positions`)
        n = self.n
        self.k[:, :, n] = k[:, :, 0]
        self.v[:, :, n] = v[:, :, 0]
        self.n = n + 1
        lengths = torch.full((q.shape[0],), n + 1, dtype=torch.int64, device=q.device)
        # a view of the valid slots: the eager reference's cost follows L, not the capacity
        out = decode_attention(q[:, :, 0], self.k[:, :, : n + 1], self.v[:, :, : n + 1], lengths,
                               backend=self.policy.backend)
        self._after_step()
        return out[:, :, None]

    def device_tokens(self) -> int:
        return self.n

    def allocated_device_tokens(self) -> int:
        return self.policy.capacity


@register
@dataclass(eq=False, kw_only=True)
class Streaming(Policy):
    """Start+Recent (StreamingLLM) with Lazy Pruning (R), Slack and Max_Drop: Algorithm 1."""

    name = "streaming"
    max_batch = 1  # one sequence: every row would need its own prune schedule and cache positions
    kernels = ("decode_attention", "rope_delta")
    # the contract matrix's data (checks.PolicyChecks, "What check_policy reads")
    covering_spec = "streaming:sink=4,window=90"  # prunes past sink + window + R = 126 > 120 tokens
    small_spec, small_budget = "streaming:sink=4,window=24", 4 + 24 + 32  # sink + window + R
    stats_keys = ("budget", "cache_length", "prune_events", "tokens_dropped", "compactions")
    prefill_equals_decoding = True  # the prefill replays Algorithm 1
    reports_attended = False  # keys re-rotate as they move (Eq. 4): not the keys the layer was given

    sink: int = param(4, low=0)
    window: int | None = param(None, "most recent tokens kept, the paper's W (none: 2044, or budget - sink - R)",
                               low=0)
    R: int = param(32, "lazy pruning: prune once the overflow reaches R tokens (0: never prune)", low=0)
    slack: int = param(16, "tokens a staged prune may keep past sink + window (Eq. 7)", low=0)
    max_drop: int = param(32, "most tokens one prune drops (Eq. 8; 0: drop down to sink + window)", low=0)
    budget: int | None = param(None, "sink + window + R: most tokens attention reads (sets window)", low=1)

    def __post_init__(self):
        super().__post_init__()
        sink, window, R, budget = self.sink, self.window, self.R, self.budget
        if budget is not None:
            if R == 0:
                raise ValueError("streaming: budget needs R >= 1 (R = 0 never prunes, nothing bounds the cache)")
            derived = budget - sink - R  # attention reads at most sink + window + R tokens
            if derived < 0:
                raise ValueError(f"streaming: budget = {budget} must be >= sink + R = {sink + R}")
            if window is not None and window != derived:
                raise ValueError(f"streaming: window = {window} contradicts budget = {budget} "
                                 f"(budget = sink + window + R, so window would be {derived}); give one of them")
            window = derived
        window = 2044 if window is None else window  # the paper's worked example: C = 2048
        if sink + window < 1:
            raise ValueError("streaming: sink + window must be >= 1 (the cache would keep nothing)")
        self.window = window
        # most tokens attention reads per KV head: C + R, or None when R = 0 (no bound)
        self.budget = self.soft_capacity + R if R else None

    @property
    def soft_capacity(self) -> int:
        return self.sink + self.window  # C, Eq. 1

    def rope_positions(self, positions):
        # positions (B, T) absolute. The prompt is rotated at 0..T-1 (the prefill replays the
        # renumbering itself); a decoded token at the slot it takes, the cache length L
        n = self.layers[0].n  # every layer prunes at the same steps: layer 0 speaks for all
        return positions if n == 0 else torch.full_like(positions, n)

    def check_length(self, cfg, max_len: int) -> None:
        if self.R == 0:  # no pruning: positions grow like the full cache's
            super().check_length(cfg, max_len)

    def validate(self, cfg) -> None:
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            # the sinks sit outside any sliding window: attention here would not be the model's
            raise ValueError("streaming does not combine with a sliding-window model (Mistral) shorter than max_len")
        if self.R and self.budget > cfg.max_position_embeddings:
            raise ValueError(
                f"streaming: sink + window + R = {self.budget} exceeds the model's context of "
                f"{cfg.max_position_embeddings} positions (cache positions reach sink + window + R - 1)")

    def allocate_shared(self) -> None:
        # the cache never holds more than C + R tokens (max_len when it never prunes)
        self.capacity = min(self.budget, self.max_len) if self.R else self.max_len
        self.inv_freq = self.rope.inv_freq.to(self.tiers.device)
        shape = (self.batch_size, self.cfg.n_kv_heads, self.capacity, self.cfg.head_dim)
        # one scratch for all layers (they run one after another): overlapping moves go through it
        self.scratch = torch.zeros(shape, dtype=self.dtype, device=self.tiers.device)

    def make_layer(self, index: int) -> StreamingLayer:
        return StreamingLayer(self, index)

    def aux_bytes(self) -> tuple[int, int]:
        return self.scratch.numel() * self.scratch.element_size(), 0  # the compaction scratch, shared

    def stats(self) -> dict:
        out = super().stats()
        first = self.layers[0]  # every layer prunes at the same steps: layer 0 speaks for all
        out.update({
            "sink": self.sink, "window": self.window, "R": self.R, "slack": self.slack, "max_drop": self.max_drop,
            "soft_capacity": self.soft_capacity, "hard_capacity": self.soft_capacity + self.slack,
            "budget": self.budget, "capacity": self.capacity, "cache_length": first.n,
            "prune_events": first.events,
            "tokens_dropped": first.dropped,
            "dropped_per_event_mean": first.dropped / first.events if first.events else 0.0,
            "dropped_per_event_max": first.max_dropped,
            "compactions": first.moves,
        })
        return out

"""softfreeze's tiers and Algorithm 1 (lines 3-15) for all layers at once: the fast form.

Paper: "Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery" (Metinov et al., arXiv
2025, https://arxiv.org/abs/2512.11221). The readable form is schedule.py (Algorithm1Layer,
`backend=reference`); this one runs by default (`backend=eager`, and `triton`): layer by layer
the step is ~25 small tensor ops per layer, 750 a step on 30 layers, which cost more than the K/V
they move (docs/softfreeze.md has the timings). tests/policies/test_softfreeze_schedule.py holds
the two to the same freezes, thaws, timers, counts and K/V, step by step.

The state of all layers is stacked with a leading layer axis; after the last layer
`schedule_all` runs the step for every layer: one comparison over a (layers, slots) tensor
decides every freeze, one gather and one scatter move the frozen rows, one more pair closes the
holes, one more brings the due tokens back. A timer is stored as thaw_at = t + d (the step at
whose end the token comes back), the same schedule without touching every timer every step.

Layout (L layers, N = max_len, cap slots per layer, grown by doubling for all layers together):
    kv        (L, cap, 2, Hkv, D)  device: K and V of layer l's active tokens in slots
                                   [0, n_act[l]), any order; a token's K and V are one row
    slots     (2, L, cap) int64    device: slot_tok (the token of each slot), slot_count (its c_j)
    kv_host   (L, N, 2, Hkv, D)    host: frozen tokens, by token index
    on_host   (L, N) bool          the host holds the token's K/V already (K/V never change, so
                                   a refreeze moves nothing)
    count, thaw_at, frozen_at (L, N); seen (L, N, W) with a history window W only
Freezing swap-removes slots (the last active slots fill the holes); restoring appends. Eq. 3 is
tabulated (duration[c] = floor(sqrt(c) / k), one lookup per step) and line 6's d_j > 0 is
c_j >= c_min.
"""
from __future__ import annotations

import math

import torch
from torch.nn.utils.rnn import pad_sequence


NOT_FROZEN = torch.iinfo(torch.int64).max  # thaw_at of a token that is not frozen


def first_freezing_count(k: float) -> int:
    """c_min: Eq. 3 gives d_j > 0 from c_j = c_min on, the smallest c with floor(sqrt(c) / k) >= 1,
    about k^2 (computed, not searched for from 1: a huge k would make a search spin)."""
    c = max(1, math.floor(k**2) - 1)
    while math.floor(math.sqrt(c) / k) < 1:
        c += 1
    return c


class FreezeTiers:
    """The active (device) and frozen (host) tiers of every layer, with Algorithm 1's state."""

    def __init__(self, policy, n_layers: int):
        p, cfg = policy, policy.cfg
        self.p, self.L, self.N = p, n_layers, p.max_len
        self.Hkv, self.D = cfg.n_kv_heads, cfg.head_dim
        dev, L, N = p.tiers.device, n_layers, p.max_len
        # Eq. 3 for every count a token can reach: a count grows at most once a step and is reset
        # by every rewalk (SoftFreeze.bind), so it stays <= max_len
        self.duration = torch.floor(torch.sqrt(torch.arange(N + 1, dtype=torch.float64)) / p.softness).long().to(dev)
        self.c_min = first_freezing_count(p.softness)
        self.cap = 0
        self.kv = self._slots = None  # allocated by reserve()
        self.appended: list[tuple[int, int]] = []  # (flat slot l * cap + a, token) of appends not in slots yet
        self.kv_host = torch.empty((L, N, 2, self.Hkv, self.D), dtype=p.dtype, pin_memory=p.tiers.pin)
        # c_j lives beside the active slot (slot_count), so the per-step update is one add; a
        # frozen token's count waits in count by token index and comes back with it
        self.count = torch.zeros((L, N), dtype=torch.int64, device=dev)
        self.thaw_at = torch.full((L, N), NOT_FROZEN, dtype=torch.int64, device=dev)
        self.frozen_at = torch.full((L, N), -1, dtype=torch.int64, device=dev)  # step of the last freeze
        self.on_host = torch.zeros((L, N), dtype=torch.bool, device=dev)
        W = p.history
        self.seen = torch.full((L, N, W), -W - 1, dtype=torch.int64, device=dev) if W else None
        self.n_act = [0] * L  # active tokens of each layer: slots [0, n_act[l])
        self.n_tok = [0] * L  # tokens seen: token indices [0, n_tok[l]), active or frozen
        self.n_frozen = [0] * L
        self.freezes = [0] * L  # tokens moved by Algorithm 1 (recovery is counted by the policy)
        self.thaws = [0] * L
        self.next_thaw = NOT_FROZEN  # at most the earliest thaw_at of a frozen token: no check before it

    @property
    def slots(self) -> torch.Tensor:
        """(2, L, cap): slot_tok and slot_count, the decoded tokens' own written first."""
        if self.appended:
            self._write_appended()
        return self._slots

    slot_tok = property(lambda self: self.slots[0])  # (L, cap)
    slot_count = property(lambda self: self.slots[1])

    def _write_appended(self) -> None:
        # a decode step appends one token to each of the 30 layers; their slot fields are
        # written here, when something first reads them, as two scatters instead of 60 scalar
        # writes (~5 us each) inside the step
        at, tok = zip(*self.appended)
        self.appended = []
        flat = self._slots.view(2, -1)  # (2, L cap)
        at = torch.tensor(at, device=flat.device)
        flat[0].index_copy_(0, at, torch.tensor(tok, device=flat.device))
        flat[1].index_fill_(0, at, 0)

    def reserve(self, n: int) -> None:
        """At least n slots in every layer."""
        if n <= self.cap:
            return
        cap = min(self.N, max(n, 2 * self.cap))
        kv = torch.zeros((self.L, cap, 2, self.Hkv, self.D), dtype=self.p.dtype, device=self.p.tiers.device)
        slots = torch.zeros((2, self.L, cap), dtype=torch.int64, device=kv.device)
        if self.cap:
            kv[:, : self.cap] = self.kv
            slots[:, :, : self.cap] = self.slots
        self.kv, self._slots, self.cap = kv, slots, cap
        # each layer's views, made once per growth: a decode step asks for them 30 times, and
        # indexing the stacked buffers anew costs ~8 view ops (microseconds) each time
        self.kv_of = list(kv.unbind(0))  # L x (cap, 2, Hkv, D)
        self.rows_of = [x.view(cap, -1) for x in self.kv_of]  # L x (cap, 2 Hkv D), as in _rows
        # L x (cap, 2, Hkv, 1, D): a slot's row shaped as a decode step's k and v stacked, which
        # then go in with one cat, as they come
        self.new_rows_of = [x[:, :, :, None] for x in self.kv_of]
        self.k_of = [x[:, 0].transpose(0, 1)[None] for x in self.kv_of]  # L x (1, Hkv, cap, D), as attention reads K
        self.v_of = [x[:, 1].transpose(0, 1)[None] for x in self.kv_of]

    # -- new tokens (the layers' prefill and decode) -----------------------------------------
    def fill(self, l: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The prompt of layer l: k, v (Hkv, T, D) into slots [0, T), as tokens 0 .. T-1."""
        T = k.shape[1]
        self.reserve(T + 64)
        self.kv[l, :T, 0] = k.transpose(0, 1)  # (T, Hkv, D)
        self.kv[l, :T, 1] = v.transpose(0, 1)
        self.slots[0, l, :T] = torch.arange(T, device=k.device)
        self.slots[1, l, :T] = 0
        self.on_host[l] = False
        self.n_act[l] = self.n_tok[l] = T

    def append(self, l: int, k: torch.Tensor, v: torch.Tensor) -> int:
        """The decoded token of layer l, k, v (1, Hkv, 1, D) as the layer's decode gets them,
        into the next free slot; returns the active slots after it (n_act[l])."""
        a = self.n_act[l]
        self.reserve(a + 1)
        torch.cat((k, v), out=self.new_rows_of[l][a])  # (2, Hkv, 1, D): the slot's row, one copy
        self.appended.append((l * self.cap + a, self.n_tok[l]))  # slot_tok = the token, slot_count = 0
        self.n_act[l] = a + 1
        self.n_tok[l] += 1
        return a + 1

    # -- Algorithm 1, lines 3-15, for all layers at once ------------------------------------------
    def _detect(self, layer: torch.Tensor, tok: torch.Tensor, now: int) -> torch.Tensor:
        """With a history window W: record a detection of tokens `tok` of layers `layer` (both
        (m,)) at step `now` and return their c_j, the detections within the last W steps."""
        W = self.p.history
        self.seen[layer, tok, self.count[layer, tok] % W] = now  # count: detections so far, the ring's pointer
        self.count[layer, tok] += 1  # (layer, token) pairs are unique, so += through an index is exact
        return (self.seen[layer, tok] > now - W).sum(dim=1)

    # -- moving one layer's K/V between the tiers (the recovery ladder) ---------------------------
    def remove_slots(self, l: int, slots: torch.Tensor) -> None:
        """Drop layer l's active slots `slots`, closing the holes with its last active slots."""
        n, m = self.n_act[l], self.n_act[l] - len(slots)
        keep = torch.ones(n, dtype=torch.bool, device=slots.device)
        keep[slots] = False
        holes = slots[slots < m]  # removed slots inside the new length...
        fill = keep[m:].nonzero()[:, 0] + m  # ...and as many kept slots past it
        kv = self.kv[l].flatten(1)  # (cap, 2 Hkv D): a row per slot (see _rows)
        kv.index_copy_(0, holes, kv.index_select(0, fill))
        self.slots[:, l, holes] = self.slots[:, l, fill]
        self.n_act[l] = m

    def restore(self, l: int, tok: torch.Tensor) -> int:
        """Bring layer l's frozen tokens `tok` back from the host tier, after its active slots."""
        r = len(tok)
        if r:
            self.reserve(self.n_act[l] + r)
            a, b = self.n_act[l], self.n_act[l] + r
            rows = self.kv_host[l].flatten(1).index_select(0, tok.cpu())  # (r, 2 Hkv D)
            self.kv[l, a:b] = self.p.tiers.to_device(rows, fresh=True).view(r, 2, self.Hkv, self.D)
            self.slots[0, l, a:b] = tok
            if self.p.history is None:
                self.slots[1, l, a:b] = self.count[l, tok]
            self.thaw_at[l, tok] = NOT_FROZEN
            self.n_act[l] = b
            self.n_frozen[l] -= r
        self.next_thaw = int(self.thaw_at[:, : max(self.n_tok)].min()) if any(self.n_frozen) else NOT_FROZEN
        return r

    def schedule_all(self, scores: list[torch.Tensor], now: int, follow: float = 0.0) -> int:
        """Algorithm1Layer.step(scores[l], now) for every layer l, as one step over stacked tensors,
        then SoftFreeze.thaw_successors with weight `follow` (0: off) in the same restore; returns
        how many tokens follow brought back. scores[l] (n_act[l],): layer l's s_j over its slots."""
        p, L = self.p, self.L
        dev = self.kv.device
        n = torch.tensor(self.n_act, device=dev)  # (L,)
        S = pad_sequence(scores, batch_first=True)  # (L, A): A = the most active slots of a layer
        A = S.shape[1]
        slot = torch.arange(A, device=dev)
        active = slot < n[:, None]  # (L, A): the padding is no slot
        if p.score == "relative":
            # each layer's mean over its own scores, as the reference takes it: a padded row's sum
            # could round differently, and a threshold one ulp off could flip a token
            means = torch.empty(L, dtype=S.dtype, device=dev)  # each written in place: no stack of 30
            for l, s in enumerate(scores):
                torch.mean(s, dim=0, out=means[l])
            tau = p.tau * means[:, None]  # (L, 1)
        else:
            tau = p.tau
        n_tok = torch.tensor(self.n_tok, device=dev)[:, None]
        # follow: the tokens some head weighed >= follow, read before the freezes move any slot;
        # the threshold follow * |A| in float64, then float32 as the reference's scalar compares
        read = self._successors(S >= (n.double() * follow).float()[:, None], active, n_tok) if follow else None
        # line 3: outside the sliding window of the last K tokens, below tau
        low = (S < tau) & active & (self.slot_tok[:, :A] < n_tok - p.window)  # (L, A)
        if p.history is None:
            c = self.slot_count[:, :A]
            c += low  # line 4, every slot of every layer at once
            freeze = low & (c >= self.c_min)  # line 6: d_j > 0 exactly when c_j >= c_min
            lf, jf = freeze.nonzero().unbind(1)  # (f,) layer and slot of each token to freeze
            cf = c[lf, jf]
        else:
            lw, jw = low.nonzero().unbind(1)
            c = self._detect(lw, self.slot_tok[lw, jw], now)  # line 4 within the last W steps
            lf, jf, cf = lw[c >= self.c_min], jw[c >= self.c_min], c[c >= self.c_min]
            freeze = torch.zeros_like(low)
            freeze[lf, jf] = True
        f = freeze.sum(dim=1)  # (L,) tokens frozen per layer
        if len(lf):
            # flat indices, 1-d index ops on flat views: cheaper than (layer, j) pair indexing
            at = lf * self.cap + jf  # (f,) the slots, in slots.view(2, -1)
            tok = self.slots[0].view(-1).index_select(0, at)  # (f,) their tokens
            key = lf * self.N + tok  # (f,) (layer, token) in the (L, N) tables, flat
            d = self.duration.index_select(0, cf)  # line 5, Eq. 3 (tabulated)
            self.thaw_at.view(-1).index_copy_(0, key, now + d)  # lines 10-15 skip the new ones this step
            self.frozen_at.view(-1).index_fill_(0, key, now)
            if p.history is None:
                self.count.view(-1).index_copy_(0, key, cf)
            self.next_thaw = min(self.next_thaw, now + int(d.min()))
            self._freeze_all(at, key)  # line 7
            self._close_holes(freeze, active, n - f)
        m = n - f  # (L,) active tokens after the freezes
        # lines 10-14: the frozen tokens whose timer has run out (due), and follow's successors
        # still frozen after them; one restore, layer by layer in token order
        T = max(self.n_tok)
        thaw_at = self.thaw_at[:, :T]
        due = thaw_at <= now if now >= self.next_thaw else None  # (L, T)
        back = due
        if read is not None:
            read &= thaw_at != NOT_FROZEN  # the successors frozen, due or not
            back = read if due is None else read | due
        r = torch.zeros_like(m)
        if back is not None:
            r = back.sum(dim=1)  # (L,)
            lr, tr = back.nonzero().unbind(1)
            if len(lr):
                self._restore_all(lr, tr, m, r)  # line 13
        thawed = torch.zeros_like(m) if due is None else due.sum(dim=1)  # (L,) line 13's, beside follow's
        if due is not None:  # (follow's restores alone leave next_thaw a lower bound)
            self.next_thaw = int(thaw_at.min())
        n_act, f, thawed, r = torch.stack((m + r, f, thawed, r)).tolist()
        self.n_act = n_act
        for l in range(L):
            self.n_frozen[l] += f[l] - r[l]
            self.freezes[l] += f[l]
            self.thaws[l] += thawed[l]
        self.reserve(max(n_act) + 1)  # room for the next decoded token in every layer
        return sum(r) - sum(thawed)

    def _successors(self, read: torch.Tensor, active: torch.Tensor, n_tok: torch.Tensor) -> torch.Tensor:
        """(L, T) bool: token j + 1 of layer l for every slot of layer l read (L, A) holding token j
        (j + 1 < n_tok[l]), T = the most tokens of a layer."""
        T = max(self.n_tok)
        succ = self.slot_tok[:, : read.shape[1]] + 1  # (L, A)
        read &= active & (succ < n_tok)
        lr, jr = read.nonzero().unbind(1)
        out = torch.zeros((self.L, T), dtype=torch.bool, device=read.device)
        out.view(-1).index_fill_(0, lr * T + succ[lr, jr], True)
        return out

    def _rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The stacked buffers seen as rows: kv (L * cap, 2 Hkv D), slots (2, L * cap),
        kv_host (L * N, 2 Hkv D). Two-dimensional on purpose: PyTorch's CPU index_select copies
        the rows of a 2-d tensor as whole blocks, 3-4x faster than those of the 4-d view."""
        return self.kv.view(self.L * self.cap, -1), self.slots.view(2, -1), self.kv_host.view(self.L * self.N, -1)

    def _freeze_all(self, at: torch.Tensor, key: torch.Tensor) -> None:
        """Copy the rows of the slots at (flat, l cap + j) holding the tokens key (flat, l N + t;
        both (f,)) to the host tier, those the host does not hold yet."""
        on_host = self.on_host.view(-1)
        new = (~on_host.index_select(0, key)).nonzero()[:, 0]
        if len(new):
            at, key = at.index_select(0, new), key.index_select(0, new)
            kv, _, kv_host = self._rows()
            rows = self.p.tiers.to_host(kv.index_select(0, at), fresh=True)  # (f', 2 Hkv D)
            kv_host.index_copy_(0, key.cpu(), rows)
            on_host.index_fill_(0, key, True)

    def _close_holes(self, freeze: torch.Tensor, active: torch.Tensor, m: torch.Tensor) -> None:
        """remove_slots for every layer: the frozen slots below a layer's new length m[l] are
        filled by its kept slots at or past it, both in slot order (as remove_slots pairs them).
        A layer has as many of one as of the other, so the two lists, layer-major, pair up."""
        # freeze, active (L, A); m (L,)
        inside = torch.arange(freeze.shape[1], device=freeze.device) < m[:, None]  # (L, A)
        holes = (freeze & inside).nonzero()
        fill = (active & ~freeze & ~inside).nonzero()
        holes, fill = holes[:, 0] * self.cap + holes[:, 1], fill[:, 0] * self.cap + fill[:, 1]
        kv, slots, _ = self._rows()
        kv.index_copy_(0, holes, kv.index_select(0, fill))
        slots.index_copy_(1, holes, slots.index_select(1, fill))

    def _restore_all(self, lr: torch.Tensor, tr: torch.Tensor, m: torch.Tensor, r: torch.Tensor) -> None:
        """restore for every layer: layer lr's token tr (both (r,), layer-major, token order) is
        appended after that layer's m[lr] active slots, r[l] tokens in layer l."""
        self.reserve(int((m + r).max()))
        # layer l's tokens go to slots m[l], m[l] + 1, ...: flat l cap + m[l] + (i - first[l]),
        # i the token's place in lr and first[l] where layer l's tokens start there
        shift = self.cap * torch.arange(self.L, device=lr.device) + m - (torch.cumsum(r, 0) - r)  # (L,)
        at = shift.index_select(0, lr) + torch.arange(len(lr), device=lr.device)  # (r,)
        key = lr * self.N + tr  # (r,) (layer, token) flat
        self._copy_back(key, at, m.tolist(), r.tolist())
        _, slots, _ = self._rows()
        slots[0].index_copy_(0, at, tr)
        if self.p.history is None:
            slots[1].index_copy_(0, at, self.count.view(-1).index_select(0, key))
        self.thaw_at.view(-1).index_fill_(0, key, NOT_FROZEN)

    def _copy_back(self, rows: torch.Tensor, at: torch.Tensor, m: list[int], r: list[int]) -> None:
        """The K/V of the restored tokens: host rows `rows` (flat, layer-major, (r,)) to device
        rows `at` (flat), which are layer l's slots [m[l], m[l] + r[l]), in that order."""
        kv, _, kv_host = self._rows()
        if kv.device != kv_host.device:
            back = self.p.tiers.to_device(kv_host.index_select(0, rows.cpu()), fresh=True)  # (r, 2 Hkv D)
            kv.index_copy_(0, at, back)
            return
        # both tiers in CPU memory: gather each layer's rows straight into its slots, one pass
        # over the bytes instead of two (into a temporary, then out of it). With ~2,800 rows a
        # step coming back, all out of cache, that halves the thaws' copy (2 ms a step to 1)
        for l, rows_l in enumerate(rows.split(r)):  # rows_l (r[l],): layer l's
            if r[l]:
                self.p.tiers.gather_to_device(kv_host, rows_l, self.rows_of[l][m[l] : m[l] + r[l]])

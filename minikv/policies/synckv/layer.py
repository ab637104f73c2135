"""synckv's layer: what each head reads at a decode step and when the reads change (Algorithm 1).

policy.py holds the paper, the map from Algorithm 1's lines to these methods, and the decisions.
R-heads keep their full KV on the device; NR-heads read static + dynamic + window slots of the
device store (bank.py), chosen by the R-heads: their own cluster's (nr_reads=cluster) or, as
Algorithm 1 lines 23-24 write it, the union over every cluster's sets (nr_reads=union).

An NR-head's device slots (with offloading), for each cluster whose sets it reads (one, or all
N_r under the union): k_static static slots, then k_dyn dynamic slots per cluster; then a ring
of `ring` = window + m - 1 slots holding the recent window, token t in slot ring_slot(t). With
window=0 (Algorithm 1 lines 23-24: no recent window) the ring holds the tokens since the last
selection point, unread, until they go to the bank as the next selection's candidates.
"""
from __future__ import annotations

from itertools import count

import torch

from ...kernels.attention_topk import attention_topk
from ...kernels.decode_attention import decode_attention
from ...kernels.gathered_attention import gathered_attention
from ..contract import LayerKV, Policy, dense_attention
from ..pool import assign_slots
from .bank import ContextBank


def query_heads(kv_heads: list[int], group: int, device) -> torch.Tensor:
    """The query heads that read the given KV heads (GQA groups of `group`), in order."""
    return torch.tensor([h * group + g for h in kv_heads for g in range(group)], device=device)


class SyncKVLayer(LayerKV):
    next_step = ("top_dynamic", "fetch_dynamic")  # what overlap.py may run beside the model

    def __init__(self, policy: Policy, index: int):  # a SyncKV (policy.py), which builds its layers
        super().__init__(policy, index)
        cfg, dev, D = policy.cfg, policy.tiers.device, policy.cfg.head_dim
        spec = policy.clustering[index]
        self.clusters, self.r_heads = spec["clusters"], spec["r_heads"]  # cluster c: members, R-head
        self.nr_heads = [h for c in self.clusters for h in c if h not in self.r_heads]
        self.nr_cluster = [next(c for c, members in enumerate(self.clusters) if h in members) for h in self.nr_heads]
        self.r_queries = query_heads(self.r_heads, cfg.n_groups, dev)
        self.nr_queries = query_heads(self.nr_heads, cfg.n_groups, dev)
        Hr, Hn, n = len(self.r_heads), len(self.nr_heads), policy.max_len
        self.k_static, self.k_dyn, self.window, self.ring = policy.k_static, policy.k_dyn, policy.window, policy.ring
        self.union = policy.nr_reads == "union"  # Algorithm 1 line 23: every cluster's sets
        self.W = max(self.window, 1)  # the window's tokens as stored; window=0 stores the new token, unread
        # Eq. 6 as written (exclude_static=False): a dynamic slot may hold a static token, read once
        self.dedup = self.union or not policy.exclude_static
        self.kr = torch.zeros((1, Hr, n, D), dtype=policy.dtype, device=dev)  # R-heads: full KV, device
        self.vr = torch.zeros((1, Hr, n, D), dtype=policy.dtype, device=dev)
        # per R-head, the tokens it may still choose for its dynamic set: False once static
        self.selectable = torch.ones(1, Hr, n, dtype=torch.bool, device=dev)
        self.offload = policy.offload and Hn > 0  # False: "w/o initialization", slot = token index
        n_sets = len(self.clusters) if self.union else 1  # clusters whose sets each NR-head holds
        self.ring_start = n_sets * (self.k_static + self.k_dyn)
        self.bank = ContextBank(n_heads=Hn, max_len=n, slots=self.ring_start + self.ring, head_dim=D, dtype=policy.dtype,
                                tiers=policy.tiers, offload=self.offload, staging=policy.staging)
        self.static = [[] for _ in self.clusters]  # per cluster: token indices, slot order
        self.dynamic = [[-1] * self.k_dyn for _ in self.clusters]  # per cluster: token held by each dynamic slot
        self.T = self.length = self.step = 0
        self.start = 0  # the recent window is tokens [start, length); tokens before it are candidates

    # -- where tokens are ----------------------------------------------------------------------
    def window_tokens(self) -> range:
        """The recent window (on the device for every head): the last `window` tokens at least,
        and those that have come and gone since the last selection point. With window=0: the
        tokens since the last selection point, held but not read (read_window_tokens)."""
        return range(self.start, self.length)

    def read_window_tokens(self) -> range:
        """The window tokens an NR-head reads: the window's, or none with window=0."""
        return self.window_tokens() if self.window else range(0)

    def read_clusters(self, c: int) -> list[int]:
        """The clusters whose sets an NR-head of cluster c reads: its own, or all (the union)."""
        return list(range(len(self.clusters))) if self.union else [c]

    def ring_slot(self, t: int) -> int:
        """The device slot of window token t: the ring after the static and dynamic slots."""
        return self.ring_start + t % self.ring

    def static_slot(self, g: int, j: int) -> int:
        """The slot of cluster g's j-th static token (g's sets come g-th under the union)."""
        return (g if self.union else 0) * self.k_static + j

    def dynamic_slot(self, g: int, j: int) -> int:
        n_sets = len(self.clusters) if self.union else 1
        return n_sets * self.k_static + (g if self.union else 0) * self.k_dyn + j

    def set_slots(self, c: int) -> list[tuple[int, int]]:
        """(token, slot) of the static, then the dynamic sets an NR-head of cluster c holds: its
        own cluster's, or every cluster's under the union."""
        pairs = []
        for g in self.read_clusters(c):  # a set's j-th token sits in the set's first slot + j
            pairs += zip(self.static[g], count(self.static_slot(g, 0)))
        for g in self.read_clusters(c):
            pairs += [(t, s) for t, s in zip(self.dynamic[g], count(self.dynamic_slot(g, 0))) if t >= 0]
        return pairs

    def read_slots(self, c: int) -> list[tuple[int, int]]:
        """(token, slot) an NR-head of cluster c reads: static, dynamic, window, each token once
        (under the union a token two clusters chose is read from the first slot holding it)."""
        pairs = self.set_slots(c)
        if self.dedup:
            seen = set()
            pairs = [(t, s) for t, s in pairs if not (t in seen or seen.add(t))]
        pairs += [(t, self.ring_slot(t)) for t in self.read_window_tokens()]
        return pairs if self.offload else [(t, t) for t, _ in pairs]

    def nr_index(self) -> torch.Tensor:
        """(1, Hn, N) slots each NR-head reads, -1 padded."""
        slots = {c: [s for _, s in self.read_slots(c)] for c in set(self.nr_cluster)}  # a cluster's heads read alike
        rows = [slots[c] for c in self.nr_cluster]
        n = max(len(r) for r in rows)
        return torch.tensor([[r + [-1] * (n - len(r)) for r in rows]], device=self.kr.device)

    # -- the contract --------------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D)
        out = dense_attention(q, k, v)
        T = self.T = self.length = k.shape[2]
        self.kr[:, :, :T] = k[:, self.r_heads]
        self.vr[:, :, :T] = v[:, self.r_heads]
        # the first decode step reads the last `window` tokens: the prompt's from start on (window=0:
        # every prompt token is a candidate of Eq. 3)
        self.start = max(0, T + 1 - self.W)
        if self.nr_heads:
            k_nr, v_nr = k[0, self.nr_heads], v[0, self.nr_heads]  # (Hn, T, D)
            self.bank.write_prompt(k_nr, v_nr)  # Algorithm 1 line 12: the NR-heads' KV goes whole
            self.initialize(q[:, :, -1], k_nr, v_nr)
        return out

    def initialize(self, q_last, k_nr, v_nr):
        """Eqs. 3-4: I_0 from the R-head's attention of the last prompt token, split by rho. The
        candidates are the tokens before the window (the window's are read at every step anyway):
        with window=0, the whole attention vector."""
        # q_last (1, Hq, D); k_nr, v_nr (Hn, T, D)
        T, n, backend = self.T, self.start, self.policy.backend
        q_r = q_last[:, self.r_queries]
        _, lse = decode_attention(q_r, self.kr[:, :, :T], self.vr[:, :, :T], torch.tensor([T], device=q_r.device),
                                  return_lse=True, backend=backend)
        _, top = attention_topk(q_r, self.kr[:, :, :n], lse, torch.tensor([n], device=q_r.device), None,
                                self.k_static + self.k_dyn, backend=backend)
        for c, row in enumerate(top[0].tolist()):
            chosen = [t for t in row if t >= 0]  # best first
            self.static[c], dyn = chosen[:self.k_static], chosen[self.k_static:]
            self.dynamic[c] = dyn + [-1] * (self.k_dyn - len(dyn))
            if self.policy.exclude_static:
                self.selectable[0, c, self.static[c]] = False
        if self.offload:  # the NR-heads keep I_0 and the window on the device (Sec. 4.2)
            for j, c in enumerate(self.nr_cluster):
                tokens, slots = zip(*self.held_slots(c))
                self.bank.keep_on_device(j, list(slots), k_nr[j, list(tokens)], v_nr[j, list(tokens)])

    def held_slots(self, c: int) -> list[tuple[int, int]]:
        """(token, slot) of every slot an NR-head of cluster c fills: like read_slots, but a
        token two clusters chose is in both of their slots."""
        return self.set_slots(c) + [(t, self.ring_slot(t)) for t in self.window_tokens()]

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D)
        self.append(k, v)
        L, backend = self.length, self.policy.backend
        q1 = q[:, :, 0]  # (1, Hq, D)
        out = torch.empty_like(q1)
        q_r = q1[:, self.r_queries]
        # line 22: R-heads over their full KV; the lse is their attention's normaliser (Eq. 5)
        out_r, lse_r = decode_attention(q_r, self.kr[:, :, :L], self.vr[:, :, :L], torch.tensor([L], device=q1.device),
                                        return_lse=True, backend=backend)
        out[:, self.r_queries] = out_r
        if self.nr_heads:
            self.bank.wait()  # the last fetch has landed
            # lines 23-24: NR-heads over static + dynamic (their cluster's, or the union) + window
            out[:, self.nr_queries] = gathered_attention(q1[:, self.nr_queries], self.bank.store_k, self.bank.store_v,
                                                         self.nr_index(), backend=backend)
        self.step += 1
        if not self.nr_heads:
            return out[:, :, None]
        if not self.policy.anticipation:  # nothing will ever judge a token that leaves: it leaves now
            self.slide_window()
        elif self.step % self.policy.m == 0:
            self.slide_window()
            if self.k_dyn:  # lines 26-31, for the steps that follow (rho = 1: no dynamic set to choose)
                self.fetch_dynamic(self.top_dynamic(q_r, lse_r, self.start))
        return out[:, :, None]

    def slide_window(self):
        """A selection point: the window shrinks to the last `window` tokens as of the next step;
        the generated tokens that leave it go to the bank (the prompt is there already)."""
        start = max(self.start, self.length + 1 - self.W)
        leaving = range(max(self.start, self.T), start)
        if self.offload and leaving:
            self.bank.spill(list(leaving), [self.ring_slot(t) for t in leaving])
        self.start = start

    def append(self, k, v):
        """A new token: R-heads' full KV; NR-heads' window ring (the slot it takes belongs to a
        token that left the window at a selection point, and went to the bank then)."""
        p = self.length
        if p >= self.kr.shape[2]:
            raise ValueError(f"the sequence outgrew max_len ({self.kr.shape[2]} tokens)")
        self.kr[0, :, p] = k[0, self.r_heads, 0]
        self.vr[0, :, p] = v[0, self.r_heads, 0]
        if self.nr_heads:
            k_nr, v_nr = k[0, self.nr_heads, 0], v[0, self.nr_heads, 0]  # (Hn, D)
            self.bank.push(self.ring_slot(p) if self.offload else p, k_nr, v_nr)
        self.length = p + 1

    def top_dynamic(self, q_r, lse_r, n: int) -> list[list[int]]:
        """Eqs. 5-6, an anticipation: per cluster (R-head), the k_dyn selectable tokens among [0, n)
        (before the window, window=0: all of them, the current token included; not static,
        exclude_static=false: static too) of most attention. q_r (1, Hr*G, D), lse_r (1, Hr*G): this
        step's R-head queries and their normalisers. Reads the R-heads' keys and `selectable`
        before n, and writes nothing (policies/overlap.py may run it beside the model)."""
        _, top = attention_topk(q_r, self.kr[:, :, :n], lse_r, torch.tensor([n], device=q_r.device),
                                self.selectable[:, :, :n], self.k_dyn, backend=self.policy.backend)
        return top[0].tolist()

    def fetch_dynamic(self, top: list[list[int]]) -> None:
        """The new dynamic sets, top_dynamic's, and their fetch (Eq. 7)."""
        moves = []  # (cluster, dynamic slot, token)
        for c, row in enumerate(top):
            if len(self.clusters[c]) == 1 and not self.union:
                continue  # a cluster of its R-head alone has nobody to serve
            moves += [(c, j, t) for t, j in assign_slots(self.dynamic[c], row)]
        if self.offload and moves:
            self.fetch(moves)

    def fetch(self, moves):
        """Eq. 7: every NR-head that reads a moved token's cluster gets the bank's row in that
        cluster's chosen dynamic slot."""
        rows = [(j, t, self.dynamic_slot(c, slot)) for j, own in enumerate(self.nr_cluster)
                for c, slot, t in moves if self.union or c == own]
        self.bank.fetch(rows)

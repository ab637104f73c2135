"""synckv: representative heads choose, every m steps, the tokens their cluster reads (SyncKV).

Paper: "SyncKV: A Syncopated Scheduling Approach to KV Cache Compression for Efficient
Long-Context LLM Inference", anonymous authors, ICLR 2026 submission (withdrawn),
https://openreview.net/forum?id=542c8KxeQt (no arXiv version, no public code).

An offline clustering (Sec. 4.1; clusters.py, `python -m minikv.bench cluster-heads`) groups each
layer's KV heads into N_r clusters, each with a representative head (R-head); the others are
NR-heads. Where to read what (Algorithm 1's lines):

    SyncKVLayer.prefill      lines 9-17: dense attention; R-heads keep their full KV on the
                             device, the NR-heads' KV goes whole to the host (bank.ContextBank)
    SyncKVLayer.initialize   Eqs. 3-4: I_0 = the top k of the R-head's attention from the last
                             prompt token (kernels/attention_topk), split by rho into the static
                             and the initial dynamic set
    SyncKVLayer.decode       line 22: R-heads over their full KV; line 24: NR-heads over static
                             + dynamic + window (kernels/gathered_attention); every m-th step
                             anticipates, the others are suspension steps (Eq. 8, lines 33-35)
    SyncKVLayer.anticipate   Eqs. 5-7, lines 26-31: the R-head's top k_dyn, max-pooled over its
                             GQA group (App. B.1), among the candidates; `fetch` copies them in
    SyncKV.split             k = budget less the window ring's slots, into static and dynamic

Decisions (docs/design.md, "synckv"): the clustering unit is the KV head; Mem% counts R-heads at
full length. The last `window` tokens, whatever their origin, are read by every head at every
step; a token leaves the window only at a selection point (`slide_window`), as a candidate, so
between anticipations the window grows to window + m - 1 tokens and budget = k + window + m - 1.
NR-heads read their own cluster's sets; the dynamic set is chosen among tokens not on the device
already. Table 3's ablations: offload=False is "w/o initialization", anticipation=False "w/o
anticipation", m=1 "w/o suspension". Beyond the paper, wide_layers gives the layers whose heads
agree least (by S, Eq. 2) more clusters than n_r (SyncKV.widen; docs/synckv.md measures why).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...kernels.attention_topk import attention_topk
from ...kernels.decode_attention import decode_attention
from ...kernels.gathered_attention import gathered_attention
from ..base import LayerKV, Policy, dense_attention, param, register
from ..pool import Staging, refill
from .bank import ContextBank
from .clusters import find_clustering, least_agreeing_layers, read_similarity


class SyncKVLayer(LayerKV):
    def __init__(self, policy: "SyncKV", index: int):
        super().__init__(policy, index)
        cfg, dev, D = policy.cfg, policy.tiers.device, policy.cfg.head_dim
        spec = policy.clustering[index]
        self.clusters, self.r_heads = spec["clusters"], spec["r_heads"]  # cluster c: members, R-head
        self.nr_heads = [h for c in self.clusters for h in c if h not in self.r_heads]
        self.nr_cluster = [next(c for c, members in enumerate(self.clusters) if h in members) for h in self.nr_heads]
        G = cfg.n_groups
        self.rq = torch.tensor([h * G + g for h in self.r_heads for g in range(G)], device=dev)  # their query heads
        self.nq = torch.tensor([h * G + g for h in self.nr_heads for g in range(G)], device=dev)
        Hr, Hn, n = len(self.r_heads), len(self.nr_heads), policy.max_len
        self.ks, self.kd, self.W, self.R = policy.k_static, policy.k_dyn, policy.window, policy.ring
        self.kr = torch.zeros((1, Hr, n, D), dtype=policy.dtype, device=dev)  # R-heads: full KV, device
        self.vr = torch.zeros((1, Hr, n, D), dtype=policy.dtype, device=dev)
        self.keep = torch.ones(1, Hr, n, dtype=torch.bool, device=dev)  # False: static, never re-selected
        self.offload = policy.offload and Hn > 0  # False: "w/o initialization", slot = token index
        # NR-heads' device slots (with offloading): [0, ks) static, [ks, ks + kd) dynamic, then a
        # ring of R = window + m - 1 slots holding the recent window, token t in slot ks + kd + t % R
        self.bank = ContextBank(n_heads=Hn, max_len=n, slots=self.ks + self.kd + self.R, head_dim=D, dtype=policy.dtype,
                                tiers=policy.tiers, offload=self.offload, staging=policy.staging)
        self.static = [[] for _ in self.clusters]  # per cluster: token indices, slot order
        self.dynamic = [[-1] * self.kd for _ in self.clusters]  # per cluster: token held by each dynamic slot
        self.read_dynamic, self.read_window = self.dynamic, range(0)  # what the last step read
        self.T = self.length = self.step = 0
        self.start = 0  # the recent window is tokens [start, length); tokens before it are candidates
        self.anticipations = self.fetched = 0  # tokens copied host -> device, per NR-head

    # -- where tokens are ----------------------------------------------------------------------
    def window_tokens(self) -> range:
        """The recent window (on the device for every head): the last `window` tokens at least,
        and those that have come and gone since the last selection point."""
        return range(self.start, self.length)

    def read_tokens(self, c: int, dynamic=None) -> list[int]:
        """Token indices an NR-head of cluster c reads: static, dynamic, window (disjoint)."""
        dynamic = (dynamic or self.dynamic)[c]
        return self.static[c] + [t for t in dynamic if t >= 0] + list(self.window_tokens())

    def slot_of(self, t: int, c: int) -> int:
        if not self.offload:
            return t
        if t >= self.start:  # in the window ring
            return self.ks + self.kd + t % self.R
        if t in self.static[c]:
            return self.static[c].index(t)
        return self.ks + self.dynamic[c].index(t)

    def nr_index(self) -> torch.Tensor:
        """(1, Hn, N) slots each NR-head reads, -1 padded."""
        rows = []
        for c in self.nr_cluster:
            if self.offload:  # slot numbers without a lookup per token
                dyn = [self.ks + j for j, t in enumerate(self.dynamic[c]) if t >= 0]
                win = [self.ks + self.kd + t % self.R for t in self.window_tokens()]
                rows.append(list(range(len(self.static[c]))) + dyn + win)
            else:
                rows.append(self.read_tokens(c))
        n = max(len(r) for r in rows)
        return torch.tensor([[r + [-1] * (n - len(r)) for r in rows]], device=self.kr.device)

    # -- the contract --------------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D)
        out = dense_attention(q, k, v)
        T = self.T = self.length = k.shape[2]
        self.kr[:, :, :T] = k[:, self.r_heads]
        self.vr[:, :, :T] = v[:, self.r_heads]
        # the first decode step reads the last `window` tokens: the prompt's from start on
        self.start = max(0, T + 1 - self.W)
        if self.nr_heads:
            k_nr, v_nr = k[0, self.nr_heads], v[0, self.nr_heads]  # (Hn, T, D)
            self.bank.write_prompt(k_nr, v_nr)  # Algorithm 1 line 12: the NR-heads' KV goes whole
            self.initialize(q[:, :, -1], k_nr, v_nr)
        self.read_dynamic, self.read_window = list(self.dynamic), self.window_tokens()
        return out

    def initialize(self, q_last, k_nr, v_nr):
        """Eqs. 3-4: I_0 from the R-head's attention of the last prompt token, split by rho. The
        candidates are the tokens before the window (the window's are read at every step anyway)."""
        # q_last (1, Hq, D); k_nr, v_nr (Hn, T, D)
        T, n, backend = self.T, self.start, self.policy.backend
        q_r = q_last[:, self.rq]
        _, lse = decode_attention(q_r, self.kr[:, :, :T], self.vr[:, :, :T], torch.tensor([T], device=q_r.device),
                                  return_lse=True, backend=backend)
        _, top = attention_topk(q_r, self.kr[:, :, :n], lse, torch.tensor([n], device=q_r.device), None,
                                self.ks + self.kd, backend=backend)
        for c, row in enumerate(top[0].tolist()):
            chosen = [t for t in row if t >= 0]  # best first
            self.static[c], dyn = chosen[:self.ks], chosen[self.ks:]
            self.dynamic[c] = dyn + [-1] * (self.kd - len(dyn))
            self.keep[0, c, self.static[c]] = False
        if self.offload:  # the NR-heads keep I_0 and the window on the device (Sec. 4.2)
            for j, c in enumerate(self.nr_cluster):
                tokens = self.read_tokens(c)
                self.bank.keep_on_device(j, [self.slot_of(t, c) for t in tokens], k_nr[j, tokens], v_nr[j, tokens])

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D)
        self.append(k, v)
        L, backend = self.length, self.policy.backend
        q1 = q[:, :, 0]  # (1, Hq, D)
        out = torch.empty_like(q1)
        q_r = q1[:, self.rq]
        # line 22: R-heads over their full KV; the lse is their attention's normaliser (Eq. 5)
        out_r, lse_r = decode_attention(q_r, self.kr[:, :, :L], self.vr[:, :, :L], torch.tensor([L], device=q1.device),
                                        return_lse=True, backend=backend)
        out[:, self.rq] = out_r
        if self.nr_heads:
            self.bank.wait()  # the last fetch has landed
            # line 24: NR-heads over static + dynamic + window, each head its own slots
            out[:, self.nq] = gathered_attention(q1[:, self.nq], self.bank.store_k, self.bank.store_v, self.nr_index(),
                                                 backend=backend)
        self.step += 1
        self.read_window = self.window_tokens()  # what this step read (the rest may change below)
        self.read_dynamic = list(self.dynamic)
        if not self.nr_heads:
            return out[:, :, None]
        if not self.policy.anticipation:  # nothing will ever judge a token that leaves: it leaves now
            self.slide_window()
        elif self.step % self.policy.m == 0:
            self.slide_window()
            self.anticipate(q_r, lse_r)  # lines 26-31, for the steps that follow
        return out[:, :, None]

    def slide_window(self):
        """A selection point: the window shrinks to the last `window` tokens as of the next step;
        the generated tokens that leave it go to the bank (the prompt is there already)."""
        start = max(self.start, self.length + 1 - self.W)
        leaving = range(max(self.start, self.T), start)
        if self.offload and leaving:
            self.bank.spill(list(leaving), [self.ks + self.kd + t % self.R for t in leaving])
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
            if self.offload:
                self.bank.push(self.ks + self.kd + p % self.R, k_nr, v_nr)
            else:
                self.bank.push(p, k_nr, v_nr)
        self.length = p + 1

    def anticipate(self, q_r, lse_r):
        """Eqs. 5-7: each R-head's top k_dyn among the tokens before the window, not static, then
        fetch."""
        # q_r (1, Hr*G, D); lse_r (1, Hr*G): this step's R-head queries and their normalisers
        n = self.start  # the candidates: tokens [0, start), all in the bank
        self.anticipations += 1
        if self.kd == 0:  # rho = 1: no dynamic set to choose
            return
        _, top = attention_topk(q_r, self.kr[:, :, :n], lse_r, torch.tensor([n], device=q_r.device),
                                self.keep[:, :, :n], self.kd, backend=self.policy.backend)
        moves = []  # (cluster, dynamic slot, token)
        for c, row in enumerate(top[0].tolist()):
            if len(self.clusters[c]) == 1:
                continue  # a cluster of its R-head alone has nobody to serve
            self.dynamic[c] = held = list(self.dynamic[c])  # a new list: read_dynamic keeps the old one
            moves += [(c, j, t) for t, j in refill(held, row)]
        if self.offload and moves:
            self.fetch(moves)

    def fetch(self, moves):
        """Eq. 7: every NR-head of a moved token's cluster gets the bank's row in the chosen slot."""
        rows = [(j, t, self.ks + slot) for j, c in enumerate(self.nr_cluster) for cc, slot, t in moves if cc == c]
        self.fetched += len(rows)
        self.bank.fetch(rows)

    # -- what was read, and where it lives --------------------------------------------------------
    def attended_indices(self) -> torch.Tensor | None:
        """(Hkv, n) int64 token indices the last decode step read per KV head, -1 padded; None
        when every head read every token."""
        L = self.length
        rows = {h: list(range(L)) for h in self.r_heads}
        rows.update({h: self.static[c] + [t for t in self.read_dynamic[c] if t >= 0] + list(self.read_window)
                     for h, c in zip(self.nr_heads, self.nr_cluster)})
        if all(len(r) == L for r in rows.values()):
            return None
        n = max(len(r) for r in rows.values())
        return torch.tensor([rows[h] + [-1] * (n - len(rows[h])) for h in range(self.cfg.n_kv_heads)])

    def nr_read(self) -> int:
        """Tokens the NR-heads read at the last step, summed (counted, not listed: end_step asks
        every step)."""
        n_window = len(self.read_window)
        per_cluster = [len(s) + sum(t >= 0 for t in d) + n_window for s, d in zip(self.static, self.read_dynamic)]
        return sum(per_cluster[c] for c in self.nr_cluster)

    def device_tokens(self) -> float:
        return (len(self.r_heads) * self.length + self.nr_read()) / self.cfg.n_kv_heads

    def resident_tokens(self) -> float:
        """KV held on the device per KV head (for Mem%): w/o initialization, all of it."""
        return self.device_tokens() if self.offload or not self.nr_heads else float(self.length)

    def host_tokens(self) -> float:
        n = max(self.T, self.start) if self.offload else 0  # the prompt, and generated tokens past the window
        return len(self.nr_heads) * n / self.cfg.n_kv_heads

    def allocated_device_tokens(self) -> float:
        Hr, Hn, Hkv = len(self.r_heads), len(self.nr_heads), self.cfg.n_kv_heads
        return (Hr * self.kr.shape[2] + Hn * self.bank.store_k.shape[2]) / Hkv

    def allocated_host_tokens(self) -> float:
        return len(self.nr_heads) * self.kr.shape[2] / self.cfg.n_kv_heads if self.offload else 0

    def aux_bytes(self) -> tuple[int, int]:
        return self.keep.numel() * self.keep.element_size(), 0


@register
@dataclass(eq=False, kw_only=True)
class SyncKV(Policy):
    """Representative heads anticipate every m steps; their clusters read only what they chose."""

    name = "synckv"
    max_batch = 1

    budget: int = param(256, "most tokens a non-representative KV head reads on the device: static + dynamic "
                             "+ window; capped by the context", low=1)
    window: int = param(32, "most recent tokens, read by every head at every step (the new token included)", low=1)
    rho: float = param(0.5, "static ratio: the share of k = budget - window slots chosen once (Eq. 4)",
                       low=0.0, high=1.0)
    m: int = param(5, "synchronization stride: every m-th step anticipates", low=1)
    n_r: int = param(1, "clusters (representative heads) per layer", low=1)
    clusters: str | None = param(None, "clustering file (none: the one shipped for this model)")
    offload: bool = param(True, "offload the other heads' KV to the host (false: w/o initialization)")
    anticipation: bool = param(True, "anticipation steps (false: the initial selection only)")
    wide_layers: int = param(0, "layers that take wide_n_r clusters instead of n_r (beyond the paper): the ones "
                                "whose heads agree least (lowest mean similarity S between heads, Eq. 2)", low=0)
    wide_n_r: int = param(0, "clusters per layer in the wide layers (0: one per KV head, full KV there)", low=0)

    def __post_init__(self):
        super().__post_init__()
        self.ring = self.window + self.m - 1 if self.anticipation else self.window  # the most tokens the window holds
        if self.budget <= self.ring:
            slots = "window + m - 1" if self.anticipation else "window"
            raise ValueError(f"budget must be an int > the recent window's slots ({slots} = {self.ring}): static + "
                             f"dynamic + window, got {self.budget!r}")
        self.k_static, self.k_dyn = self.split(self.budget - self.ring)

    def split(self, k: int) -> tuple[int, int]:
        """k selected slots -> (k_static, k_dyn): the split of Eq. 4, with k_dyn = floor((1 - rho) k) as
        defined under Eq. 6."""
        k_dyn = math.floor((1.0 - self.rho) * k + 1e-9)
        return k - k_dyn, k_dyn

    def validate(self, cfg):
        # neither set holds more than the context: a budget past it costs at most what full KV costs
        # for each (a selection of k >= the candidates takes them all, capped or not)
        k_static, k_dyn = self.split(self.budget - self.ring)
        self.k_static, self.k_dyn = min(k_static, self.max_len), min(k_dyn, self.max_len)
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("synckv does not combine with a sliding-window model (Mistral) shorter than max_len")
        if self.n_r > cfg.n_kv_heads:
            raise ValueError(f"n_r must be <= the model's {cfg.n_kv_heads} KV heads, got {self.n_r}")
        self.clustering, self.clustering_file = find_clustering(cfg, self.n_r, self.clusters)
        if self.wide_layers:
            self.clustering = self.widen(cfg)
        for i, layer in enumerate(self.clustering):
            heads = sorted(h for c in layer["clusters"] for h in c)
            ok = heads == list(range(cfg.n_kv_heads)) and len(layer["r_heads"]) == len(layer["clusters"])
            if not ok or any(r not in c for r, c in zip(layer["r_heads"], layer["clusters"])):
                raise ValueError(f"{self.clustering_file}: layer {i}'s clusters do not partition the KV heads")

    def widen(self, cfg) -> list[dict]:
        """Uneven N_r over layers: the wide_layers layers whose heads agree least take the file's
        clustering for wide_n_r clusters (their R-heads stay whole: Mem% rises by their share)."""
        wide_n_r = self.wide_n_r or cfg.n_kv_heads
        if self.wide_layers > cfg.n_layers:
            raise ValueError(f"wide_layers must be <= the model's {cfg.n_layers} layers, got {self.wide_layers}")
        if not self.n_r < wide_n_r <= cfg.n_kv_heads:
            raise ValueError(f"wide_n_r must be > n_r ({self.n_r}) and <= the model's {cfg.n_kv_heads} KV heads, "
                             f"got {wide_n_r}")
        wide = least_agreeing_layers(read_similarity(self.clustering_file), self.wide_layers)
        more, _ = find_clustering(cfg, wide_n_r, str(self.clustering_file))
        return [more[i] if i in wide else layer for i, layer in enumerate(self.clustering)]

    def make_layer(self, index: int) -> SyncKVLayer:
        if index == 0:  # one pair of staging buffers for all layers (they fetch one after another)
            n_nr = max(self.cfg.n_kv_heads - len(layer["r_heads"]) for layer in self.clustering)
            rows = n_nr * self.k_dyn  # the most (head, token) rows a fetch moves
            self.staging = Staging((2 * max(1, rows), self.cfg.head_dim), self.dtype, self.tiers) if self.offload else None
        return SyncKVLayer(self, index)

    def aux_bytes(self) -> tuple[int, int]:
        return self.staging.nbytes() if self.staging is not None else (0, 0)

    def stats(self) -> dict:
        s = super().stats()
        layers = self.layers
        n_ant = sum(layer.anticipations for layer in layers)
        n_nr = sum(len(layer.nr_heads) for layer in layers) / max(len(layers), 1)
        fetched = sum(layer.fetched for layer in layers)
        full = sum(layer.length for layer in layers)
        s.update({
            "anticipation_steps": max((layer.anticipations for layer in layers), default=0),
            # tokens copied host -> device per NR-head per layer, per anticipation
            "tokens_fetched": fetched,
            "tokens_fetched_per_anticipation": fetched / n_ant / n_nr if n_ant and n_nr else 0.0,
            "mem_percent": 100.0 * sum(layer.resident_tokens() for layer in layers) / full if full else 0.0,
            "clustering_file": str(self.clustering_file),
        })
        return s

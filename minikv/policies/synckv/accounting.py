"""synckv's accounting, beside its rule (layer.py), which never calls it: what each head read at
the last step and where the KV lives, for stats(), the budget checks and attention recall.

    Accounting.prefill, decode    record what the step read (the window and the dynamic sets as
                                  attention saw them; an anticipation may change both after it)
    Accounting.fetch              counts the (NR-head, token) rows Eq. 7 copies in
    read_tokens, slot_of          where the tokens the next step reads sit
    nr_read, device_tokens        tokens the heads read: R-heads their full KV, NR-heads static +
                                  dynamic + window
    attended_indices, last_read   the same, token by token
    resident_tokens               Mem% (Table 3): KV held on the device per KV head
    anticipations                 the layer's anticipation steps, from its step count
    Report                        the policy's: the figures stats() adds, the read bound
                                  check_policy holds, the bytes beside the KV
"""
from __future__ import annotations

import torch


class Accounting:
    """Mixin before SyncKVLayer: the layer's tiers and reads (see the module docstring)."""

    def __init__(self, policy, index: int):
        super().__init__(policy, index)
        self.read_dynamic, self.read_window = [list(d) for d in self.dynamic], range(0)  # nothing read yet
        self.fetched = 0  # (NR-head, token) rows fetched so far

    def prefill(self, q, k, v, positions):
        out = super().prefill(q, k, v, positions)
        self.read_dynamic, self.read_window = [list(d) for d in self.dynamic], self.read_window_tokens()
        return out

    def decode(self, q, k, v, positions):
        # attention reads the sets as they stand and the window up to the new token (appended;
        # window=0: none of it)
        start, dynamic = self.start, [list(d) for d in self.dynamic]
        out = super().decode(q, k, v, positions)
        self.read_dynamic, self.read_window = dynamic, range(start, self.length) if self.window else range(0)
        return out

    @property
    def anticipations(self) -> int:
        """Anticipation steps so far: every m-th decode step, where there are NR-heads to serve."""
        return self.step // self.policy.m if self.policy.anticipation and self.nr_heads else 0

    def fetch(self, moves):
        # Eq. 7's rows: each moved token, for every NR-head that reads its cluster's sets
        self.fetched += sum(self.union or c == own for own in self.nr_cluster for c, _, _ in moves)
        super().fetch(moves)

    def read_tokens(self, c: int) -> list[int]:
        """Token indices an NR-head of cluster c reads: static, dynamic, window (disjoint)."""
        return [t for t, _ in self.read_slots(c)]

    def slot_of(self, t: int, c: int) -> int:
        """The device slot an NR-head of cluster c reads token t from."""
        return dict(self.read_slots(c))[t]

    def budget_heads(self):
        return self.nr_heads  # the R-heads keep full KV: the budget bounds the others

    def attended_indices(self) -> torch.Tensor | None:
        """(Hkv, n) int64 token indices the last decode step read per KV head, -1 padded; None
        when every head read every token."""
        L = self.length
        rows = {h: list(range(L)) for h in self.r_heads}
        rows.update({h: self.last_read(c) for h, c in zip(self.nr_heads, self.nr_cluster)})
        if all(len(r) == L for r in rows.values()):
            return None
        n = max(len(r) for r in rows.values())
        return torch.tensor([rows[h] + [-1] * (n - len(rows[h])) for h in range(self.cfg.n_kv_heads)])

    def last_read(self, c: int) -> list[int]:
        """The tokens an NR-head of cluster c read at the last step: static, dynamic, window."""
        sets = [t for g in self.read_clusters(c) for t in self.static[g]]
        sets += [t for g in self.read_clusters(c) for t in self.read_dynamic[g] if t >= 0]
        return list(dict.fromkeys(sets)) + list(self.read_window)

    def nr_read(self) -> int:
        """Tokens the NR-heads read at the last step, summed (counted, not listed: end_step asks
        every step)."""
        if self.dedup:
            return sum(len(self.last_read(c)) for c in self.nr_cluster)
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
        return self.selectable.numel() * self.selectable.element_size(), 0


class Report:
    """Mixin before Policy in SyncKV (policy.py): what it reports of its bound layers."""

    def read_bound(self, budget: int) -> int:
        # nr_reads=union (Algorithm 1 line 23): an NR-head reads every cluster's static and dynamic
        # sets, up to N_r of each, and the window once
        if self.nr_reads != "union":
            return budget
        n_sets = max(len(layer["clusters"]) for layer in self.clustering)
        return n_sets * (budget - self.window_reads) + self.window_reads

    def aux_bytes(self) -> tuple[int, int]:
        return self.staging.nbytes() if self.staging is not None else (0, 0)

    def stats(self) -> dict:
        s = super().stats()  # (its device_tokens land every layer's fetch: overlap.py)
        # n_r: the clusters per layer it ran (preset=paper: the paper's for the model)
        s.update(report(self.layers), clustering_file=str(self.clustering_file), n_r=self.n_r_bound)
        return s


def report(layers: list) -> dict:
    """The figures stats() adds, from the layers' accounting (their fetches landed)."""
    n_ant = sum(layer.anticipations for layer in layers)
    n_nr = sum(len(layer.nr_heads) for layer in layers) / max(len(layers), 1)
    fetched = sum(layer.fetched for layer in layers)
    full = sum(layer.length for layer in layers)
    return {
        "anticipation_steps": max((layer.anticipations for layer in layers), default=0),
        # tokens copied host -> device per NR-head per layer, per anticipation
        "tokens_fetched": fetched,
        "tokens_fetched_per_anticipation": fetched / n_ant / n_nr if n_ant and n_nr else 0.0,
        "mem_percent": 100.0 * sum(layer.resident_tokens() for layer in layers) / full if full else 0.0,
    }

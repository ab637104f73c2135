"""How a prompt comes into a PagedKV (paged.py), at prefill only, never in a decode step: the
sink pages and the window ring on the device, the pages between them offloaded as candidates,
the state the prompt's tokens appended one by one (and rolled) would reach
(tests/policies/test_paged.py holds the two equal)."""
from __future__ import annotations

import math

import torch


class PagedPrefill:
    """Base of PagedKV: its prefill."""

    def prefill(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a prompt: k, v (1, Hkv, T, D). Ends in the state T appends would reach."""
        T, P = k.shape[2], self.P
        n_pages = math.ceil(T / P)
        if n_pages > self.max_pages:
            raise ValueError(f"{T} tokens exceed the capacity of {self.max_pages} pages of {P}")
        sink = min(n_pages, self.n_sink)
        rest = n_pages - sink
        # after the last token of a full page, a full ring has already rolled (see append)
        kept = min(rest, self.n_window - 1 if T % P == 0 else self.n_window)
        n_cand = rest - kept
        for p in list(range(sink)) + list(range(sink + n_cand, n_pages)):  # sink and window pages
            self.pool.write(self.slot_of(p), k[0, :, p * P:(p + 1) * P], v[0, :, p * P:(p + 1) * P])
        if n_cand:
            a, b = sink * P, (sink + n_cand) * P
            kc = k[0, :, a:b].reshape(self.Hkv, n_cand, P, self.D).permute(1, 2, 0, 3)  # (n, P, Hkv, D) NHD view
            vc = v[0, :, a:b].reshape(self.Hkv, n_cand, P, self.D).permute(1, 2, 0, 3)
            self.n_cand = n_cand
            self.store(kc, vc, 0)
        self.length = T

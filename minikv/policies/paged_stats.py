"""The accounting of the paged stores (paged.py, host_pages.py), beside them: what a layer's
PagedKV holds on each tier and what its last attention read. The stores' rule never calls it;
stats(), the budget checks and attention recall (bench) do.

    PagedStats.device_tokens, host_tokens   tokens per KV head on each tier
    PagedStats.resident                     the candidate each selected slot holds
    PagedStats.read_indices                 the tokens the last attend() read (its record,
                                            `last_read`), per KV head
    PagedStats.aux_bytes                    the page table, lengths and the store's digests
    HostPagesStats                          freekv's store: the tokens of a page, its digests' bytes
    PagedLayer                              a policy layer whose KV lives in a PagedKV: its tier
                                            accounting is the store's
"""
from __future__ import annotations

import torch

from .contract import LayerKV


class PagedStats:
    """Base of PagedKV: its accounting (see the module docstring)."""

    def device_tokens(self) -> float:
        # = page_lens.sum() / Hkv without a tensor op: the sink and window slots hold every token
        # that is not a candidate
        return self.length - self.n_cand * self.P + sum(map(sum, self.held_lens)) / self.Hkv

    def host_tokens(self) -> int:
        return self.n_cand * self.P

    @property
    def resident(self) -> torch.Tensor:
        """(Hkv, n_select) int64: the candidate in each selected slot, -1 = empty."""
        return torch.tensor(self.held, dtype=torch.int64)

    def read_indices(self) -> torch.Tensor:
        """(Hkv, n) int64: the token indices the last attend() read per KV head (sink pages,
        selected candidates, window), -1 padding: what attention recall is measured against."""
        length, n_cand, held, lens = self.last_read
        P, sink_end = self.P, min(length, self.n_sink * self.P)
        window = list(range((self.n_sink + n_cand) * P, length))  # empty while the sinks hold all
        rows = []
        for h in range(self.Hkv):
            pages = sorted((c, n) for c, n in zip(held[h], lens[h]) if c >= 0)
            selected = [t for c, n in pages for t in self.candidates.page_tokens(h, c, n, self.n_sink * P)]
            rows.append(list(range(sink_end)) + selected + window)
        width = max(map(len, rows))
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64)

    def aux_bytes(self) -> tuple[int, int]:
        """(device, host) bytes besides the K/V slots: page table, lengths and the store's own
        (the staging buffers are the policy's: `Staging.nbytes`)."""
        device, host = self.candidates.aux_bytes()
        return device + sum(t.numel() * t.element_size() for t in (self.pool.page_table, self.pool.page_lens)), host


class HostPagesStats:
    """Base of host_pages.HostPages: what read_indices and aux_bytes ask of the store."""

    def page_tokens(self, h: int, c: int, n: int, first_token: int) -> list[int]:
        """The absolute indices of candidate c's tokens (its first n), candidates starting at token
        first_token."""
        start = first_token + c * self.P
        return list(range(start, start + n))

    def aux_bytes(self) -> tuple[int, int]:
        """(device, host) bytes besides the K/V pages: the digests (and codes)."""
        return sum(t.numel() * t.element_size() for t in (self.lo, self.hi, self.codes) if t is not None), 0


class PagedLayer(LayerKV):
    """A policy's layer whose KV lives in a PagedKV (`self.kv`): its tier accounting is the
    paged store's. Subclasses add what they reserve on the host and aux buffers of their own."""

    def device_tokens(self) -> float:
        return self.kv.device_tokens()

    def host_tokens(self) -> int:
        return self.kv.host_tokens()

    def allocated_device_tokens(self) -> int:
        return self.kv.S * self.kv.P

    def aux_bytes(self) -> tuple[int, int]:
        return self.kv.aux_bytes()  # the pool's page table and lengths, the store's digests

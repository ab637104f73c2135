"""Where SyncKV's non-representative heads (NR-heads) keep their KV, for one layer.

    host bank   bank_k, bank_v (Hn, max_len, D) on the host tier (pinned when CUDA is present):
                the "context bank" of Sec. 4.2, by token index. It receives the whole prompt at
                prefill (Algorithm 1 line 12) and each generated token when it leaves the recent
                window (`spill`).
    device      store_k, store_v (1, Hn, S, D): the slots attention reads. With offloading, S =
                budget slots per head (SyncKVLayer decides what each slot holds: static, dynamic,
                the recent window's ring); without ("w/o initialization"), S = max_len and slot =
                token index.

`fetch` is Eq. 7: one gather of the wanted rows on the host into a staging buffer, one copy to
the device, one scatter into their slots, through Tiers.copy_in (tiers.py), which counts the bytes
and, on CUDA, runs it on the side stream after the current stream's work (this step's attention
over the old slots), so the transfer overlaps the rest of the forward (Sec. 4.5); the next
attention waits for it (`wait`). On the CPU it runs in order.
"""
from __future__ import annotations

import torch

from ..pool import Staging


class ContextBank:
    def __init__(self, *, n_heads: int, max_len: int, slots: int, head_dim: int, dtype: torch.dtype, tiers,
                 offload: bool, staging: Staging | None):
        dev, D, pin = tiers.device, head_dim, tiers.pin
        self.tiers, self.offload = tiers, offload
        shape = (1, n_heads, slots if offload else max_len, D)
        self.store_k = torch.zeros(shape, dtype=dtype, device=dev)  # read every step
        self.store_v = torch.zeros(shape, dtype=dtype, device=dev)
        if offload:
            self.bank_k = torch.empty(n_heads, max_len, D, dtype=dtype, pin_memory=pin)
            self.bank_v = torch.empty_like(self.bank_k, pin_memory=pin)
            # the policy's two staging buffers (its layers fetch in turn): rows [0, n) keys, [n, 2n)
            # values of one fetch's n (head, token) rows
            self.staging = staging

    def write_prompt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (Hn, T, D): the prompt, whole, to the bank (or, w/o offloading, to the device)."""
        T = k.shape[1]
        if self.offload:
            self.tiers.write_host(self.bank_k[:, :T], k)
            self.tiers.write_host(self.bank_v[:, :T], v)
        else:
            self.store_k[0, :, :T] = k
            self.store_v[0, :, :T] = v

    def keep_on_device(self, head: int, slots: list[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (n, D) of one head, still on the device after the prefill, into its slots."""
        self.store_k[0, head, slots] = k
        self.store_v[0, head, slots] = v

    def push(self, slot: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A new token's k, v (Hn, D) into `slot` of every head."""
        self.store_k[0, :, slot] = k
        self.store_v[0, :, slot] = v

    def spill(self, tokens: list[int], slots: list[int]) -> None:
        """Tokens leaving the device (the recent window): each slot's row of every head to the
        bank at its token index, so that a later anticipation can fetch it back."""
        slots_t = torch.tensor(slots, device=self.store_k.device)
        self.bank_k[:, tokens] = self.tiers.to_host(self.store_k[0].index_select(1, slots_t), fresh=True)  # (Hn, n, D)
        self.bank_v[:, tokens] = self.tiers.to_host(self.store_v[0].index_select(1, slots_t), fresh=True)

    def fetch(self, rows: list[tuple[int, int, int]]) -> None:
        """Eq. 7: for each (head, token, slot), the bank's row of that token into that slot."""
        n, n_bank, n_slots, D = len(rows), self.bank_k.shape[1], self.store_k.shape[2], self.store_k.shape[3]
        src = torch.tensor([h * n_bank + t for h, t, _ in rows])
        dst = torch.tensor([h * n_slots + s for h, _, s in rows])

        def gather(buffer):  # (>= 2n, D) pinned host rows
            torch.index_select(self.bank_k.view(-1, D), 0, src, out=buffer[:n])
            torch.index_select(self.bank_v.view(-1, D), 0, src, out=buffer[n:2 * n])
            return buffer[:2 * n]

        def scatter(staged):  # (2n, D) on the device -> their rows of the flat (Hn * S, D) store
            at = dst.to(staged.device, non_blocking=True)
            self.store_k.view(-1, D).index_copy_(0, at, staged[:n])
            self.store_v.view(-1, D).index_copy_(0, at, staged[n:])

        self.tiers.copy_in(self.staging, gather, scatter, into=self, background=True)

    def wait(self) -> None:
        """Before attention reads the slots: the last fetch has landed."""
        self.tiers.wait(self)

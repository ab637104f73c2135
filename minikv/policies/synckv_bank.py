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
the device, one scatter into their slots. On CUDA it runs on a side stream after the current
stream's work (this step's attention over the old slots) and records an event that the next
attention waits on (`wait`), so the transfer overlaps the rest of the forward (Sec. 4.5); on the
CPU it runs in order. Every byte that crosses is counted in the policy's Tiers.
"""
from __future__ import annotations

import torch



class ContextBank:
    def __init__(self, *, n_heads: int, max_len: int, slots: int, head_dim: int, dtype: torch.dtype, tiers,
                 offload: bool, stage_rows: int):
        dev, D, pin = tiers.device, head_dim, tiers.pin
        self.tiers, self.offload = tiers, offload
        shape = (1, n_heads, slots if offload else max_len, D)
        self.store_k = torch.empty(shape, dtype=dtype, device=dev)  # read every step
        self.store_v = torch.empty(shape, dtype=dtype, device=dev)
        if offload:
            self.bank_k = torch.empty(n_heads, max_len, D, dtype=dtype, pin_memory=pin)
            self.bank_v = torch.empty_like(self.bank_k, pin_memory=pin)
            self.stage_host = torch.empty(2, max(1, stage_rows), D, dtype=dtype, pin_memory=pin)
            self.stage_dev = torch.empty(2, max(1, stage_rows), D, dtype=dtype, device=dev)
        self.cuda = dev.type == "cuda"
        if self.cuda:
            self.side, self.ready = torch.cuda.Stream(device=dev), torch.cuda.Event()

    def _count_to_host(self, t: torch.Tensor) -> None:
        self.tiers.bytes_to_host += 2 * t.numel() * t.element_size()  # keys and values

    def write_prompt(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v (Hn, T, D): the prompt, whole, to the bank (or, w/o offloading, to the device)."""
        T = k.shape[1]
        if self.offload:
            self.bank_k[:, :T].copy_(k)
            self.bank_v[:, :T].copy_(v)
            self._count_to_host(k)
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
        k = self.store_k[0].index_select(1, slots_t).to(self.bank_k.device)  # (Hn, n, D)
        v = self.store_v[0].index_select(1, slots_t).to(self.bank_v.device)
        self.bank_k[:, tokens] = k
        self.bank_v[:, tokens] = v
        self._count_to_host(k)

    def fetch(self, rows: list[tuple[int, int, int]]) -> None:
        """Eq. 7: for each (head, token, slot), the bank's row of that token into that slot."""
        n_bank, n_slots, D = self.bank_k.shape[1], self.store_k.shape[2], self.store_k.shape[3]
        src = torch.tensor([h * n_bank + t for h, t, _ in rows])
        dst = torch.tensor([h * n_slots + s for h, _, s in rows])
        if self.cuda:
            self.ready.synchronize()  # the last fetch has finished reading the staging buffer
        stage = self.stage_host[:, :len(rows)]
        torch.index_select(self.bank_k.view(-1, D), 0, src, out=stage[0])
        torch.index_select(self.bank_v.view(-1, D), 0, src, out=stage[1])
        self.tiers.bytes_to_device += stage.numel() * stage.element_size()
        if not self.cuda:
            self._scatter(stage, dst)
            return
        self.side.wait_stream(torch.cuda.current_stream())  # this step's reads of the slots first
        with torch.cuda.stream(self.side):
            self._scatter(stage, dst)
            self.ready.record(self.side)

    def _scatter(self, stage: torch.Tensor, dst: torch.Tensor) -> None:
        # stage (2, m, D) host rows -> device staging -> their rows of the flat (Hn * S, D) store
        blocks = self.stage_dev[:, :stage.shape[1]]
        blocks.copy_(stage, non_blocking=self.cuda)
        dst = dst.to(blocks.device, non_blocking=self.cuda)
        self.store_k.view(-1, self.store_k.shape[3]).index_copy_(0, dst, blocks[0])
        self.store_v.view(-1, self.store_v.shape[3]).index_copy_(0, dst, blocks[1])

    def wait(self) -> None:
        """Before attention reads the slots: the last fetch has landed."""
        if self.cuda:
            torch.cuda.current_stream().wait_event(self.ready)

    def staging_bytes(self) -> tuple[int, int]:
        if not self.offload:
            return 0, 0
        return (self.stage_dev.numel() * self.stage_dev.element_size(),
                self.stage_host.numel() * self.stage_host.element_size())

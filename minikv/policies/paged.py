"""Paged KV storage of one layer, shared by the page-based policies (freekv; icecache reuses it).

A sequence's tokens fall into logical pages of P tokens: page p holds tokens [p P, (p + 1) P).
Three kinds of pages, each with its own home:

    sink pages      pages 0 .. n_sink-1: stay on the device tier for good, read by every step
    window pages    the n_window most recent pages, the last one partly filled: on the device
                    tier, in a ring of slots; when the last page fills up and the ring is full,
                    the oldest window page is *offloaded*: copied to the host tier in HND layout
                    and summarised by a digest, after which it is a *candidate*. So attention
                    reads between (n_window - 1) P + 1 and n_window P of the latest tokens: a
                    policy that promises a window of W tokens asks for W / P + 1 pages
    candidates      pages that left the window: their full KV lives on the host tier, and
                    `recall` brings a chosen few per KV head back into n_select device slots

Device tier, NHD (FreeKV's GPU layout): k_pages, v_pages (S, P, Hkv, D), S = n_sink + n_select +
n_window slots, in that order. Slot s of KV head m holds whatever page head m put there: the sink
and window slots hold the same page for all heads, the selected slots a page per head. Attention
reads them through `page_table` (1, Hkv, S) and `page_lens` (1, Hkv, S): the number of valid
tokens of each slot, P for a full page, less for the partly filled last page (masked, never
padded into attention), 0 for an unused slot.

Host tier, HND (FreeKV's CPU layout): host (max_pages, Hkv, 2, P, D) indexed by candidate number
c (page n_sink + c), so that one page of one KV head, keys and values, is one contiguous block of
2 P D elements: a recall copies whole blocks. Digests (1, Hkv, max_pages, D) lo and hi, computed
when a page is offloaded: Quest's per-channel min and max of the page's keys ("minmax"), or
ArkVale's box around the centre, centre +- mean |k - centre| ("arkvale").

Recall is incremental: given a new selection per KV head, only the pages not already resident are
copied, into the slots of resident pages that fell out of the selection (those with the lowest
current scores). On the CPU the steps run in order (host and device are both CPU memory: the
copies happen and are counted, nothing is saved). On CUDA, what overlaps and what does not:

  * the choice of pages (the top-k in page_scores) runs on the main stream, and the host waits
    for its result (`.cpu()`, one small sync per layer): the slot bookkeeping is host-side;
  * the copy does not block: gather into one of two pinned staging buffers used in turn, one
    host-to-device transfer and the HND -> NHD scatter, on the side stream for a background
    recall (it overlaps the rest of the forward) or on the main stream for a correction;
  * every recall is ordered after the previous one, whichever stream each ran on (one `ready`
    event chains them), because two recalls may write the same slot: a late background write
    must never land over a newer correction. `wait_recall` makes attention wait for the last
    recall, hence for all of them. `streams` is injectable so that tests can record this order
    on a machine without a GPU.
"""
from __future__ import annotations

import math

import torch

from ..kernels.page_gather import page_gather
from ..kernels.page_layout import hnd_to_nhd, nhd_to_hnd
from ..kernels.paged_attention import paged_attention
from ..models.attention import one_query_attention
from .base import LayerKV
from .streams import CudaStreams

DIGESTS = ("minmax", "arkvale")


def page_digest(k: torch.Tensor, kind: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Box (lo, hi) of each page's keys per channel: k (n, Hkv, P, D) -> lo, hi (n, Hkv, D)."""
    kmin, kmax = k.amin(dim=2), k.amax(dim=2)
    if kind == "minmax":  # Quest: the tightest box holding every key
        return kmin, kmax
    if kind == "arkvale":  # ArkVale's cuboid: centre +- the mean distance of the keys to it
        centre = (kmin + kmax) / 2
        radius = (k - centre[:, :, None]).abs().mean(dim=2)
        return centre - radius, centre + radius
    raise ValueError(f"digest must be one of {DIGESTS}, got {kind!r}")


def check_page_geometry(page_size, budget, sink, window) -> None:
    """The parameter checks every page-based policy shares: whole pages for budget, sink and
    window, and a window of at least one page (the partly filled last page is always read)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    for name, value in (("budget", budget), ("sink", sink), ("window", window)):
        if not isinstance(value, int) or value < 0 or value % page_size:
            raise ValueError(f"{name} must be a non-negative multiple of page_size={page_size}, got {value!r}")
    if window < page_size:
        raise ValueError(f"window must be >= page_size={page_size} (the partly filled last page), got {window}")


def pool_attention(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_lens: torch.Tensor) -> torch.Tensor:
    """paged_attention through the identity page table, reading the pool in place: q (1, Hq, D),
    k_pages, v_pages (S, P, Hkv, D), page_lens (1, Hkv, S) -> (1, Hq, D). Slot s of KV head m
    shows its first page_lens[0, m, s] tokens; the rest get weight exactly 0. Unlike the
    reference it does not zero the hidden values: the pool only ever holds KV written by the
    model, finite, and 0 times a finite value is 0. On a CPU, some 60 us less per layer than
    gathering the pool first (SmolLM2, 17 slots of 16)."""
    S, P, Hkv, D = k_pages.shape
    hidden = (torch.arange(P, device=q.device) >= page_lens[0, :, :, None]).view(Hkv, 1, S * P)
    k = k_pages.view(S * P, Hkv, D).transpose(0, 1)[None].float()  # (1, Hkv, S P, D): a view (a float32 copy in half precision)
    v = v_pages.view(S * P, Hkv, D).transpose(0, 1)[None].float()
    return one_query_attention(q.float()[:, :, None], k, v, 1.0 / math.sqrt(D), hidden)[:, :, 0].to(q.dtype)


class Staging:
    """The two staging buffers recalls use in turn: pinned host and device, (n, 2, P, D) each.

    One per policy, not per layer: layers run one after another, and a buffer is refilled only
    after the host has waited for the copy that last read it (`free`, on CUDA), whichever layer
    issued that copy. Per layer they would cost as much memory as the selected pages themselves."""

    def __init__(self, n: int, page_size: int, head_dim: int, dtype: torch.dtype, tiers):
        shape = (max(1, n), 2, page_size, head_dim)
        self.host = [torch.empty(shape, dtype=dtype, pin_memory=tiers.pin) for _ in range(2)]
        self.dev = [torch.empty(shape, dtype=dtype, device=tiers.device) for _ in range(2)]
        self.free = None  # CUDA events, one per buffer: recorded after the copy that reads it
        self.turn = 0

    def take(self) -> int:
        """The buffer to fill next; the other one may still be in flight."""
        self.turn ^= 1
        return self.turn ^ 1

    def nbytes(self) -> tuple[int, int]:
        return sum(t.numel() * t.element_size() for t in self.dev), sum(t.numel() * t.element_size() for t in self.host)


class PagedKV:
    """Paged KV of one layer for one sequence (batch 1). See the module docstring."""

    def __init__(self, *, n_kv: int, head_dim: int, page_size: int, max_len: int, n_sink: int, n_select: int,
                 n_window: int, dtype: torch.dtype, tiers, digest: str = "arkvale", backend: str = "eager",
                 staging: Staging | None = None, streams=None):
        if n_window < 1:
            raise ValueError(f"n_window must be >= 1 (the partly filled last page is always attended), got {n_window}")
        if digest not in DIGESTS:
            raise ValueError(f"digest must be one of {DIGESTS}, got {digest!r}")
        self.P, self.Hkv, self.D = page_size, n_kv, head_dim
        self.n_sink, self.n_select, self.n_window = n_sink, n_select, n_window
        self.digest, self.backend, self.tiers = digest, backend, tiers
        self.max_pages = max(1, math.ceil(max_len / page_size))
        self.S = n_sink + n_select + n_window
        self.w0 = n_sink + n_select  # first window slot
        dev, P, H, D = tiers.device, page_size, n_kv, head_dim
        self.k_pages = torch.zeros(self.S, P, H, D, dtype=dtype, device=dev)  # NHD device pool
        self.v_pages = torch.zeros(self.S, P, H, D, dtype=dtype, device=dev)
        self.page_table = torch.arange(self.S, dtype=torch.int32, device=dev).expand(1, H, self.S).contiguous()
        self.page_lens = torch.zeros(1, H, self.S, dtype=torch.int32, device=dev)
        self.host = torch.empty(self.max_pages, H, 2, P, D, dtype=dtype, pin_memory=tiers.pin)  # HND host tier
        self.lo = torch.zeros(1, H, self.max_pages, D, dtype=dtype, device=dev)  # digests, on the device
        self.hi = torch.zeros(1, H, self.max_pages, D, dtype=dtype, device=dev)
        # candidate number held by each selected slot of each KV head, -1 = empty: host-side
        # bookkeeping of Hkv * n_select integers, kept in Python lists (a tensor op costs more
        # than the whole Python loop over them); `resident` is its tensor view
        self.held = [[-1] * n_select for _ in range(H)]
        self.length = 0  # tokens stored
        self.n_cand = 0  # pages offloaded so far = candidates
        self.n_cand_tensor = torch.zeros(1, dtype=torch.int64, device=dev)  # the same, as page_scores' n_valid
        self.pages_recalled = 0
        # the gather reads the host tier: Triton can address it only when it is not CPU memory
        # beside a GPU (on a CPU-only machine the kernel runs in Triton's interpreter)
        self.gather_backend = "eager" if dev.type == "cuda" else backend
        # one recall moves at most every selected slot of every head; policies share one Staging
        self.staging = staging if staging is not None else Staging(H * n_select, P, D, dtype, tiers)
        self.use_streams(streams if streams is not None else (CudaStreams(dev) if dev.type == "cuda" else None))
        self.last_read = (0, 0, [[-1] * n_select for _ in range(H)])  # what the last attend() read

    def use_streams(self, streams) -> None:
        """The stream API of the asynchronous recall path: CUDA's, or a recorder in tests; None
        runs every copy in order on the calling thread (the CPU)."""
        self.streams = streams
        if streams is not None:
            self.side = streams.stream()
            if self.staging.free is None:
                self.staging.free = [streams.event(), streams.event()]
            self.ready = streams.event()  # recorded after every recall: the end of the chain

    # -- where pages live --------------------------------------------------------------------
    def slot_of(self, page: int) -> int:
        """Device slot of a sink or window page."""
        return page if page < self.n_sink else self.w0 + (page - self.n_sink) % self.n_window

    @property
    def resident(self) -> torch.Tensor:
        """(Hkv, n_select) int64: the candidate number in each selected slot, -1 = empty."""
        return torch.tensor(self.held, dtype=torch.int64)

    def device_tokens(self) -> float:
        # = page_lens.sum() / Hkv without a tensor op: the sink and window slots hold every token
        # that is not a candidate, the selected slots full pages
        n_selected = sum(c >= 0 for row in self.held for c in row)
        return self.length - self.n_cand * self.P + n_selected * self.P / self.Hkv

    def host_tokens(self) -> int:
        return self.n_cand * self.P

    # -- writing -----------------------------------------------------------------------------
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
            self._write_page(p, k[0, :, p * P:(p + 1) * P], v[0, :, p * P:(p + 1) * P])
        if n_cand:
            a, b = sink * P, (sink + n_cand) * P
            kc = k[0, :, a:b].reshape(self.Hkv, n_cand, P, self.D).permute(1, 2, 0, 3)  # (n, P, Hkv, D) NHD view
            vc = v[0, :, a:b].reshape(self.Hkv, n_cand, P, self.D).permute(1, 2, 0, 3)
            self._offload(kc, vc)
        self.length = T

    def _write_page(self, page: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (Hkv, n, D), n <= P tokens of one page -> its sink or window slot
        s, n = self.slot_of(page), k.shape[1]
        self.k_pages[s, :n] = k.transpose(0, 1)
        self.v_pages[s, :n] = v.transpose(0, 1)
        self.page_lens[0, :, s] = n

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """One new token: k, v (1, Hkv, 1, D) into the partly filled last page of the window."""
        page, off = divmod(self.length, self.P)
        if page >= self.max_pages:
            raise ValueError(f"the sequence outgrew max_len ({self.max_pages * self.P} tokens)")
        s = self.slot_of(page)
        self.k_pages[s, off] = k.reshape(self.Hkv, self.D)
        self.v_pages[s, off] = v.reshape(self.Hkv, self.D)
        self.page_lens.select(2, s).fill_(off + 1)  # page_lens[0, :, s]
        self.length += 1

    def roll(self) -> bool:
        """If the last page just filled up and the window ring is full, offload the oldest window
        page so that its slot takes the next page. Call after each step's attention; returns True
        when a page became a candidate (the selection must then be recomputed)."""
        if self.length % self.P or self.length <= self.n_sink * self.P:
            return False
        first_window = self.n_sink + self.n_cand
        last = self.length // self.P - 1
        if last - first_window + 1 < self.n_window:
            return False
        s = self.slot_of(first_window)
        self._offload(self.k_pages[s:s + 1], self.v_pages[s:s + 1])
        self.page_lens[0, :, s] = 0
        return True

    def _offload(self, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v (n, P, Hkv, D) NHD pages leaving the device -> host HND blocks + digests.
        # The NHD -> HND transpose happens here, once per page, so that recalls copy whole blocks.
        n, c = k.shape[0], self.n_cand
        blocks = nhd_to_hnd(k, v)  # (n, Hkv, 2, P, D)
        self.host[c:c + n].copy_(blocks)
        self.tiers.bytes_to_host += blocks.numel() * blocks.element_size()
        lo, hi = page_digest(blocks[:, :, 0], self.digest)  # (n, Hkv, D)
        self.lo[0, :, c:c + n] = lo.transpose(0, 1)
        self.hi[0, :, c:c + n] = hi.transpose(0, 1)
        self.n_cand += n
        self.n_cand_tensor.fill_(self.n_cand)

    # -- recall ------------------------------------------------------------------------------
    def holds(self, selection: torch.Tensor) -> list[bool]:
        """Per KV head: do its selected slots hold exactly `selection` (Hkv, n_select) (as sets)?"""
        return [set(want) - {-1} == set(held) - {-1} for want, held in zip(selection.tolist(), self.held)]

    def recall(self, selection: torch.Tensor, heads=None, background: bool = False) -> int:
        """Make the selected slots hold `selection` (Hkv, n_select) candidate numbers (-1: none),
        for the KV heads where `heads` (Hkv,) bool (tensor or list) is True (all by default).
        Copies only missing pages. Returns the number of pages copied."""
        rows = selection.tolist()  # bookkeeping is host-side (on CUDA: one small sync)
        on = heads.tolist() if isinstance(heads, torch.Tensor) else heads
        moves = []  # (host row, device slot, KV head) of each page to copy
        lens_change = False
        for h, want in enumerate(rows):
            if on is not None and not on[h]:
                continue  # this head keeps what it holds
            held = self.held[h]
            keep = set(want) - {-1}
            missing = [c for c in want if c >= 0 and c not in held]  # in selection order
            # free: empty, or its page dropped from the selection; in slot order. The j-th missing
            # page goes to the j-th free slot: a head has at least as many free slots as missing
            # pages, the selection holding no duplicates
            free = [j for j, c in enumerate(held) if c not in keep]
            was_used = [held[j] >= 0 for j in free]
            for j in free:
                held[j] = -1
            for c, j in zip(missing, free):
                held[j] = c
                moves.append((c * self.Hkv + h, self.n_sink + j, h))
            lens_change |= was_used != [held[j] >= 0 for j in free]  # a slot emptied, or an empty one filled
        if moves:
            flat, slots, heads = (torch.tensor(column) for column in zip(*moves))  # (n,) each, contiguous
            self._copy_in(flat, slots, heads, background)
        if lens_change:  # only while the selection has fewer pages than slots: rewrite their lengths
            lens = torch.tensor([[self.P if c >= 0 else 0 for c in row] for row in self.held], dtype=torch.int32)
            self.page_lens[0, :, self.n_sink:self.w0].copy_(lens, non_blocking=True)
        self.pages_recalled += len(moves)
        return len(moves)

    def _copy_in(self, flat: torch.Tensor, slots: torch.Tensor, heads: torch.Tensor, background: bool) -> None:
        # flat (n,) rows of host viewed as (max_pages * Hkv, 2, P, D): gather the blocks into a
        # staging buffer (one contiguous host read per block), copy it to the device in one
        # transfer, then the HND -> NHD kernel scatters the blocks into their slots.
        n, stage = flat.numel(), self.staging
        buf = stage.take()  # two staging buffers in turn: the next gather need not wait for this copy
        host_rows = self.host.view(-1, 2, self.P, self.D)
        if self.streams is None:
            page_gather(host_rows, flat, stage.host[buf], backend=self.gather_backend)
            blocks = stage.host[buf][:n]
            if self.tiers.device.type != "cpu":  # on a CPU-only machine the staged blocks are already "there"
                blocks = stage.dev[buf][:n].copy_(blocks)
            self.tiers.bytes_to_device += blocks.numel() * blocks.element_size()
            hnd_to_nhd(blocks, self.k_pages, self.v_pages, slots, heads, backend=self.backend)
            return
        S = self.streams
        stage.free[buf].synchronize()  # the copy that last read this buffer (any layer's) is done
        page_gather(host_rows, flat, stage.host[buf], backend=self.gather_backend)
        main = S.current()
        stream = self.side if background else main
        stream.wait_stream(main)  # selection, and this step's attention over the old slots, first
        stream.wait_event(self.ready)  # the previous recall into these slots, on whichever stream
        with S.use(stream):
            blocks = stage.dev[buf][:n]
            blocks.copy_(stage.host[buf][:n], non_blocking=True)
            hnd_to_nhd(blocks, self.k_pages, self.v_pages, slots.to(blocks.device, non_blocking=True),
                       heads.to(blocks.device, non_blocking=True), backend=self.backend)
            stage.free[buf].record(stream)
            self.ready.record(stream)
        self.tiers.bytes_to_device += n * 2 * self.P * self.D * blocks.element_size()

    def wait_recall(self) -> None:
        """Before attention: the main stream waits for the last recall (each waited for the one
        before it, so this covers every recall into these slots)."""
        if self.streams is not None:
            self.streams.current().wait_event(self.ready)

    # -- reading -----------------------------------------------------------------------------
    def attend(self, q: torch.Tensor) -> torch.Tensor:
        """q (1, Hq, D) over every device slot with a token -> (1, Hq, D)."""
        self.wait_recall()
        self.last_read = (self.length, self.n_cand, [list(row) for row in self.held])
        if self.backend == "eager":  # the table is the identity (entry j is slot j): no gather
            return pool_attention(q, self.k_pages, self.v_pages, self.page_lens)
        return paged_attention(q, self.k_pages, self.v_pages, self.page_table, self.page_lens, backend=self.backend)

    def read_indices(self) -> torch.Tensor:
        """(Hkv, n) int64: the token indices the last attend() read per KV head (sink pages,
        selected candidates, window), -1 padding: what attention recall is measured against."""
        length, n_cand, held = self.last_read
        P, sink_end = self.P, min(length, self.n_sink * self.P)
        window = list(range((self.n_sink + n_cand) * P, length))  # empty while the sinks hold all
        rows = []
        for h in range(self.Hkv):
            pages = sorted(c for c in held[h] if c >= 0)
            rows.append(list(range(sink_end)) + [t for c in pages for t in range((self.n_sink + c) * P,
                                                                                 (self.n_sink + c + 1) * P)] + window)
        width = max(map(len, rows))
        return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int64)

    def aux_bytes(self) -> tuple[int, int]:
        """(device, host) bytes besides the K/V slots: digests, page table and lengths (the
        staging buffers are the policy's: `Staging.nbytes`)."""
        return sum(t.numel() * t.element_size() for t in (self.lo, self.hi, self.page_table, self.page_lens)), 0

    def host_page(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidate c's keys and values as stored on the host: (Hkv, P, D) each."""
        return self.host[c, :, 0], self.host[c, :, 1]


class PagedLayer(LayerKV):
    """A policy's layer whose KV lives in a PagedKV (`self.kv`): its tier accounting is the
    paged store's. Subclasses add what they reserve on the host and their aux buffers."""

    def device_tokens(self) -> float:
        return self.kv.device_tokens()

    def host_tokens(self) -> int:
        return self.kv.host_tokens()

    def allocated_device_tokens(self) -> int:
        return self.kv.S * self.kv.P

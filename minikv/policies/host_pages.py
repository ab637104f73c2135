"""freekv's candidate store (HostPages): the pages that left the window, consecutive, on the host
tier in HND layout, (max_pages, Hkv, 2, P, D), so that one page of one KV head is one contiguous
block of 2 P D elements (a recall copies whole blocks), with a digest of each page on the device:

    page_digest     lo, hi per channel: min/max (FreeKV's text, Quest's bound) or ArkVale's box
    codes           digest=quant2 (beyond the papers): each key's 2-bit code in its page's box
                    (kernels/page_scores: pack_codes)

What it holds on each tier is counted in paged_stats.py (HostPagesStats).
"""
from __future__ import annotations

import math

import torch

from ..kernels.page_layout import nhd_to_hnd
from ..kernels.page_scores import pack_codes
from .paged_stats import HostPagesStats

DIGESTS = ("minmax", "arkvale", "quant2")  # quant2: Quest's box and 2-bit codes of each key in it


def page_digest(k: torch.Tensor, kind: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    """Box (lo, hi) of each page's keys per channel: k (n, Hkv, P, D) -> lo, hi (n, Hkv, D)."""
    kmin, kmax = k.amin(dim=2), k.amax(dim=2)
    if kind in ("minmax", "quant2"):  # Quest: the tightest box holding every key
        return kmin, kmax
    if kind == "arkvale":  # ArkVale's cuboid: centre +- the mean distance of the keys to it
        centre = (kmin + kmax) / 2
        radius = (k - centre[:, :, None]).abs().mean(dim=2)
        return centre - radius, centre + radius
    raise ValueError(f"digest must be one of {DIGESTS}, got {kind!r}")


class HostPages(HostPagesStats):
    """freekv's candidate store: consecutive pages on the host, HND, with a digest of each."""

    def __init__(self, *, n_kv: int, head_dim: int, page_size: int, max_len: int, dtype: torch.dtype, tiers,
                 digest: str):
        if digest not in DIGESTS:
            raise ValueError(f"digest must be one of {DIGESTS}, got {digest!r}")
        H, P, D, dev = n_kv, page_size, head_dim, tiers.device
        self.P, self.digest, self.tiers = P, digest, tiers
        self.max_pages = max(1, math.ceil(max_len / P))
        self.host = torch.empty(self.max_pages, H, 2, P, D, dtype=dtype, pin_memory=tiers.pin)  # HND host tier
        self.lo = torch.zeros(1, H, self.max_pages, D, dtype=dtype, device=dev)  # digests, on the device
        self.hi = torch.zeros(1, H, self.max_pages, D, dtype=dtype, device=dev)
        self.n_valid = torch.zeros(1, dtype=torch.int64, device=dev)  # pages held, as page_scores' n_valid
        # quant2: each key's 2-bit codes in its page's box, four channels a byte (page_scores' codes)
        self.codes = torch.zeros(1, H, self.max_pages, P, (D + 3) // 4, dtype=torch.uint8, device=dev) \
            if digest == "quant2" else None

    def offload(self, k: torch.Tensor, v: torch.Tensor, first: int) -> None:
        """Pages leaving the window, k, v (n, P, Hkv, D) NHD -> candidates first.. : host HND blocks
        and digests. The NHD -> HND transpose happens here, once per page, so that recalls copy
        whole blocks."""
        n = k.shape[0]
        blocks = nhd_to_hnd(k, v)  # (n, Hkv, 2, P, D)
        self.tiers.write_host(self.host[first:first + n], blocks)
        lo, hi = page_digest(blocks[:, :, 0], self.digest)  # (n, Hkv, D)
        self.lo[0, :, first:first + n] = lo.transpose(0, 1)
        self.hi[0, :, first:first + n] = hi.transpose(0, 1)
        if self.codes is not None:
            self.codes[0, :, first:first + n] = pack_codes(blocks[:, :, 0], lo, hi).transpose(0, 1)
        self.n_valid.fill_(first + n)

    def lens(self, held: list[list[int]]) -> list[list[int]]:
        """Valid tokens of each held candidate (-1: none): a candidate page is always full."""
        return [[self.P if c >= 0 else 0 for c in row] for row in held]

"""Gathered page recall, eager reference (IceCache Sec. 4.3, "bulk loading"; FreeKV's recall).

The pages a step selects are scattered over the host tier (IceCache's semantic pages are not even
in token order). Copying them one by one to the device would be many small transfers; instead
they are first gathered into one contiguous staging buffer, which then crosses to the device in
one copy and is scattered into its slots there (kernels/page_layout):

    src   (M, *block)   the host tier viewed as M page blocks (e.g. (pages * Hkv, 2, P, D) HND:
                        one block is one page of one KV head, keys then values, contiguous)
    rows  (n,) int      the blocks to recall, in staging order (distinct or not)
    out   (>= n, *block) the staging buffer; out[:n] is written
    -> out[:n]
"""
from __future__ import annotations

import torch


def page_gather(src, rows, out):
    n = rows.numel()
    return torch.index_select(src, 0, rows.long(), out=out[:n])

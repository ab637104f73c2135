"""The levels a DCI forest's points are promoted to, and its random projection directions: both
drawn when a forest is made (tree.DCIForest's `promoted`, policy.py), read by its build and insert.

Mao, Wang, Ester, Li, "IceCache: Memory-Efficient KV-Cache Management for Long-Sequence LLMs",
ICLR 2026 submission, arXiv:2604.10539, https://arxiv.org/abs/2604.10539 (Alg. 1 lines 29-33,
Alg. 2, App. B.1).

Decisions (docs/design.md, "icecache" and "The paper as a preset"):
  * promotion=counter (the default, the authors' M-DCI code): a deterministic counter in
    insertion order, point t reaches level 2 when t + 1 is a multiple of 100 (ratio 0.01), each
    higher level every 5th (0.2); one level per point (level_of, levels_of);
  * promotion=random (icecache:paper): "while Random(0, 1) < r", drawn ahead for every point of
    a layer's tree from one stream per layer (promotion_stream, promotion_levels); the draws of
    point t do not depend on when it is inserted;
  * one random unit vector u in R^{D+1} for every layer and head (m = L = 1, the default); the
    m L of pdci.PDCIForest's indices are drawn from the same generator, the first being u.
"""
from __future__ import annotations

import random

import torch

FIRST_PROMOTION = 100  # a point in 100 reaches level 2 (the authors' ratio_1 = 0.01)
NEXT_PROMOTION = 5  # a level-l point in 5 reaches level l + 1 (ratio_2 = 0.2)


def level_of(t: int, first: int = FIRST_PROMOTION, nxt: int = NEXT_PROMOTION) -> int:
    """Level of the t-th point (0-based, insertion order) under the deterministic promotion counter."""
    n = t + 1
    if n % first:
        return 1
    level, n = 2, n // first
    while n % nxt == 0:
        level, n = level + 1, n // nxt
    return level


def levels_of(t: torch.Tensor, first: int = FIRST_PROMOTION, nxt: int = NEXT_PROMOTION) -> torch.Tensor:
    """level_of for a tensor of point indices t (int64) at once."""
    n = t + 1
    level = torch.ones_like(n)
    up = n % first == 0
    n = n // first
    while bool(up.any()):  # one pass per level: at most log_nxt(n / first) + 1 of them
        level += up
        n, up = n // nxt, up & (n % nxt == 0)
    return level


def promotion_stream(seed: int, layer: int) -> random.Random:
    """The Random(0, 1) of the paper's promotion for the tree of `layer` (its KV heads share it):
    Python's Mersenne Twister seeded with the string "icecache/<seed>/<layer>"."""
    return random.Random(f"icecache/{seed}/{layer}")


def promotion_levels(n: int, r: float, stream: random.Random) -> torch.Tensor:
    """The paper's random promotion (Alg. 1 lines 29-33, Alg. 2) for points 0..n-1 in insertion
    order, each taking its draws from `stream` after the points before it -> levels (n,) int64."""
    levels = []
    for _ in range(n):
        level = 1  # start at the bottom level
        while stream.random() < r:  # while Random(0, 1) < r: promote to the next higher level
            level += 1
        levels.append(level)
    return torch.tensor(levels, dtype=torch.int64)


def random_direction(head_dim: int, seed: int = 0) -> torch.Tensor:
    """The one projection vector u (D + 1,), unit norm, float32 (shared by all layers and heads)."""
    return random_directions(head_dim, 1, seed)[0]


def random_directions(head_dim: int, n: int, seed: int = 0) -> torch.Tensor:
    """n projection vectors (n, D + 1), each of unit norm, float32: randn(D + 1) in float64 drawn
    n times in turn from one generator seeded with `seed`, each normalised (the first is
    random_direction's; one draw per vector, as torch draws a long tensor otherwise)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.stack([torch.randn(head_dim + 1, generator=g, dtype=torch.float64) for _ in range(n)])
    return (u / u.norm(dim=1, keepdim=True)).float()

"""Inputs and comparisons of the selection operations: attention_topk, page_scores, dci_scores
(draw_<op>, build_<op>, compare_<op>, as in attention.py), and the keys page_scores' 2-bit codes
stand for (unpack_codes).

A selection is compared as the reference orders it (descending score, ties to the lower index):
exactly where the inputs make every score exact (integer data, duplicated pages or keys: real
ties), and elsewhere up to swaps of near-equal scores, whose order float rounding may decide.
"""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from .tolerances import assert_close, random_tensor

NEG_INF = float("-inf")


def assert_same_selection(index, want_index, want_scores, tol, name="index"):
    """Equal lists, except that entries whose reference scores differ by at most tol (relative,
    above 1) may swap places: index, want_index (..., k) int64 (-1 padded), want_scores (..., N)."""
    index, want_index, want_scores = index.cpu(), want_index.cpu(), want_scores.cpu().double()
    assert index.shape == want_index.shape, f"{name}: shape {tuple(index.shape)} != {tuple(want_index.shape)}"
    assert index.dtype == torch.int64, f"{name}: dtype {index.dtype}, want int64"
    rows = index.reshape(-1, index.shape[-1]).tolist()
    for r, (got, want) in enumerate(zip(rows, want_index.reshape(-1, index.shape[-1]).tolist())):
        scores = want_scores.reshape(-1, want_scores.shape[-1])[r]
        where = f"{name} row {r}: {got} != {want}"
        assert got.count(-1) == want.count(-1), where
        for x, y in zip(got, want):
            if x != y:
                assert x >= 0 and y >= 0 and x < len(scores), where
                gap = abs(float(scores[x]) - float(scores[y]))
                assert gap <= tol * max(1.0, abs(float(scores[y]))), f"{where} (score gap {gap:g})"


def compare_scores_index(got, want, tol, atol, rtol, exact=False):
    """(scores, index) against the reference's: -inf at the same places, finite scores close,
    the selection the same (exactly, or up to near-ties)."""
    assert isinstance(got, tuple) and len(got) == 2, f"want (scores, index), got {type(got).__name__}"
    (scores, index), (want_scores, want_index) = got, want
    assert scores.shape == want_scores.shape, f"scores: shape {tuple(scores.shape)} != {tuple(want_scores.shape)}"
    finite = want_scores > NEG_INF
    assert torch.equal((scores > NEG_INF).cpu(), finite.cpu()), "scores: -inf at other places than the reference's"
    assert_close(scores[finite], want_scores[finite], torch.float32, atol=atol, rtol=rtol, name="scores")
    if exact:
        assert torch.equal(index.cpu(), want_index.cpu()), f"index {index.tolist()} != reference {want_index.tolist()}"
    assert_same_selection(index, want_index, want_scores, tol)


# -- attention_topk: SyncKV's group-max-pooled attention and its top k -----------------------------


@st.composite
def draw_attention_topk(draw, dtypes):
    B, Hkv, L_cap = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 150))
    return dict(B=B, Hkv=Hkv, group=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 24, 64])), L_cap=L_cap,
                n_valid=draw(st.lists(st.integers(0, L_cap), min_size=B, max_size=B)),
                k_top=draw(st.integers(1, 40)), keep=draw(st.booleans()), dup=draw(st.booleans()),
                scale=draw(st.none() | st.sampled_from([0.1, 0.3])),
                dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)))


def build_attention_topk(p, device):
    """q strided, keys with NaN past n_valid (and copies of earlier keys when `dup`: exact ties),
    lse of each query head over all L_cap + 5 tokens (as SyncKV passes its attention's lse)."""
    from ..kernels.decode_attention import reference as decode

    B, Hkv, G, D, L, dtype, seed = p["B"], p["Hkv"], p["group"], p["D"], p["L_cap"], p["dtype"], p["seed"]
    q = random_tensor((B, Hkv * G, 2, D), dtype, seed, device)[:, :, 0]
    k_all = random_tensor((B, Hkv, L + 5, D), dtype, seed + 1, device)
    if p["dup"] and L > 3:
        k_all[:, :, L // 2:L] = k_all[:, :, :L - L // 2].clone()
    _, lse = decode.decode_attention(q, k_all, k_all, torch.full((B,), L + 5, device=device), p["scale"], None, True)
    k = k_all[:, :, :L].clone()
    for b, n in enumerate(p["n_valid"]):
        k[b, :, n:] = float("nan")
    g = torch.Generator().manual_seed(seed)
    keep = (torch.rand(B, Hkv, L, generator=g) > 0.3).to(device) if p["keep"] else None
    return q, k, lse, torch.tensor(p["n_valid"], device=device), keep, p["k_top"], p["scale"]


def compare_attention_topk(got, want, p, got_args=None, want_args=None):
    compare_scores_index(got, want, tol=1e-6, atol=1e-6, rtol=1e-4)


# -- page_scores: Quest page bounds (or 2-bit codes), GQA group reduction, top k per KV head -------


def unpack_codes(codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """The keys page_scores' 2-bit codes stand for (pack_codes' inverse, an oracle of the tests):
    codes (..., P, ceil(D / 4)), lo, hi (..., D) -> k^ (..., P, D) float32, channel d from bits
    2 (d % 4) of byte d // 4, k^ = lo + c (hi - lo) / 3."""
    D = lo.shape[-1]
    d = torch.arange(D, device=codes.device)
    c = (codes[..., d // 4] >> (2 * (d % 4)).to(torch.uint8)) & 3  # (..., P, D)
    lo, hi = lo.float().unsqueeze(-2), hi.float().unsqueeze(-2)
    return lo + c.float() * (hi - lo) / 3


@st.composite
def draw_page_scores(draw, dtypes):
    """Boxes: small odd page counts and ~250 pages (an 8k context in 32-token pages); integer data
    (every score exact, so ties are real, `dup` forcing them) or normal. Codes: small shapes
    (the kernel loops over page tokens and channels)."""
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    codes = draw(st.booleans())
    if codes:
        N, P, D = draw(st.integers(1, 12)), draw(st.integers(1, 4)), draw(st.sampled_from([3, 4, 8, 12]))
    else:
        N, P, D = draw(st.integers(1, 40) | st.integers(200, 260)), 0, draw(st.sampled_from([4, 8, 12, 64]))
    return dict(B=B, Hkv=Hkv, G=G, N=N, P=P, D=D, codes=codes, n_valid=draw(st.lists(st.integers(0, N), min_size=B, max_size=B)),
                k=draw(st.integers(1, N)), scale=draw(st.sampled_from([1.0, 0.3, 1 / math.sqrt(D)])),
                reduce=draw(st.sampled_from(["softmax_mean", "mean", "max"])),
                integer=not codes and draw(st.booleans()), dup=draw(st.booleans()),
                dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)))


def build_page_scores(p, device):
    """q strided, boxes lo <= hi (B, Hkv, N, D) with NaN past n_valid, and with `codes` the 2-bit
    codes of P keys per page (the boxes their min/max)."""
    from ..kernels.page_scores.reference import pack_codes

    g = torch.Generator().manual_seed(p["seed"])
    B, Hkv, G, N, D = p["B"], p["Hkv"], p["G"], p["N"], p["D"]
    draw = (lambda *s: torch.randint(-3, 4, s, generator=g).float()) if p["integer"] else \
        (lambda *s: torch.randn(*s, generator=g))
    q = draw(B, Hkv * G, 2, D)[:, :, 1]  # a strided view, as the policy passes q[:, :, 0]
    codes = None
    if p["codes"]:
        keys = draw(B, Hkv, N, p["P"], D)
        lo, hi = keys.amin(3), keys.amax(3)
        codes = pack_codes(keys, lo, hi).to(device)
    else:
        lo = draw(B, Hkv, N, D)
        hi = lo + draw(B, Hkv, N, D).abs()
        if p["dup"] and N > 2:
            lo[:, :, N // 2:] = lo[:, :, :N - N // 2].clone()
            hi[:, :, N // 2:] = hi[:, :, :N - N // 2].clone()
    for b, n in enumerate(p["n_valid"]):
        lo[b, :, n:] = float("nan")
        hi[b, :, n:] = float("nan")
    q = q.to(device=device, dtype=p["dtype"])
    return (q, lo.to(device), hi.to(device), torch.tensor(p["n_valid"], device=device), p["k"], p["scale"],
            p["reduce"], codes)


def compare_page_scores(got, want, p, got_args=None, want_args=None):
    # integer boxes: every page logit is exact in both, and so are the group's mean and max of
    # them, so the indices must match exactly, ties included. Not under softmax_mean: two pages
    # whose logits are the same numbers on different heads tie mathematically, but the mean of
    # their softmax values sums in another order and may differ in the last bit, either way;
    # there the selection may differ only between scores within tol
    exact = p["integer"] and p["reduce"] != "softmax_mean"
    compare_scores_index(got, want, tol=1e-5, atol=None, rtol=None, exact=exact)


# -- dci_scores: exact q . k over a block's shared candidates, top k per query ---------------------


@st.composite
def draw_dci_scores(draw, dtypes):
    B, G, H, N = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.integers(1, 3)), draw(st.integers(1, 40))
    C = draw(st.integers(1, 37))
    return dict(B=B, G=G, H=H, N=N, C=C, D=draw(st.sampled_from([8, 24, 60, 64])), k=draw(st.integers(0, C)),  # 0: scores only
                dtype=draw(st.sampled_from(dtypes)), ties=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def build_dci_scores(p, device):
    """keys (H, N, D) (ties: few distinct keys, so equal scores), q (B, G, D), a KV head per
    block, ragged candidate lists padded with -1 at the end, a mask; NaN in every key that no
    block of its head lists."""
    B, G, H, N, C, D = (p[x] for x in ("B", "G", "H", "N", "C", "D"))
    g = torch.Generator().manual_seed(p["seed"])
    keys = random_tensor((H, N, D), p["dtype"], p["seed"], device)
    if p["ties"]:
        keys = keys[:, torch.randint(0, min(3, N), (N,), generator=g).to(device)].contiguous()
    q = random_tensor((B, G, D), p["dtype"], p["seed"] + 1, device)
    heads = torch.randint(0, H, (B,), generator=g)
    cand = torch.randint(0, N, (B, C), generator=g)
    counts = torch.randint(0, C + 1, (B,), generator=g)
    cand[torch.arange(C)[None] >= counts[:, None]] = -1  # ragged blocks, padded at the end
    mask = torch.rand(B, G, C, generator=g) < 0.7
    listed = torch.zeros(H, N, dtype=torch.bool)
    for b in range(B):
        listed[heads[b], cand[b][cand[b] >= 0]] = True
    keys[~listed.to(device)] = float("nan")
    return q, keys, heads.to(device), cand.to(device), mask.to(device), p["k"]


def compare_dci_scores(got, want, p, got_args=None, want_args=None):
    """-inf exactly where the reference has it; scores close; the picks exactly a stable
    descending order of the kernel's own scores, carrying the reference's picked scores."""
    from ..kernels.dci_scores.reference import ranked

    assert isinstance(got, tuple) and len(got) == 2, f"want (scores, best), got {type(got).__name__}"
    (scores, best), (want_scores, want_best) = got, want
    scored = want_scores > NEG_INF
    assert scores.shape == want_scores.shape, f"scores: shape {tuple(scores.shape)} != {tuple(want_scores.shape)}"
    assert torch.equal((scores == NEG_INF).cpu(), (~scored).cpu()), "scores: -inf at other places than the reference's"
    assert_close(scores[scored], want_scores[scored], torch.float32, atol=1e-4, rtol=1e-4, name="scores")
    assert best.shape == want_best.shape, f"best: shape {tuple(best.shape)} != {tuple(want_best.shape)}"
    expected = ranked(scores.cpu().float(), p["k"])
    assert torch.equal(best.cpu(), expected), f"best {best.tolist()} is not its scores' stable order {expected.tolist()}"
    picked = want_best >= 0
    assert torch.equal((best >= 0).cpu(), picked.cpu()), "best: -1 at other places than the reference's"
    assert_close(scores.gather(2, best.clamp_min(0))[picked], want_scores.gather(2, want_best.clamp_min(0))[picked],
                 torch.float32, atol=1e-4, rtol=1e-4, name="picked scores")

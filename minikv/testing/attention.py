"""Inputs and comparisons of the attention operations: decode_attention, gathered_attention,
paged_attention, attention_relevance.

Each operation has `draw_<op>(draw, dtypes) -> params` (what hypothesis draws: shapes, lengths,
dtype, seed, the scalar arguments), `build_<op>(p, device) -> args` (the reference's positional
arguments, built afresh from the params: the same values on every device and every call) and
`compare_<op>(got, want, p, got_args, want_args)` (the kernel's result against the reference's,
with the operation's tolerance; the arguments after each call, for the operations that write
into them). Every slot a correct kernel must not read holds NaN: past a row's length, before its
window, unlisted slots, pool tokens no table entry covers.

Scores: q and k are standard normal, so that the scaled scores q.k * scale spread by about 1 at the
default scale; `loud` draws multiply q so that they spread by LOUD (|s| past 100 in a long row): a
row's sum of exp(s) then leaves float32's range (past EXP_RANGE), which a kernel survives only by
subtracting the row's largest score first. An output that is not finite there is reported as that
overflow, not as a poisoned read. A loud score carries LOUD times a quiet one's float32 rounding,
which softmax passes on to the output: float32 results of loud draws are held to LOUD times the
float32 tolerances (`loosened`); 16-bit ones to their dtype's, which is wider still.
"""
from __future__ import annotations

import math

import torch
from hypothesis import strategies as st

from .tolerances import REL_RMS, TOLERANCES, assert_close, random_tensor

SCALES = st.none() | st.sampled_from([0.1, 0.3, 1.0])  # None: the default, 1/sqrt(D)
LOUD = 50.0  # the spread of a loud draw's scaled scores
EXP_RANGE = math.log(torch.finfo(torch.float32).max)  # 88.72: exp(s) is inf in float32 past it


def gain(p, D) -> float:
    """What q is multiplied by: 1, or (loud) LOUD over the spread of q.k * scale, sqrt(D) * scale."""
    scale = p["scale"] if p["scale"] is not None else 1 / math.sqrt(D)
    return LOUD / (math.sqrt(D) * scale) if p.get("loud") else 1.0


def loosened(p, dtype) -> dict:
    """assert_close's atol, rtol and rel_rms for a result in `dtype`: its own, or for a float32
    result of a loud draw LOUD times them (the module docstring)."""
    atol, rtol = TOLERANCES[dtype]
    k = LOUD if p.get("loud") and dtype == torch.float32 else 1.0
    return dict(atol=atol * k, rtol=rtol * k, rel_rms=REL_RMS[dtype] * k)


def query(p, device, Hq, D):
    """q (B, Hq, D): contiguous, or (strided_q) q[:, :, 0] of a (B, Hq, T, D) projection, as the
    policies pass it; times gain(p, D)."""
    shape = (p["B"], Hq, 3, D) if p.get("strided_q") else (p["B"], Hq, D)
    q = (random_tensor(shape, torch.float32, p["seed"], device) * gain(p, D)).to(p["dtype"])
    return q[:, :, 0] if p.get("strided_q") else q


def check_overflow(out, lse, name="out"):
    """out (B, Hq, D) against the reference's lse (B, Hq): elements that are not finite, in a row
    whose sum of exp(s) leaves float32's range, are an overflow, and said so."""
    bad = ~out.cpu().isfinite()
    rows = bad.any(-1)  # (B, Hq)
    if rows.any():
        peak = lse.cpu()[rows].abs().max().item()
        assert peak <= EXP_RANGE, (
            f"{name}: {int(bad.sum())} elements not finite, in rows whose log-sum-exp of the scores reaches "
            f"{peak:.1f}: an overflow (exp(s) summed leaves float32's range past {EXP_RANGE:.1f}; subtract "
            f"each row's largest score before exp)")


def split(result, with_lse: bool, name: str):
    """(out, lse or None) of an attention result, which must be a pair exactly when with_lse."""
    if with_lse:
        assert isinstance(result, tuple) and len(result) == 2, f"{name}: with return_lse, want (out, lse), got {type(result).__name__}"
        return result
    assert isinstance(result, torch.Tensor), f"{name}: without return_lse, want a tensor, got {type(result).__name__}"
    return result, None


def compare_out_lse(got, want, p, got_args=None, want_args=None, lse_dtype=torch.float32, lse_atol=1e-4, lse_rtol=1e-5,
                    reference=None):
    """reference: the operation's reference, whose args end with return_lse: the lse that tells an
    overflow (check_overflow) when the result has none."""
    with_lse = isinstance(want, tuple)
    out, lse = split(got, with_lse, "result")
    want_out, want_lse = split(want, with_lse, "reference")
    assert out.dtype == want_out.dtype, f"out: dtype {out.dtype}, the query's is {want_out.dtype}"
    if reference is not None and not out.isfinite().all():
        check_overflow(out, want_lse if with_lse else reference(*want_args[:-1], True)[1])
    assert_close(out, want_out, name="out", **loosened(p, want_out.dtype))
    if with_lse:
        k = LOUD if p.get("loud") else 1.0  # the lse carries the scores' rounding
        assert_close(lse, want_lse, lse_dtype, atol=lse_atol and lse_atol * k, rtol=lse_rtol and lse_rtol * k,
                     name="lse", rel_rms=None if lse_rtol is None else lse_rtol * k)


# -- decode_attention: q over k, v (B, Hkv, L_cap, D), slots [0, lengths[b]), the last `window` ---


@st.composite
def draw_decode_attention(draw, dtypes):
    B = draw(st.integers(1, 3))
    # 512: a long row, where P.V summed in a 16-bit dtype drifts well past its rounding
    lengths = draw(st.lists(st.sampled_from([1, 2, 17, 63, 64, 65, 111, 512]) | st.integers(1, 130), min_size=B,
                            max_size=B))
    return dict(B=B, Hkv=draw(st.integers(1, 3)), group=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 32, 60, 64])),
                lengths=lengths, L_cap=max(lengths) + draw(st.integers(0, 40)),  # capacity beyond the longest row
                window=draw(st.none() | st.integers(1, 80)), scale=draw(SCALES), return_lse=draw(st.booleans()),
                dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)), strided_q=draw(st.booleans()),
                loud=draw(st.booleans()))


def build_decode_attention(p, device):
    """q (B, Hq, D), k, v (B, Hkv, L_cap, D) with NaN outside [length - window, length)."""
    B, Hkv, D, L, dtype, seed = p["B"], p["Hkv"], p["D"], p["L_cap"], p["dtype"], p["seed"]
    q = query(p, device, Hkv * p["group"], D)
    k = random_tensor((B, Hkv, L, D), dtype, seed + 1, device)
    v = random_tensor((B, Hkv, L, D), dtype, seed + 2, device)
    for b, n in enumerate(p["lengths"]):
        first = max(0, n - p["window"]) if p["window"] is not None else 0
        for t in (k, v):
            t[b, :, n:] = float("nan")
            t[b, :, :first] = float("nan")
    lengths = torch.tensor(p["lengths"], device=device)
    return q, k, v, lengths, p["scale"], p["window"], p["return_lse"]


def compare_decode_attention(got, want, p, got_args=None, want_args=None):
    from ..kernels.decode_attention.reference import decode_attention

    compare_out_lse(got, want, p, got_args, want_args, reference=decode_attention)


# -- gathered_attention: each KV head reads its own list of slots, -1 padded ----------------------


@st.composite
def draw_gathered_attention(draw, dtypes):
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 3))
    L_cap = draw(st.sampled_from([1, 17, 63, 100]) | st.integers(1, 130))
    N = draw(st.integers(1, min(L_cap, 70) + 5))
    # per (row, KV head): how many entries are listed (>= 1, <= N and <= L_cap), the rest -1
    listed = draw(st.lists(st.integers(1, min(N, L_cap)), min_size=B * Hkv, max_size=B * Hkv))
    return dict(B=B, Hkv=Hkv, group=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 20, 60, 64])),
                L_cap=L_cap, N=N, listed=listed, shuffle_pad=draw(st.booleans()), scale=draw(SCALES),
                return_lse=draw(st.booleans()), dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)),
                strided_q=True, loud=draw(st.booleans()))


def build_gathered_attention(p, device):
    """q strided; k, v (B, Hkv, L_cap, D) with NaN in every unlisted slot; index (B, Hkv, N) of
    distinct slots in random order, -1 padded (at the end, or scattered in between)."""
    B, Hkv, D, L, N, dtype, seed = p["B"], p["Hkv"], p["D"], p["L_cap"], p["N"], p["dtype"], p["seed"]
    g = torch.Generator().manual_seed(seed)
    q = query(p, device, Hkv * p["group"], D)
    k = random_tensor((B, Hkv, L, D), dtype, seed + 1, device)
    v = random_tensor((B, Hkv, L, D), dtype, seed + 2, device)
    index = torch.full((B, Hkv, N), -1, dtype=torch.int64)
    for r, n in enumerate(p["listed"]):
        b, m = divmod(r, Hkv)
        slots = torch.randperm(L, generator=g)[:n]
        row = torch.cat((slots, torch.full((N - n,), -1)))
        if p["shuffle_pad"]:
            row = row[torch.randperm(N, generator=g)]
        index[b, m] = row
        hidden = torch.ones(L, dtype=torch.bool)
        hidden[slots] = False
        k[b, m, hidden.to(device)] = float("nan")
        v[b, m, hidden.to(device)] = float("nan")
    return q, k, v, index.to(device), p["scale"], p["return_lse"]


def compare_gathered_attention(got, want, p, got_args=None, want_args=None):
    from ..kernels.gathered_attention.reference import gathered_attention

    compare_out_lse(got, want, p, got_args, want_args, reference=gathered_attention)


# -- paged_attention: a pool (S, P, Hkv, D) read through a per-KV-head page table ------------------


@st.composite
def draw_paged_attention(draw, dtypes):
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    P = draw(st.sampled_from([3, 4, 16, 32]))
    S, N = draw(st.integers(1, 7)), draw(st.integers(1, 5))
    tokens = draw(st.lists(st.integers(1, N * P), min_size=B * Hkv, max_size=B * Hkv))  # odd totals
    return dict(B=B, Hkv=Hkv, G=G, P=P, S=S, N=N, tokens=tokens, D=draw(st.sampled_from([16, 24, 60, 64])),
                scale=draw(SCALES), return_lse=draw(st.booleans()), dtype=draw(st.sampled_from(dtypes)),
                strided=draw(st.booleans()), holes=draw(st.booleans()), seed=draw(st.integers(0, 2**16)),
                loud=draw(st.booleans()))


def build_paged_attention(p, device):
    """q, a pool k_pages, v_pages (S, P, Hkv, D) (strided: views with gaps), page_table and
    page_lens (B, Hkv, N) int32: each KV head's tokens over full pages, the last one partial,
    (holes) unused entries between used ones; NaN in every pool token no entry reads."""
    B, Hkv, G, P, S, N, D = (p[x] for x in ("B", "Hkv", "G", "P", "S", "N", "D"))
    dtype, seed = p["dtype"], p["seed"]
    g = torch.Generator().manual_seed(seed)
    q = query(p, device, Hkv * G, D)
    if p["strided"]:  # a pool viewed out of a wider buffer: non-contiguous slot and token strides
        k_pages = random_tensor((S, P, Hkv + 1, D), dtype, seed + 1, device)[:, :, 1:]
        v_pages = random_tensor((S + 2, P, Hkv, D), dtype, seed + 2, device)[1:S + 1]
    else:
        k_pages = random_tensor((S, P, Hkv, D), dtype, seed + 1, device)
        v_pages = random_tensor((S, P, Hkv, D), dtype, seed + 2, device)
    table = torch.randint(0, S, (B, Hkv, N), generator=g, dtype=torch.int32)
    lens = torch.zeros(B, Hkv, N, dtype=torch.int32)
    for i, n in enumerate(p["tokens"]):
        b, m = divmod(i, Hkv)
        full, rest = divmod(n, P)
        lens[b, m, :full] = P
        if rest:
            lens[b, m, full] = rest
        if p["holes"]:  # the same lengths in a shuffled order
            lens[b, m] = lens[b, m, torch.randperm(N, generator=g)]
    read = torch.zeros(S, P, Hkv, dtype=torch.bool)
    for b in range(B):
        for m in range(Hkv):
            for j in range(N):
                read[table[b, m, j], :lens[b, m, j], m] = True
    k_pages[~read.to(device)] = float("nan")
    v_pages[~read.to(device)] = float("nan")
    return q, k_pages, v_pages, table.to(device), lens.to(device), p["scale"], p["return_lse"]


def compare_paged_attention(got, want, p, got_args=None, want_args=None):
    # the kernel's lse is held to the cache dtype's tolerance (it sums P-token pages in their dtype)
    from ..kernels.paged_attention.reference import paged_attention

    compare_out_lse(got, want, p, got_args, want_args, lse_dtype=p["dtype"], lse_atol=None, lse_rtol=None,
                    reference=paged_attention)


# -- attention_relevance: decode attention and Eq. 2's s_j = mean_h |q_h . k_j| ------------------


@st.composite
def draw_attention_relevance(draw, dtypes):
    B = draw(st.integers(1, 2))
    lengths = draw(st.lists(st.sampled_from([1, 2, 17, 31, 33, 63]) | st.integers(1, 70), min_size=B, max_size=B))
    return dict(B=B, Hkv=draw(st.integers(1, 3)), group=draw(st.integers(1, 4)), D=draw(st.sampled_from([16, 32, 60, 64])),
                lengths=lengths, L_cap=max(lengths) + draw(st.integers(0, 40)), all_slots=draw(st.booleans()),
                scale=draw(SCALES), dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)),
                strided_q=draw(st.booleans()), loud=draw(st.booleans()))


def build_attention_relevance(p, device):
    """q, k, v with NaN in every slot >= length, lengths (B,); all_slots: lengths None over k, v
    sliced to the shortest row (every slot of every row is read)."""
    B, Hkv, D, L, dtype, seed = p["B"], p["Hkv"], p["D"], p["L_cap"], p["dtype"], p["seed"]
    q = query(p, device, Hkv * p["group"], D)
    k = random_tensor((B, Hkv, L, D), dtype, seed + 1, device)
    v = random_tensor((B, Hkv, L, D), dtype, seed + 2, device)
    if p["all_slots"]:
        n = min(p["lengths"])
        return q, k[:, :, :n], v[:, :, :n], None, p["scale"]
    for b, n in enumerate(p["lengths"]):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    return q, k, v, torch.tensor(p["lengths"], device=device), p["scale"]


def compare_attention_relevance(got, want, p, got_args=None, want_args=None):
    assert isinstance(got, tuple) and len(got) == 2, f"want (out, s), got {type(got).__name__}"
    (out, s), (want_out, want_s) = got, want
    assert out.dtype == want_out.dtype, f"out: dtype {out.dtype}, the query's is {want_out.dtype}"
    if not out.isfinite().all():  # the lse of the same attention tells an overflow
        from ..kernels.decode_attention.reference import decode_attention

        q, k, v, lengths, scale = want_args
        lengths = lengths if lengths is not None else torch.full((q.shape[0],), k.shape[2], device=q.device)
        check_overflow(out, decode_attention(q, k, v, lengths, scale, None, True)[1])
    assert_close(out, want_out, name="out", **loosened(p, want_out.dtype))
    # s: float32 sums of the same products (exact for 16-bit inputs) in another order
    assert s.dtype == torch.float32, f"s: dtype {s.dtype}, want float32"
    k = LOUD if p.get("loud") else 1.0
    assert_close(s, want_s, torch.float32, atol=1e-4 * k, rtol=1e-5 * k, name="s")

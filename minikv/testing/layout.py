"""Inputs and comparisons of the operations that move or rotate KV: page_gather, page_layout,
rope_delta (draw_<op>, build_<op>, compare_<op>, as in attention.py). These write into their
arguments, so the comparisons read the arguments after the call too: what a kernel must write,
and what it must leave alone (NaN-filled, so that a stray write or a missed one shows).
"""
from __future__ import annotations

import torch
from hypothesis import strategies as st

from .tolerances import assert_close, random_tensor


def same_bits(a, b, name):
    """Equal element for element, NaN equal to NaN (a copy must move bits, not values)."""
    a, b = a.cpu(), b.cpu()
    assert a.shape == b.shape and a.dtype == b.dtype, f"{name}: {tuple(a.shape)} {a.dtype} != {tuple(b.shape)} {b.dtype}"
    differ = ~((a == b) | (a.isnan() & b.isnan()))
    assert not differ.any(), f"{name}: {int(differ.sum())} of {a.numel()} elements differ from the reference's"


# -- page_gather: src[rows[i]] into out[i], the front of a staging buffer ---------------------------


@st.composite
def draw_page_gather(draw, dtypes):
    return dict(M=draw(st.integers(1, 12)), n=draw(st.integers(0, 9)), P=draw(st.sampled_from([1, 3, 16])),
                D=draw(st.sampled_from([4, 24, 64])), spare=draw(st.integers(0, 3)),
                dtype=draw(st.sampled_from(dtypes)), seed=draw(st.integers(0, 2**16)))


def build_page_gather(p, device):
    """src (M, 2, P, D) host pages as (pages * Hkv, 2, P, D), rows (n,) with repeats, out a
    NaN-filled staging buffer of n + spare blocks."""
    M, n, P, D, dtype = p["M"], p["n"], p["P"], p["D"], p["dtype"]
    src = random_tensor((M, 2, P, D), dtype, p["seed"], device)
    rows = torch.randint(0, M, (n,), generator=torch.Generator().manual_seed(p["seed"])).to(device)
    out = torch.full((n + p["spare"], 2, P, D), float("nan"), dtype=dtype, device=device)
    return src, rows, out


def compare_page_gather(got, want, p, got_args, want_args):
    n, out = p["n"], got_args[2]
    assert isinstance(got, torch.Tensor) and got.shape[0] == n, "want out[:n] back"
    assert n == 0 or got.data_ptr() == out.data_ptr(), "the result must be out[:n], written in place"
    same_bits(out, want_args[2], "out")  # exactly the listed blocks, in order, and nothing past them


# -- page_layout (hnd_to_nhd): HND blocks into (slot, KV head) of an NHD pool -------------------------


@st.composite
def draw_page_layout(draw, dtypes):
    S, Hkv = draw(st.integers(1, 6)), draw(st.integers(1, 3))
    pairs = draw(st.lists(st.tuples(st.integers(0, S - 1), st.integers(0, Hkv - 1)), unique=True, max_size=S * Hkv))
    return dict(S=S, Hkv=Hkv, P=draw(st.sampled_from([3, 4, 32])), D=draw(st.sampled_from([8, 60, 64])),
                pairs=pairs, dtype=draw(st.sampled_from(dtypes)), strided=draw(st.booleans()),
                seed=draw(st.integers(0, 2**16)))


def build_page_layout(p, device):
    """blocks (n, 2, P, D), NaN-filled pools k_pages (strided: a wider head stride), v_pages
    (S, P, Hkv, D), distinct (slot, head) pairs: slots int64, heads int32."""
    n, S, P, Hkv, D, dtype = len(p["pairs"]), p["S"], p["P"], p["Hkv"], p["D"], p["dtype"]
    blocks = random_tensor((n, 2, P, D), dtype, p["seed"], device)
    if p["strided"]:
        k = torch.full((S, P, Hkv + 1, D), float("nan"), dtype=dtype, device=device)[:, :, :-1]
    else:
        k = torch.full((S, P, Hkv, D), float("nan"), dtype=dtype, device=device)
    v = torch.full((S, P, Hkv, D), float("nan"), dtype=dtype, device=device)
    slots = torch.tensor([s for s, _ in p["pairs"]], dtype=torch.int64, device=device)
    heads = torch.tensor([h for _, h in p["pairs"]], dtype=torch.int32, device=device)
    return blocks, k, v, slots, heads


def compare_page_layout(got, want, p, got_args, want_args):
    same_bits(got_args[1], want_args[1], "k_pages")
    same_bits(got_args[2], want_args[2], "v_pages")


# -- rope_delta: RoPE-rotated keys moved from position p to p + delta ---------------------------------

# (head_dim D, rotary_dim R): full rotary, partial rotary (Pythia: 25%), and D not a power of 2
HEAD_DIMS = [(16, 16), (64, 64), (64, 16), (60, 60), (100, 24), (128, 64)]


@st.composite
def draw_rope_delta(draw, dtypes):
    D, R = draw(st.sampled_from(HEAD_DIMS))
    T = draw(st.sampled_from([1, 7, 16, 63, 100]))
    kind = draw(st.sampled_from(["per_token", "tensor_scalar", "int"]))
    lo, hi = -5000, 5000  # negative deltas move keys back, as after a prune
    if kind == "per_token":
        delta = draw(st.lists(st.integers(lo, hi), min_size=T, max_size=T))
    else:
        delta = draw(st.integers(lo, hi))
    return dict(B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), T=T, D=D, R=R, kind=kind, delta=delta,
                delta_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                dtype=draw(st.sampled_from(dtypes)), layout=draw(st.sampled_from(["contiguous", "cache_slice", "bthd"])),
                out=draw(st.sampled_from(["new", "inplace", "given"])), seed=draw(st.integers(0, 2**16)))


def rope_x(p, device):
    """x (B, H, T, D): contiguous; a slice along T of a larger cache (as a streaming policy
    rotates its recent block); or (B, T, H, D) transposed (as projections give)."""
    B, H, T, D, dtype, seed = p["B"], p["H"], p["T"], p["D"], p["dtype"], p["seed"]
    if p["layout"] == "cache_slice":
        return random_tensor((B, H, T + 9, D), dtype, seed, device)[:, :, 4:4 + T]
    if p["layout"] == "bthd":
        return random_tensor((B, T, H, D), dtype, seed, device).transpose(1, 2)
    return random_tensor((B, H, T, D), dtype, seed, device)


def build_rope_delta(p, device):
    """x in its layout, delta ((T,) or () tensor on the device, or a python int), inv_freq (R/2,)
    float32 of theta 10000, out None (a new tensor), x itself, or a NaN-filled tensor like x."""
    from ..models.rope import RotaryEmbedding

    x = rope_x(p, device)
    delta = p["delta"] if p["kind"] == "int" else torch.tensor(p["delta"], dtype=p["delta_dtype"], device=device)
    inv_freq = RotaryEmbedding(p["R"], p["R"], 10000.0).inv_freq.to(device)
    out = {"new": None, "inplace": x, "given": torch.full_like(x, float("nan"))}[p["out"]]
    return x, delta, inv_freq, out


def compare_rope_delta(got, want, p, got_args, want_args):
    R, out = p["R"], got_args[3]
    assert isinstance(got, torch.Tensor) and got.dtype == want.dtype, "want a tensor like x"
    assert out is None or got.data_ptr() == out.data_ptr(), "with out given, the result must be out"
    assert_close(got, want, name="x rotated")
    same_bits(got[..., R:], want[..., R:], "channels past the rotary dim")  # copied, never rounded
    assert_close(got_args[0], want_args[0], name="x after the call")  # untouched, or rotated in place

"""freekv's quant2 codes at the shapes the policy runs (page size 32; head dims 64 and 128, four
channels to a byte with none left over), against a transcription that shares nothing with
kernels/page_scores/reference.py: each channel's code is the nearest of the four levels
lo + c (hi - lo) / 3 (found by comparing distances, not by rounding), stored in bits 2 (d % 4)
of byte d // 4, and coded_logits is q . k^ summed in float64 over the decoded keys."""
import pytest
import torch

from minikv.kernels.page_scores.reference import coded_logits, pack_codes
from minikv.testing.selection import unpack_codes


def nearest_levels(keys, lo, hi):
    """(..., P, D) -> (..., P, D) int64: argmin over c of |k - (lo + c (hi - lo) / 3)|."""
    c = torch.arange(4, dtype=torch.float64)
    lo, hi = lo.double()[..., None, :, None], hi.double()[..., None, :, None]
    levels = lo + c * (hi - lo) / 3  # (..., 1, D, 4)
    return (keys.double()[..., None] - levels).abs().argmin(-1)


def decode(codes, D):
    """Codes (..., P, D / 4) uint8 -> (..., P, D) int64, channel d from bits 2 (d % 4) of byte d // 4."""
    out = torch.zeros(*codes.shape[:-1], D, dtype=torch.int64)
    for d in range(D):
        out[..., d] = (codes[..., d // 4].long() >> (2 * (d % 4))) & 3
    return out


@pytest.mark.parametrize("D", [64, 128])
def test_codes_at_page_size_32(D):
    g = torch.Generator().manual_seed(D)
    B, Hkv, G, N, P = 1, 2, 3, 5, 32
    keys = torch.randn(B, Hkv, N, P, D, generator=g)
    lo, hi = keys.amin(3), keys.amax(3)
    codes = pack_codes(keys, lo, hi)
    assert codes.shape == (B, Hkv, N, P, D // 4) and codes.dtype == torch.uint8
    expect = nearest_levels(keys, lo, hi)
    got = decode(codes, D)
    # a key exactly half-way between two levels may go either way; random keys never are
    assert torch.equal(got, expect)
    # every page's min and max channel values are levels 0 and 3 exactly
    assert (got.amin(3) == 0).all() and (got.amax(3) == 3).all()
    khat = lo.double()[..., None, :] + got.double() * (hi.double() - lo.double())[..., None, :] / 3  # (B, Hkv, N, P, D)
    torch.testing.assert_close(unpack_codes(codes, lo, hi).double(), khat, rtol=0, atol=1e-6)
    q = torch.randn(B * Hkv, G, D, generator=g)
    logits = coded_logits(q, lo, hi, codes)  # (B Hkv, G, N, P)
    assert logits.shape == (B * Hkv, G, N, P)
    exact = torch.einsum("bgd,bnpd->bgnp", q.double(), khat.reshape(B * Hkv, N, P, D))
    torch.testing.assert_close(logits.double(), exact, rtol=0, atol=1e-4 * D ** 0.5)

"""rope_delta: delta rotation composes with RoPE, leaves the partial-rotary tail alone, and the
Triton kernel matches the eager reference on odd shapes, dtypes, deltas and strided views
(minikv.testing's strategies("rope_delta"): contiguous, a slice of a cache, (B, T, H, D)
transposed; a new tensor, in place, or into a given one)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels import check_backend, lookup
from minikv.kernels.rope_delta import rope_delta, rope_delta_
from minikv.models.rope import RotaryEmbedding, apply_rotary
from minikv.testing import assert_close, check, random_tensor, strategies

BACKENDS = ["eager", "triton"]


def inv_freq_for(R, device):
    return RotaryEmbedding(R, R, 10000.0).inv_freq.to(device)


@given(case=strategies("rope_delta", dtypes=[torch.float32]), backend=st.sampled_from(BACKENDS))
def test_rope_delta_rotation_composes(device, case, backend):
    """RoPE(k, p) rotated by delta == RoPE(k, p + delta), for positions up to a few thousand.

    Tolerance: every angle is a float32 product position * inv_freq (inv_freq <= 1), rounded with
    relative error <= 2**-24, so each of the three angles involved is off by up to
    |position| * 2**-24 radians, and a rotated pair of norm r moves by at most r times that.
    """
    B, H, T, D, R = (case.params[x] for x in ("B", "H", "T", "D", "R"))
    _, delta, _, _ = case.inputs()
    rope = RotaryEmbedding(D, R, 10000.0)
    g = torch.Generator().manual_seed(case.params["seed"])
    k = torch.randn(B, H, T, D, generator=g).to(device)
    p = torch.randint(0, 4096, (B, T), generator=g).to(device)
    shift = torch.as_tensor(delta, device=device).expand(T)  # (T,)
    p = torch.maximum(p, -shift)  # keep p + delta >= 0: positions are never negative

    moved = rope_delta(rope.apply(k, p), delta, rope.inv_freq.to(device), backend=backend)
    direct = rope.apply(k, p + shift)

    max_angle = (p.abs() + shift.abs() + (p + shift).abs()).max().item()
    pair_norm = (k[..., : R // 2].square() + k[..., R // 2 : R].square()).sqrt().max().item()
    atol = 2 * max_angle * 2**-24 * pair_norm + 1e-5
    # relative to the key, the same bound: every pair moves by at most twice the angle error
    rel_rms = 2 * max_angle * 2**-24 + 1e-5
    assert_close(moved, direct, atol=atol, rtol=1e-5, rel_rms=rel_rms, name="RoPE(k, p) moved by delta")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@given(case=strategies("rope_delta"))
def test_partial_rotary_leaves_tail(case, backend, inplace):
    """Channels >= rotary_dim come out bit-identical, in place or not, in every dtype."""
    x, delta, inv_freq, _ = case.inputs()
    R = case.params["R"]
    before = x.clone()
    if inplace:
        out = rope_delta_(x, delta, inv_freq, backend=backend)
        assert out.data_ptr() == x.data_ptr()
    else:
        out = rope_delta(x, delta, inv_freq, backend=backend)
        assert torch.equal(x, before), "the input must not change"
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(out[..., R:], before[..., R:])


@given(case=strategies("rope_delta"))
def test_rope_delta_kernel_matches_reference(case):
    """Out of place, in place (out=x) and into a given tensor; the tail bit for bit."""
    check(case, lookup("rope_delta", "triton"))


def test_rope_delta_writes_into_cache_slice_only(device):
    """In place on a slice of a preallocated cache: the slots around it are untouched."""
    cache = random_tensor((1, 2, 40, 64), torch.bfloat16, 0, device)
    before = cache.clone()
    inv_freq = inv_freq_for(64, device)
    expected = rope_delta(cache[:, :, 10:30], 7, inv_freq)
    rope_delta_(cache[:, :, 10:30], 7, inv_freq, backend="triton")
    assert torch.equal(cache[:, :, :10], before[:, :, :10]) and torch.equal(cache[:, :, 30:], before[:, :, 30:])
    assert_close(cache[:, :, 10:30], expected)


def test_reference_is_rotary_embedding_at_position_delta(device):
    """The op's reference is models/rope.py's RoPE at position delta (rotations compose)."""
    rope = RotaryEmbedding(64, 32, 10000.0)
    x = random_tensor((2, 3, 7, 64), torch.float32, 1, device)
    delta = torch.tensor([0, 1, -1, 100, -100, 4000, -4000], device=device)
    cos, sin = rope.cos_sin(delta)
    torch.testing.assert_close(rope_delta(x, delta, rope.inv_freq.to(device)), apply_rotary(x, cos.to(device), sin.to(device)),
                               atol=1e-6, rtol=0)


def test_unknown_backend_lists_the_choices(device):
    with pytest.raises(ValueError, match="'eager', 'triton'"):
        check_backend("cuda")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        rope_delta(torch.zeros(1, 1, 1, 4, device=device), 1, inv_freq_for(4, device), backend="Triton")

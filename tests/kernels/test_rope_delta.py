"""rope_delta: delta rotation composes with RoPE, leaves the partial-rotary tail alone, and the
Triton kernel matches the eager reference on odd shapes, dtypes, deltas and strided views."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.kernels import check_backend
from minikv.kernels._testing import DEVICE, assert_close, random_tensor
from minikv.kernels.rope_delta import rope_delta, rope_delta_
from minikv.models.rope import RotaryEmbedding, apply_rotary

BACKENDS = ["eager", "triton"]
# (head_dim D, rotary_dim R): full rotary, partial rotary (Pythia: 25%), and D not a power of 2
HEAD_DIMS = [(16, 16), (64, 64), (64, 16), (60, 60), (100, 24), (128, 64)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@st.composite
def rope_cases(draw, dtypes=DTYPES):
    D, R = draw(st.sampled_from(HEAD_DIMS))
    T = draw(st.sampled_from([1, 7, 16, 63, 100]))
    kind = draw(st.sampled_from(["per_token", "tensor_scalar", "int"]))
    lo, hi = -5000, 5000  # negative deltas move keys back, as after a prune
    if kind == "per_token":
        deltas = draw(st.lists(st.integers(lo, hi), min_size=T, max_size=T))
        delta = torch.tensor(deltas, dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    elif kind == "tensor_scalar":
        delta = torch.tensor(draw(st.integers(lo, hi)))
    else:
        delta = draw(st.integers(lo, hi))
    return dict(
        B=draw(st.integers(1, 2)), H=draw(st.integers(1, 3)), T=T, D=D, R=R, delta=delta,
        dtype=draw(st.sampled_from(dtypes)), layout=draw(st.sampled_from(["contiguous", "cache_slice", "bthd"])),
        seed=draw(st.integers(0, 2**16)),
    )


def make_x(case):
    """x (B, H, T, D) in the requested layout: contiguous; a slice along T of a larger cache (as a
    streaming policy rotates its recent block); or (B, T, H, D) transposed (as projections give)."""
    B, H, T, D, dtype, seed = case["B"], case["H"], case["T"], case["D"], case["dtype"], case["seed"]
    if case["layout"] == "cache_slice":
        cache = random_tensor((B, H, T + 9, D), dtype, seed)
        return cache[:, :, 4 : 4 + T]
    if case["layout"] == "bthd":
        return random_tensor((B, T, H, D), dtype, seed).transpose(1, 2)
    return random_tensor((B, H, T, D), dtype, seed)


def inv_freq_for(R):
    return RotaryEmbedding(R, R, 10000.0).inv_freq


@given(case=rope_cases(dtypes=[torch.float32]), backend=st.sampled_from(BACKENDS))
def test_rope_delta_rotation_composes(case, backend):
    """RoPE(k, p) rotated by delta == RoPE(k, p + delta), for positions up to a few thousand.

    Tolerance: every angle is a float32 product position * inv_freq (inv_freq <= 1), rounded with
    relative error <= 2**-24, so each of the three angles involved is off by up to
    |position| * 2**-24 radians, and a rotated pair of norm r moves by at most r times that.
    """
    B, H, T, D, R = case["B"], case["H"], case["T"], case["D"], case["R"]
    rope = RotaryEmbedding(D, R, 10000.0)
    g = torch.Generator().manual_seed(case["seed"])
    k = torch.randn(B, H, T, D, generator=g).to(DEVICE)
    p = torch.randint(0, 4096, (B, T), generator=g).to(DEVICE)
    delta = torch.as_tensor(case["delta"], device=DEVICE).expand(T)  # (T,)
    p = torch.maximum(p, -delta)  # keep p + delta >= 0: positions are never negative

    moved = rope_delta(rope.apply(k, p), case["delta"], rope.inv_freq, backend=backend)
    direct = rope.apply(k, p + delta)

    max_angle = (p.abs() + delta.abs() + (p + delta).abs()).max().item()
    pair_norm = (k[..., : R // 2].square() + k[..., R // 2 : R].square()).sqrt().max().item()
    atol = 2 * max_angle * 2**-24 * pair_norm + 1e-5
    # relative to the key, the same bound: every pair moves by at most twice the angle error
    rel_rms = 2 * max_angle * 2**-24 + 1e-5
    assert_close(moved, direct, atol=atol, rtol=1e-5, rel_rms=rel_rms, name="RoPE(k, p) moved by delta")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("inplace", [False, True], ids=["copy", "inplace"])
@given(case=rope_cases())
def test_partial_rotary_leaves_tail(case, backend, inplace):
    """Channels >= rotary_dim come out bit-identical, in place or not, in every dtype."""
    R = case["R"]
    x = make_x(case)
    before = x.clone()
    if inplace:
        out = rope_delta_(x, case["delta"], inv_freq_for(R), backend=backend)
        assert out.data_ptr() == x.data_ptr()
    else:
        out = rope_delta(x, case["delta"], inv_freq_for(R), backend=backend)
        assert torch.equal(x, before), "the input must not change"
    assert out.dtype == x.dtype and out.shape == x.shape
    assert torch.equal(out[..., R:], before[..., R:])


@given(case=rope_cases(), inplace=st.booleans())
def test_rope_delta_kernel_matches_reference(case, inplace):
    x = make_x(case)
    inv_freq = inv_freq_for(case["R"])
    expected = rope_delta(x, case["delta"], inv_freq, backend="eager")
    if inplace:
        actual = x.clone()
        rope_delta_(actual, case["delta"], inv_freq, backend="triton")
    else:
        actual = rope_delta(x, case["delta"], inv_freq, backend="triton")
    assert_close(actual, expected, name=f"rope_delta {case['dtype']} D={case['D']} R={case['R']} T={case['T']}")


def test_rope_delta_writes_into_cache_slice_only():
    """In place on a slice of a preallocated cache: the slots around it are untouched."""
    cache = random_tensor((1, 2, 40, 64), torch.bfloat16, 0)
    before = cache.clone()
    inv_freq = inv_freq_for(64)
    expected = rope_delta(cache[:, :, 10:30], 7, inv_freq)
    rope_delta_(cache[:, :, 10:30], 7, inv_freq, backend="triton")
    assert torch.equal(cache[:, :, :10], before[:, :, :10]) and torch.equal(cache[:, :, 30:], before[:, :, 30:])
    assert_close(cache[:, :, 10:30], expected)


def test_reference_is_rotary_embedding_at_position_delta():
    """The op's reference is models/rope.py's RoPE at position delta (rotations compose)."""
    rope = RotaryEmbedding(64, 32, 10000.0)
    x = random_tensor((2, 3, 7, 64), torch.float32, 1)
    delta = torch.tensor([0, 1, -1, 100, -100, 4000, -4000])
    torch.testing.assert_close(rope_delta(x, delta, rope.inv_freq), apply_rotary(x, *rope.cos_sin(delta)), atol=1e-6,
                               rtol=0)


def test_unknown_backend_lists_the_choices():
    with pytest.raises(ValueError, match="'eager', 'triton'"):
        check_backend("cuda")
    with pytest.raises(ValueError, match="unknown kernel backend"):
        rope_delta(torch.zeros(1, 1, 1, 4), 1, inv_freq_for(4), backend="Triton")

"""Pieces the Triton kernels share: base-2 softmax constants, a dot that works in the
interpreter, and the merge of split-K partial attentions by their log-sum-exps; and the one place
where the Triton versions minikv runs on differ (3.6.0 on the GPU machine that is lent, 3.9.0 in
CI, docs/gpu.md): see `TRITON_VERSION` below. (The compile check's API, bench/gpu_compile.py, is
spelled the same in both.)

Imported only by fused.py modules, which `load_fused` imports after choosing the interpreter
(TRITON_INTERPRET must be set before any @triton.jit decoration runs).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import launch as configs

TRITON_VERSION = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:2])


# -- where Triton versions differ ------------------------------------------------------------------


def _interpreter_index_fix() -> None:
    """Triton's interpreter holds a scalar (a loaded length, a program id) as a one-element 1-d
    numpy array and, before 3.8, turns it into a Python int for `range()` with `int(array)`, which
    NumPy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"): every
    kernel whose loop bounds are loaded values (decode_attention's `range(start, end, BLOCK_N)`)
    fails there. 3.8 and 3.9 convert `int(array.squeeze())`; the same here, for older ones."""
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor  # called by _patch_lang for each kernel launch

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(())))

    interpreter._patch_lang_tensor = patched


if TRITON_VERSION < (3, 8):
    _interpreter_index_fix()


# -- what the kernels share --------------------------------------------------------------------------

LOG2E = 1.4426950408889634  # softmaxes run in base 2 (exp2 is the fast one): scale * log2(e)
LN2 = tl.constexpr(0.6931471805599453)  # and back to natural log for the returned lse


@triton.jit
def dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    # Triton's interpreter keeps bfloat16 as raw uint16 and np.matmul's the bit patterns (still
    # so in 3.9): there, multiply in float32 instead. bf16 * bf16 products are exact in float32,
    # so this is the same arithmetic as the tensor-core path, up to summation order.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit(do_not_specialize=["S", "slb", "slh"])  # split counts: no recompile as they change
def _merge_kernel(
    o_part_ptr, lse_part_ptr, out_ptr, lse_ptr,
    S, sob, soh, sos, slb, slh, s_out_b, s_out_h,
    Hq, D: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # program (b, h): out = sum_s exp(lse_s - lse) o_s, lse = log sum_s exp(lse_s)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse_s = tl.load(lse_part_ptr + b * slb + h * slh + s, mask=s < S, other=float("-inf"))  # (BLOCK_S,)
    top = tl.max(lse_s, axis=0)
    w = tl.exp(lse_s - top)  # (BLOCK_S,) weight of each split, 0 for empty ones
    mask = (s < S)[:, None] & (d < D)[None, :]
    o_s = tl.load(o_part_ptr + b * sob + h * soh + s[:, None] * sos + d[None, :], mask=mask, other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * o_s, axis=0) / total  # (BLOCK_D,)
    tl.store(out_ptr + b * s_out_b + h * s_out_h + d, out.to(out_ptr.dtype.element_ty), mask=d < D)
    tl.store(lse_ptr + b * Hq + h, top + tl.log(total))


def merge_splits(o_part: torch.Tensor, lse_part: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """o_part (B, Hq, S, D) float32, lse_part (B, Hq, S) -> out (B, Hq, D), lse (B, Hq) float32."""
    B, Hq, S, D = o_part.shape
    assert lse.shape == (B, Hq) and lse.is_contiguous() and out.shape == (B, Hq, D) and out.stride(2) == 1
    cfg = configs.merge(S, D, configs.target(out.device).arch)
    _merge_kernel[(B, Hq)](
        o_part, lse_part, out, lse,
        S, o_part.stride(0), o_part.stride(1), o_part.stride(2), lse_part.stride(0), lse_part.stride(1),
        out.stride(0), out.stride(1),
        Hq, D=D, **cfg.kwargs(),
    )


MAX_SPLITS = 64  # the merge holds all of a head's partials, (S, D), in registers


def split_len_for(rows: int, n_sm: int, L_cap: int, block_n: int) -> int:
    """Slots per split-K program of a decode kernel whose grid has `rows` programs per split:
    enough splits for ~2 programs per SM, none shorter than 256 slots, at most MAX_SPLITS, and a
    whole number of block_n tiles."""
    splits = max(1, min(triton.cdiv(2 * n_sm, rows), triton.cdiv(L_cap, 256), MAX_SPLITS))
    return triton.cdiv(triton.cdiv(L_cap, splits), block_n) * block_n


def check_dense_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *others: torch.Tensor,
                   block_n: int | None = None) -> tuple[int, int, int, int]:
    """The checks of a launcher whose KV is dense per row: q (B, Hq, D), k and v (B, Hkv, L, D),
    Hq a multiple of Hkv, one float dtype, contiguous head dims, every tensor (others too) on one
    device, CUDA or the interpreter, block_n (if given) a power of 2 >= 16 (tl.dot) -> (B, Hq, Hkv, D)."""
    assert q.dim() == 3 and k.dim() == 4, f"want q (B, Hq, D), k (B, Hkv, L, D); got {tuple(q.shape)}, {tuple(k.shape)}"
    B, Hq, D = q.shape
    Hkv = k.shape[1]
    assert k.shape == v.shape and k.shape[0] == B and k.shape[3] == D, \
        f"k {tuple(k.shape)} and v {tuple(v.shape)} must be (B, Hkv, L, D) for q {tuple(q.shape)}"
    assert Hq % Hkv == 0, f"query heads {Hq} must be a multiple of KV heads {Hkv}"
    assert q.dtype == k.dtype == v.dtype, f"one dtype for q, k, v, got {q.dtype}, {k.dtype}, {v.dtype}"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16), q.dtype
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "the head dim must be contiguous"
    assert all(t.device == q.device for t in (k, v, *others)), "all tensors on one device"
    configs.check_device(configs.target(q.device), q)
    assert block_n is None or (block_n >= 16 and block_n & (block_n - 1) == 0), "block_n: a power of 2 >= 16 (tl.dot)"
    return B, Hq, Hkv, D

"""Launch configurations of the Triton kernels: block sizes, num_warps and num_stages as pure
functions of (shapes, dtype, compute capability), and the target they are chosen for.

Every launcher in kernels/*/fused.py asks one function here for its configuration, so the choice
is made in one place and the ahead-of-time compile check (`python -m minikv.bench gpu-check
--compile-only`, docs/gpu.md) compiles exactly what a launch on that GPU would. The rules:

- Shared memory: a config must fit the architecture's opt-in limit per block (SMEM_LIMIT) in
  float32 as well as in the 16-bit dtypes. A float32 tile takes twice the bytes, and Triton's
  software pipelining keeps `num_stages` copies of every tile a loop loads: float32 configs use
  smaller key blocks and fewer stages.
- Registers: tiles are sized so that the default bf16 decode path compiles without spills at the
  geometries of docs/gpu.md (a tile of R x C float32 spread over 32 * num_warps threads costs
  R * C / (32 * num_warps) registers a thread).
- Recompilation: a constexpr that follows the context length (a page count, a row length) is
  bucketed (`bucket`), so a decode of any length compiles a bounded number of variants; the
  lengths themselves are runtime arguments that the kernels mark do_not_specialize.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import triton

from . import triton_interpreted

# opt-in shared memory per block, bytes (CUDA programming guide, "Compute capabilities")
SMEM_LIMIT = {80: 166_912, 86: 101_376, 87: 166_912, 89: 101_376, 90: 232_448}
SM_COUNT = {80: 108, 90: 132}  # A100 and H100 SXM: the splits the compile check plans for


@dataclass(frozen=True)
class Target:
    """Where kernels run: arch = compute capability major * 10 + minor (0 under the
    interpreter), n_sm its multiprocessor count, interpreted whether Triton's interpreter runs them."""
    arch: int
    n_sm: int
    interpreted: bool


INTERPRETER = Target(arch=0, n_sm=1, interpreted=True)
_override: Target | None = None


def target(device: torch.device) -> Target:
    """The target of a launch on `device` (or the one `compiling_for` sets)."""
    if _override is not None:
        return _override
    if triton_interpreted():
        return INTERPRETER
    return _cuda_target(torch.device(device))


@functools.lru_cache
def _cuda_target(device: torch.device) -> Target:
    props = torch.cuda.get_device_properties(device)
    return Target(props.major * 10 + props.minor, props.multi_processor_count, interpreted=False)


@contextlib.contextmanager
def compiling_for(t: Target):
    """Launchers plan for `t` inside this block (the compile check, which launches nothing)."""
    global _override
    previous, _override = _override, t
    try:
        yield t
    finally:
        _override = previous


def check_device(t: Target, *tensors: torch.Tensor) -> None:
    """Compiled Triton kernels take raw CUDA pointers: refuse any other tensor in one line (a CPU
    pointer would otherwise fail inside Triton, or worse, be read). Meta tensors pass: the compile
    check plans launches with them and launches nothing."""
    if t.interpreted:
        return
    for x in tensors:
        if not (x.is_cuda or x.is_meta):
            raise ValueError(f"backend=triton runs compiled kernels on CUDA, got a tensor on {x.device}: "
                             "move the model and its inputs to the GPU, or use backend=eager")


@dataclass(frozen=True)
class Config:
    blocks: dict  # the kernel's BLOCK_* constexprs
    num_warps: int = 4
    num_stages: int = 2

    def kwargs(self) -> dict:
        return {**self.blocks, "num_warps": self.num_warps, "num_stages": self.num_stages}


def pow2(n: int, least: int = 16) -> int:
    """The power of 2 >= n, at least `least` (tl.dot needs 16 rows and columns)."""
    return max(least, triton.next_power_of_2(n))


def bucket(n: int, lo: int, hi: int) -> int:
    """The smallest lo * 4**i >= n, capped at hi: a length that grows by one token at a time
    crosses a bucket edge log4(hi / lo) times, and so compiles that many variants at most."""
    b = lo
    while b < n and b < hi:
        b *= 4
    return min(b, hi)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def decode_attention(group: int, head_dim: int, dtype: torch.dtype, arch: int) -> Config:
    """Grouped flash-decoding (decode_attention, gathered_attention): a (BLOCK_G, BLOCK_D) query
    tile against BLOCK_N keys. At D >= 128 the (BLOCK_N, BLOCK_D) key tile and the float32
    accumulator outgrow 4 warps' registers: 8 warps. float32: 32-key blocks (64 spilled at D 64
    on sm_90), 16 and one stage at D 256."""
    block_d = pow2(head_dim)
    wide = _itemsize(dtype) * block_d  # bytes of one key row
    block_n = 64 if _itemsize(dtype) == 2 and block_d <= 128 else 32 if wide <= 512 else 16
    return Config(dict(BLOCK_G=pow2(group), BLOCK_N=block_n, BLOCK_D=block_d),
                  num_warps=4 if block_d <= 64 else 8, num_stages=2 if wide <= 512 else 1)


def gathered_attention(group: int, head_dim: int, dtype: torch.dtype, arch: int) -> Config:
    """decode_attention's tiles at half the keys: each slot's index is one more register a key."""
    cfg = decode_attention(group, head_dim, dtype, arch)
    return Config({**cfg.blocks, "BLOCK_N": max(16, cfg.blocks["BLOCK_N"] // 2)}, cfg.num_warps, cfg.num_stages)


def attention_relevance(q_heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, arch: int) -> Config:
    """All query heads of a row in one (BLOCK_H, BLOCK_D) tile, against BLOCK_N keys of every KV
    head per step (the relevance of Eq. 2 needs all heads). Each step loads kv_heads key tiles
    and as many value tiles: in float32 (an "ieee" dot on CUDA cores, its operands in registers)
    at D >= 128, 16 keys a step, unpipelined (num_stages 1: 2 stages of 8 KV heads' tiles would
    not fit in shared memory)."""
    block_d = pow2(head_dim)
    wide = _itemsize(dtype) == 4 and block_d >= 128
    return Config(dict(BLOCK_H=pow2(q_heads), BLOCK_N=16 if wide else 32, BLOCK_D=block_d),
                  num_warps=4 if block_d <= 64 else 8, num_stages=1 if wide or kv_heads * block_d > 512 else 2)


def attention_topk_pooled(group: int, head_dim: int, dtype: torch.dtype, arch: int) -> Config:
    """One tile of BLOCK_N keys per program, no loop (nothing to pipeline)."""
    return Config(dict(BLOCK_G=pow2(group), BLOCK_N=64, BLOCK_D=pow2(head_dim)),
                  num_warps=4 if head_dim <= 64 else 8, num_stages=1)


ROW_BUCKETS = (256, 32768)  # attention_topk's row tile: 256, 1024, 4096, 16384, 32768


def row_topk(length: int, arch: int) -> Config:
    """A whole row of `length` scores in one register tile, bucketed: <= 32 elements a thread."""
    block = bucket(length, *ROW_BUCKETS)
    return Config(dict(BLOCK_L=block), num_warps=min(32, max(4, block // 1024)), num_stages=1)


PAGE_BUCKETS = (64, 16384)  # page_scores' page tile: 64, 256, 1024, 4096, 16384


def page_scores(group: int, pages: int, arch: int) -> Config:
    """All of a head's pages in one (BLOCK_G, BLOCK_N) float32 tile, bucketed; warps grow with
    the tile to keep it near 32 registers a thread (up to 32 warps, 1,024 threads)."""
    block_n = bucket(pages, *PAGE_BUCKETS)
    block_g = triton.next_power_of_2(group)
    return Config(dict(BLOCK_G=block_g, BLOCK_N=block_n),
                  num_warps=min(32, max(4, block_g * block_n // 1024)), num_stages=1)


def paged_attention(group: int, page: int, head_dim: int, dtype: torch.dtype, arch: int) -> Config:
    """One page of keys per step: (BLOCK_P, BLOCK_D) tiles."""
    block_d = pow2(head_dim)
    return Config(dict(BLOCK_G=pow2(group), BLOCK_P=pow2(page), BLOCK_D=block_d),
                  num_warps=4 if block_d <= 64 else 8, num_stages=2)


def dci_scores(group: int, candidates: int, head_dim: int, arch: int) -> Config:
    """Candidate keys in blocks of BLOCK_C (16, 32 or 64: three variants). The product is a
    float32 "ieee" dot (no tensor cores), whose operands take registers: 8 warps, and no
    pipelining (2 stages spilled 6.7 KB at D 256 in 16-bit)."""
    return Config(dict(BLOCK_G=pow2(group), BLOCK_C=min(64, pow2(candidates)), BLOCK_D=pow2(head_dim)),
                  num_warps=8, num_stages=1)


def merge(splits: int, head_dim: int, arch: int) -> Config:
    """The merge of split-K partials: (BLOCK_S, BLOCK_D) in registers; splits <= MAX_SPLITS, so
    BLOCK_S takes the powers of 2 up to 64 (seven variants)."""
    return Config(dict(BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=triton.next_power_of_2(head_dim)),
                  num_warps=4, num_stages=1)


def copy_block(elements: int, arch: int) -> Config:
    """page_gather: BLOCK contiguous elements a program."""
    return Config(dict(BLOCK=min(1024, triton.next_power_of_2(elements))), num_warps=4, num_stages=1)


def page_layout(page: int, head_dim: int, arch: int) -> Config:
    return Config(dict(BLOCK_P=triton.next_power_of_2(page), BLOCK_D=triton.next_power_of_2(head_dim)),
                  num_warps=4, num_stages=1)


def rope_delta(tokens: int, rotary_half: int, tail: int, arch: int) -> Config:
    """BLOCK_T tokens a program: 1 when decoding, up to 16 in a prefill (five variants); 8 warps
    from (16, 64) tiles on (4 spilled on sm_80 at D 80 and 256)."""
    block_t, block_half = min(16, triton.next_power_of_2(tokens)), triton.next_power_of_2(rotary_half)
    return Config(dict(BLOCK_T=block_t, BLOCK_HALF=block_half, BLOCK_TAIL=triton.next_power_of_2(max(tail, 1))),
                  num_warps=8 if block_t * block_half >= 1024 else 4, num_stages=1)

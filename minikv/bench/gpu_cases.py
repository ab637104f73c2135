"""The kernels' cases for the GPU checks: for each fused kernel, the arguments of one call at a
model geometry, dtype and context, built by a tensor maker: `Meta` (shapes only: the compile
check plans launches with them, bench/gpu_compile.py) or `Random` (data on a device: gpu-check's
kernel checks, bench/gpu_check.py). One definition serves both, so what is compiled ahead of time
is what is run on the GPU."""
from __future__ import annotations

import importlib

import torch

GEOMETRIES = {  # name: (query heads, KV heads, head dim)
    "SmolLM2": (9, 3, 64),
    "Qwen2.5-Coder-0.5B": (14, 2, 64),
    "Llama-3-8B": (32, 8, 128),
    "Qwen2.5-7B": (28, 4, 128),
    "odd-D80-G7": (21, 3, 80),
    "Gemma-2-2B": (8, 4, 256),  # D 256: the widest head dim minikv's kernels take
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PAGE = 16  # tokens per page of the paged policies


def fused_module(op: str):
    return importlib.import_module(f"minikv.kernels.{op}.fused")


class Meta:
    """Tensors with shapes and dtypes and no data: what the compile check plans launches with."""

    device = torch.device("meta")

    def floats(self, *shape, dtype=torch.float32):
        return torch.empty(shape, dtype=dtype, device="meta")

    def ints(self, high, *shape, dtype=torch.int64):  # values in [0, high)
        return torch.empty(shape, dtype=dtype, device="meta")

    def full(self, value, *shape, dtype=torch.int64):
        return torch.empty(shape, dtype=dtype, device="meta")

    def perm(self, n, k, dtype=torch.int64):  # k distinct values in [0, n)
        return torch.empty((k,), dtype=dtype, device="meta")

    def bools(self, *shape):
        return torch.empty(shape, dtype=torch.bool, device="meta")


class Random(Meta):
    """The same tensors with data, drawn on `device` by its own generator (gpu-check's kernel
    checks: on a GPU, a 32k context's gigabyte of keys is drawn in milliseconds)."""

    def __init__(self, device, seed=0):
        self.device = torch.device(device)
        self.gen = torch.Generator(self.device).manual_seed(seed)

    def floats(self, *shape, dtype=torch.float32):
        return torch.randn(shape, generator=self.gen, device=self.device).to(dtype)

    def ints(self, high, *shape, dtype=torch.int64):
        return torch.randint(0, high, shape, generator=self.gen, device=self.device).to(dtype)

    def full(self, value, *shape, dtype=torch.int64):
        return torch.full(shape, value, dtype=dtype, device=self.device)

    def perm(self, n, k, dtype=torch.int64):
        return torch.randperm(n, generator=self.gen, device=self.device)[:k].to(dtype)

    def bools(self, *shape):
        return torch.rand(shape, generator=self.gen, device=self.device) < 0.8


# -- one case per kernel: (op, function, arguments) at a geometry, dtype and context --------------
# The same arguments go to minikv.kernels.<op>.<function> with either backend, and to its fused.py.


def case_decode_attention(make, hq, hkv, d, dtype, ctx):
    k = make.floats(1, hkv, ctx, d, dtype=dtype)
    return "decode_attention", "decode_attention", (make.floats(1, hq, d, dtype=dtype), k, make.floats(*k.shape, dtype=dtype),
                                                    make.full(ctx, 1))


def case_attention_relevance(make, hq, hkv, d, dtype, ctx):
    return "attention_relevance", "attention_relevance", case_decode_attention(make, hq, hkv, d, dtype, ctx)[2]


def case_gathered_attention(make, hq, hkv, d, dtype, ctx):
    q, k, v, _ = case_decode_attention(make, hq, hkv, d, dtype, ctx)[2]
    return "gathered_attention", "gathered_attention", (q, k, v, make.ints(ctx, 1, hkv, ctx // 8))


def case_attention_topk(make, hq, hkv, d, dtype, ctx):
    q, k, _, n_valid = case_decode_attention(make, hq, hkv, d, dtype, ctx)[2]
    lse = make.floats(1, hq).abs() * 4 + 8  # the order of a decode's lse at these lengths
    return "attention_topk", "attention_topk", (q, k, lse, n_valid, make.bools(1, hkv, ctx), max(1, ctx // 16))


def case_page_scores(make, hq, hkv, d, dtype, ctx, codes=False):
    n = ctx // PAGE
    mid, half = make.floats(1, hkv, n, d, dtype=dtype), make.floats(1, hkv, n, d, dtype=dtype).abs()
    c = make.ints(256, 1, hkv, n, PAGE, (d + 3) // 4, dtype=torch.uint8) if codes else None
    return "page_scores", "page_scores", (make.floats(1, hq, d, dtype=dtype), mid - half, mid + half, make.full(n, 1),
                                          min(n, 64), d ** -0.5, "softmax_mean", c)


def case_page_scores_codes(make, hq, hkv, d, dtype, ctx):
    return case_page_scores(make, hq, hkv, d, dtype, ctx, codes=True)


def case_paged_attention(make, hq, hkv, d, dtype, ctx):
    n = ctx // PAGE
    k = make.floats(n * hkv, PAGE, hkv, d, dtype=dtype)
    table = make.perm(n * hkv, hkv * n, dtype=torch.int32).reshape(1, hkv, n)
    return "paged_attention", "paged_attention", (make.floats(1, hq, d, dtype=dtype), k, make.floats(*k.shape, dtype=dtype),
                                                  table, make.full(PAGE, 1, hkv, n, dtype=torch.int32))


def case_dci_scores(make, hq, hkv, d, dtype, ctx):
    g, c = hq // hkv, min(ctx, 2048)
    return "dci_scores", "dci_scores", (make.floats(1, g, d, dtype=dtype), make.floats(hkv, ctx, d, dtype=dtype),
                                        make.ints(hkv, 1), make.perm(ctx, c).reshape(1, c), make.bools(1, g, c), 64)


def case_page_gather(make, hq, hkv, d, dtype, ctx):
    n = ctx // PAGE
    return "page_gather", "page_gather", (make.floats(n * hkv, 2, PAGE, d, dtype=dtype), make.ints(n * hkv, 64),
                                          make.floats(64, 2, PAGE, d, dtype=dtype))


def case_page_layout(make, hq, hkv, d, dtype, ctx):
    n = ctx // PAGE
    m = min(n, 64)  # blocks scattered, to distinct slots
    pool = make.floats(n, PAGE, hkv, d, dtype=dtype)
    return "page_layout", "hnd_to_nhd", (make.floats(m, 2, PAGE, d, dtype=dtype), pool,
                                         make.floats(*pool.shape, dtype=dtype), make.perm(n, m), make.ints(hkv, m))


def case_rope_delta(make, hq, hkv, d, dtype, ctx):
    """A whole cache moved by one delta (a decode step's one token compiles BLOCK_T = 1 besides)."""
    inv_freq = 10000.0 ** -(torch.arange(0, d, 2, dtype=torch.float32) / d)
    return "rope_delta", "rope_delta", (make.floats(1, hkv, ctx, d, dtype=dtype), make.ints(ctx, ctx),
                                        inv_freq.to(make.device))


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}

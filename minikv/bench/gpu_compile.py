"""Ahead-of-time compile check of every fused kernel, no GPU needed (`gpu-check --compile-only`).

Each kernel's launcher is run on *meta* tensors (shapes and dtypes, no data) inside
`launch.compiling_for(target)`, with Triton's launch replaced by a recorder: so the launcher's own
launch configuration (kernels/launch.py), grid and arguments are what gets compiled, specialised
as Triton's JIT would specialise them (pointers 16-byte aligned, ints by value). Every distinct
launch is then compiled for each architecture with `triton.compile` and the ptxas that ships in
Triton's wheel, and reported: shared memory against the architecture's limit, registers and
spill bytes (ptxas -v), compile seconds.

Runs in its own process (`python -m minikv.bench.gpu_compile`): it needs TRITON_INTERPRET=0 when
triton is imported, and a process that imported minikv without CUDA has selected the interpreter.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import os
import re
import sys
import tempfile
import time

import torch

from minikv.kernels import launch as configs

GEOMETRIES = {  # name: (query heads, KV heads, head dim)
    "SmolLM2": (9, 3, 64),
    "Qwen2.5-Coder-0.5B": (14, 2, 64),
    "Llama-3-8B": (32, 8, 128),
    "Qwen2.5-7B": (28, 4, 128),
    "odd-D80-G7": (21, 3, 80),
    "Gemma-2-2B": (8, 4, 256),  # D 256: the widest head dim minikv's kernels take
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONTEXTS = (4096, 32768)
PAGE = 16  # tokens per page of the paged policies


def _fused(op: str):
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
    """The same tensors with data, on `device` (gpu-check's kernel checks)."""

    def __init__(self, device, seed=0):
        self.device, self.gen = torch.device(device), torch.Generator().manual_seed(seed)

    def floats(self, *shape, dtype=torch.float32):
        return torch.randn(shape, generator=self.gen).to(self.device, dtype)

    def ints(self, high, *shape, dtype=torch.int64):
        return torch.randint(0, high, shape, generator=self.gen).to(self.device, dtype)

    def full(self, value, *shape, dtype=torch.int64):
        return torch.full(shape, value, dtype=dtype, device=self.device)

    def perm(self, n, k, dtype=torch.int64):
        return torch.randperm(n, generator=self.gen)[:k].to(self.device, dtype)

    def bools(self, *shape):
        return (torch.rand(shape, generator=self.gen) < 0.8).to(self.device)


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


# a few representative configurations per kernel, the default run's compile test (tests/kernels/test_compile.py):
# (kernel, geometry, dtype, context, arch)
SAMPLE = [("decode_attention", "Llama-3-8B", "bfloat16", 4096, 80), ("decode_attention", "Llama-3-8B", "bfloat16", 4096, 90),
          ("attention_relevance", "Qwen2.5-Coder-0.5B", "float16", 4096, 90),
          ("attention_topk", "Qwen2.5-Coder-0.5B", "float16", 32768, 90), ("page_scores", "SmolLM2", "bfloat16", 32768, 80),
          ("gathered_attention", "odd-D80-G7", "bfloat16", 4096, 90), ("paged_attention", "Qwen2.5-7B", "bfloat16", 4096, 90),
          ("dci_scores", "SmolLM2", "float32", 4096, 90), ("page_gather", "SmolLM2", "bfloat16", 4096, 90),
          ("page_layout", "SmolLM2", "float16", 4096, 90), ("rope_delta", "Llama-3-8B", "bfloat16", 4096, 90)]


def contexts_for(kernel: str) -> tuple[int, ...]:
    """Contexts to plan at: the two of CONTEXTS, and where a block size follows the length, every
    bucket edge up to 32k (a row of L tokens for attention_topk, L / PAGE pages for page_scores)."""
    if kernel == "attention_topk":
        return (256, 1024, 4096, 16384, 32768)
    if kernel.startswith("page_scores"):
        return tuple(b * PAGE for b in (64, 256, 1024)) + (32768,)
    return CONTEXTS


# -- recording launches --------------------------------------------------------------------------


@contextlib.contextmanager
def recording(launches: list):
    """Triton's launch replaced by one that appends (kernel, grid, bound arguments, options)."""
    from triton.runtime.jit import JITFunction

    def record(self, *args, grid, warmup, **kwargs):
        options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        launches.append((self, grid, bound.arguments, options))

    run = JITFunction.run
    JITFunction.run = record
    try:
        yield launches
    finally:
        JITFunction.run = run


def specialise(fn, arguments: dict):
    """(signature, constexprs, attrs) for ASTSource, as the JIT would make them for these arguments."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    signature, constexprs, attrs = {}, {}, {}
    for i, p in enumerate(fn.params):
        value = arguments[p.name]
        if p.is_constexpr:
            signature[p.name], constexprs[(i,)] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(CUDABackend, value, False, not p.do_not_specialize,
                                            not p.do_not_specialize_on_alignment)
        if kind == "constexpr":  # an int equal to 1
            signature[p.name], constexprs[(i,)] = "constexpr", spec
            continue
        signature[p.name] = kind
        if isinstance(spec, str) and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def grid_ok(grid) -> bool:
    """Axis 0 below 2**31, axes 1 and 2 at most 65,535 (CUDA's grid limits)."""
    grid = tuple(grid) + (1,) * (3 - len(grid))
    return grid[0] < 2**31 and grid[1] <= 65535 and grid[2] <= 65535


def compile_one(fn, arguments: dict, options: dict, arch: int) -> dict:
    """Compile for sm_<arch>: shared bytes, registers, spill bytes (ptxas -v), seconds."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, attrs = specialise(fn, arguments)
    triton.knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed on stdout
    log = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                    target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as err:  # noqa: BLE001  (reported in the row: the check fails on it)
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:200],
                "compile_s": time.perf_counter() - start}
    seconds = time.perf_counter() - start
    text = log.getvalue()
    regs = re.findall(r"Used (\d+) registers", text)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    return {"shared": kernel.metadata.shared, "registers": int(regs[-1]) if regs else None,
            "spill_bytes": sum(int(a) + int(b) for a, b in spills), "compile_s": seconds}


def plan(kernel: str, geometry: str, dtype: str, context: int, arch: int) -> list:
    """The launches of `kernel` at this configuration, planned for sm_<arch>."""
    op, function, args = CASES[kernel](Meta(), *GEOMETRIES[geometry], DTYPES[dtype], context)
    launches = []
    target = configs.Target(arch, configs.SM_COUNT.get(arch, 132), interpreted=False)
    with configs.compiling_for(target), recording(launches):
        getattr(_fused(op), function)(*args)
        if kernel == "rope_delta":  # and a decode step's one token
            getattr(_fused(op), function)(args[0][:, :, :1], args[1][:1], args[2])
    return launches


def configurations(kernels, geometries, dtypes, archs, contexts=None):
    """(kernel, geometry, dtype, context, arch) of every combination (contexts: contexts_for's)."""
    return [(k, g, d, c, a) for k in kernels for g in geometries for d in dtypes
            for c in contexts or contexts_for(k) for a in archs]


def check(configs_, out=sys.stdout) -> list[dict]:
    """Compile every distinct launch of these configurations; one row each (rows of launches
    already compiled with the same specialisation are not repeated)."""
    rows, seen = [], set()
    for kernel, geometry, dtype, context, arch in configs_:
        for fn, grid, arguments, options in plan(kernel, geometry, dtype, context, arch):
            key = (fn.__name__, fn.fn.__module__, repr(specialise(fn, arguments)),
                   repr(sorted(options.items())), arch)
            if key in seen:
                continue
            seen.add(key)
            row = {"kernel": kernel, "function": fn.__name__, "geometry": geometry,
                   "dtype": dtype, "context": context, "arch": arch,
                   "limit": configs.SMEM_LIMIT[arch], "grid_ok": grid_ok(grid),
                   "config": {k: v for k, v in arguments.items() if k.startswith("BLOCK_")}
                   | options}
            row |= compile_one(fn, arguments, options, arch)
            row["ok"] = "error" not in row and row["shared"] <= row["limit"] and row["grid_ok"]
            rows.append(row)
            print(format_row(row), file=out, flush=True)
    return rows


HEADER = (f"{'kernel':<20} {'function':<20} {'geometry':<18} {'dtype':<8} {'context':>7} {'sm':>3} "
          f"{'shared B':>8} {'limit B':>8} {'regs':>4} {'spill B':>7} {'compile s':>9}  status")


def format_row(r: dict) -> str:
    status = "ok" if r["ok"] else ("FAILED: " + r["error"] if "error" in r else
                                   "OVER SHARED MEMORY" if r["shared"] > r["limit"] else "GRID TOO LARGE")
    return (f"{r['kernel']:<20} {r['function']:<20} {r['geometry']:<18} {r['dtype']:<8} {r['context']:>7} "
            f"{r['arch']:>3} {r.get('shared', '-'):>8} {r['limit']:>8} {r.get('registers') or '-':>4} "
            f"{r.get('spill_bytes', '-'):>7} {r['compile_s']:>9.1f}  {status}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m minikv.bench.gpu_compile", description=__doc__)
    p.add_argument("--arch", type=int, action="append", choices=sorted(configs.SMEM_LIMIT))
    p.add_argument("--kernel", action="append", choices=sorted(CASES))
    p.add_argument("--geometry", action="append", choices=list(GEOMETRIES))
    p.add_argument("--dtype", action="append", choices=list(DTYPES))
    p.add_argument("--context", type=int, action="append", help="contexts in tokens (default: contexts_for)")
    p.add_argument("--sample", action="store_true", help="only SAMPLE's configurations (the default run's test)")
    p.add_argument("--json", default=None, metavar="FILE")
    args = p.parse_args(argv)
    print(HEADER, flush=True)
    rows = check(SAMPLE if args.sample else configurations(
        args.kernel or sorted(CASES), args.geometry or list(GEOMETRIES), args.dtype or list(DTYPES),
        args.arch or [80, 90], args.context))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows}, f, indent=1)
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows)} compiled, {len(bad)} failed or over shared memory, "
          f"{sum(r.get('spill_bytes', 0) > 0 for r in rows)} with spills", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said without its warning
    # a fresh cache: a cached kernel skips ptxas, whose report gives registers and spills
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="minikv-gpu-compile-")
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("error: the compile check needs TRITON_INTERPRET=0 (it compiles; the interpreter cannot)")
    sys.exit(main())

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
import inspect
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time

from minikv.atomic import atomic_write
from minikv.kernels import launch as configs

from .gpu_cases import CASES, DTYPES, GEOMETRIES, PAGE, Meta, fused_module

CONTEXTS = (4096, 32768)

# a few representative configurations per kernel, the default run's compile test (tests/kernels/test_compile.py):
# (kernel, geometry, dtype, context, arch)
SAMPLE = [("decode_attention", "Llama-3-8B", "bfloat16", 4096, 80), ("decode_attention", "Llama-3-8B", "bfloat16", 4096, 90),
          ("attention_relevance", "Qwen2.5-Coder-0.5B", "float16", 4096, 90),
          ("attention_topk", "Qwen2.5-Coder-0.5B", "float16", 32768, 90), ("page_scores", "SmolLM2", "bfloat16", 32768, 80),
          ("gathered_attention", "SmolLM2", "bfloat16", 4096, 90), ("paged_attention", "odd-D80-G7", "bfloat16", 4096, 90),
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
        getattr(fused_module(op), function)(*args)
        if kernel == "rope_delta":  # and a decode step's one token
            getattr(fused_module(op), function)(args[0][:, :, :1], args[1][:1], args[2])
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


def summary(rows: list[dict]) -> str:
    """A Markdown table, one line per (kernel, function, dtype, arch): its launches' worst shared
    memory, registers and spills over the geometries and contexts, and where the worst spill is."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["function"], r["dtype"], r["arch"]), []).append(r)
    lines = ["| kernel | function | dtype | sm | launches | shared B, max | limit B | registers, max | "
             "spill B, max | worst spill at | compile s |", "|" + " --- |" * 11]
    for (kernel, function, dtype, arch), rs in groups.items():
        done = [r for r in rs if "error" not in r]
        worst = max(done, key=lambda r: r["spill_bytes"], default=None)
        where = f"{worst['geometry']} {worst['context']}" if worst and worst["spill_bytes"] else "-"
        failed = len(rs) - len(done)
        lines.append(f"| {kernel} | {function} | {dtype} | {arch} | {len(rs)}{f' ({failed} FAILED)' if failed else ''} "
                     f"| {max((r['shared'] for r in done), default='-')} | {rs[0]['limit']} "
                     f"| {max((r['registers'] or 0 for r in done), default='-')} "
                     f"| {max((r['spill_bytes'] for r in done), default='-')} | {where} "
                     f"| {sum(r['compile_s'] for r in rs):.0f} |")
    return "\n".join(lines)


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
        atomic_write(args.json, json.dumps({"rows": rows}, indent=1))
    bad = [r for r in rows if not r["ok"]]
    print("\n" + summary(rows) + "\n")
    print(f"{len(rows)} compiled, {len(bad)} failed or over shared memory, "
          f"{sum(r.get('spill_bytes', 0) > 0 for r in rows)} with spills", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said without its warning
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("error: the compile check needs TRITON_INTERPRET=0 (it compiles; the interpreter cannot)", file=sys.stderr)
        sys.exit(2)
    # a fresh cache: a cached kernel skips ptxas, whose report gives registers and spills
    cache = os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="minikv-gpu-compile-")
    try:
        code = main()
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    sys.exit(code)

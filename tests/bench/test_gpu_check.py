"""gpu-check: without CUDA it exits 2 in one line (except --compile-only); its parts run on the
CPU at tiny sizes, Triton's kernels in the interpreter (the same code a GPU runs at full size)."""
import pytest
import torch

from minikv.bench import gpu_check
from minikv.bench.__main__ import main
from minikv.cli import run_command

from ..fixtures import CPU_ONLY

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def test_without_cuda_exits_2_in_one_line(capsys):
    assert run_command(main, ["gpu-check", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: gpu-check needs a CUDA device")
    assert run_command(main, ["gpu-check", "--arch", "90"]) == 2
    assert run_command(main, ["gpu-check", "--compile-only", "--arch", "75"]) == 2


def test_kernel_part_compares_kernels_with_their_references(capsys):
    """A few kernels (the interpreter is slow); test_all_parts_run_on_the_cpu (slow) runs them all."""
    some = ("decode_attention", "attention_topk", "page_gather", "page_layout", "rope_delta")
    sizes = gpu_check.Sizes(tests=(), geometries=("SmolLM2",), dtypes=("float32",), contexts=(64,),
                            policies=(), new_tokens=2, prompt_tokens=8, speed_contexts=(), kernels=some)
    rows = gpu_check.check_kernels(sizes, CPU_ONLY, gpu_check.wall_timer)  # its CPU logic, interpreted
    assert [r["kernel"] for r in rows] == list(some)
    assert all(r["ok"] and r["gbps"] > 0 for r in rows), [r for r in rows if not r["ok"]]
    assert "(b) kernels: triton vs eager" in capsys.readouterr().out


def test_compare_flags_a_wrong_output():
    ref = [torch.ones(64), torch.arange(100)]
    assert gpu_check.compare(ref, [torch.ones(64), torch.arange(100)], torch.float32)["ok"]
    assert not gpu_check.compare(ref, [torch.ones(64) * 1.01, torch.arange(100)], torch.float32)["ok"]
    assert not gpu_check.compare(ref, [torch.ones(64), torch.arange(100).roll(1)], torch.float32)["ok"]


@pytest.mark.slow
def test_all_parts_run_on_the_cpu(capsys):
    sizes = gpu_check.Sizes(tests=("tests/kernels/test_compile.py", "-k", "refuse"), geometries=("SmolLM2",),
                            dtypes=("float32",), contexts=(64,), policies=("full",), new_tokens=3,
                            prompt_tokens=16, speed_contexts=(32,), model_dtype="float32")
    report = gpu_check.run_checks(sizes, CPU_ONLY, gpu_check.wall_timer)  # its CPU logic, interpreted
    assert report["ok"], report
    assert {r["kernel"] for r in report["kernels"]} == set(gpu_check.CASES)
    assert report["policies"][0]["equal"] and report["speed"][0]["x_full"] == 1.0

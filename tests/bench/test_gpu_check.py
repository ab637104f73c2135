"""gpu-check: without CUDA it exits 2 in one line (except --compile-only); its parts run on the
CPU at tiny sizes, Triton's kernels in the interpreter (the same code a GPU runs at full size)."""
import json
import time

import pytest
import torch

from minikv import kernels
from minikv.bench import gpu_check, gpu_models, gpu_policies
from minikv.bench.__main__ import main
from minikv.cli import run_command
from minikv.kernels.decode_attention.reference import decode_attention
from minikv.testing.models import _COMMON, FAMILIES

from ..fixtures import CPU_ONLY

TINY = {**_COMMON, **FAMILIES["llama_gqa"], "max_position_embeddings": 4096}  # streaming's defaults fit 4k

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


def test_policy_part_compares_logits_of_both_backends_on_the_same_tokens():
    model = gpu_models.weightless(TINY, CPU_ONLY, torch.float32)  # the interpreter runs on CPU tensors
    row = gpu_policies.compare_backends(model, gpu_models.random_ids(97, 12), "full", 4)
    assert row["ok"] and row["equal"] and row["tokens"] == 4 and row["first_difference"] is None
    assert 0 <= row["logits_rel_rms"] <= 1e-5


def test_policy_part_flags_a_kernel_that_drops_a_token(monkeypatch):
    """backend=triton replaced by a decode_attention that forgets each row's newest token: the
    logits move far past rounding, whatever the greedy tokens do."""
    def drops_newest(q, k, v, lengths, scale=None, window=None, return_lse=False):
        return decode_attention(q, k, v, lengths - 1, scale, window, return_lse)

    monkeypatch.setitem(kernels._REGISTRY["decode_attention"], "drops_newest", drops_newest)
    monkeypatch.setattr(gpu_policies, "with_backend", lambda spec, backend: f"{spec}:backend="
                        + ("drops_newest" if backend == "triton" else backend))
    model = gpu_models.weightless(TINY, CPU_ONLY, torch.float32)  # the eager paths only: CPU
    row = gpu_policies.compare_backends(model, gpu_models.random_ids(97, 12), "full", 4)
    assert not row["ok"] and row["logits_rel_rms"] > gpu_policies.LOGITS_REL_RMS[torch.float32] * 100


def test_rows_reach_the_json_as_they_come_and_a_spent_share_stops_its_part(tmp_path, capsys):
    path = tmp_path / "rows.json"
    sizes = gpu_check.Sizes(tests=(), geometries=("SmolLM2",), dtypes=("float32",), contexts=(64,), policies=(),
                            new_tokens=2, prompt_tokens=8, speed_contexts=(), kernels=("page_gather",),
                            budget={"kernels": 0})
    report = gpu_check.Report(sizes, str(path))
    report.add("policies", {"policy": "full", "ok": True})
    assert json.loads(path.read_text())["policies"] == [{"policy": "full", "ok": True}]  # written at once
    assert gpu_check.check_kernels(sizes, CPU_ONLY, gpu_check.wall_timer, report) == []  # its 0 s are spent
    saved = json.loads(path.read_text())
    assert saved["ok"] and not saved["complete"]
    assert saved["not_run"] == ["kernels: page_gather SmolLM2 float32 64 and after (its 0 s were spent)"]
    assert "kernels: out of its 0 s" in capsys.readouterr().out
    report.add("speed", report.guarded(lambda: 1 / 0, policy="full"))  # a row that fails fails the run
    assert not json.loads(path.read_text())["ok"]
    assert json.loads(path.read_text())["speed"][0]["error"] == "ZeroDivisionError: division by zero"


def test_tests_that_need_the_weights_are_left_out_where_they_are_absent(monkeypatch):
    from ..conftest import pytest_collection_modifyitems

    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: None)
    assert gpu_check.test_marks() == "not slow and not weights"
    monkeypatch.setattr(gpu_check.importlib.util, "find_spec", lambda name: object())
    assert gpu_check.test_marks() == "not slow"

    class Item:  # what the hook reads and writes of a collected test
        def __init__(self, *fixtures):
            self.fixturenames, self.marks = fixtures, []

        def add_marker(self, mark):
            self.marks.append(mark.name)

    items = [Item("device", "smollm2"), Item("smollm2_cpu"), Item("hf_smollm2"), Item("device", "reference_dir")]
    pytest_collection_modifyitems(items)
    assert [i.marks for i in items] == [["weights"], ["weights"], ["weights"], []]


def test_tests_stopped_at_the_runs_limit_keep_their_summary(monkeypatch, tmp_path):
    # One test passes, the next waits until it is stopped: the stop lands mid-run however fast
    # pytest starts (the run waits for the first test's file before its limit starts to count).
    started = tmp_path / "started"
    (tmp_path / "test_waits.py").write_text(
        "import pathlib, time\n"
        "def test_passes():\n    pass\n"
        f"def test_waits():\n    pathlib.Path({str(started)!r}).touch()\n    time.sleep(120)\n")
    monkeypatch.setattr(gpu_check, "MIN_TEST_S", 60.0)
    wait = gpu_check.subprocess.Popen.wait

    def wait_until_started(proc, timeout=None):  # the limit counts from the second test's start
        if timeout == 60.0:
            while not started.exists() and proc.poll() is None:
                time.sleep(0.05)
            timeout = 0.5
        return wait(proc, timeout=timeout)

    monkeypatch.setattr(gpu_check.subprocess.Popen, "wait", wait_until_started)
    sizes = gpu_check.Sizes(tests=(str(tmp_path / "test_waits.py"),), geometries=(), dtypes=(),
                            contexts=(), policies=(), new_tokens=2, prompt_tokens=8, speed_contexts=(), total_s=0)
    report = gpu_check.Report(sizes, str(tmp_path / "rows.json"))
    got = gpu_check.run_tests(sizes, report)
    assert got["stopped"] and got["ok"] and got["exit"] != 0  # interrupted, and nothing failed
    assert got["summary"].startswith("1 passed")
    assert not report.data["complete"] and report.data["not_run"] == ["tests: stopped after 60 s"]


def test_all_parts_run_on_the_cpu(tmp_path):
    """Every part, in order, at tiny sizes: the kernels in the interpreter, random-weight models."""
    sizes = gpu_check.Sizes(tests=("tests/kernels/test_compile.py", "-k", "refuse"), geometries=("SmolLM2",),
                            dtypes=("float32",), contexts=(64,), policies=("full", "streaming"), new_tokens=3,
                            prompt_tokens=16, speed_contexts=(40,), model=TINY, speed_model=TINY,
                            model_dtype="float32", kernels=("page_gather",))
    report = gpu_check.run_checks(sizes, CPU_ONLY, gpu_check.wall_timer, str(tmp_path / "rows.json"))
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved["ok"] and saved["complete"], saved
    assert [r["kernel"] for r in saved["kernels"]] == ["page_gather"]
    assert [r["policy"] for r in saved["policies"]] == ["full", "streaming"] and all(r["equal"] for r in saved["policies"])
    assert [(r["context"], r["policy"]) for r in saved["speed"]] == [(40, "full"), (40, "streaming")]
    assert saved["speed"][0]["x_full"] == 1.0 and saved["speed"][1]["x_full"] > 0
    assert saved["notes"]["policies"]["weights"] == "random" and saved["tests"]["summary"].startswith("1 passed")
    assert report.data["policies"] == saved["policies"]  # the file holds what the run returns


@pytest.mark.slow
def test_every_kernel_runs_on_the_cpu():
    sizes = gpu_check.Sizes(tests=(), geometries=("SmolLM2",), dtypes=("float32",), contexts=(64,), policies=(),
                            new_tokens=3, prompt_tokens=16, speed_contexts=())
    rows = gpu_check.check_kernels(sizes, CPU_ONLY, gpu_check.wall_timer)  # its CPU logic, interpreted
    assert {r["kernel"] for r in rows} == set(gpu_check.CASES) and all(r["ok"] for r in rows), rows

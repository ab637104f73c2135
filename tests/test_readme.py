"""Every command and code block of README.md and docs/*.md runs as written, and shows what it prints.

The marking scheme (README.md, section Tests, says the same), for every page:
- ```python blocks run in order, in one namespace per page, in this process. minikv.load("smollm2")
  there hands out the session's model, and transformers' from_pretrained of the bundled GGUF the
  session's transformers copy (the blocks' calls are checked for their arguments), so the blocks
  cost only their generation. A `print(...)  # text` line says what it prints: `text` must be in
  the output.
- ```bash blocks: each command (backslash continuations joined, comments dropped) runs from the
  repository root with bash, `python` and `.venv/bin/python` being this interpreter.
- A bash block right after `<!-- readme-test: check -->` holds long benchmarks: each runs with
  `python -m minikv.bench --check ...`, which checks every flag (policy specs, sizes, device,
  model) and exits without loading the model.
- A block right after `<!-- readme-test: skip: <reason> -->` is not run; the reason is required.
- ```text blocks are output or layouts, never run. A text block right after a bash block, with
  no heading between them, is that block's output: each of its lines must match a line of what the commands printed, numbers being
  free (speeds differ from run to run and machine to machine).
- A results page of docs/ (every page but the guides in GUIDES) opens with the command that
  regenerates it: its first block is a bash block.
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
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # a Markdown link or image target, anchor dropped
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GUIDES = {"cli.md", "design.md", "extending.md", "hf.md", "reading.md"}  # docs pages that explain rather than report a benchmark


def readme_blocks(text: str) -> list[dict]:
    """[{lang, code, mark, line, end, after_heading}] for every fenced block; mark is the readme-test
    comment on the last non-empty line before the fence, if any; after_heading says whether a
    heading comes between the previous block and this one."""
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
        since = lines[blocks[-1]["end"]:start] if blocks else []
        blocks.append({"lang": m.group(1), "code": "\n".join(lines[start + 1:i]), "line": start + 1,
                       "mark": mark.group(1) if mark else None, "end": i + 1,
                       "after_heading": any(ln.startswith("#") for ln in since)})
        i += 1
    return blocks


def name_of(page: Path) -> str:
    return str(page.relative_to(ROOT))


BLOCKS = {name_of(p): readme_blocks(p.read_text(encoding="utf-8")) for p in PAGES}


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
    readme = BLOCKS["README.md"]
    assert any(b["lang"] == "python" for b in readme) and any(b["lang"] == "bash" and not b["mark"] for b in readme)
    for name, blocks in BLOCKS.items():
        langs = {b["lang"] for b in blocks}
        assert langs <= {"python", "bash", "text"}, f"{name}: unmarked or unknown fences: {langs}"
        for b in blocks:
            assert b["mark"] is None or b["lang"] == "bash", f"{name}:{b['line']}: only bash blocks take a mark"
        assert "papers/" not in (ROOT / name).read_text(), f"{name}: cite papers by title and link, not by a path"


@pytest.mark.parametrize("name", [n for n in BLOCKS if n.startswith("docs/") and Path(n).name not in GUIDES])
def test_a_results_page_opens_with_the_command_that_regenerates_it(name):
    blocks = BLOCKS[name]
    assert blocks and blocks[0]["lang"] == "bash", f"{name}: its first block must be the command that regenerates it"


@pytest.mark.parametrize("name", list(BLOCKS))
def test_local_links_resolve(name):
    page = ROOT / name
    for target in LINK.findall(page.read_text(encoding="utf-8")):
        if "://" in target or target.startswith("mailto:"):
            continue
        assert (page.parent / target).exists(), f"{name}: link to {target}, which does not exist"


@pytest.mark.parametrize("name", [n for n, blocks in BLOCKS.items() if any(b["lang"] == "python" for b in blocks)])
def test_python_blocks_run_and_print_what_they_say(name, smollm2, hf_smollm2, monkeypatch):
    import minikv
    from transformers import AutoModelForCausalLM

    from minikv.loading import smollm2_gguf_path

    def load(model_name, *args, **kwargs):
        assert model_name == "smollm2" and not args and not kwargs, (model_name, args, kwargs)
        return smollm2

    def from_pretrained(path, *args, gguf_file=None, dtype=None, **kwargs):
        # transformers reading the bundled GGUF: the session's copy (tests/fixtures.py, hf_smollm2)
        gguf = smollm2_gguf_path()
        assert (str(path), gguf_file, dtype) == (str(gguf.parent), gguf.name, torch.float32) and not args and not kwargs
        return hf_smollm2

    monkeypatch.setattr(minikv, "load", load)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", from_pretrained)
    namespace: dict = {}
    for b in (b for b in BLOCKS[name] if b["lang"] == "python"):
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(b["code"], f"{name}:{b['line']}", "exec"), namespace)
        printed = out.getvalue()
        for line in b["code"].splitlines():
            m = re.match(r"\s*print\(.*\)\s+# (.+)$", line)
            if m:
                assert m.group(1).strip() in printed, f"{name}:{b['line']}: {line!r} printed {printed!r}"


def _bash_cases():
    cases = []
    for name, blocks in BLOCKS.items():
        for j, b in enumerate(blocks):
            if b["lang"] != "bash" or (b["mark"] or "").startswith("skip"):
                continue
            following = blocks[j + 1] if j + 1 < len(blocks) else None
            is_output = following and following["lang"] == "text" and not following["after_heading"]
            expected = following["code"] if is_output else None
            cases.append(pytest.param(name, b, expected, id=f"{name}:line{b['line']}"))
    return cases


@pytest.mark.parametrize("name, block, expected", _bash_cases())
def test_bash_blocks_run_as_written(name, block, expected):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    printed = []
    for command in commands(block["code"]):
        run = as_run(command, block["mark"] == "check")
        p = subprocess.run(["bash", "-c", run], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
        assert p.returncode == 0, f"{name}:{block['line']}: {command}\n{p.stderr[-2000:]}"
        printed += (p.stdout + p.stderr).splitlines()
    for line in (expected or "").splitlines():
        if line.strip():
            assert any(pattern_of(line).fullmatch(got.strip()) for got in printed), \
                f"{name}:{block['line']}: {line!r} not among {printed}"

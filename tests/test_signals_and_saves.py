"""Nothing lost when a run is stopped or its disk fills (issue 52): SIGTERM ends generate and the
benchmarks as Ctrl-C does (what was computed kept, one line, exit code 143), every save is atomic
(a failed write leaves the previous file whole), and a partial compare.json says it is partial.

The signal cases start the real `python -m` entry points in a subprocess, with a policy plugin
(full KV) that touches a file once it has decoded a few tokens: the signal comes while the
command computes, not while it loads."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_cli_robust import ROOT, as_at_a_terminal, env, strict_loads

PYTHON = sys.executable
MARKING = '''
import os
from dataclasses import dataclass

import minikv
from minikv.policies.full import Full


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class Marking(Full):
    """Full KV that touches $MARK after its fourth forward (on a sequence of $MARK_LEN tokens or more)."""

    name = "marking"

    def end_step(self, logits=None):
        action = super().end_step(logits)
        if self.steps == 4 and self.max_len >= int(os.environ.get("MARK_LEN", "0")):
            open(os.environ["MARK"], "w").close()
        return action
'''


def stopped_by(signum, argv, tmp_path, after_mark: float = 0.0, mark_len: int = 0) -> subprocess.CompletedProcess:
    """python -m argv with the marking policy importable; `signum` once it has decoded 4 tokens."""
    (tmp_path / "marking.py").write_text(MARKING)
    mark = tmp_path / "mark"
    p = subprocess.Popen([PYTHON, "-m", *argv[:1], "--import", str(tmp_path / "marking.py"), *argv[1:]],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                         env=env(MARK=str(mark), MARK_LEN=str(mark_len)), preexec_fn=as_at_a_terminal)
    deadline = time.monotonic() + 300
    while not mark.exists():
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(after_mark)
    p.send_signal(signum)
    out, err = p.communicate(timeout=300)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


def test_sigterm_while_importing_is_one_line():
    p = subprocess.Popen([PYTHON, "-m", "minikv.generate", "--prompt", "Hi", "--threads", "1"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env(), preexec_fn=as_at_a_terminal)
    time.sleep(1.0)  # minikv imported, torch importing
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert (p.returncode, err, out) == (143, "terminated\n", "")


@pytest.mark.parametrize("signum, code, word", [(signal.SIGTERM, 143, "terminated"),
                                                pytest.param(signal.SIGINT, 130, "interrupted", marks=pytest.mark.slow)])
def test_a_signal_during_generate_json_keeps_the_text(tmp_path, signum, code, word):
    proc = stopped_by(signum, ["minikv.generate", "--prompt", "Tell me a story", "--policy", "marking",
                               "--max-new-tokens", "5000", "--ignore-eos", "--json", "--threads", "1"], tmp_path)
    assert proc.returncode == code, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"{word}: ") and "tokens generated, kept above" in lines[0], lines
    out = strict_loads(proc.stdout)
    assert out["stats"]["interrupted"] is True and len(out["token_ids"]) >= 3 and out["text"]


def test_sigterm_during_ppl_keeps_the_tokens_scored(tmp_path):
    report = tmp_path / "ppl.json"
    proc = stopped_by(signal.SIGTERM, ["minikv.bench", "ppl", "--policy", "marking", "--tokens", "4000",
                                       "--baseline-every", "0", "--tpot-at", "--json", str(report),
                                       "--threads", "1"], tmp_path, after_mark=1.0)
    assert proc.returncode == 143, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("terminated: the ") and f"tokens scored are in the table above and in {report}" in last
    saved = strict_loads(report.read_text())
    assert saved["complete"] is False and saved["rows"][0]["spec"] == "marking"
    n = int(last.split()[2])
    assert 4 <= n < 3999 and len(saved["rows"][0]["step_times_s"]) == n and saved["rows"][0]["ppl"] > 1
    assert "marking" in proc.stdout  # the table


@pytest.mark.slow  # ppl's test above keeps the default run's share; this one takes some 40 s
def test_sigterm_during_speed_keeps_the_rounds_done(tmp_path):
    report = tmp_path / "speed.json"
    # two prompt lengths; the signal comes during the second length's round, after the first's finished
    proc = stopped_by(signal.SIGTERM, ["minikv.bench", "speed", "--policy", "marking", "--prompt-lengths", "16",
                                       "2000", "--new-tokens", "6", "--repeats", "1", "--warmup", "0",
                                       "--json", str(report), "--threads", "1"], tmp_path, mark_len=1000)
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == f"terminated: the rounds every policy finished are in the table above and in {report}"
    saved = strict_loads(report.read_text())
    assert saved["complete"] is False and [r["prompt_tokens"] for r in saved["rows"]] == [16]


def every_benchmark():
    from minikv.bench.__main__ import benchmarks

    return sorted(benchmarks())


@pytest.mark.parametrize("name", every_benchmark())
def test_sigterm_ends_every_benchmark_as_ctrl_c_does(name, tmp_path, monkeypatch, capsys):
    """Each `minikv.bench` command, in process: SIGTERM arrives while it runs; the command ends
    with one line `terminated: ...` and 143, as a Ctrl-C ends it with `interrupted...` and 130
    (what generate, ppl and speed keep: the subprocess tests above)."""
    from minikv.bench.__main__ import benchmarks, main
    from minikv.cli import run_command

    def killed_while_running(args):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises here
        raise AssertionError("SIGTERM was not handled")

    monkeypatch.setattr(benchmarks()[name], "run", killed_while_running)
    argv = {"cluster-heads": ["--out", str(tmp_path / "c.json")], "gpu-check": ["--compile-only"]}.get(name, [])
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = run_command(main, [name, *argv])
        ignored = [signal.getsignal(sig) for sig in before]
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err.strip().splitlines()
    assert (code, err) == (143, ["terminated"])
    assert ignored == [signal.SIG_IGN] * 2  # the process is ending: a second signal must not interrupt that


# -- atomic saves ------------------------------------------------------------------------------


def test_a_write_that_fails_leaves_the_previous_file_whole(tmp_path):
    """A real write error (the file-size limit, EFBIG, as a full disk gives ENOSPC) in a child
    process: write_json raises naming the file, and the file holds the previous save."""
    script = f"""
import json, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the limit as an error, not a signal
from minikv.bench.common import write_json
path = {str(tmp_path / 'out.json')!r}
write_json(path, {{"rows": [1]}})
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
try:
    write_json(path, {{"rows": list(range(100000))}})
except OSError as err:
    print(err)
"""
    proc = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(f"[Errno {errno.EFBIG}] cannot write {tmp_path / 'out.json'}: File too large")
    assert strict_loads((tmp_path / "out.json").read_text())["rows"] == [1]
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind


def test_a_compare_whose_disk_fills_keeps_its_last_save(tmp_path, monkeypatch, capsys):
    """The second save of a compare run meets a full disk (ENOSPC injected at the fsync every
    save does): one line naming the file and where the rows are, exit 2, compare.json whole."""
    import minikv.atomic
    import minikv.bench.compare as compare
    from minikv.bench.__main__ import main
    from minikv.cli import run_command
    from minikv.loading import resolve
    from minikv.tokenizer import load_tokenizer

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    def two_prompts(model, tok, result, instances, long_ids, long_prompt, saved):
        result["rows"][0]["scores"] = {"niah_single_1": 100.0}
        saved()
        monkeypatch.setattr(minikv.atomic.os, "fsync", full)
        result["rows"][0]["scores"] = {"niah_single_1": 50.0}
        saved()

    tok = load_tokenizer(resolve("smollm2", progress=False))
    monkeypatch.setattr(compare, "load_model", lambda args: (None, tok))
    monkeypatch.setattr(compare, "run_rows", two_prompts)
    out = tmp_path / "run"
    code = run_command(main, ["compare", "--tasks", "niah_single_1", "--seeds", "0", "1", "--policy", "streaming",
                              "--budget", "64", "--out", str(out), "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert err[-1] == (f"error: [Errno 28] cannot write {out / 'compare.json'}: No space left on device; the rows "
                       f"measured before it are in {out / 'compare.json'}")
    saved = strict_loads((out / "compare.json").read_text())
    assert saved["rows"][0]["scores"] == {"niah_single_1": 100.0} and saved["complete"] is False
    assert [p.name for p in out.iterdir()] == ["compare.json"]


def test_atomic_open_keeps_the_old_file_when_the_block_fails(tmp_path):
    from minikv.atomic import atomic_open, atomic_write

    path = tmp_path / "f.txt"
    atomic_write(path, "old")
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(path) as f:
            f.write("new, half")
            raise KeyboardInterrupt
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["f.txt"]  # no temporary left
    link = tmp_path / "link.txt"
    link.symlink_to(path)
    atomic_write(link, b"new")  # through a link: the file it points at is replaced, the link stays
    assert link.is_symlink() and path.read_bytes() == b"new"
    atomic_write(path, b"new")
    umask = os.umask(0)
    os.umask(umask)
    assert path.read_bytes() == b"new" and (path.stat().st_mode & 0o777) == 0o666 & ~umask  # as open() makes it


# -- a partial compare.json says so --------------------------------------------------------------


def test_a_partial_compare_json_renders_as_partial(tmp_path):
    from minikv.bench import compare_report as report

    run = {"settings": {"preset": "smoke", "tasks": ["niah_single_1", "long"], "length": 768},
           "rows": [{"source": "minikv", "spec": "full", "policy": "full", "budget": None, "error": None,
                     "scores": {"niah_single_1": 100.0}}]}
    report.annotate(run)
    assert "every row ran through every task and the long pass" in report.markdown(run)
    run["complete"] = False
    text = report.markdown(run)
    assert text.startswith("**Partial run**") and "every row ran" not in text
    run["complete"], run["settings"]["tasks"] = True, ["niah_single_1"]
    text = report.markdown(run)
    assert "every row ran through every task," in text and "long pass" not in text.split("\n")[0]


@pytest.mark.parametrize("data, says", [({"rows": [1, 2]}, "row 0 is 1, not an object with a 'policy' name"),
                                        ({"rows": [], "settings": []}, "'settings' is not an object")])
def test_from_a_json_that_is_not_a_compare_run_is_one_line(tmp_path, data, says):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    proc = subprocess.run([PYTHON, "-m", "minikv.bench", "compare", "--from", str(bad)], capture_output=True,
                          text=True, cwd=ROOT, env=env(), timeout=120)
    assert proc.returncode == 2 and proc.stderr == f"error: {bad} is not a compare JSON: {says}\n", proc.stderr

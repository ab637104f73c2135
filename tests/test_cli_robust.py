"""Nothing a command computes is lost, nothing it prints is silently wrong (issue 42): output paths
checked before the model loads, runs that measured nothing end in an error, strict JSON, bounded
threads, quiet pipes and Ctrl-C, inputs refused for what they are, messages that name the path.

The command-line cases start the real `python -m` entry points in a subprocess."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def env(**extra) -> dict:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def as_at_a_terminal() -> None:
    """The child's Ctrl-C as a terminal delivers it: a harness that runs the tests in the
    background (bash `cmd &` without job control) hands its children SIGINT ignored, and Python
    then never raises KeyboardInterrupt."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def cli(*argv, timeout=180, **kwargs) -> subprocess.CompletedProcess:
    """python -m <argv>, from the repository root; text stdout and stderr."""
    kwargs.setdefault("env", env())
    return subprocess.run([PYTHON, "-m", *argv], capture_output=True, text=True, cwd=ROOT, timeout=timeout, **kwargs)


def shell(script: str, timeout=180) -> subprocess.CompletedProcess:
    """A bash line with `python` standing for this interpreter: closed streams, pipes."""
    return subprocess.run(["bash", "-c", script.replace("python ", f"{PYTHON} ")], capture_output=True, text=True,
                          cwd=ROOT, env=env(), timeout=timeout)


def one_error(proc, *fragments) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]
    return lines[0]


def strict_loads(text: str):
    """json.loads as JSON.parse or jq read it: NaN and Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")

    return json.loads(text, parse_constant=refuse)


# -- 2. every output path checked before the model loads -----------------------------------------

MISSING = "/nonexistent-minikv-dir/out"
OUTPUTS = [
    ("cluster-heads", "--out", MISSING + ".json"),
    ("compare", "--json", MISSING + ".json"),
    ("dci-recall", "--json", MISSING + ".json"),
    ("memory", "--png", MISSING + ".png"),
    ("memory", "--json", MISSING + ".json"),
    ("needle-mass", "--json", MISSING + ".json"),
    ("passkey", "--json", MISSING + ".json"),
    ("ppl", "--json", MISSING + ".json"),
    ("recall", "--json", MISSING + ".json"),
    ("speed", "--png", MISSING + ".png"),
    ("speed", "--json", MISSING + ".json"),
]


@pytest.mark.parametrize("command, flag, path", OUTPUTS, ids=[f"{c} {f}" for c, f, _ in OUTPUTS])
def test_every_benchmark_refuses_an_unwritable_output_before_it_runs(command, flag, path):
    t0 = time.perf_counter()
    proc = cli("minikv.bench", command, flag, path, "--threads", "1", timeout=120)
    one_error(proc, flag, path, "does not exist")
    assert proc.stdout == ""
    assert time.perf_counter() - t0 < 120  # the import only: the run itself takes minutes


def test_compare_out_that_is_a_file_is_refused_before_the_model(tmp_path):
    (tmp_path / "file").write_text("keep me")
    proc = cli("minikv.bench", "compare", "--out", str(tmp_path / "file"), "--threads", "1")
    one_error(proc, "--out", "is a file, not a directory")
    assert (tmp_path / "file").read_text() == "keep me"
    proc = cli("minikv.bench", "compare", "--out", str(tmp_path / "file" / "sub"), "--threads", "1")
    one_error(proc, "--out")


def test_output_checks_keep_existing_files_and_leave_nothing_new(tmp_path):
    from argparse import Namespace

    from minikv.cli import check_output_paths

    kept = tmp_path / "old.json"
    kept.write_text("{}")
    check_output_paths(Namespace(json=str(kept), png=str(tmp_path / "new.png"), out=str(tmp_path / "dir")),
                       dirs=("out",))
    assert kept.read_text() == "{}" and not (tmp_path / "new.png").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.json"]  # the directory is made when written
    with pytest.raises(ValueError, match="is a directory"):
        check_output_paths(Namespace(json=str(tmp_path)))


def test_compare_and_recall_that_measured_nothing_exit_2():
    # freekv keeps absolute positions: 9000 tokens exceed SmolLM2's context of 8192 in every row
    proc = cli("minikv.bench", "compare", "--tasks", "niah_single_1", "--seeds", "0", "--policy", "freekv",
               "--budget", "64", "--length", "9000", "--threads", "1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: no row ran"), proc.stderr
    assert proc.stdout == ""
    proc = cli("minikv.bench", "recall", "--policy", "freekv", "--budget", "128", "--prompt-length", "9000",
               "--threads", "1")
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: no policy was measured")
    assert proc.stdout == ""


def test_interrupted_compare_says_where_its_rows_are(tmp_path, monkeypatch, capsys):
    import minikv.bench.compare as compare
    from minikv.bench.__main__ import main
    from minikv.cli import run_command

    def interrupted_after_one_prompt(model, tok, result, instances, long_ids, long_prompt, saved):
        result["rows"][0]["scores"] = {"niah_single_1": 100.0}
        saved()
        raise KeyboardInterrupt

    from minikv.loading import resolve
    from minikv.tokenizer import load_tokenizer

    tok = load_tokenizer(resolve("smollm2", progress=False))
    monkeypatch.setattr(compare, "load_model", lambda args: (None, tok))
    monkeypatch.setattr(compare, "run_rows", interrupted_after_one_prompt)
    out = tmp_path / "run"
    code = run_command(main, ["compare", "--tasks", "niah_single_1", "--seeds", "0", "--policy", "streaming",
                              "--budget", "64", "--out", str(out), "--threads", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 130
    assert err[-1] == f"interrupted: the rows measured so far are in {out / 'compare.json'}"
    assert strict_loads((out / "compare.json").read_text())["rows"][0]["scores"] == {"niah_single_1": 100.0}


# -- 5. strict JSON --------------------------------------------------------------------------------


def test_dumps_writes_null_for_nan_and_infinity(tmp_path):
    from minikv.bench.common import write_json
    from minikv.cli import dumps

    data = {"a": float("nan"), "b": [1.0, float("inf"), -float("inf")], "c": ({"d": 2},)}
    assert strict_loads(dumps(data)) == {"a": None, "b": [1.0, None, None], "c": [{"d": 2}]}
    write_json(str(tmp_path / "x.json"), {"rate": float("nan")})
    assert strict_loads((tmp_path / "x.json").read_text())["rate"] is None


@pytest.mark.parametrize("spec, keys", [("freekv", ["speculative_exact_rate"]),
                                        ("icecache", ["keys_scored_fraction", "mean_page_fill"])])
def test_generate_json_is_strict_on_a_short_prompt(spec, keys):
    proc = cli("minikv.generate", "--prompt", "Hi", "--policy", spec, "--max-new-tokens", "2", "--json",
               "--threads", "1")
    assert proc.returncode == 0, proc.stderr
    stats = strict_loads(proc.stdout)["stats"]
    for key in keys:
        assert key in stats


# -- 6. threads, streams, pipes, Ctrl-C -------------------------------------------------------------


def test_threads_beyond_the_cores_are_capped_with_a_warning():
    from minikv.cli import usable_cores

    cores = usable_cores()
    proc = cli("minikv.generate", "--prompt", "Hi", "--max-new-tokens", "1", "--threads", "10000", "--quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.strip() == (f"warning: --threads 10000 is more than the {cores} CPU cores this process "
                                   f"can use; using {cores}")


def test_closed_stdin_is_one_line_and_closed_stdout_is_quiet():
    proc = shell("python -m minikv.generate --prompt-file - --threads 1 <&-")
    one_error(proc, "stdin is closed")
    proc = shell("python -m minikv.generate --prompt Hi --max-new-tokens 2 --threads 1 --quiet >&-")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


@pytest.mark.parametrize("flags", ["", "--json"])
def test_a_reader_that_stops_reading_ends_the_command_quietly(flags):
    proc = shell(f"python -m minikv.generate --prompt 'Tell me a story' --max-new-tokens 200 --ignore-eos "
                 f"--threads 1 --quiet {flags} | head -c 5; echo \" rc=${{PIPESTATUS[0]}}\"")
    assert proc.stdout.endswith(" rc=0\n") and len(proc.stdout) == 5 + len(" rc=0\n"), proc.stdout
    assert proc.stderr == ""


def interrupt(argv, after: float, twice: bool) -> subprocess.CompletedProcess:
    p = subprocess.Popen([PYTHON, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         cwd=ROOT, env=env(), preexec_fn=as_at_a_terminal)
    time.sleep(after)
    p.send_signal(signal.SIGINT)
    if twice:
        time.sleep(0.05)
        p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, p.returncode, out, err)


@pytest.mark.parametrize("after, twice", [(0.2, False), (0.2, True), (1.0, True)])
def test_ctrl_c_while_importing_is_one_line(after, twice):
    proc = interrupt(["minikv.generate", "--prompt", "Hi", "--threads", "1"], after, twice)
    assert (proc.returncode, proc.stderr) == (130, "interrupted\n")


def test_two_ctrl_c_while_generating_are_one_line():
    p = subprocess.Popen([PYTHON, "-m", "minikv.generate", "--prompt", "Tell me a story", "--max-new-tokens", "5000",
                          "--ignore-eos", "--threads", "1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         cwd=ROOT, env=env(), preexec_fn=as_at_a_terminal)
    assert p.stdout.read(1)  # the first token is out: generation runs
    p.send_signal(signal.SIGINT)
    time.sleep(0.05)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=120)
    lines = err.decode().strip().splitlines()
    assert p.returncode == 130 and len(lines) == 1 and lines[0].startswith("interrupted: "), err


# -- 7. inputs read as what they are -------------------------------------------------------------


def test_stdin_that_is_not_utf8_is_refused_like_a_file():
    proc = subprocess.run([PYTHON, "-m", "minikv.generate", "--prompt-file", "-", "--threads", "1"],
                          input=b"The capital \xff of France", capture_output=True, cwd=ROOT, env=env(), timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.decode().strip() == "error: the prompt on stdin is not UTF-8 text (invalid start byte at byte 12)"


def test_command_line_bytes_that_are_not_utf8_are_refused_before_the_model(monkeypatch):
    from minikv.generate.__main__ import check_args, parse_args

    proc = subprocess.run([PYTHON, "-m", "minikv.generate", "--prompt", b"caf\xe9", "--threads", "1"],
                          capture_output=True, cwd=ROOT, env=env(), timeout=120)
    assert proc.returncode == 2 and b"is not UTF-8 text" in proc.stderr and proc.stderr.count(b"\n") == 1
    with pytest.raises(ValueError, match="lone surrogate"):
        check_args(parse_args(["--prompt", "caf\udce9"]))


def test_a_duplicate_spec_key_is_an_error():
    from minikv.policies import make

    with pytest.raises(ValueError, match="parameter 'sink' is given twice in 'streaming:sink=4,sink=8'"):
        make("streaming:sink=4,sink=8")
    proc = cli("minikv.generate", "--prompt", "Hi", "--policy", "streaming:sink=4, sink=8")
    one_error(proc, "given twice")


# -- 8. messages that name the path and say what to do ------------------------------------------


def test_cpu_with_an_index_says_what_to_use():
    proc = cli("minikv.generate", "--prompt", "Hi", "--device", "cpu:0")
    assert one_error(proc) == "error: device 'cpu:0': the CPU is one device, without an index; use cpu"


def test_minikv_cache_that_is_a_file(tmp_path):
    (tmp_path / "cache").write_text("")
    proc = cli("minikv.generate", "--prompt", "Hi", env=env(MINIKV_CACHE=str(tmp_path / "cache")))
    assert one_error(proc) == (f"error: the model cache {tmp_path / 'cache'} is a file, not a directory; "
                               "point MINIKV_CACHE at a directory")


def test_a_cache_that_cannot_be_written_names_minikv_cache():
    where = "/sys/minikv-cache-test"  # sysfs: no one may create a directory there, root included
    proc = cli("minikv.generate", "--prompt", "Hi", env=env(MINIKV_CACHE=where))
    line = one_error(proc, f"cannot write the model cache {where}", "set MINIKV_CACHE to a directory you can write")
    assert ".importing" not in line


def test_a_full_disk_names_the_cache_on_a_line_of_its_own(tmp_path, monkeypatch, capsys):
    import minikv.gguf_import
    from minikv.cli import run_command
    from minikv.generate.__main__ import main

    def full(file, shapes, tensors, metadata):
        next(iter(tensors))  # the import's progress bar is open and drawn
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setenv("MINIKV_CACHE", str(tmp_path))
    monkeypatch.setattr(minikv.gguf_import, "write_safetensors", full)
    assert run_command(main, ["--prompt", "Hi", "--threads", "1"]) == 2
    err = capsys.readouterr().err
    last = err.split("\r")[-1]  # what a terminal shows on the last line
    assert last == (f"error: [Errno 28] no space left on the device to write the model cache {tmp_path}: free "
                    "some space, or set MINIKV_CACHE to a directory on another disk\n"), err
    assert [p.name for p in tmp_path.iterdir()] == []  # no temporary directory left behind

"""The commands' one error path and their checks before the model loads, the summary line, the
statistics table, and the loader's messages.

Most cases run a command's main() in this process through minikv.cli.run_command, with the model
loader replaced by one that fails the test: a flag error must be reported before any weight is
read. Two cases start the real `python -m` entry points, to hold the exit code and the absence of
a traceback end to end."""
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import minikv.loading
from minikv.bench.__main__ import main as bench_main
from minikv.cli import one_line, run_command
from minikv.generate.__main__ import main as generate_main
from minikv.generate.__main__ import print_stats, summary_line


@pytest.fixture
def no_model_load(monkeypatch):
    """Any attempt to read weights fails: the checks must have stopped the command before."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr(minikv.loading, "load_model", refuse)
    monkeypatch.setattr(minikv.loading, "import_gguf", refuse)


def run(main, argv, capsys):
    code = run_command(main, argv)
    err = capsys.readouterr().err
    return code, err


GENERATE_ERRORS = [
    (["--prompt", "hi", "--policy", "nope"], "unknown policy 'nope'; available: "),
    (["--prompt", "hi", "--policy", "freekv:speculative=maybe"], "speculative is a boolean"),
    (["--prompt", "hi", "--policy", "streaming:window=abc"], "window must be an integer"),
    (["--prompt", "hi", "--policy", "streaming:sink=-1"], "sink must be an int >= 0"),
    (["--prompt", "hi", "--policy", "softfreeze:softness=inf"], "softness must be a finite float"),
    (["--prompt", "hi", "--policy", "softfreeze:tau=nan"], "tau must be a finite float"),
    (["--prompt", "hi", "--top-p", "2"], "top_p must be in (0, 1]"),
    (["--prompt", "hi", "--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--prompt", "hi", "--temperature", "nan"], "temperature must be a finite number >= 0"),
    (["--prompt", "hi", "--temperature", "inf"], "temperature must be a finite number >= 0"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--prompt", "hi", "--threads", "0"], "--threads must be >= 1"),
    (["--prompt", "hi", "--dtype", "float8"], "unknown dtype 'float8'"),
    (["--prompt", "hi", "--device", "cpu:0"], "device 'cpu:0': the CPU is one device, without an index; use cpu"),
    (["--prompt", "hi", "--policy", "streaming:sink=4,sink=8"], "parameter 'sink' is given twice"),
    (["--prompt", "   "], "the prompt is empty"),
    (["--prompt-file", "/nonexistent/prompt.txt"], "prompt file /nonexistent/prompt.txt does not exist"),
    (["--prompt", "hi", "--model", "/nonexistent/model"], "no model '/nonexistent/model'"),
    (["--prompt", "hi", "--model", "/nonexistent/model.gguf"], "GGUF file /nonexistent/model.gguf does not exist"),
]


@pytest.mark.parametrize("argv, message", GENERATE_ERRORS, ids=[m for _, m in GENERATE_ERRORS])
def test_generate_errors_are_one_line_before_loading(argv, message, capsys, no_model_load):
    code, err = run(generate_main, argv, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_generate_model_path_that_is_a_file_or_an_empty_directory(tmp_path, capsys, no_model_load):
    notes = tmp_path / "notes.txt"
    notes.write_text("not a model")
    code, err = run(generate_main, ["--prompt", "hi", "--model", str(notes)], capsys)
    assert code == 2 and f"{notes} is a file, not a model" in err and "does not exist" not in err
    code, err = run(generate_main, ["--prompt", "hi", "--model", str(tmp_path)], capsys)
    assert code == 2 and "has no config.json" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="holds the message of a machine without CUDA")
def test_cuda_without_cuda_says_so(capsys, no_model_load):
    code, err = run(generate_main, ["--prompt", "hi", "--device", "cuda"], capsys)
    assert code == 2 and "no CUDA device is available" in err and "pin" not in err
    code, err = run(bench_main, ["speed", "--device", "cuda"], capsys)
    assert code == 2 and "no CUDA device is available" in err


BENCH_ERRORS = [
    (["passkey", "--policy", "nope"], "unknown policy 'nope'"),
    (["passkey", "--depths", "0.5", "1.5"], "a depth is in [0, 1]"),
    (["passkey", "--policy", "freekv", "--budget", "100"], "multiple of page_size"),
    (["passkey", "--lengths", "0"], "--lengths must be >= 1"),
    (["ppl", "--tokens", "1"], "--tokens must be >= 2"),
    (["ppl", "--policy", "streaming:R=x"], "R must be an integer"),
    (["ppl", "--tpot-at", "600", "-5"], "--tpot-at takes token counts >= 1, got -5"),
    (["ppl", "--json", "/nonexistent-dir/ppl.json"], "--json /nonexistent-dir/ppl.json: directory /nonexistent-dir does not exist"),
    (["memory", "--policy", "softfreeze:egr=maybe"], "egr is a boolean"),
    (["memory", "--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["speed", "--policy", "streaming:nope=1"], "has no parameter 'nope'"),
    (["speed", "--threads", "0"], "--threads must be >= 1"),
    (["speed", "--model", "/nonexistent/x.gguf"], "does not exist"),
]


@pytest.mark.parametrize("argv, message", BENCH_ERRORS, ids=[" ".join(a) for a, _ in BENCH_ERRORS])
def test_bench_errors_are_one_line_before_loading(argv, message, capsys, no_model_load):
    code, err = run(bench_main, argv, capsys)
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_bench_check_validates_without_running(capsys, no_model_load):
    code, err = run(bench_main, ["--check", "passkey", "--depths", "0", "1", "--policy", "streaming"], capsys)
    assert code == 0 and "flags are valid" in err


def test_unexpected_exceptions_are_one_line_too(capsys):
    def broken(argv):
        raise KeyError("surprise")

    code, err = run(broken, None, capsys)
    assert code == 1 and err.count("\n") == 1 and "internal error, KeyError" in err and "MINIKV_TRACEBACK" in err
    assert one_line(ValueError("two\n  lines")) == "two; lines"


def test_entry_points_exit_2_without_a_traceback():
    """The real `python -m` commands, as a user types them."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for cmd in (["minikv.generate", "--prompt", "hi", "--policy", "freekv:speculative=maybe"],
                ["minikv.bench", "passkey", "--depths", "2"]):
        p = subprocess.run([sys.executable, "-m", *cmd], capture_output=True, text=True, env=env, timeout=300)
        assert p.returncode == 2, p.stderr
        assert p.stderr.startswith("error: ") and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr


# -- the loader's messages ---------------------------------------------------------------------


def test_load_without_tokenizer_names_load_model(smollm2, tmp_path):
    from minikv.loading import resolve

    source = resolve("smollm2", progress=False)
    for name in ("config.json", "model.safetensors"):
        os.symlink(source / name, tmp_path / name)
    with pytest.raises(FileNotFoundError, match=r"no tokenizer in .*minikv\.load_model\("):
        minikv.load(tmp_path)
    model = minikv.load_model(tmp_path)  # the model alone loads
    assert model.cfg.n_layers == smollm2[0].cfg.n_layers
    shutil.rmtree(tmp_path)


# -- the real model: summary line, table, threads ----------------------------------------------


@pytest.fixture
def loaded(smollm2, monkeypatch):
    """The commands' loader hands out the session's model instead of reading it again."""
    import minikv.loading

    monkeypatch.setattr(minikv.loading, "load", lambda *a, **k: smollm2)
    threads = torch.get_num_threads()
    yield smollm2
    torch.set_num_threads(threads)


def test_generate_prints_a_summary_line_and_a_table_with_human_units(loaded, capsys):
    model, tok = loaded
    code = run_command(generate_main, ["--chat", "--prompt", "What is the capital of France?", "--max-new-tokens", "12",
                                       "--stats", "--threads", "1"])
    out, err = capsys.readouterr()
    assert code == 0 and "Paris" in out
    n_prompt = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                      add_generation_prompt=True), add_bos=False))
    line = err.splitlines()[0]
    m = re.fullmatch(r"prompt (\d+) tokens, ([\d.]+) tok/s \| generated (\d+) tokens, ([\d.]+) tok/s \| policy full \| "
                     r"device KV (\d+) tokens, ([\d.]+) (KiB|MiB) \| host KV 0 tokens, 0 B", line)
    assert m, line
    assert int(m[1]) == n_prompt and 1 < int(m[3]) <= 12
    assert int(m[5]) == n_prompt + int(m[3]) - 1  # every token but the last sampled one went through the cache
    assert re.search(r"^device_bytes +[\d.]+ (KiB|MiB)$", err, re.M)  # the --stats table, human units
    assert torch.get_num_threads() == 1
    code = run_command(generate_main, ["--prompt", "Hello", "--max-new-tokens", "2", "--quiet"])
    assert code == 0 and capsys.readouterr().err == ""


def test_one_token_has_no_time_per_token(loaded, capsys):
    model, tok = loaded
    stats = minikv.generate(model, tok, "Hello", max_new_tokens=1).stats
    assert stats["new_tokens"] == 1 and stats["tpot_s"] is None and stats["tokens_per_s"] is None
    print_stats(stats)
    err = capsys.readouterr().err
    assert re.search(r"^tpot_s +-$", err, re.M) and "nan" not in err
    assert "generated 1 tokens, - tok/s" in summary_line(stats)


def test_batch_results_carry_each_sequence_and_the_batch_once(loaded):
    model, tok = loaded
    prompts = ["What is the capital of France?", "Write a long poem about the sea."]
    batch = minikv.generate(model, tok, prompts, chat=True, max_new_tokens=14)
    assert isinstance(batch, list) and len(batch) == 2
    for prompt, r in zip(prompts, batch):
        n_prompt = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}],
                                                          add_generation_prompt=True), add_bos=False))
        assert r.stats["prompt_tokens"] == n_prompt
        assert r.stats["new_tokens"] == len(r.token_ids)
        assert "tpot_s" not in r.stats  # timing is the batch's
    short, long = batch
    assert short.stats["finish"] == "eos" and short.stats["new_tokens"] < 14  # "Paris." and its end of turn
    assert long.stats["finish"] == "length" and long.stats["new_tokens"] == 14
    assert batch.stats["new_tokens"] == short.stats["new_tokens"] + long.stats["new_tokens"]
    assert batch.stats["prompt_tokens"] == short.stats["prompt_tokens"] + long.stats["prompt_tokens"]
    assert batch.stats["tpot_s"] > 0 and batch.stats["policy"] == "full"


def test_prefill_progress_counts_prompt_tokens(loaded):
    model, tok = loaded
    calls = []
    r = minikv.generate(model, tok, "The capital of France is a city that", max_new_tokens=1,
                        progress=lambda done, total: calls.append((done, total)))
    n, layers = r.stats["prompt_tokens"], model.cfg.n_layers
    assert len(calls) == layers and {total for _, total in calls} == {n}
    assert [done for done, _ in calls] == [round(n * i / layers) for i in range(1, layers + 1)]


def test_generate_help_lists_policies_defaults_and_the_same_max_new_tokens_as_the_api(capsys):
    import inspect

    from minikv.policies import available

    with pytest.raises(SystemExit):
        generate_main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    api_default = inspect.signature(minikv.generate).parameters["max_new_tokens"].default
    assert f"(default: {api_default}, as minikv.generate)" in text
    assert "(default: smollm2)" in text and "(default: full;" in text
    from minikv.loading import ALIASES
    assert all(alias in text for alias in ALIASES)  # the names --model takes, each real model's
    for name in available():
        assert re.search(rf"\b{name}: .*?backend=eager", text), name
    assert "speculative=true" in text  # booleans shown as the words the specs take


def test_bench_help_tells_the_users_benchmarks_from_the_research_probes(capsys):
    """The layout decides the group: minikv/bench/ holds what a user runs to choose a policy,
    minikv/bench/research/ the probes; --help lists them under two headings, CLI names as ever."""
    with pytest.raises(SystemExit):
        bench_main(["--help"])
    out = capsys.readouterr().out
    users, _, research = out.partition("research probes (minikv/bench/research/):")
    users = users.partition("to choose a policy:")[2]
    listed = lambda part: {line.split()[0] for line in part.splitlines() if line.startswith("  ") and line[2] != " "}
    assert listed(users) == {"compare", "speed", "memory", "passkey", "ppl", "gpu-check"}
    assert listed(research) == {"needle-mass", "quant2-cost", "recall", "dci-recall", "cluster-heads"}
    assert "lockstep" in users and "per layer and KV head" in research  # each line: its module's summary


def test_generate_help_lists_every_parameter_with_its_bounds_and_meaning(capsys):
    """--help derives from the policies' declarations: every parameter, its bounds, its meaning,
    and the cap by the context."""
    from minikv.policies import available
    from minikv.policies.registry import _REGISTRY, parameters

    with pytest.raises(SystemExit):
        generate_main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for name in available():
        for key in parameters(_REGISTRY[name]):
            assert f" {key}=" in out, (name, key)
    assert "softness=2.0 float in (0, 65536.0]: the paper's k in Eq. 3" in out
    assert "budget larger than the context costs what full KV costs" in out

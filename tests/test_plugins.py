"""Policies from outside minikv (minikv/plugins.py): @minikv.register_policy, --import MODULE on the
commands (imported before the flags are parsed: the policy is in --help and --policy takes it), the
entry-point group minikv.policies, and one line with exit code 2 for a module that fails."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import minikv
from minikv.policies.base import _REGISTRY

ROOT = Path(__file__).resolve().parent.parent

MODULE = (Path(__file__).resolve().parent / "everything_policy.py").read_text()  # defines everything_plugin


def command(*args, cwd, env=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


@pytest.fixture
def plugin_dir(tmp_path, monkeypatch):
    """A directory holding my_policies.py, the current one; the registry as it was afterwards."""
    (tmp_path / "my_policies.py").write_text(MODULE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield tmp_path
    _REGISTRY.pop("everything_plugin", None)
    sys.modules.pop("my_policies", None)


def generate_main(argv):
    from minikv.cli import run_command
    from minikv.generate.__main__ import main

    return run_command(main, argv)


def bench_main(argv):
    from minikv.bench.__main__ import main
    from minikv.cli import run_command

    return run_command(main, argv)


def test_generate_imports_the_module_before_parsing_its_flags(plugin_dir, capsys):
    """--help lists the policy; --policy runs it (SmolLM2, 3 tokens): a module of the current
    directory, as python -m finds it."""
    with pytest.raises(SystemExit) as done:
        generate_main(["--import", "my_policies", "--help"])
    assert done.value.code == 0 and "everything_plugin: Full KV under another name" in capsys.readouterr().out
    assert generate_main(["--import", "my_policies", "--policy", "everything_plugin", "--prompt", "Hello",
                          "--max-new-tokens", "3", "--json"]) == 0
    assert '"policy": "everything_plugin"' in capsys.readouterr().out


def test_bench_takes_import_on_every_command_and_a_file_path(plugin_dir, capsys):
    path = str(plugin_dir / "my_policies.py")
    assert bench_main(["--check", "compare", "--policy", "everything_plugin"]) == 2
    assert "unknown policy 'everything_plugin'" in capsys.readouterr().err
    assert bench_main(["--check", "compare", "--import", path, "--policy", "everything_plugin", "--preset", "smoke"]) == 0
    with pytest.raises(SystemExit):
        bench_main(["passkey", "--import=" + path, "--help"])
    assert "--import MODULE" in capsys.readouterr().out


@pytest.mark.parametrize("module, says", [
    ("no_such_module_xyz", "error: --import no_such_module_xyz: ModuleNotFoundError: No module named"),
    ("broken_policies", "error: --import broken_policies: ZeroDivisionError: division by zero"),
    ("missing.py", "error: --import missing.py: FileNotFoundError: no such file: missing.py"),
])
def test_a_bad_module_is_one_line_and_exit_2(plugin_dir, capsys, module, says):
    (plugin_dir / "broken_policies.py").write_text("1 / 0\n")
    for main in (lambda a: generate_main(["--prompt", "x", *a]), lambda a: bench_main(["compare", "--check", *a])):
        assert main(["--import", module]) == 2
        err = capsys.readouterr().err
        assert err.startswith(says) and err.count("\n") == 1, err
    sys.modules.pop("broken_policies", None)


def test_a_command_imports_before_anything_else():
    """A fresh process, from the repository root: python -m minikv.generate --import FILE --help."""
    out = command("-m", "minikv.generate", "--import", "tests/everything_policy.py", "--help", cwd=ROOT)
    assert out.returncode == 0 and "everything_plugin" in out.stdout, out.stderr


def test_an_entry_point_is_discovered(plugin_dir, monkeypatch):
    """A distribution declaring [minikv.policies] in its entry points: its module is imported the
    first time minikv lists or makes a policy, with no flag."""
    import minikv.plugins

    info = plugin_dir / "my_policies-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-policies\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[minikv.policies]\neverything = my_policies\n")
    sys.path.insert(0, str(plugin_dir))
    monkeypatch.setattr(minikv.plugins, "_loaded_entry_points", False)
    assert "everything_plugin" in minikv.available_policies()
    assert minikv.make_policy("everything_plugin").name == "everything_plugin"


def test_register_policy_refuses_what_it_cannot_register():
    from dataclasses import dataclass

    from minikv.policies.full import Full

    with pytest.raises(TypeError, match="subclass of minikv.policies.Policy"):
        minikv.register_policy(object)

    @dataclass(eq=False, kw_only=True)
    class Taken(Full):
        name = "streaming"

    with pytest.raises(ValueError, match="'streaming' is taken by minikv.policies.streaming.Streaming"):
        minikv.register_policy(Taken)

    @dataclass(eq=False, kw_only=True)
    class Spaced(Full):
        name = "two words"

    with pytest.raises(ValueError, match="must be a word"):
        minikv.register_policy(Spaced)
    assert _REGISTRY["streaming"].__module__ == "minikv.policies.streaming" and "two words" not in _REGISTRY


# -- a file or directory by path: a namespace of its own (issue 52) ---------------------------------


@pytest.mark.parametrize("stem", ["random", "json"])
def test_a_plugin_file_named_as_a_stdlib_module_shadows_nothing(tmp_path, stem):
    """p/random.py (a natural name for a random-eviction baseline) is imported as
    minikv_plugins.random: the standard library's random stays what every later import gets."""
    (tmp_path / "p").mkdir()
    (tmp_path / "p" / f"{stem}.py").write_text(MODULE)
    out = command("-m", "minikv.generate", "--import", f"p/{stem}.py", "--policy", "everything_plugin",
                  "--prompt", "Hello", "--max-new-tokens", "2", "--json", "--threads", "1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert '"policy": "everything_plugin"' in out.stdout


def test_a_path_is_imported_under_minikv_plugins(plugin_dir):
    import json
    import random

    import minikv.plugins

    (plugin_dir / "json.py").write_text(MODULE)
    module = minikv.plugins.import_module(str(plugin_dir / "json.py"))
    try:
        assert module.__name__ == "minikv_plugins.json" and sys.modules["json"] is json
        assert _REGISTRY["everything_plugin"].__module__ == "minikv_plugins.json"
        assert minikv.plugins.import_module(str(plugin_dir / "json.py")) is module  # twice: once
        other = plugin_dir / "other"
        other.mkdir()
        (other / "json.py").write_text("X = 1\n")
        second = minikv.plugins.import_module(str(other / "json.py"))  # same stem, another file
        assert second.__name__ == "minikv_plugins.json_2" and second.X == 1
        assert sys.modules["random"] is random
    finally:
        for name in ("minikv_plugins.json", "minikv_plugins.json_2"):
            sys.modules.pop(name, None)


def test_a_package_directory_is_imported_and_a_bad_path_is_one_line(plugin_dir, capsys):
    pkg = plugin_dir / "pkgdir"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from .impl import *  # noqa\n")
    (pkg / "impl.py").write_text(MODULE)
    (plugin_dir / "plain").mkdir()
    (plugin_dir / "notes.txt").write_text("")
    try:
        assert bench_main(["--check", "compare", "--import", "./pkgdir/", "--policy", "everything_plugin",
                           "--preset", "smoke"]) == 0
        assert sys.modules["minikv_plugins.pkgdir"].__path__ == [str(pkg)]
    finally:
        sys.modules.pop("minikv_plugins.pkgdir", None)
        sys.modules.pop("minikv_plugins.pkgdir.impl", None)
    capsys.readouterr()
    for path, says in [("./plain", "error: --import ./plain: FileNotFoundError: directory plain has no __init__.py"),
                       ("notes.txt", "error: --import notes.txt: ValueError: notes.txt is not a .py file"),
                       ("./nowhere", "error: --import ./nowhere: FileNotFoundError: no such file: nowhere")]:
        assert generate_main(["--prompt", "x", "--import", path]) == 2
        err = capsys.readouterr().err
        assert err.startswith(says) and err.count("\n") == 1, err


# -- a plugin's bug is the plugin's: named, and what was generated kept (issue 52) ---------------------

BOOM = '''
from dataclasses import dataclass

import torch

import minikv
from minikv.policies.full import Full, FullLayer


class BoomLayer(FullLayer):
    def decode(self, q, k, v, positions):
        if self.policy.steps == 4:
            raise RuntimeError("kaboom")
        return super().decode(q, k, v, positions)


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class Boom(Full):
    """Full KV whose decode fails after four tokens (the prefill's and three decoded)."""

    name = "boom"

    def make_layer(self, index):
        return BoomLayer(self, index)


@minikv.register_policy
@dataclass(eq=False, kw_only=True)
class Holding(Full):
    """Full KV whose stats() hold a tensor."""

    name = "holding"

    def stats(self):
        return {**super().stats(), "probe": torch.ones(2)}
'''


def test_a_plugin_failing_mid_generation_is_named_and_the_text_kept(tmp_path):
    (tmp_path / "boom.py").write_text(BOOM)
    out = command("-m", "minikv.generate", "--import", "boom.py", "--policy", "boom", "--prompt", "Tell me a story",
                  "--max-new-tokens", "20", "--ignore-eos", "--threads", "1", cwd=tmp_path)
    assert out.returncode == 2, out.stderr
    line = next(i for i, ln in enumerate(BOOM.splitlines(), 1) if "kaboom" in ln)
    assert out.stderr == (f"error: policy 'boom' (module minikv_plugins.boom, {tmp_path / 'boom.py'} line {line}) "
                          "raised RuntimeError: kaboom (a bug in that plugin, not in minikv; MINIKV_TRACEBACK=1 "
                          "shows where)\n")
    assert out.stdout.endswith("\n") and len(out.stdout.strip()) > 5  # the tokens before it, on their own line
    out = command("-m", "minikv.generate", "--import", "boom.py", "--policy", "boom", "--prompt", "Tell me a story",
                  "--max-new-tokens", "20", "--ignore-eos", "--threads", "1", "--json", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.startswith("error: policy 'boom' (module minikv_plugins.boom")
    result = json.loads(out.stdout)
    assert result["stats"]["error"] == "RuntimeError: kaboom" and len(result["token_ids"]) == 4 and result["text"]


def test_a_plugin_stats_json_cannot_hold_is_named_and_the_text_kept(tmp_path):
    (tmp_path / "boom.py").write_text(BOOM)
    out = command("-m", "minikv.generate", "--import", "boom.py", "--policy", "holding", "--prompt", "Hi",
                  "--max-new-tokens", "3", "--ignore-eos", "--threads", "1", "--json", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == ("error: policy 'holding' (module minikv_plugins.boom): stats() gave 'probe', a Tensor, "
                          "which JSON cannot hold (give numbers, strings, lists or dicts); the text is printed above "
                          "with null for it\n")
    result = json.loads(out.stdout)
    assert result["stats"]["probe"] is None and len(result["token_ids"]) == 3 and result["stats"]["new_tokens"] == 3

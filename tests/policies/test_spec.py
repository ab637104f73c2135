"""Policy spec strings: values are parsed as their parameter's type, with no model; the triton
backend on a machine without CUDA runs in Triton's interpreter or is refused at once."""
import os
import subprocess
import sys
import textwrap

from dataclasses import dataclass, field, fields

import pytest
import torch

from minikv.policies import Policy, available, make
from minikv.policies.base import _REGISTRY, register
from minikv.policies.params import param, parse_value, show, value_type


@dataclass(eq=False, kw_only=True)
class _Typed(Policy):
    """A policy whose parameters cover every annotation style the parser reads."""

    name = "_typed_test"

    flag: bool = param(True, "a flag")
    count: int = param(3, "a count")
    ratio: float = param(0.5, "a ratio")
    label: str = param("x", "a label")
    maybe: int | None = param(None, "an optional count")

    def make_layer(self, index):
        raise AssertionError("_typed_test is never bound: it exists to parse specs")


@pytest.fixture(autouse=True)
def typed_policy():
    """Registered only while a test of this file runs: every other test iterates the registry
    (policies.available()) and must not meet it."""
    register(_Typed)
    yield
    del _REGISTRY[_Typed.name]


@pytest.mark.parametrize("text, value", [
    ("true", True), ("on", True), ("yes", True), ("1", True), ("TRUE", True),
    ("false", False), ("off", False), ("no", False), ("0", False), ("Off", False),
])
def test_boolean_words(text, value):
    assert make(f"_typed_test:flag={text}").flag is value


@pytest.mark.parametrize("text", ["maybe", "2", "enabled", "", "none", "y"])
def test_any_other_boolean_is_an_error(text):
    with pytest.raises(ValueError, match="flag is a boolean: use true/false, on/off, yes/no or 1/0"):
        make(f"_typed_test:flag={text}")


def test_values_take_their_parameter_type():
    p = make("_typed_test:count=1,ratio=1,label=1,maybe=none")
    assert p.count == 1 and type(p.count) is int  # 1 for an int stays 1, not True
    assert p.ratio == 1.0 and type(p.ratio) is float
    assert p.label == "1"
    assert p.maybe is None
    assert make("_typed_test:maybe=7").maybe == 7
    with pytest.raises(ValueError, match="count must be an integer, got '1.5'"):
        make("_typed_test:count=1.5")
    with pytest.raises(ValueError, match="count must be an integer, got 'true'"):
        make("_typed_test:count=true")
    with pytest.raises(ValueError, match="ratio must be a number, got 'half'"):
        make("_typed_test:ratio=half")
    with pytest.raises(ValueError, match="maybe must be an integer or none"):
        make("_typed_test:maybe=some")


def test_real_policies_parse_by_type():
    assert make("freekv:speculative=off").speculative is False
    assert make("freekv:speculative=1").speculative is True
    with pytest.raises(ValueError, match="speculative is a boolean"):
        make("freekv:speculative=maybe")
    assert make("streaming:sink=1").sink == 1
    assert make("softfreeze:tau=1").tau == 1.0
    with pytest.raises(ValueError, match="egr is a boolean"):
        make("softfreeze:egr=sometimes")


def test_untyped_parameters_fall_back_to_the_first_fitting_type():
    @dataclass
    class Untyped:  # no informative annotation, no informative default
        a: object = None
        b: object = field(default_factory=list)

    a, b = fields(Untyped)
    assert value_type(a) == (None, True) and value_type(b) == (None, False)
    assert parse_value("on") is True and parse_value("12") == 12 and parse_value("1.5") == 1.5
    assert parse_value("text") == "text" and parse_value("none") is None


# -- backend=triton without CUDA -----------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for machines without CUDA")
def test_triton_backend_without_cuda_runs_in_the_interpreter_after_torch_imported_triton():
    """The crash the README's first users met: building a model on the meta device makes torch
    import triton (torch._dynamo), in compiled mode unless TRITON_INTERPRET was set before, and a
    triton-backend policy then failed at its first kernel call, mid-generation. Importing minikv
    selects the interpreter first; the policy warns once and computes what eager computes."""
    script = textwrap.dedent("""
        import warnings
        import torch
        import minikv
        from minikv.config import ModelConfig
        from minikv.models import build_model
        from minikv.policies import make
        import triton.language.standard as standard  # torch imports triton while building models

        cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                          n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=256, rotary_dim=8)
        with torch.device("meta"):
            build_model(cfg)
        torch.manual_seed(0)
        model = build_model(cfg).eval()
        ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
        logits = {}
        for backend in ("eager", "triton"):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                policy = make(f"freekv:page_size=4,budget=24,sink=4,window=8,backend={backend}")
            assert [str(w.message).startswith("backend=triton without CUDA") for w in caught] == (
                [True] if backend == "triton" else []), caught
            policy.bind(cfg, device="cpu", dtype=torch.float32, max_len=48)  # CPU_ONLY: runs without CUDA only
            out = [model(ids[:, :32], policy=policy)[:, -1]]
            for t in range(32, 36):
                out.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]]), policy=policy)[:, -1])
            logits[backend] = torch.stack(out)
        torch.testing.assert_close(logits["triton"], logits["eager"], rtol=1e-4, atol=1e-4)
        print("ok", type(standard.max).__name__)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["OMP_NUM_THREADS"] = "1"
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                       cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.split() == ["ok", "InterpretedFunction"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter path is for machines without CUDA")
def test_triton_backend_is_refused_at_once_when_the_interpreter_is_off(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # e.g. a user who set it so before starting Python
    with pytest.raises(ValueError, match="needs Triton's interpreter.*TRITON_INTERPRET=1"):
        make("freekv:backend=triton")


# -- the paper as a preset ---------------------------------------------------------------------


# each paper's rules and sizes where the defaults depart from them, read from the papers
# (docs/design.md, "The paper as a preset"), not from the library: softfreeze Eq. 2 as is with the
# paper's tau, the prompt judged as step 1 and no recovery (future work); freekv's min-max pooled
# keys at B = 2048; synckv's N_r clusters in every layer (N_r from the model, at bind), Algorithm 1
# lines 23-24's union and no window, Eq. 6 over the whole vector; icecache's Algorithm 1 lines
# 16-17, the offload before attention, its random promotion (lines 29-33), the union over a group
# (Sec. 4.2), P-DCI's several indices (Sec. 3.3) and Algorithm 4 as written
PAPERS = {"softfreeze": dict(score="raw", tau=0.5, judge_prompt=True, egr=False),
          "freekv": dict(digest="minmax", budget=2048),
          "synckv": dict(wide_layers=0, nr_reads="union", window=0, exclude_static=False, n_r=None),
          "icecache": dict(window_offload="before", promotion="random", gqa="union", descent="greedy", simple=4,
                           composite=2, batch=1),
          "streaming": {}, "h2o": {}, "full": {}}


@pytest.mark.parametrize("name", sorted(PAPERS))
def test_the_paper_preset_sets_the_papers_rules(name):
    p, default = make(f"{name}:paper"), make(name)
    assert {k: getattr(p, k) for k in PAPERS[name]} == PAPERS[name]
    assert all(getattr(default, k) != v for k, v in PAPERS[name].items())  # each a departure of the default


@pytest.mark.parametrize("name", available())
def test_a_size_given_beside_the_preset_stays(name):
    """The paper's sizes (PAPER_SIZES) are what preset=paper takes when they are not given; a
    size given, the class default included, stays, through the spec and the class alike."""
    from minikv.policies.params import paper_sizes

    cls = _REGISTRY[name]
    defaults = {f.name: f.default for f in fields(cls)}
    for key, value in paper_sizes(cls).items():
        assert defaults[key] != value and getattr(make(f"{name}:paper"), key) == value
        assert getattr(make(f"{name}:paper,{key}={show(defaults[key])}"), key) == defaults[key]
        assert getattr(cls(preset="paper", **{key: defaults[key]}), key) == defaults[key]


@pytest.mark.parametrize("name", available())
def test_every_policy_takes_the_paper_preset(name):
    """NAME:paper is NAME:preset=paper; the preset's values are declared parameters, pass their
    checks, and are what the policy holds; a value given against them is refused by name."""
    from minikv.policies.base import parameters
    from minikv.policies.params import paper_rules

    cls = _REGISTRY[name]
    rules = paper_rules(cls)
    assert set(rules) <= set(parameters(cls))
    for spec in (f"{name}:paper", f"{name}:preset=paper"):
        p = make(spec)
        assert p.preset == "paper" and all(getattr(p, k) == v for k, v in rules.items())
    for key, value in rules.items():
        choices = (not value,) if isinstance(value, bool) else parameters(cls)[key].metadata["choices"] or (value + 1,)
        other = next(c for c in choices if c != value)
        with pytest.raises(ValueError, match=rf"preset=paper sets {key}="):
            make(f"{name}:paper,{key}={show(other)}")


@pytest.mark.parametrize("name", available())
def test_the_class_called_with_the_paper_preset_refuses_what_the_spec_refuses(name):
    """cls(preset="paper", key=value) answers as make's spec does: a value of one of the paper's
    parameters other than the paper's is refused with the same line, the class default
    included (the silent case: apply_preset cannot tell it given from left out); the paper's
    own value is accepted."""
    from minikv.policies.params import paper_rules

    cls = _REGISTRY[name]
    defaults = {f.name: f.default for f in fields(cls)}
    for key, value in paper_rules(cls).items():
        assert defaults[key] != value  # a rule the preset changes: the default is the silent case
        with pytest.raises(ValueError) as spec_error:
            make(f"{name}:paper,{key}={show(defaults[key])}")
        with pytest.raises(ValueError) as call_error:
            cls(preset="paper", **{key: defaults[key]})
        assert str(call_error.value) == str(spec_error.value)
        assert f"preset=paper sets {key}={show(value)}" in str(call_error.value)
        assert getattr(cls(preset="paper", **{key: value}), key) == value


def test_the_help_lines_say_what_the_preset_sets_and_show_none():
    """--help's lines per policy (params.describe): the preset's line, and only it, says what
    paper sets, or that the defaults are the paper's rules, or that there is no paper."""
    from minikv.policies.params import describe

    def lines(name):
        return {line.split("=", 1)[0]: line for line in describe(_REGISTRY[name])}

    tails = {"freekv": "; here paper sets digest=minmax; and sizes, which a value given replaces: budget=2048",
             "synckv": "; here paper sets wide_layers=0, nr_reads=union, window=0, exclude_static=false; and sizes, "
                       "which a value given replaces: n_r=none (from the model, at bind)",
             "streaming": "; here the defaults are the paper's rules",
             "full": "; no paper here: paper is the defaults"}
    for name, tail in tails.items():
        by_name = lines(name)
        assert by_name["preset"].startswith("preset=none ") and by_name["preset"].endswith(tail), name
        assert not any("paper sets" in line or "paper's rules;" in line for key, line in by_name.items()
                       if key != "preset"), name
    assert lines("streaming")["budget"].startswith("budget=none ")  # a None default reads as the spec's word

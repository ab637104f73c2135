"""The compiled decode step (fast/compiled.py): the same logits as the eager step, for every
family and policy shape, with compiled code really running, and an eager fallback where
torch.compile cannot run.

The compiled step is the CPU's (inductor's C++ code, MKL's products, a C++ compiler's absence):
every model and policy here is on CPU_ONLY whatever the test device, the eager twin included."""
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import minikv
from minikv.loading import load_model
from minikv.fast import compiled as compiled_module
from minikv.policies import make

from ..fixtures import CPU_ONLY, ITEMS_PROMPT, greedy_logits

MODELS = Path(__file__).resolve().parents[2] / "reference" / "models"
RANDOM = sorted(p.name for p in MODELS.iterdir() if p.name != "smollm2" and (p / "config.json").exists())


@pytest.fixture(scope="module")
def compiled_smollm2():
    model, tok = minikv.load("smollm2", device=CPU_ONLY, dtype=torch.float32, progress=False, compile=True)
    assert model.compiled is not None
    return model, tok


def prefill_then_decode(model, ids):
    """ids (B, T): prefill the first 7 tokens under the full cache, then decode the rest one by
    one -> the logits of every position (B, T, V)."""
    B, T = ids.shape
    policy = make("full").bind(model.cfg, device=CPU_ONLY, dtype=torch.float32, max_len=T, batch_size=B)
    steps = [model(ids[:, :7], policy=policy)]
    for t in range(7, T):
        steps.append(model(ids[:, t : t + 1], positions=torch.full((B, 1), t), policy=policy))
    return torch.cat(steps, dim=1)


@pytest.mark.parametrize("name", RANDOM)
def test_compiled_decode_equals_transformers_logits(name):
    """Every family (GQA, q/k/v bias, sliding window, scaled RoPE, partial rotary, parallel
    residual), a batch of rows: prefill 7 tokens, then compiled decode steps; every step's logits
    equal transformers' to 1e-4, as the eager decode's do (test_logits)."""
    ref = load_file(str(MODELS / name / "expected.safetensors"))
    model = load_model(MODELS / name, device=CPU_ONLY, dtype=torch.float32, compile=True)
    assert model.compiled is not None
    assert (prefill_then_decode(model, ref["input_ids"]) - ref["logits"]).abs().max().item() <= 1e-4


def test_warm_up_compiles_what_a_decode_step_runs(monkeypatch):
    """Loading compiles (and checks) every graph a batch-of-one decode step calls: the first
    real step compiles nothing more (a compile there would cost seconds inside the first timed
    step); a batch of another size compiles its own graphs once, on its first step."""
    compiles = []
    standalone_compile = compiled_module.torch._inductor.standalone_compile
    monkeypatch.setattr(compiled_module.torch._inductor, "standalone_compile",
                        lambda *a, **k: compiles.append(1) or standalone_compile(*a, **k))
    # a model whose layers rotate alike (a hybrid model's decode step runs eagerly: compiled.install)
    model = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32, compile=True)
    assert model.compiled is not None and model.cfg.n_layers >= 2
    assert len(compiles) == 4  # project, finish_then_project, finish, head
    prefill_then_decode(model, torch.randint(0, model.cfg.vocab_size, (1, 10)))
    assert len(compiles) == 4
    for _ in range(2):
        prefill_then_decode(model, torch.randint(0, model.cfg.vocab_size, (3, 9)))
        assert len(compiles) == 8 and sorted(model.compiled.steps) == [1, 3]


@pytest.mark.parametrize("spec", ["full", "streaming:sink=4,window=60", "freekv:budget=128"])
def test_compiled_smollm2_follows_the_eager_model_under_a_policy(smollm2_cpu, compiled_smollm2, spec):
    """Same prompt, same policy: the compiled model's logits at every decode step equal the eager
    model's (float32 sums in another order: ~1e-5 on logits of order 10-30), and the policy saw
    the same tokens (streaming renumbers positions, freekv selects pages from q)."""
    model, tok = smollm2_cpu
    ids = torch.tensor([tok.encode(ITEMS_PROMPT)])
    eager, eager_policy = greedy_logits(model, ids, spec, steps=6)
    comp, comp_policy = greedy_logits(compiled_smollm2[0], ids, spec, steps=6)
    assert (eager.argmax(-1) == comp.argmax(-1)).all()
    assert (eager - comp).abs().max().item() <= 1e-3
    assert eager_policy.stats()["device_tokens"] == comp_policy.stats()["device_tokens"]


def test_compiled_code_runs_the_products(compiled_smollm2):
    """A one-token decode step calls compiled graphs, one between two attentions, and no eager
    linear or matmul: the weights' products ran inside inductor's code, not in MKL called from
    Python. The only eager products are the attention's own (the policy's, two per layer, over
    head_dim)."""
    from torch.profiler import ProfilerActivity, profile

    model, tok = compiled_smollm2
    ids = torch.tensor([tok.encode("The capital of France is")])
    policy = make("full").bind(model.cfg, device=CPU_ONLY, dtype=torch.float32, max_len=ids.shape[1] + 2)
    logits = model(ids, policy=policy, logits_at=torch.tensor([ids.shape[1] - 1]))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        model(logits.argmax(-1)[:, None], positions=torch.tensor([[ids.shape[1]]]), policy=policy,
              logits_at=torch.tensor([0]))
    names = [e.key for e in prof.key_averages()]
    assert sum("CompiledFxGraph" in n for n in names) >= 2
    # one call between two attentions (a finish and the next project), plus the first project,
    # the last finish and the head
    calls = sum(e.count for e in prof.key_averages() if "CompiledFxGraph" in e.key)
    assert calls == model.cfg.n_layers + 2
    assert not {"aten::linear", "aten::mm", "aten::matmul"} & set(names)
    bmm = [e for e in prof.events() if e.name == "aten::bmm"]
    assert len(bmm) == 2 * model.cfg.n_layers
    D = model.cfg.head_dim
    assert all(e.input_shapes[0][-1] in (D, ids.shape[1] + 1) and D in e.input_shapes[1] for e in bmm)


def test_generate_cli_compile_prints_what_the_eager_model_does(smollm2, monkeypatch, capsys):
    from minikv.generate.__main__ import main

    argv = ["--prompt", "The capital of France is", "--max-new-tokens", "6", "--quiet", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
        eager = capsys.readouterr().out
        assert main(argv + ["--compile"]) == 0
        assert capsys.readouterr().out == eager
    finally:
        torch.set_num_threads(threads)


def test_compiling_says_so_on_a_terminal(monkeypatch, capsys):
    monkeypatch.setattr(compiled_module.sys.stderr, "isatty", lambda: True)
    model = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32, compile=True)
    lines = capsys.readouterr().err.splitlines()
    assert model.compiled is not None and len(lines) == 2
    assert lines[0].startswith("minikv: compiling the decode step")
    assert re.fullmatch(r"minikv: decode step compiled in [\d.]+ s", lines[1])


def test_without_a_working_compiler_decoding_stays_eager(monkeypatch, capsys):
    def broken_compile(gm, inputs, **kwargs):
        raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")

    monkeypatch.setattr(compiled_module.torch._inductor, "standalone_compile", broken_compile)
    model = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32, compile=True)
    err = capsys.readouterr().err
    assert model.compiled is None
    assert err.count("\n") == 1 and "No working C++ compiler found" in err and "decoding eagerly" in err
    ref = load_file(str(MODELS / "llama_gqa3" / "expected.safetensors"))
    assert (prefill_then_decode(model, ref["input_ids"][:1]) - ref["logits"][:1]).abs().max().item() <= 1e-4


def test_a_policy_output_the_graphs_were_not_compiled_for_is_refused(monkeypatch):
    """The compiled graphs run without guards: an attention output of another dtype or shape
    than the query's is an error, not garbage read by code compiled for another layout."""
    model = load_model(MODELS / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32, compile=True)
    ids = torch.randint(0, model.cfg.vocab_size, (1, 9))
    policy = make("full").bind(model.cfg, device=CPU_ONLY, dtype=torch.float32, max_len=9)
    model(ids[:, :8], policy=policy)
    layer_type = type(policy.layer(0))
    decode = layer_type.decode
    monkeypatch.setattr(layer_type, "decode", lambda self, *a: decode(self, *a).double())
    with pytest.raises(RuntimeError, match=r"decode returned \(1, \d+, 1, \d+\) torch.float64, expected"):
        model(ids[:, 8:], positions=torch.tensor([[8]]), policy=policy)

"""minikv.hf: minikv's policies inside transformers models.

The oracles: minikv's own runtime under the same policy (SmolLM2 from the bundled GGUF, and a
tiny random Llama checkpoint from reference/), and transformers' own attention (a random Qwen3,
an architecture minikv does not implement, with a budget that covers the whole context).
Every test but the first needs the hf extra (marked `hf`; CI installs it). CI runs this file on
the oldest and the newest transformers pyproject admits (constraints.txt, constraints-hf-newest.txt),
with transformers' FutureWarnings as errors: a deprecation the adapter trips fails CI first.
"""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import minikv
from minikv.policies import available, make

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.filterwarnings("error::FutureWarning")


def test_core_never_imports_transformers():
    # a policy run in minikv's own runtime, in a fresh interpreter: transformers stays out
    code = (
        "import sys, torch\n"
        "import minikv\n"
        "from minikv.loading import load_model\n"
        "model = load_model('reference/models/llama_gqa3', dtype=torch.float32)\n"
        "policy = minikv.make_policy('streaming:sink=2,window=6,R=2,slack=0,max_drop=0')\n"
        "policy.bind(model.cfg, device='cpu', dtype=torch.float32, max_len=24)\n"  # CPU_ONLY: imports are the test
        "model(torch.arange(16)[None] % 90, policy=policy)\n"
        "for t in range(16, 24):\n"
        "    model(torch.tensor([[t]]), positions=torch.tensor([[t]]), policy=policy)\n"
        "assert policy.stats()['prune_events'] > 0\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('transformers', 'accelerate', 'minikv.hf'))\n"
        "assert not bad and 'minikv.hf' not in sys.modules, bad\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def pins(name):
    """{package: version} of a constraints file's `package==version` lines."""
    lines = (ROOT / name).read_text().splitlines()
    return dict(ln.split("==") for ln in lines if ln.strip() and not ln.startswith("#"))


def test_ci_pins_both_ends_of_the_hf_range():
    # .ci/test runs this file on the oldest transformers pyproject's hf extra admits
    # (constraints.txt) and on the newest (constraints-hf-newest.txt); nothing else differs
    pyproject = (ROOT / "pyproject.toml").read_text()
    floor, ceiling = re.search(r'"transformers>=([\d.]+),<(\d+)"', pyproject).groups()
    oldest, newest = pins("constraints.txt"), pins("constraints-hf-newest.txt")
    version = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert version(oldest["transformers"]) == version(floor + ".0")
    assert version(oldest["transformers"]) < version(newest["transformers"]) < (int(ceiling),)
    del oldest["transformers"], newest["transformers"]
    assert oldest == newest
    # jinja2 renders chat templates from downloaded files: no release with a sandbox escape
    jinja_floor = re.search(r'"jinja2>=([\d.]+)"', pyproject).group(1)
    assert version(jinja_floor) >= (3, 1, 6), "CVE-2024-56326, CVE-2025-27516"


# -- helpers ------------------------------------------------------------------------------------


def recording(spec):
    """An unbound policy whose end_step records the next-token logits (1, V) of every forward,
    and the tokens each layer's attention read in it (layers that report attended_indices)."""
    policy = make(spec)
    policy.seen_logits, policy.seen_reads = [], []
    end_step = policy.end_step

    def end_step_recording(logits=None):
        policy.seen_logits.append(logits[0].detach().clone())
        reads = [layer.attended_indices() for layer in policy.layers]
        policy.seen_reads.append([None if r is None else [sorted(t for t in row if t >= 0) for row in r.tolist()]
                                  for r in reads])
        return end_step(logits)

    policy.end_step = end_step_recording
    return policy


def run_minikv(model, tok, ids, spec, new):
    policy = recording(spec)
    result = minikv.generate(model, tok, ids, policy=policy, max_new_tokens=new, stop_at_eos=False)
    return result.token_ids, policy


def run_hf(hf, ids, spec, new, **kwargs):
    import minikv.hf

    policy = recording(spec)
    with minikv.hf.policy(hf, policy) as run:
        out = hf.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None, **kwargs)
    assert run.policy is policy
    return out[0, len(ids):].tolist(), policy


def compare(name, got, want, tol, min_equal):
    """Tokens (and per-step logits) of the adapter `got` against minikv's runtime `want`, each a
    (tokens, policy) pair. All tokens equal, or the first `min_equal`; every step's logits within
    `tol` up to the first token that differs or the first step whose attention read other tokens
    in some layer, which must not come before step `min_equal`. (A selection is discrete: the two
    runs' float sums differ in the last bits, and a near-tie can flip which of two tokens a layer
    keeps. Measured: synckv, 1,000-token prompt, step 45, layer 23, two tokens at pooled attention
    0.0011787886 and 0.0011787824. From there the two runs attend differently, both correctly.)
    Returns the steps compared."""
    (toks_a, pol_a), (toks_b, pol_b) = got, want
    same = next((i for i, (a, b) in enumerate(zip(toks_a, toks_b)) if a != b), min(len(toks_a), len(toks_b)))
    assert len(toks_a) == len(toks_b), name
    assert same == len(toks_a) or same >= min_equal, f"{name}: tokens differ from step {same}"
    steps = min(len(pol_a.seen_logits), len(pol_b.seen_logits), same + 1)
    read_same = next((t for t, (a, b) in enumerate(zip(pol_a.seen_reads, pol_b.seen_reads)) if a != b), None)
    if read_same is not None:  # that step's logits come from other reads: compare the ones before
        assert read_same >= min_equal, f"{name}: the layers read other tokens from step {read_same}"
        same, steps = min(same, read_same), min(steps, read_same)
    for t in range(steps):
        err = (pol_a.seen_logits[t] - pol_b.seen_logits[t]).abs().max().item()
        assert err <= tol, f"{name}: step {t} logits differ by {err}"
    return same


# -- SmolLM2 from the bundled GGUF, every registered policy at its defaults ------------------------
# transformers' model is loaded on the CPU (hf_smollm2): minikv's runtime runs beside it there
# (smollm2_cpu), so that the two runs' logits compare on one device

SMOLLM2_TOL = 2e-3  # max |logit difference|, float32: matmul summation order only (measured below 1e-4)


@pytest.mark.hf
@pytest.mark.parametrize("prompt, new", [
    (400, 32),  # the default run: ~8 s of one core per policy
    pytest.param(1000, 64, marks=pytest.mark.slow),  # the acceptance size
], ids=["400+32", "1000+64"])
@pytest.mark.parametrize("name", available())
def test_smollm2_policy_matches_minikv_runtime(name, prompt, new, smollm2_cpu, hf_smollm2):
    from minikv.bench.common import text_ids

    model, tok = smollm2_cpu
    ids = text_ids(tok, prompt)
    want = run_minikv(model, tok, ids, name, new)
    got = run_hf(hf_smollm2, ids, name, new)
    same = compare(name, got, want, SMOLLM2_TOL, min_equal=min(new, 32))
    if same == new:  # the same tokens: the same KV in every tier of every layer
        a, b = got[1].stats(), want[1].stats()
        for key in ("device_tokens_per_layer", "host_tokens_per_layer", "device_bytes", "host_bytes",
                    "device_bytes_allocated", "host_bytes_allocated", "bytes_to_host", "bytes_to_device"):
            assert a[key] == b[key], key


@pytest.mark.hf
@pytest.mark.slow
def test_smollm2_softfreeze_rewind_restarts_generate(smollm2_cpu, hf_smollm2):
    # an entropy rule that spikes at almost every step climbs the ladder to its rewalk rung, whose
    # rewind the adapter serves by restarting generate from the kept tokens, as minikv's loop does
    model, tok = smollm2_cpu
    from minikv.bench.common import text_ids

    ids = text_ids(tok, 120)
    spec = "softfreeze:egr_window=2,egr_z=0,egr_min=0,egr_calm=100,max_rewalks=2"
    want = run_minikv(model, tok, ids, spec, 40)
    got = run_hf(hf_smollm2, ids, spec, 40)
    assert want[1].stats()["rewalks"] == 2
    assert compare("softfreeze rewind", got, want, SMOLLM2_TOL, min_equal=40) == 40
    a, b = got[1].stats(), want[1].stats()
    for key in ("rewalks", "rewalked_tokens", "spikes", "full_resets", "device_tokens_per_layer", "host_tokens_per_layer"):
        assert a[key] == b[key], key


@pytest.mark.hf
@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_smollm2_passkey_4k_freekv_same_answers(seed, smollm2_cpu, hf_smollm2):
    from minikv.bench.passkey import build_prompt, draw_key

    model, tok = smollm2_cpu
    key = draw_key(seed)
    ids = build_prompt(tok, 4000, 0.5, key)
    spec = "freekv:budget=256"
    want_ids, _ = run_minikv(model, tok, ids, spec, 8)
    got_ids, policy = run_hf(hf_smollm2, ids, spec, 8)
    assert tok.decode(got_ids) == tok.decode(want_ids)
    assert max(policy.stats()["device_tokens_per_layer"]) <= 256


# -- a tiny random Llama (reference/models): renumbering and retrieval against minikv's runtime -------


@pytest.fixture(scope="module")
def tiny_llama(reference_dir):
    from transformers import AutoModelForCausalLM

    from minikv.loading import load_model

    path = reference_dir / "models" / "llama_gqa3"
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path, dtype=torch.float32), hf


class NoTokenizer:
    eos_ids = ()

    def decode(self, ids):
        return ""


@pytest.mark.hf
@pytest.mark.parametrize("spec", [
    "streaming:sink=2,window=9,R=3,slack=2,max_drop=2",  # prunes every few steps: positions renumbered
    "freekv:page_size=4,sink=4,window=8,budget=24",  # retrieval of 3 pages out of up to 16
    "softfreeze:window=4,softness=1",  # freezes from the first detection on
    "full",
])
def test_tiny_llama_matches_minikv_runtime(spec, tiny_llama):
    model, hf = tiny_llama
    ids = (torch.arange(37) * 7 % 97).tolist()
    want = run_minikv(model, NoTokenizer(), ids, spec, 24)
    got = run_hf(hf, ids, spec, 24)
    assert compare(spec, got, want, 1e-4, min_equal=24) == 24
    a, b = got[1].stats(), want[1].stats()
    assert a["device_tokens_per_layer"] == b["device_tokens_per_layer"]
    assert a["host_tokens_per_layer"] == b["host_tokens_per_layer"]
    assert max(a["device_tokens_per_layer"]) < len(ids) + 24 or spec == "full"


@pytest.mark.hf
def test_tiny_llama_softfreeze_rewinds_restart_generate(tiny_llama):
    # spikes at almost every step: the ladder reaches its rewalk rung twice; each rewind restarts
    # generate from the kept tokens, and the result is minikv's loop's, token for token
    model, hf = tiny_llama
    ids = (torch.arange(37) * 7 % 97).tolist()
    spec = "softfreeze:egr_window=2,egr_z=0,egr_min=0,egr_calm=100,max_rewalks=2,window=4"
    want = run_minikv(model, NoTokenizer(), ids, spec, 30)
    got = run_hf(hf, ids, spec, 30)
    assert want[1].stats()["rewalks"] == 2
    assert len(got[1].seen_logits) == 30 + 2 * 4  # each rewalk regenerates 4 tokens
    assert compare("softfreeze rewind", got, want, 1e-4, min_equal=30) == 30
    a, b = got[1].stats(), want[1].stats()
    for key in ("rewalks", "rewalked_tokens", "spikes", "device_tokens_per_layer", "host_tokens_per_layer"):
        assert a[key] == b[key], key


@pytest.mark.hf
def test_attached_model_without_policy_cache_is_unchanged(tiny_llama):
    import minikv.hf

    _, hf = tiny_llama
    x = torch.tensor([(torch.arange(20) * 5 % 97).tolist()])
    before = hf.generate(x, max_new_tokens=8, do_sample=False, eos_token_id=None, output_logits=True,
                         return_dict_in_generate=True)
    minikv.hf.attach(hf)
    try:
        after = hf.generate(x, max_new_tokens=8, do_sample=False, eos_token_id=None, output_logits=True,
                            return_dict_in_generate=True)
    finally:
        minikv.hf.detach(hf)
    assert hf.config._attn_implementation != minikv.hf.ATTENTION
    assert torch.equal(before.sequences, after.sequences)
    for a, b in zip(before.logits, after.logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.hf
def test_plain_cache_in_a_loop_of_ones_own(tiny_llama):
    import minikv.hf

    model, hf = tiny_llama
    ids = (torch.arange(30) * 3 % 97).tolist()
    spec = "streaming:sink=2,window=6,R=2,slack=0,max_drop=0"
    cache = minikv.hf.cache(hf, spec, max_new_tokens=10)
    with pytest.raises(ValueError, match="no stats before"):
        cache.stats()
    arg = {minikv.hf.cache_argument(hf): cache}  # past_key_values= before transformers 5.24, cache= since
    out = hf(torch.tensor([ids]), **arg)
    tokens = []
    for _ in range(10):
        tokens.append(int(out.logits[0, -1].argmax()))
        out = hf(torch.tensor([[tokens[-1]]]), **arg)
    want, _ = run_minikv(model, NoTokenizer(), ids, spec, 10)
    assert tokens == want
    assert cache.get_seq_length() == 40
    assert minikv.hf.stats(hf)["cache_length"] == cache.stats()["cache_length"] <= 2 + 6 + 2
    minikv.hf.detach(hf)


# -- a random Qwen3 built in the test: an architecture minikv's runtime does not have ---------------


@pytest.fixture(scope="module")
def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.25 / p.shape[1] ** 0.5)
            else:
                p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


def hf_own(model, ids, new):
    """transformers' own generation: its cache, its SDPA attention."""
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                         output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), [l[0] for l in out.logits]


QWEN3_IDS = (torch.arange(48) * 11 % 101).tolist()


@pytest.mark.hf
@pytest.mark.parametrize("spec", [
    "freekv:page_size=8,sink=8,window=8,budget=80",  # 48 + 24 tokens: every page fits the budget
    "streaming:sink=4,window=80,R=4",  # never reaches its capacity
])
def test_qwen3_whole_context_budget_equals_transformers(spec, qwen3):
    want_toks, want_logits = hf_own(qwen3, QWEN3_IDS, 24)
    toks, policy = run_hf(qwen3, QWEN3_IDS, spec, 24)
    assert toks == want_toks
    assert len(policy.seen_logits) == 24  # the prefill and 23 decode steps
    for t, (a, b) in enumerate(zip(policy.seen_logits, want_logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {t}")
    # attention read every token: the prompt and the 23 fed back (the 24th is never fed)
    assert policy.stats()["device_tokens_per_layer"] == [48 + 23] * 2


@pytest.mark.hf
@pytest.mark.parametrize("spec, most", [
    ("freekv:page_size=8,sink=8,window=8,budget=32", 32),
    ("streaming:sink=4,window=12,R=4,slack=0,max_drop=0", 20),
])
def test_qwen3_small_budget_runs_within_it(spec, most, qwen3):
    want_toks, want_logits = hf_own(qwen3, QWEN3_IDS, 24)
    toks, policy = run_hf(qwen3, QWEN3_IDS, spec, 24)
    stats = policy.stats()
    assert len(toks) == 24
    assert max(stats["device_tokens_per_layer"]) <= most
    if spec.startswith("freekv"):
        assert stats["host_tokens"] == 48 + 23 - 8 * 2 or stats["pages_recalled"] > 0
    else:
        assert stats["prune_events"] > 0
    # the policy, not transformers' attention, produced the logits: they leave the full-KV ones
    assert (policy.seen_logits[-1] - want_logits[-1]).abs().max() > 1e-3


# -- what is refused, and how -------------------------------------------------------------------------


@pytest.mark.hf
def test_refusals_are_clear(qwen3):
    import minikv.hf

    x = torch.tensor([QWEN3_IDS[:12], QWEN3_IDS[12:24]])
    with pytest.raises(ValueError, match="batch size <= 1"):
        with minikv.hf.policy(qwen3, "freekv:page_size=8,sink=8,window=8,budget=32"):
            qwen3.generate(x, max_new_tokens=4, do_sample=False)
    mask = torch.ones_like(x)
    mask[0, :3] = 0  # left padding
    with pytest.raises(ValueError, match="padding"):
        with minikv.hf.policy(qwen3, "full"):
            qwen3.generate(x, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="no parameter 'budgte'"):
        with minikv.hf.policy(qwen3, "freekv:budgte=32"):
            pass
    attention = qwen3.config._attn_implementation
    cache = minikv.hf.cache(qwen3, "full")
    assert qwen3.config._attn_implementation == minikv.hf.ATTENTION
    with pytest.raises(ValueError, match="max_new_tokens"):
        qwen3(x[:1], **{minikv.hf.cache_argument(qwen3): cache})
    minikv.hf.detach(qwen3)
    assert qwen3.config._attn_implementation == attention
    # batch 2 without padding is fine for `full`, which holds any batch
    with minikv.hf.policy(qwen3, "full") as run:
        out = qwen3.generate(x, max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert out.shape == (2, 16) and run.stats()["device_tokens"] == 12 + 3


# -- what the adapter reads of transformers' names ------------------------------------------------------


@pytest.mark.hf
def test_cache_found_by_type_and_annotation_not_by_name():
    # transformers 5.24 renamed the forward's `past_key_values` to `cache`; the hooks find the
    # PolicyCache by its type, and the name to hand it to generate under comes from the forward's
    # signature, so another rename cannot silently detach the policy
    import minikv.hf
    from transformers import Cache

    class Renamed:
        def forward(self, input_ids=None, kv_state: Cache | None = None, **kwargs): ...

    class NoCache:
        def forward(self, input_ids=None, use_cache: bool = True): ...

    assert minikv.hf.cache_argument(Renamed()) == "kv_state"
    with pytest.raises(ValueError, match="NoCache.forward declares no Cache argument"):
        minikv.hf.cache_argument(NoCache())
    cache = object.__new__(minikv.hf.PolicyCache)
    assert minikv.hf.wiring._policy_cache((), {"input_ids": None, "kv_state": cache}) is cache
    assert minikv.hf.wiring._policy_cache((None, None, None, cache), {}) is cache
    assert minikv.hf.wiring._policy_cache((), {"past_key_values": None, "cache": None}) is None

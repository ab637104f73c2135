"""minikv.hf on models with sliding-window layers: Gemma 3's local and global layers, a Qwen2
whose layer_types mix both (an architecture minikv's runtime does not have), a Mistral whose
every layer is local (needs the hf extra).

The oracles: minikv's own runtime on the same weights (reference/models/gemma3_tiny, a window of
8 tokens on layers 0 and 2; reference/models/mistral_swa), and transformers' own generation,
whose DynamicCache keeps a sliding layer's window itself. The prompts are long enough that the
local windows roll (70 tokens over windows of 8) and every policy's small spec (the one
check_policy holds it to) evicts on the global layer. The real Gemma-3-270M (slow; the gemma
extra and transformers 5.24, which reads its GGUF) against minikv's runtime at the end.
"""
import json
import shutil

import pytest
import torch

import minikv
from minikv.policies import available, make

# minikv's own policies: a plugin another test registers in the same process (docs/examples) is
# that test's, with its own refusals
OWN = [name for name in available() if type(make(name)).__module__.startswith("minikv.policies")]
from tests.models.test_gemma3 import needs_gemma
from tests.test_hf import NoTokenizer, compare, hf_own, run_hf, run_minikv

pytestmark = [pytest.mark.hf, pytest.mark.filterwarnings("error::FutureWarning")]

# Gemma's pad id is 0 (transformers masks it out of a prompt as padding), 1 and 2 are EOS and BOS
GEMMA_IDS = [2] + (torch.arange(69) * 7 % 86 + 3).tolist()
NEW = 16


def load_both(path):
    from transformers import AutoModelForCausalLM

    from minikv.loading import load_model

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return load_model(path, dtype=torch.float32, fast=False), hf


@pytest.fixture(scope="module")
def gemma3(reference_dir):
    return load_both(reference_dir / "models" / "gemma3_tiny")


def small_spec(name, cfg, workdir):
    """The policy's small spec (check_policy's), with the file it needs for this model made where
    it needs one (synckv's head clustering, for the model's global layers)."""
    cls = type(make(name))
    return cls.spec_for_model(cls.small_spec or name, cfg, workdir)


@pytest.mark.parametrize("name", OWN)
def test_gemma3_every_policy_matches_minikv_runtime(name, gemma3, tmp_path):
    # the local layers (0 and 2) keep their window of 8 in the runtime's rings, rotated at the
    # absolute positions with the local RoPE base; the policy governs the global layer (1), and
    # scores there by query_pre_attn_scalar^-1/2 (24, not head_dim 16)
    model, hf = gemma3
    spec = small_spec(name, model.cfg, tmp_path)
    want = run_minikv(model, NoTokenizer(), GEMMA_IDS, spec, NEW)
    got = run_hf(hf, GEMMA_IDS, spec, NEW)
    assert compare(spec, got, want, 1e-4, min_equal=NEW) == NEW
    a, b = got[1].stats(), want[1].stats()
    for key in ("device_tokens_per_layer", "host_tokens_per_layer", "window_layers", "window_tokens",
                "device_bytes", "host_bytes"):
        assert a[key] == b[key], key
    seen = len(GEMMA_IDS) + NEW - 1  # the last token is never fed
    local, global_, _ = a["device_tokens_per_layer"]
    assert a["window_layers"] == 2 and local == 8  # the windows rolled: 8 of the 85 tokens
    assert (global_ < seen) == (name != "full"), global_  # the policy evicted on the global layer


def test_gemma3_full_equals_transformers_own_sliding_cache(gemma3):
    # the rings against transformers' DynamicCache, which keeps the sliding layers' windows itself
    _, hf = gemma3
    want_toks, want_logits = hf_own(hf, GEMMA_IDS, NEW)
    toks, policy = run_hf(hf, GEMMA_IDS, "full", NEW)
    assert toks == want_toks
    for t, (a, b) in enumerate(zip(policy.seen_logits, want_logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-4, msg=f"step {t}")
    assert policy.stats()["device_tokens_per_layer"] == [8, len(GEMMA_IDS) + NEW - 1, 8]


# -- a Qwen2 whose layer_types mix sliding and full attention: no minikv runtime for it -----------


@pytest.fixture(scope="module")
def qwen2_mixed():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         use_sliding_window=True, sliding_window=8, tie_word_embeddings=False,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that attention is far from uniform
        for name, p in model.named_parameters():
            p.normal_(0, 1.25 / p.shape[1] ** 0.5) if p.dim() == 2 else p.copy_(1 + 0.2 * torch.randn_like(p))
    return model


QWEN2_IDS = (torch.arange(40) * 11 % 100 + 1).tolist()


def test_qwen2_mixed_layers_whole_context_budget_equals_transformers(qwen2_mixed):
    # a budget covering the context on the full layer; the sliding ones in the rings: transformers'
    # own logits, which its sliding cache layers give
    want_toks, want_logits = hf_own(qwen2_mixed, QWEN2_IDS, NEW)
    toks, policy = run_hf(qwen2_mixed, QWEN2_IDS, "freekv:page_size=8,sink=8,window=8,budget=64", NEW)
    assert toks == want_toks
    for t, (a, b) in enumerate(zip(policy.seen_logits, want_logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {t}")
    assert policy.stats()["device_tokens_per_layer"] == [8, 40 + NEW - 1, 8]


def test_renumbering_refused_where_one_rotary_table_serves_both_kinds(qwen2_mixed):
    # Qwen2 rotates every layer with one table: streaming's renumbered positions would reach the
    # local layers, whose windows the runtime keeps at the absolute ones
    import minikv.hf

    with pytest.raises(ValueError, match=r"^minikv.hf: policy 'streaming' renumbers the global layers' positions, "
                                         r"and this model rotates its local and global layers with one table"):
        run_hf(qwen2_mixed, QWEN2_IDS, "streaming:sink=4,window=12,R=4", 4)
    assert not getattr(qwen2_mixed, "_minikv_hooks", None)  # the block left the model as it was
    with minikv.hf.policy(qwen2_mixed, "full"):  # a policy that keeps positions runs
        qwen2_mixed.generate(torch.tensor([QWEN2_IDS]), max_new_tokens=2, do_sample=False)


# -- a Mistral: every layer a sliding window -----------------------------------------------------------


@pytest.fixture(scope="module")
def mistral(reference_dir):
    return load_both(reference_dir / "models" / "mistral_swa")  # a window of 8 on both layers


MISTRAL_IDS = (torch.arange(30) * 5 % 130 + 1).tolist()


def test_mistral_window_shorter_than_the_sequence_full_only(mistral):
    # every layer local: the rings are the whole cache, transformers' own and minikv's runtime's
    model, hf = mistral
    want_toks, want_logits = hf_own(hf, MISTRAL_IDS, NEW)
    got = run_hf(hf, MISTRAL_IDS, "full", NEW)
    assert got[0] == want_toks == run_minikv(model, NoTokenizer(), MISTRAL_IDS, "full", NEW)[0]
    for t, (a, b) in enumerate(zip(got[1].seen_logits, want_logits)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=f"step {t}")
    assert got[1].stats()["device_tokens_per_layer"] == [8, 8]
    # a policy has no global layer to govern: refused, with the one line minikv's runtime gives
    for name in OWN:
        if name != "full":
            with pytest.raises(ValueError) as runtime:
                run_minikv(model, NoTokenizer(), MISTRAL_IDS, name, NEW)
            with pytest.raises(ValueError) as bridge:
                run_hf(hf, MISTRAL_IDS, name, NEW)
            line = str(runtime.value)
            assert str(bridge.value) == line and "\n" not in line and line.startswith(name), line
            assert "sliding" in line, line


@pytest.mark.parametrize("name", OWN)
def test_mistral_window_covering_the_sequence_every_policy(name, reference_dir, tmp_path):
    # a window of 64 over 30 + 16 tokens is no window: every policy governs both layers, in
    # transformers as in minikv's runtime (streaming renumbering positions, softfreeze included)
    path = tmp_path / "mistral_64"
    shutil.copytree(reference_dir / "models" / "mistral_swa", path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "sliding_window": 64}))
    model, hf = load_both(path)
    spec = small_spec(name, model.cfg, tmp_path)
    want = run_minikv(model, NoTokenizer(), MISTRAL_IDS, spec, NEW)
    got = run_hf(hf, MISTRAL_IDS, spec, NEW)
    assert compare(spec, got, want, 1e-4, min_equal=NEW) == NEW
    a, b = got[1].stats(), want[1].stats()
    assert a["device_tokens_per_layer"] == b["device_tokens_per_layer"] and a["window_layers"] == 0
    assert got[1].cfg.n_layers == 2 and got[1].cfg.sliding_window is None


# -- the real Gemma-3-270M, read by transformers from the GGUF minikv reads --------------------------


def _reads_gemma3_gguf() -> bool:
    import transformers

    return tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (5, 24)  # 5.23 has no Gemma 3 reader


@pytest.fixture(scope="module")
def gemma3_270m():
    from transformers import AutoModelForCausalLM

    from minikv.loading import cache_dir
    from minikv.packaged import GEMMA3_270M, assemble

    gguf = assemble(GEMMA3_270M, cache_dir())
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    return minikv.load("gemma3-270m", dtype=torch.float32, progress=False, fast=False), hf


@pytest.mark.slow  # 10 minutes of two busy CPU cores for both (2 of them loading the models)
@needs_gemma
@pytest.mark.skipif(not _reads_gemma3_gguf(), reason="transformers reads Gemma 3 GGUFs from 5.24 (constraints-hf-newest.txt)")
@pytest.mark.parametrize("spec", ["freekv:budget=256", "streaming:budget=256"])
def test_gemma3_270m_matches_minikv_runtime(spec, gemma3_270m):
    # 700 tokens of natural text: the 15 local layers' windows of 512 roll, the policy holds 256
    # of the 3 global layers' tokens (streaming renumbering their positions only)
    from minikv.bench.common import text_ids

    (model, tok), hf = gemma3_270m
    ids = text_ids(tok, 700)
    want = run_minikv(model, tok, ids, spec, 8)
    got = run_hf(hf, ids, spec, 8)
    assert compare(spec, got, want, 2e-3, min_equal=8) == 8
    a, b = got[1].stats(), want[1].stats()
    assert a["device_tokens_per_layer"] == b["device_tokens_per_layer"]
    assert a["window_layers"] == 15 and a["window_tokens"] == 15 * 512

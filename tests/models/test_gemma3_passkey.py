"""Issue 51's acceptance on the real hybrid model: every registered policy at its defaults finds the
pass key on Gemma-3-270M (minikv.load("gemma3-270m")) at 8,000 tokens and three depths wherever
full KV finds it, each with its Mem%: the KV it holds over every layer (the local layers' windows
included, as stats() counts them) as a share of full KV in every layer.

Full KV here is the runtime's own: its local layers keep their 512-token windows, so its Mem% is
the ring-only baseline's, (15 x 512 + 3 x T) / (18 x T), 22% at 8k; a policy governs the three
global layers and must hold no more than that. The filler is the passkey benchmark's own repeated
sentences: on natural text this base model with full KV already misses the key at 8,192 tokens
in 6 of 6 prompts (docs/gemma3.md, both haystacks with intervals), which would leave nothing to
hold a policy to. 16 new tokens, not the benchmark's 8: the model answers " the pass key. 27611."
at depths 0.5 and 0.9, a digit a token, and 8 tokens cut the key (transformers answers the same,
reference/gemma3_passkey_oracle.py).

Slow (three 8k prefills shared by every policy) and skipped without the gemma extra."""
import pytest
import torch

from minikv.bench.passkey import build_prompt, draw_key, score, shared_trials
from minikv.policies import available, make

from ..fixtures import DEVICE
from .test_gemma3 import needs_gemma

LENGTH = 8000
DEPTHS = (0.1, 0.5, 0.9)
NEW_TOKENS = 16  # " the pass key. 27611." is 10 tokens or more: Gemma's vocabulary spells a number digit by digit
# Where a default misses by its own rule (measured at 1,200, 4,096 and 8,000 tokens,
# docs/gemma3.md): strict, so that a change either way shows. SyncKV binds with the clustering
# shipped for the model (policies/data): one KV head per layer, so its one R-head is the only head
# and keeps full KV on the global layers, and it finds the key wherever full KV does
XFAIL = {
    # StreamingLLM keeps the first 4 and the last 2,044 tokens: a key at depth 0.1 or 0.5 of 8k is
    # outside its window by construction; at 0.9, inside it, it missed too (docs/gemma3.md)
    "streaming": pytest.mark.xfail(strict=True, raises=AssertionError,
                                   reason="the keys at 0.1 and 0.5 lie outside streaming's 2,044-token window"),
    # H2O at 256 evicts during the prefill the tokens whose accumulated attention is lowest, the key
    # among them, before the question that asks for it arrives
    "h2o": pytest.mark.xfail(strict=True, raises=AssertionError,
                             reason="h2o evicts the key in the prefill (found nowhere from 1.2k to 32k, docs/gemma3.md)"),
}


@pytest.fixture(scope="module")
def trials():
    """{spec: [(found, Mem%) per depth]} for full KV and every policy that binds, one shared
    prefill per depth; {spec: error} for those that refuse to bind."""
    import minikv

    model, tok = minikv.load("gemma3-270m", device=DEVICE, dtype=torch.bfloat16, progress=False)
    specs, refused = ["full"], {}
    for name in (n for n in available() if n != "full"):
        try:
            make(name).bind(model.cfg, device=model.device, dtype=model.dtype, max_len=LENGTH + NEW_TOKENS)
        except ValueError as e:
            refused[name] = e
        else:
            specs.append(name)
    found = {spec: [] for spec in specs}
    for i, depth in enumerate(DEPTHS):
        key = draw_key(i)
        ids = build_prompt(tok, LENGTH, depth, key)
        assert len(ids) == LENGTH
        out = shared_trials(model, tok, specs, ids, NEW_TOKENS)
        seq = out["full"]["stats"]["device_tokens_per_layer"][5]  # a global layer: every token fed
        for spec in specs:
            mem = 100 * out[spec]["stats"]["device_tokens"] / seq
            found[spec].append((score(out[spec]["text"], key), mem, seq))
    print(f"\nGemma-3-270M, passkey at {LENGTH} tokens, depths {DEPTHS}, (found, Mem%): "
          + "; ".join(f"{s} {[(f, round(m, 1)) for f, m, _ in v]}" for s, v in found.items()))
    return model.cfg, found, refused


@needs_gemma
@pytest.mark.slow
def test_full_kv_is_the_ring_only_baseline_and_finds_the_key(trials):
    cfg, found, _ = trials
    windows = [w for w in map(cfg.layer_window, range(cfg.n_layers)) if w is not None]  # 15 x 512
    for hit, mem, seq in found["full"]:
        assert seq == LENGTH + NEW_TOKENS - 1
        ring_only = 100 * (sum(windows) + (cfg.n_layers - len(windows)) * seq) / (cfg.n_layers * seq)
        assert mem == pytest.approx(ring_only, rel=1e-6)
    assert any(hit for hit, _, _ in found["full"]), "full KV found the key at no depth: nothing to hold policies to"


@needs_gemma
@pytest.mark.slow
@pytest.mark.parametrize("name", [pytest.param(n, marks=XFAIL.get(n, ())) for n in available() if n != "full"])
def test_every_default_finds_the_key_where_full_kv_does(trials, name, record_property):
    _, found, refused = trials
    if name in refused:
        raise refused[name]
    record_property("found_and_mem_percent", [(hit, round(mem, 1)) for hit, mem, _ in found[name]])
    for depth, (full_hit, full_mem, _), (hit, mem, _) in zip(DEPTHS, found["full"], found[name]):
        assert hit or not full_hit, f"{name} missed the key at depth {depth} where full KV found it (Mem% {mem:.1f})"
        assert mem <= full_mem + 1e-6, f"{name} held {mem:.1f}% of full KV, more than full KV's own {full_mem:.1f}%"

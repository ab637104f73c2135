"""The policy contract, one test matrix over every registered policy (policies.available()), as
kvpress runs one over every press: a budget covering the context gives full KV's logits, through
the host tier where the policy offloads; a smaller budget holds per layer; stats carry the keys
the README documents; bad values are refused by name; sizes are capped by the context; and
backend=reference greedy-decodes what the default backend does on SmolLM2.

A new policy needs a row in each table below (the first test fails until it has one)."""
from __future__ import annotations

import json

import pytest
import torch

from minikv.policies import available, make
from minikv.policies.base import _REGISTRY, parameters
from minikv.policies.params import value_type
from minikv.policies.synckv.clusters import FORMAT, config_sha256

PROMPT, NEW = 80, 40  # llama_gqa3: 80 prompt tokens, 40 decoded (120 = max_len)

# a budget covering the context, with small pages so that KV really crosses the tiers
COVERING = {
    "full": "full",
    "streaming": "streaming:sink=4,window=90",  # prunes past sink + window + R = 126 > 120 tokens
    "softfreeze": "softfreeze:tau=0",  # nothing is below relevance 0: nothing freezes
    "freekv": "freekv:page_size=4,budget=160,sink=4,window=8",
    "icecache": "icecache:page_size=2,budget=160,sink=2,window=4,skip_layers=0",
    "synckv": "synckv:budget=160,window=32,m=3,wide_layers=0",
}
# a budget well below the context: (spec, the budget attention may read per layer and KV head)
SMALL = {
    "full": None,
    "streaming": ("streaming:sink=4,window=24", 4 + 24 + 32),  # sink + window + R
    "softfreeze": None,  # no budget: it freezes by relevance
    "freekv": ("freekv:page_size=4,budget=24,sink=4,window=8", 24),
    "icecache": ("icecache:page_size=2,budget=16,sink=2,window=4,skip_layers=0", 16),
    "synckv": ("synckv:budget=48,window=8,m=3,wide_layers=0", 48),
}
OFFLOADS = {"softfreeze", "freekv", "icecache", "synckv"}  # KV crosses to the host tier
BASE_STATS = {"policy", "device_tokens", "host_tokens", "device_tokens_peak", "kv_bytes_read_per_step",
              "device_bytes", "host_bytes", "device_bytes_allocated", "host_bytes_allocated", "bytes_to_host",
              "bytes_to_device", "device_tokens_per_layer", "host_tokens_per_layer"}
STATS = {
    "full": set(),
    "streaming": {"budget", "cache_length", "prune_events", "tokens_dropped", "compactions"},
    "softfreeze": {"compression", "total_tokens", "freezes", "thaws", "spikes", "rewalks", "recovered_tokens"},
    "freekv": {"correction_rate", "pages_recalled", "pages_recalled_per_step", "speculative_exact_rate"},
    "icecache": {"pages_recalled", "pages_recalled_per_step", "keys_scored_fraction", "mean_page_fill"},
    "synckv": {"anticipation_steps", "tokens_fetched", "mem_percent", "clustering_file"},
}


@pytest.fixture(scope="module")
def gqa3(reference_dir, tmp_path_factory, device):
    """reference/models/llama_gqa3 (2 layers, 9 query heads over 3 KV heads, head dim 8) and a
    synckv clustering for it (layer 0 one cluster, layer 1 two)."""
    from minikv.loading import load_model

    model = load_model(reference_dir / "models" / "llama_gqa3", device=device, dtype=torch.float32)
    cfg = model.cfg
    layers = [{"clusters": [[0, 1, 2]], "r_heads": [0]}, {"clusters": [[0, 2], [1]], "r_heads": [2, 1]}]
    doc = {"format": FORMAT, "model": {"name": "test", "config_sha256": config_sha256(cfg), "weights_sha256": "-",
                                       "n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads},
           "corpus": {}, "seed": 0, "similarity": [], "clusterings": {"1": layers}}
    path = tmp_path_factory.mktemp("contract") / "gqa3.json"
    path.write_text(json.dumps(doc))
    return model, str(path)


def with_clusters(spec: str, clusters: str) -> str:
    if not spec.startswith("synckv"):
        return spec
    return f"{spec}{',' if ':' in spec else ':'}clusters={clusters}"


def run(model, spec, ids, every_step=None):
    """Prefill PROMPT tokens, decode the rest one by one; logits (steps, V) and the policy."""
    policy = make(spec).bind(model.cfg, device=model.device, dtype=torch.float32, max_len=ids.shape[1])
    out = [model(ids[:, :PROMPT], policy=policy)[:, -1]]
    for t in range(PROMPT, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]], device=model.device), policy=policy)[:, -1])
        if every_step is not None:
            every_step(policy)
    return torch.stack(out), policy


def random_ids(model, n=PROMPT + NEW, seed=1):
    return torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed)).to(model.device)


def test_every_policy_is_in_the_matrix():
    for table in (COVERING, SMALL, STATS):
        assert set(table) == set(available())


@pytest.mark.parametrize("name", available())
def test_budget_covering_the_context_equals_full_kv(gqa3, name):
    model, clusters = gqa3
    ids = random_ids(model)
    expect, _ = run(model, "full", ids)
    got, policy = run(model, with_clusters(COVERING[name], clusters), ids)
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)
    s = policy.stats()
    if name in OFFLOADS - {"softfreeze"}:  # softfreeze at tau = 0 has nothing to freeze
        assert s["bytes_to_host"] > 0 and s["host_tokens"] > 0  # the KV it returned really crossed the tiers


@pytest.mark.parametrize("name", available())
def test_budget_holds_and_stats_carry_the_documented_keys(gqa3, name):
    model, clusters = gqa3
    spec, budget = SMALL[name] or (COVERING[name], None)
    most = []

    def read_per_head(policy):  # the most tokens any layer's attention read for one KV head
        counts = []
        for layer in policy.layers:
            read = layer.attended_indices()
            if read is None:
                counts.append(layer.device_tokens())
                continue
            heads = getattr(layer, "nr_heads", range(read.shape[0]))  # synckv: R-heads keep full KV
            counts += [int((read[h] >= 0).sum()) for h in heads]
        most.append(max(counts))

    _, policy = run(model, with_clusters(spec, clusters), random_ids(model), every_step=read_per_head)
    if budget is not None:
        assert 0 < max(most) <= budget
    s = policy.stats()
    assert BASE_STATS | STATS[name] <= set(s), sorted(BASE_STATS | STATS[name] - set(s))
    if name in OFFLOADS and budget is not None:  # nothing offloaded is lost: every token is in a tier
        assert s["host_tokens"] > 0


def bad_values(name):
    """(parameter, a value its declaration refuses) for every parameter of a policy."""
    for key, f in parameters(_REGISTRY[name]).items():
        kind, _ = value_type(f)
        m = f.metadata
        if kind == "float":
            yield key, "nan"
            yield key, "inf"
        if kind in ("int", "float") and m["low"] is not None:
            yield key, str(m["low"] - 1)
        if kind in ("int", "float") and m["high"] is not None:
            yield key, str(m["high"] * 2 + 1)
        if kind in ("int", "float", "bool"):
            yield key, "abc"
        if m["choices"]:
            yield key, "no_such_choice"


@pytest.mark.parametrize("name, key, value", [(n, k, v) for n in available() for k, v in bad_values(n)])
def test_refusals_are_clean_and_name_the_parameter(name, key, value):
    with pytest.raises(ValueError, match=rf"\b{key}\b"):
        make(f"{name}:{key}={value}")


# -- sizes are capped by the context (issue 29) ----------------------------------------------------


@pytest.mark.parametrize("spec, default", [
    ("freekv:budget=1048576", "freekv"), ("icecache:budget=1048576", "icecache"),
    ("synckv:budget=1048576,wide_layers=0", "synckv:wide_layers=0"),
    ("softfreeze:history=100000", "softfreeze"), ("softfreeze:rewalk_tokens=1000,max_rewalks=10000", "softfreeze"),
])
def test_a_size_past_the_context_costs_what_the_default_costs(gqa3, spec, default):
    """On a 50-token context, a budget (or history, or rewalk) far past it allocates no more
    than the default parameters do (whose budget already covers the context): sizes are capped
    by the context at bind. Before the cap, freekv:budget=1048576 on a six-token prompt grew to
    20 GB."""
    model, clusters = gqa3
    ids = random_ids(model, 10)
    allocated = {}
    for s in (spec, default):
        policy = make(with_clusters(s, clusters)).bind(model.cfg, device=model.device, dtype=torch.float32, max_len=50)
        model(ids, policy=policy)
        stats = policy.stats()
        allocated[s] = stats["device_bytes_allocated"] + stats["host_bytes_allocated"]
        if s.startswith("softfreeze"):  # Eq. 3's table: one entry per count a context can reach
            assert policy.duration.numel() <= 51
    assert allocated[spec] <= allocated[default], allocated


def test_streaming_refuses_a_window_past_the_model_positions(gqa3):
    model, _ = gqa3
    with pytest.raises(ValueError, match="exceeds the model's context"):
        make("streaming:window=100000").bind(model.cfg, device=model.device, dtype=torch.float32, max_len=50)


def test_softness_inf_is_refused_at_once():
    with pytest.raises(ValueError, match="softness must be a finite float"):
        make("softfreeze:softness=inf")
    assert make("softfreeze:softness=65536").c_min == 2**32  # the largest k: d = 1 from c = k^2 on, computed


# -- backend=reference on SmolLM2 ---------------------------------------------------------------------

REFERENCE_SPECS = {  # budgets below the ~60-token context, so that every policy selects or frees
    "full": "full",
    "streaming": "streaming:sink=4,window=16",
    "softfreeze": "softfreeze",
    "freekv": "freekv:page_size=4,budget=32,sink=4,window=8",
    "icecache": "icecache:page_size=4,budget=32,sink=4,window=8",
    "synckv": "synckv:budget=48,window=8,wide_layers=0",
}


@pytest.mark.parametrize("name", available())
def test_smollm2_reference_backend_greedy_decodes_what_the_default_does(smollm2, name):
    """A ~60-token prompt, 4 new tokens (with the model already loaded, well under a second per
    policy on one thread)."""
    from minikv.generate import generate

    model, tok = smollm2
    prompt = "The three primary colours are red, yellow and blue. " * 5
    spec = REFERENCE_SPECS[name]
    default = generate(model, tok, prompt, policy=spec, max_new_tokens=4)
    reference = generate(model, tok, prompt, policy=f"{spec}{',' if ':' in spec else ':'}backend=reference",
                         max_new_tokens=4)
    assert reference.token_ids == default.token_ids

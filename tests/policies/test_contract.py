"""The policy contract, one matrix over every registered policy (policies.available()), as kvpress
runs one over every press: minikv.testing.check_policy, with the data each policy declares on its
class (contract.Policy, "What check_policy reads"), on the tiny model of every family and SmolLM2.
Below it, checks of single parameters the matrix does not reach."""
from __future__ import annotations

import json

import pytest
import torch

from minikv.policies import available, make
from minikv.policies.softfreeze.schedule_fast import first_freezing_count
from minikv.policies.synckv.clusters import FORMAT, config_sha256
from minikv.testing import PolicyContractError, check_policy

from ..fixtures import DEVICE

PROMPT, NEW = 80, 40


@pytest.mark.parametrize("name", available())
def test_contract(smollm2, name):
    ran = check_policy(name, smollm2=smollm2)
    assert "smollm2" in ran["covering"] and "smollm2" in ran["reference"]


def test_check_policy_fails_naming_the_check_on_planted_bugs(monkeypatch):
    """Each planted bug fails its check: a step that reads one token more than attended_indices()
    says, a recall that is not bit for bit (1 ulp off), a budget declared one token short."""
    from minikv.policies.h2o import H2O, H2OLayer
    from minikv.policies.tiers import Tiers

    real = H2OLayer.decode

    def hides_a_token(self, q, k, v, positions):
        out = real(self, q, k, v, positions)
        self._read = self._read[:, 1:]
        return out

    with monkeypatch.context() as m:
        m.setattr(H2OLayer, "decode", hides_a_token)
        with pytest.raises(PolicyContractError, match="h2o on the tiny llama_gqa model: attended: layer 0"):
            check_policy("h2o", families=("llama_gqa",), smollm2=False)
    with monkeypatch.context() as m:
        m.setattr(H2O, "small_budget", H2O.small_budget - 1)
        with pytest.raises(PolicyContractError, match="budget: a decode step of h2o:budget=24,window=8 read 24"):
            check_policy("h2o", families=("llama_gqa",), smollm2=False)
    copy_in = Tiers.copy_in
    monkeypatch.setattr(Tiers, "copy_in", lambda self, staging, gather, scatter, into, background=False: copy_in(
        self, staging, gather, lambda rows: scatter(torch.nextafter(rows, rows + 1)), into, background))
    with pytest.raises(PolicyContractError, match="offload: .* never given .*bit for bit"):
        check_policy("freekv", families=("llama_gqa",), smollm2=False)


@pytest.fixture(scope="module")
def gqa3(reference_dir, tmp_path_factory):
    """reference/models/llama_gqa3 (2 layers, 9 query heads over 3 KV heads, head dim 8) and a
    synckv clustering for it (layer 0 one cluster, layer 1 two)."""
    from minikv.loading import load_model

    model = load_model(reference_dir / "models" / "llama_gqa3", device=DEVICE, dtype=torch.float32)
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


def random_ids(model, n=PROMPT + NEW, seed=1):
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    return ids.to(DEVICE)


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
        policy = make(with_clusters(s, clusters)).bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=50)
        model(ids, policy=policy)
        stats = policy.stats()
        allocated[s] = stats["device_bytes_allocated"] + stats["host_bytes_allocated"]
        if s.startswith("softfreeze"):  # Eq. 3's table: one entry per count a context can reach
            assert policy.state.duration.numel() <= 51
    assert allocated[spec] <= allocated[default], allocated


def test_streaming_refuses_a_window_past_the_model_positions(gqa3):
    model, _ = gqa3
    with pytest.raises(ValueError, match="exceeds the model's context"):
        make("streaming:window=100000").bind(model.cfg, device=DEVICE, dtype=torch.float32, max_len=50)


def test_softness_inf_is_refused_at_once():
    with pytest.raises(ValueError, match="softness must be a finite float"):
        make("softfreeze:softness=inf")
    assert first_freezing_count(65536.0) == 2**32  # the largest k: d = 1 from c = k^2 on, computed

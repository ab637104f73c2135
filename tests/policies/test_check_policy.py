"""check_policy beyond the contract: a user's own transcription of the paper (oracle=) run beside
the policy, catching the four SnapKV slips of docs/examples/my_snapkv_bugs.py (each legal under
the contract) and a heavy hitter evicted in minikv's h2o; per-run state kept on the Policy object;
a duplicate in attended_indices()."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

import minikv
from minikv.policies.registry import _REGISTRY
from minikv.testing import PolicyContractError, check_policy

EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
QUICK = dict(families=("llama_gqa",), smollm2=False, backends=("eager",))  # GQA: 9 query heads over 3 KV heads


@pytest.fixture(scope="module")
def examples():
    """docs/examples on the path, as `--import docs/examples/...` or a user's script puts it."""
    sys.path.insert(0, str(EXAMPLES))
    import my_h2o
    import my_snapkv
    import my_snapkv_bugs

    yield my_h2o, my_snapkv, my_snapkv_bugs
    sys.path.remove(str(EXAMPLES))


def test_the_correct_snapkv_agrees_with_its_oracle_on_every_tiny_model(examples):
    _, snapkv, _ = examples
    ran = check_policy(snapkv.MySnapKV, oracle=snapkv.snapkv_oracle, smollm2=False, backends=("eager",))
    assert ran["oracle"] == ["llama_gqa", "qwen2_bias", "gpt_neox", "gemma3_hybrid"]


@pytest.mark.parametrize("bug", ["snapkv_window_short", "snapkv_groups_interleaved", "snapkv_one_query_head",
                                 "snapkv_no_causal_mask"])
def test_each_snapkv_slip_is_caught_by_the_oracle_naming_step_layer_and_head(examples, bug):
    """Each slip keeps the contract (docs/extending.md runs plain check_policy on each); the oracle
    fails it at the first decode step, naming the layer and the KV head."""
    _, snapkv, _ = examples
    with pytest.raises(PolicyContractError) as caught:
        check_policy(bug, oracle=snapkv.snapkv_oracle, **QUICK)
    message = str(caught.value)
    assert message.startswith(f"{bug} on the tiny llama_gqa model: oracle: decode step 1 (token 80), layer ")
    assert "KV head" in message and "only the policy's: [" in message and "only the oracle's: [" in message


def test_minikv_h2o_agrees_with_the_users_transcription_and_a_planted_eviction_does_not(examples, monkeypatch):
    """docs/examples/my_h2o.py's h2o_oracle (Algorithm 1 in float64) beside minikv's h2o: they agree;
    with the eviction inverted (the heavy hitters leave instead of the lightest) the oracle fails."""
    h2o, _, _ = examples
    assert check_policy("h2o", oracle=h2o.h2o_oracle, **QUICK)["oracle"] == ["llama_gqa"]
    from minikv.policies.h2o import H2OLayer

    keep = H2OLayer._keep
    monkeypatch.setattr(H2OLayer, "_keep", lambda self, score, pos: keep(self, -score, pos))
    with pytest.raises(PolicyContractError, match=r"h2o:budget=24,window=8 attends \d+ tokens, the oracle"):
        check_policy("h2o", oracle=h2o.h2o_oracle, **QUICK)


def test_an_oracle_with_a_row_per_query_head_is_told_what_it_returns(examples):
    def per_query_head(step):
        return None if step.prefill else [list(range(step.k.shape[1]))] * step.q.shape[0]

    with pytest.raises(PolicyContractError, match=r"the oracle returned 9 rows, want one per KV head \(3\)"):
        check_policy("full", oracle=per_query_head, **QUICK)


def test_an_oracle_needs_a_policy_that_reports_what_it_attends():
    with pytest.raises(ValueError, match="oracle= is compared with attended_indices.., which Streaming declares"):
        check_policy("streaming", oracle=lambda step: None, **QUICK)


# -- per-run state ------------------------------------------------------------------------------


@pytest.fixture
def counting(examples):
    """myh2o with a counter of decode calls kept on the Policy object (set once, in __post_init__),
    and, if `steers`, the counter deciding the window: what a second generate call inherits."""
    h2o, _, _ = examples

    def make(steers):
        class CountingLayer(h2o.MyH2OLayer):
            def decode(self, q, k, v, positions):
                self.policy.calls += 1
                if steers and self.policy.calls > 80:  # past one run: 40 steps x 2 layers
                    self.policy.window = 1
                return super().decode(q, k, v, positions)

        @minikv.register_policy
        @dataclass(eq=False, kw_only=True)
        class Counting(h2o.MyH2O):
            name = "counting_h2o"
            stats_keys = ("tokens_kept", "calls")

            def __post_init__(self):
                super().__post_init__()
                self.calls = 0

            def make_layer(self, index):
                return CountingLayer(self, index)

            def stats(self):
                return {**super().stats(), "calls": 0 if steers else self.calls}

        return Counting

    yield make
    _REGISTRY.pop("counting_h2o", None)


def test_a_counter_kept_on_the_policy_object_is_noticed(counting):
    """Two runs of one policy object (two generate calls) report 80 then 160 decode calls: state on
    the Policy, not on the layers bind rebuilds."""
    with pytest.raises(PolicyContractError, match=r"per-run state: counting_h2o:budget=24,window=8 run a second "
                                                  r"time reports calls = 160, 80 the first time"):
        check_policy(counting(steers=False), **QUICK)


def test_state_on_the_policy_object_that_changes_the_next_run_is_noticed(counting):
    with pytest.raises(PolicyContractError, match="per-run state: .* gives other logits than the first time"):
        check_policy(counting(steers=True), **QUICK)


def test_a_token_listed_twice_in_attended_indices_is_named_a_duplicate(monkeypatch):
    from minikv.policies.h2o import H2OLayer

    real = H2OLayer.decode

    def lists_the_first_twice(self, q, k, v, positions):
        out = real(self, q, k, v, positions)
        self._read = torch.cat([self._read, self._read[:, :1]], dim=1)
        return out

    monkeypatch.setattr(H2OLayer, "decode", lists_the_first_twice)
    with pytest.raises(PolicyContractError, match=r"attended: layer 0, KV head 0 at position 80: attended_indices\(\) "
                                                  r"lists token \d+ more than once \(a duplicate"):
        check_policy("h2o", **QUICK)


def test_synckv_paper_is_held_to_what_its_union_reads_and_no_more(monkeypatch):
    """synckv:paper's NR-heads read the union of every cluster's sets (Algorithm 1 line 23): up to
    N_r (k_static + k_dyn) tokens at a budget of k. check_policy holds them to that bound, not to
    the budget alone (which the paper's rule passes by design), and still fails a read past it."""
    check_policy("synckv:paper,budget=24,m=3", families=("llama_gqa",), smollm2=False, backends=("eager",))
    from minikv.policies.synckv.policy import SyncKV
    monkeypatch.setattr(SyncKV, "read_bound", lambda self, budget: budget)  # the budget alone
    with pytest.raises(PolicyContractError, match="budget: a decode step of synckv:paper"):
        check_policy("synckv:paper,budget=24,m=3", families=("llama_gqa",), smollm2=False, backends=("eager",))

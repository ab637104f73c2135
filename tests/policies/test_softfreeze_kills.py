"""softfreeze's readable form (schedule.py, policy.py) on what its other tests leave open
(docs/mutation.md): score=attention against its formula written out in float64 (the other tests
hold it only to the fast form's own computation), the tiers in the model's dtype, and follow's
thaw of a token frozen in the step its predecessor was read."""
import math

import pytest
import torch

from minikv.policies import make
from minikv.policies.softfreeze.schedule import attention_share

from ..fixtures import DEVICE
from .test_softfreeze import TINY


def test_attention_share_is_the_largest_head_weight_times_the_active_count():
    """s_j = |A| * max over query heads h of softmax_h(q_h . k_j / sqrt(D)) (schedule.attention_share)."""
    g = torch.Generator().manual_seed(0)
    Hkv, G, A, D = 2, 3, 7, 16
    q, k = torch.randn(1, Hkv * G, D, generator=g) * 2, torch.randn(1, Hkv, A, D, generator=g) * 2
    w = [[math.exp(float(q[0, h].double() @ k[0, h // G, j].double()) / math.sqrt(D)) for j in range(A)]
         for h in range(Hkv * G)]
    want = [A * max(w[h][j] / sum(w[h]) for h in range(Hkv * G)) for j in range(A)]
    torch.testing.assert_close(attention_share(q.to(DEVICE), k.to(DEVICE)).cpu().double(),
                               torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6)


def test_both_tiers_hold_the_model_dtype():
    layer = make("softfreeze:backend=reference").bind(TINY, device=DEVICE, dtype=torch.bfloat16, max_len=16).layers[0]
    assert layer.kv.dtype == layer.kv_host.dtype == torch.bfloat16


def test_follow_thaws_the_newest_token_frozen_in_its_predecessors_step():
    """With window=0 the newest token may be frozen in the step that read the one before it;
    follow brings it back."""
    policy = make("softfreeze:backend=reference,window=0,follow=0.5").bind(TINY, device=DEVICE, dtype=torch.float32,
                                                                          max_len=16)
    layer = policy.layers[0]
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 6, 16, generator=g).to(DEVICE) for H in (6, 2, 2))  # (1, H, T, D)
    layer.prefill(q, k, v, None)
    layer.freeze(torch.tensor([5], device=DEVICE))
    policy.thaw_successors([torch.tensor([4], device=DEVICE), torch.tensor([], dtype=torch.int64, device=DEVICE)])
    assert bool(layer.active[5])


def test_end_step_records_the_next_token_entropy_and_counts_a_spike():
    """After every forward, H = -sum p log p of the next-token distribution (nats); with egr on,
    an H above the calm steps' mean by more than egr_min is a spike and climbs one rung."""
    for egr in (True, False):
        policy = make(f"softfreeze:backend=reference,egr={str(egr).lower()},egr_window=2").bind(
            TINY, device=DEVICE, dtype=torch.float32, max_len=16)
        peaked = torch.full((1, 64), -30.0, device=DEVICE)
        peaked[0, 3] = 0.0
        for logits in (peaked, peaked, torch.zeros(1, 64, device=DEVICE)):  # calm, calm, uniform: log 64 nats
            policy.end_step(logits)
        p = torch.softmax(peaked[0].double(), -1)
        assert policy.entropies[0] == pytest.approx(float(-(p * p.log()).sum()), rel=1e-4, abs=1e-9)
        assert policy.entropies[-1] == pytest.approx(math.log(64), rel=1e-5)
        assert (policy.counters["spikes"], policy.level) == ((1, 1) if egr else (0, 0))


def test_a_history_shorter_than_the_context_counts_only_its_last_steps():
    """history=W (the paper's window for c_j): of detections at steps 0, 1 and 5, a history of 2
    counts only the last; none counts all three."""
    for spec, want in (("history=2", [1, 2, 1]), ("history=none", [1, 2, 3])):
        layer = make(f"softfreeze:backend=reference,{spec}").bind(TINY, device=DEVICE, dtype=torch.float32,
                                                                  max_len=16).layers[0]
        tok = torch.tensor([0], device=DEVICE)
        assert [int(layer.count_detections(tok, now)[0]) for now in (0, 1, 5)] == want, spec


def test_the_default_score_of_a_step_is_the_attention_share():
    """score=attention (the default): the step's s_j is attention_share over the active tokens."""
    policy = make("softfreeze:backend=reference").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=16)
    layer = policy.layers[0]
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, 6, 16, generator=g).to(DEVICE) for H in (6, 2, 2))  # (1, H, T, D)
    layer.prefill(q, k, v, None)
    q1, k1, v1 = (torch.randn(1, H, 1, 16, generator=g).to(DEVICE) for H in (6, 2, 2))
    layer.decode(q1, k1, v1, None)
    keys = torch.cat((k, k1), 2)  # (1, Hkv, 7, D): every token active
    torch.testing.assert_close(policy.scores[0], attention_share(q1[:, :, 0], keys))


def test_follow_defaults_and_checks():
    assert [make(f"softfreeze:{s}").follow_weight for s in ("tau=1", "score=relative", "follow=0.3")] == [0.1, 0.0, 0.3]
    with pytest.raises(ValueError, match="^follow needs score=attention"):
        make("softfreeze:score=relative,follow=0.3")
    import dataclasses

    with pytest.raises(ValueError, match="^softfreeze does not support sliding-window attention"):
        make("softfreeze").bind(dataclasses.replace(TINY, sliding_window=8), device=DEVICE, dtype=torch.float32,
                                max_len=16)


def test_end_step_after_a_forward_that_skipped_a_layer_is_an_error():
    policy = make("softfreeze:backend=reference").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=16)
    policy.scores = [torch.zeros(0, device=DEVICE), None]  # layer 0 ran, layer 1 did not
    with pytest.raises(RuntimeError, match="^softfreeze: end_step after a forward that skipped some layers$"):
        policy.end_step()

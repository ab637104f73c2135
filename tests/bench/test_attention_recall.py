"""Attention recall probe: against a fake policy whose attended set is known exactly."""
import math

import pytest
import torch

from minikv.bench.recall_probe import RecallProbe, attended_mass, oracle_mass
from minikv.config import ModelConfig
from minikv.models.attention import dense_attention
from minikv.policies.contract import LayerKV, Policy

from ..fixtures import DEVICE


class SinkWindowLayer(LayerKV):
    """Keeps every token, attends to the first `sink` and the last `window` of them; reports them."""

    def __init__(self, policy, index):
        super().__init__(policy, index)
        self.k = self.v = None
        self.read = None

    def prefill(self, q, k, v, positions):
        self.k, self.v = k, v
        return dense_attention(q, k, v)

    def decode(self, q, k, v, positions):
        self.k, self.v = torch.cat([self.k, k], 2), torch.cat([self.v, v], 2)
        n, p = self.k.shape[2], self.policy
        self.read = sorted(set(range(min(p.sink, n))) | set(range(max(0, n - p.window), n)))
        idx = torch.tensor(self.read, device=self.k.device)
        return dense_attention(q, self.k[:, :, idx], self.v[:, :, idx], q_pos=positions,
                               k_pos=idx[None].expand(q.shape[0], -1))

    def attended_indices(self):
        idx = torch.tensor(self.read, dtype=torch.int64, device=self.k.device)
        # pad one KV head's row with -1 (and repeat an index) to check both are ignored
        rows = idx[None].repeat(self.cfg.n_kv_heads, 1)
        return torch.cat([rows, torch.full((rows.shape[0], 2), -1, device=rows.device), rows[:, :1]], dim=1)

    def device_tokens(self):
        return len(self.read or [])


class SinkWindow(Policy):
    """Not registered: the compare harness must not pick it up."""

    name = "sinkwindow"

    def __init__(self, *, sink: int = 2, window: int = 3):
        super().__init__()
        self.sink, self.window = sink, window

    def make_layer(self, index):
        return SinkWindowLayer(self, index)


def tiny_cfg(n_layers=2, n_heads=6, n_kv=2, head_dim=8) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": "llama", "hidden_size": n_heads * head_dim, "num_hidden_layers": n_layers,
                                "num_attention_heads": n_heads, "num_key_value_heads": n_kv,
                                "intermediate_size": 32, "vocab_size": 50, "max_position_embeddings": 64})


def run_layer(probe_policy, q_fn, T=7, steps=5, n_kv=2, n_heads=6, D=8, seed=0):
    """Prefill T random tokens into layer 0, then `steps` decode steps; returns all q and k (drawn
    on the CPU, so that the hand-computed sums read them; the layer gets test-device copies)."""
    g = torch.Generator().manual_seed(seed)
    layer = probe_policy.layer(0)
    ks = torch.randn(1, n_kv, T + steps, D, generator=g)
    vs = torch.randn(1, n_kv, T + steps, D, generator=g)
    qs = [q_fn(g) for _ in range(steps)]
    q0, k, v = (x.to(DEVICE) for x in (torch.randn(1, n_heads, T, D, generator=g), ks, vs))
    layer.prefill(q0, k[:, :, :T], v[:, :, :T], torch.arange(T, device=DEVICE)[None])
    for s in range(steps):
        t = T + s
        layer.decode(qs[s].to(DEVICE), k[:, :, t:t + 1], v[:, :, t:t + 1], torch.tensor([[t]], device=DEVICE))
    return qs, ks


def test_uniform_attention_gives_the_share_of_tokens_read():
    # q = 0: full attention is uniform over the n tokens, so recall is |read| / n exactly
    policy = SinkWindow(sink=2, window=3)
    probe = RecallProbe(policy)
    policy.bind(tiny_cfg(n_layers=1), device=DEVICE, dtype=torch.float32, max_len=16)
    run_layer(policy, lambda g: torch.zeros(1, 6, 1, 8), T=7, steps=5)
    # steps see n = 8 .. 12 tokens, of which 5 are read
    expected = sum(5 / n for n in range(8, 13)) / 5
    assert probe.count == 5
    assert probe.recall == pytest.approx(expected, abs=1e-6)


def test_recall_equals_a_hand_computed_sum():
    policy = SinkWindow(sink=1, window=2)
    probe = RecallProbe(policy)
    policy.bind(tiny_cfg(n_layers=1), device=DEVICE, dtype=torch.float32, max_len=16)
    qs, ks = run_layer(policy, lambda g: 3 * torch.randn(1, 6, 1, 8, generator=g), T=6, steps=4)
    per_step = []
    for s, q in enumerate(qs):
        n = 6 + s + 1
        read = {0, n - 2, n - 1}
        heads = []
        for h in range(6):
            logits = [float(q[0, h, 0] @ ks[0, h // 3, j]) / math.sqrt(8) for j in range(n)]
            top = max(logits)
            w = [math.exp(x - top) for x in logits]
            heads.append(sum(w[j] for j in read) / sum(w))
        per_step.append(sum(heads) / 6)
    assert probe.recall == pytest.approx(sum(per_step) / len(per_step), abs=1e-5)
    assert 0 < probe.recall < 1


def test_oracle_is_the_best_selection_and_bounds_the_policy():
    p = torch.tensor([[0.5, 0.1, 0.4, 0.0], [0.1, 0.6, 0.2, 0.1]])  # 2 query heads, 1 KV head
    # group sums: [0.6, 0.7, 0.6, 0.1]; top-1 = token 1, top-2 = token 1 and (tie) 0 or 2: both give 1.3 / 2
    assert oracle_mass(p, 2, [1, 2, 4, 9]) == pytest.approx([0.35, 0.65, 1.0, 1.0])
    policy = SinkWindow(sink=1, window=2)
    probe = RecallProbe(policy, oracle_budgets=[3, 64])
    policy.bind(tiny_cfg(n_layers=1), device=DEVICE, dtype=torch.float32, max_len=16)
    run_layer(policy, lambda g: 3 * torch.randn(1, 6, 1, 8, generator=g), T=6, steps=4)
    assert probe.oracle[64] == pytest.approx(1.0)
    assert probe.recall <= probe.oracle[3] + 1e-6  # the policy reads 3 tokens: the oracle of 3 bounds it


def test_attended_mass_ignores_padding_and_duplicates():
    p = torch.full((2, 5), 0.2)
    assert attended_mass(p, torch.tensor([[0, 0, 3, -1]])).tolist() == pytest.approx([0.4, 0.4])
    with pytest.raises(ValueError, match="beyond"):
        attended_mass(p, torch.tensor([[5]]))


def test_probe_through_a_model_forward():
    # the probe wraps the layers bind() builds; generation through a real (tiny) model measures
    # one value per decode step and layer
    from minikv.generate import generate
    from minikv.models import build_model

    cfg = tiny_cfg()
    torch.manual_seed(0)
    model = build_model(cfg).eval()

    class Ids:
        eos_ids = set()

        def decode(self, ids):
            return " ".join(map(str, ids))

    policy = SinkWindow(sink=2, window=4)
    probe = RecallProbe(policy, oracle_budgets=[6])
    generate(model, Ids(), list(range(1, 20)), policy=policy, max_new_tokens=6, stop_at_eos=False)
    assert probe.count == 5 * cfg.n_layers  # the last sampled token is never fed
    assert 0 < probe.recall <= probe.oracle[6] + 1e-6

"""The byte accounting every policy reports (Policy.stats, Policy.token_bytes), written out for
full KV on two layers and a batch of two: K and V of one token, the tokens held and reserved on
each tier, and what attention read per decode step (counted after each step)."""
import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE

CFG = ModelConfig(model_type="llama", vocab_size=32, hidden_size=64, intermediate_size=8, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=16, max_position_embeddings=256, rotary_dim=16)


@pytest.mark.parametrize("dtype, element", [(torch.float32, 4), (torch.bfloat16, 2)])
def test_full_kv_accounts_for_every_byte(dtype, element):
    B, T, steps, max_len = 2, 10, 3, 40
    policy = make("full").bind(CFG, device=DEVICE, dtype=dtype, max_len=max_len, batch_size=B)
    tb = 2 * CFG.n_kv_heads * CFG.head_dim * element  # K and V, every KV head, one token, one layer
    assert policy.token_bytes() == tb
    x = lambda H, n: torch.randn(B, H, n, CFG.head_dim).to(DEVICE, dtype)  # noqa: E731
    for layer in policy.layers:
        layer.prefill(x(4, T), x(2, T), x(2, T), torch.arange(T, device=DEVICE).expand(B, T))
    policy.end_step()
    for t in range(T, T + steps):
        for layer in policy.layers:
            layer.decode(x(4, 1), x(2, 1), x(2, 1), torch.full((B, 1), t, device=DEVICE))
        policy.end_step()
    st = policy.stats()
    held = T + steps
    assert (st["device_tokens"], st["host_tokens"], st["device_tokens_peak"]) == (held, 0, held)
    assert st["device_tokens_per_layer"] == [held, held] and st["host_tokens_per_layer"] == [0, 0]
    assert st["device_bytes"] == B * 2 * held * tb and st["host_bytes"] == 0
    assert st["device_bytes_allocated"] == B * 2 * max_len * tb and st["host_bytes_allocated"] == 0
    # the decode steps read T + 1, T + 2, T + 3 tokens: their mean, all layers and rows
    assert st["kv_bytes_read_per_step"] == B * 2 * tb * (T + 2)
    assert (st["bytes_to_host"], st["bytes_to_device"], st["policy"]) == (0, 0, "full")

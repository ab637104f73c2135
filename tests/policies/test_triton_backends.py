"""Policies whose triton backend no other test runs: `full:backend=triton` (the GPU baseline every
speed figure divides by) and softfreeze's paper scores, score=raw and score=relative (Eq. 2 as
is, and over the layer's mean), on triton. A tiny random model decodes with backend=eager and
backend=triton from the same prompt; the logits of every step agree (Triton's interpreter on a
CPU, the compiled kernels on CUDA: the `device` fixture)."""
import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=64, intermediate_size=64, n_layers=2,
                   n_heads=4, n_kv_heads=2, head_dim=16, max_position_embeddings=256, rotary_dim=16)


def decode_logits(model, ids, spec, device, steps=6):
    """Prefill ids (1, T), then `steps` greedy steps -> logits (steps + 1, V) and the policy."""
    T = ids.shape[1]
    policy = make(spec).bind(TINY, device=device, dtype=torch.float32, max_len=T + steps + 1)
    out = [model(ids, policy=policy, logits_at=torch.tensor([T - 1], device=device))]
    for t in range(T, T + steps):
        nxt = out[-1].argmax(-1)
        out.append(model(nxt[:, None], positions=torch.tensor([[t]], device=device), policy=policy,
                         logits_at=torch.tensor([0], device=device)))
    return torch.cat(out), policy


@pytest.mark.parametrize("spec", [
    "full",
    # tau 1 and softness 0.5 freeze about half of the tokens outside the window within these few
    # steps (not all: the scores decide which)
    "softfreeze:window=4,tau=1,softness=0.5,score=raw",
    "softfreeze:window=4,tau=1,softness=0.5,score=relative",
])
def test_triton_backend_decodes_as_eager(spec, device):
    from minikv.models.llama import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(TINY).eval().to(device)
    ids = torch.randint(0, TINY.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1)).to(device)
    sep = "," if ":" in spec else ":"
    with torch.no_grad():
        eager, _ = decode_logits(model, ids, f"{spec}{sep}backend=eager", device)
        triton, policy = decode_logits(model, ids, f"{spec}{sep}backend=triton", device)
    torch.testing.assert_close(triton, eager, rtol=1e-4, atol=1e-4)
    if spec.startswith("softfreeze"):
        assert policy.stats()["freezes"] > 0, policy.stats()

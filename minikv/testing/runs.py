"""check_policy's runs (policies.py): a policy on a model, prefill then one token at a time,
with the Recorder (recorder.py) and an oracle (oracle.py) watching when asked."""
from __future__ import annotations

import torch

from ..policies.registry import make
from .oracle import OracleRun
from .recorder import Recorder, fail as _fail

PROMPT, NEW = 80, 40  # tokens of the tiny models' runs: 120 of their 128 positions


def run(model, ids, spec, where, prompt=PROMPT, budget=None, attended=False, rows_back=False, oracle=None):
    """Prefill `prompt` tokens, feed the rest one by one, checking what was asked on every step ->
    (logits (steps, V), the policy). spec: a spec, or a Policy object (bound afresh)."""
    device = device_of(model)
    policy = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=ids.shape[1])
    spec = spec if isinstance(spec, str) else policy.name
    beside = OracleRun(oracle, policy, where, spec) if oracle is not None else None
    if attended or rows_back or oracle is not None:  # it wraps the layers and tiers: nothing to keep
        Recorder(policy, policy.cfg, where, spec, attended, beside)
    out = [model(ids[:, :prompt], policy=policy)[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]], device=device), policy=policy)[:, -1])
        if budget is not None:
            _check_budget(policy, budget, where, spec)
    return torch.stack(out), policy


def _check_budget(policy, budget, where, spec):
    most = 0
    for layer in policy.layers:
        read = layer.attended_indices()
        for h in layer.budget_heads():
            most = max(most, layer.device_tokens() if read is None else int((read[h] >= 0).sum()))
    bound = policy.read_bound(budget)  # the budget, or what the rule reads at it (synckv's union)
    if not 0 < most <= bound:
        _fail(where, f"budget: a decode step of {spec} read {most} tokens for one KV head (declared small_budget "
                     f"{budget}: at most {bound} read)")


def greedy(model, ids, spec, new) -> tuple[list[int], dict]:
    device = device_of(model)
    policy = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=ids.shape[1] + new)
    T, tokens = ids.shape[1], []
    nxt = model(ids, policy=policy)[:, -1].argmax(-1)
    for t in range(T, T + new - 1):
        tokens.append(int(nxt))
        nxt = model(nxt[:, None], positions=torch.tensor([[t]], device=device), policy=policy)[:, -1].argmax(-1)
    return tokens + [int(nxt)], policy.stats()


def device_of(model) -> torch.device:
    return model.embed.weight.device


def random_ids(model, n=PROMPT + NEW, seed=1):
    # drawn on the CPU's generator (the same ids on every device), then moved to the model
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    return ids.to(device_of(model))

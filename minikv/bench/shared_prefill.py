"""One prefill forward for several caches: how compare, passkey and speed share a prompt.

A prompt's prefill is the same forward for every policy (the policies differ in what they keep,
not in the prompt's attention, which is dense). So the benchmarks run it once: SharedPrefill
stands in for a policy in `model(x, policy=...)`, hands each layer's q, k, v to every policy's
layer, and the forward goes on with the first policy's output. The dense attention over the
prompt is computed once for all of them (reusing_attention).

A policy whose prefill output differs from the first one's (streaming, when it prunes inside a
long prompt and replays the prompt over what it keeps) or that rotates the prompt at other
positions leaves the shared forward at that point: it is listed in `left`, its cache is
half-filled, and the caller binds it afresh and prefills it alone (shared_prefill below).
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F


def _version(x):
    # a tensor's in-place change counter; inference tensors keep none, and there identity alone
    # decides (the policies share q, k, v and none may change them in place)
    return x._version if isinstance(x, torch.Tensor) and not x.is_inference() else None


def _same(x, kept: tuple) -> bool:
    # tensors by identity (the kept ones stay alive, so an id is never reused) and version, the
    # rest by value
    y, version = kept
    return (x is y and _version(x) == version) if isinstance(x, torch.Tensor) else x == y


@contextlib.contextmanager
def reusing_attention():
    """Inside it, a call of torch's scaled_dot_product_attention on the very same tensors as an
    earlier one (the same objects, not modified since) and the same other arguments returns that
    call's output instead of computing it again. Each policy's prefill attends the same q, k, v
    (models.attention.dense_attention), and at 16k tokens that attention costs as much as the
    rest of the forward, once per policy. Scoped to one layer's calls, so the outputs kept are one
    layer's. The model and the policies know nothing of it: it is the benchmark's own business."""
    kept: list[tuple[dict, torch.Tensor]] = []  # per earlier call: {argument: (value, version)}, output
    sdpa = F.scaled_dot_product_attention

    def reused(*args, **kwargs):
        call = dict(enumerate(args), **kwargs)
        for earlier, out in kept:
            if earlier.keys() == call.keys() and all(_same(call[a], earlier[a]) for a in call):
                return out
        out = sdpa(*args, **kwargs)
        kept.append(({a: (x, _version(x)) for a, x in call.items()}, out))
        return out

    F.scaled_dot_product_attention = reused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa


class SharedPrefill:
    def __init__(self, policies: list):
        self.policies = list(policies)
        self.tags = list(range(len(policies)))  # each sharing policy's index in `policies`
        self.left: list[int] = []  # the indices of the policies that left the shared forward
        self.steps = 0

    def layer(self, index: int) -> "SharedPrefill._Layer":
        return SharedPrefill._Layer(self, index)

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        found = [p.rope_positions(positions) if hasattr(p, "rope_positions") else positions for p in self.policies]
        self._keep([torch.equal(f, found[0]) for f in found])
        return found[0]

    def end_step(self, logits=None) -> None:
        for p in self.policies:
            p.end_step(logits)
        self.steps += 1

    def _keep(self, agree: list[bool]) -> None:
        """The policies that disagree with the first one leave."""
        self.left += [j for j, ok in zip(self.tags, agree) if not ok]
        self.policies = [p for p, ok in zip(self.policies, agree) if ok]
        self.tags = [j for j, ok in zip(self.tags, agree) if ok]

    class _Layer:
        def __init__(self, shared: "SharedPrefill", index: int):
            self.shared, self.index = shared, index

        def prefill(self, q, k, v, positions):
            sh = self.shared
            with reusing_attention():  # the dense attention over the prompt, computed once for all
                outs = [p.layer(self.index).prefill(q, k, v, positions) for p in sh.policies]
            sh._keep([torch.equal(out, outs[0]) for out in outs])
            return outs[0]


def shared_prefill(model, ids: list[int], policies: list, rebind) -> list[torch.Tensor]:
    """Logits after the prompt for each bound policy: one forward for all that agree with the
    first, one forward each for those that left. rebind(j) binds policy j afresh (the shared
    forward left it half-filled) and returns it; policies[j] is replaced by it."""
    x = torch.tensor([ids], device=model.device)
    at = torch.tensor([len(ids) - 1], device=model.device)
    shared = SharedPrefill(policies)
    logits = [model(x, policy=shared, logits_at=at)] * len(policies)
    for j in shared.left:
        policies[j] = rebind(j)
        logits[j] = model(x, policy=policies[j], logits_at=at)
    return logits

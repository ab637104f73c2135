"""check_policy(spec, oracle=...): the user's own transcription of the paper, step by step beside
the policy.

The contract (policies.py) proves that a policy attends what it says it attends, within its
budget; it cannot know which tokens the paper keeps. An oracle can: a function written from the
paper, with its own arithmetic, that says at every decode step which tokens each KV head's
attention reads. check_policy calls it for every layer at every forward of its small-spec run on
each tiny model (the prefill, then each decode step), with what the layer was given, and fails at
the first decode step, layer and KV head where the oracle's tokens and `attended_indices()` part:

    def oracle(step: Step):
        ...                    # step.q, step.k, step.v, step.attention(), step.state, step.params
        return kept            # at a decode step: (Hkv, m) token positions (-1 pads), or a list of
                               # Hkv lists, or None for every token; at the prefill: ignored

    check_policy("mypolicy", oracle=oracle)

docs/extending.md transcribes H2O's Algorithm 1 and SnapKV's Listing 1 this way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from .recorder import fail


@dataclass
class Step:
    """What an oracle is given at one layer's forward. The tensors are float64 copies on the CPU
    (the oracle's arithmetic is its own); in check_policy's runs a token's position is its row."""

    layer: int  # the layer's index
    step: int  # 0: the prefill; 1, 2, ...: the decode steps
    q: torch.Tensor  # (Hq, T, D): this forward's queries as the layer got them (rotated); T = 1 decoding
    k: torch.Tensor  # (Hkv, n, D): every key the layer was given so far, this forward's the last T
    v: torch.Tensor  # (Hkv, n, D): the values, likewise
    positions: torch.Tensor  # (n,) int64: the tokens' positions, 0 .. n - 1
    params: dict  # the policy's parameters (its dataclass fields after construction)
    state: dict = field(default_factory=dict)  # the oracle's own, one per layer, kept across the run

    @property
    def prefill(self) -> bool:
        return self.step == 0

    def attention(self, tokens=None) -> torch.Tensor:
        """(Hq, T, m) float64: softmax(q k^T / sqrt(D)) of this forward's queries over `tokens`
        ((Hkv, m) positions, -1 as padding; None: all n), query head h reading KV head
        h // (Hq / Hkv), each query seeing only tokens at or before its own position."""
        Hq, T, D = self.q.shape
        Hkv, n = self.k.shape[:2]
        tokens = self.positions.expand(Hkv, n) if tokens is None else torch.as_tensor(tokens, dtype=torch.int64)
        G = Hq // Hkv
        idx = tokens.clamp_min(0).repeat_interleave(G, 0)  # (Hq, m)
        keys = self.k.repeat_interleave(G, 0).gather(1, idx[:, :, None].expand(-1, -1, D))  # (Hq, m, D)
        logits = self.q @ keys.transpose(1, 2) / math.sqrt(D)  # (Hq, T, m)
        q_pos = self.positions[n - T:]  # (T,)
        hidden = (tokens.repeat_interleave(G, 0) < 0)[:, None, :] | (idx[:, None, :] > q_pos[None, :, None])
        return torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)


class OracleRun:
    """The oracle beside one run of the policy: called from the Recorder after each forward of each
    layer (`after`), it compares a decode step's tokens with the layer's attended_indices()."""

    def __init__(self, oracle, policy, where, spec):
        self.oracle, self.where, self.spec, self.window = oracle, where, spec, policy.cfg.sliding_window
        self.params = {f.name: getattr(policy, f.name) for f in fields(policy) if f.init}
        self.states: dict[int, dict] = {}
        self.steps: dict[int, int] = {}

    def after(self, i, layer, q, kv, decoding):
        pos, k, v = kv  # (n,), (Hkv, n, D): every token layer i was given
        step = self.steps.get(i, 0)  # check_policy's runs prefill first: step 0
        self.steps[i] = step + 1
        cpu = lambda t: t.detach().to("cpu", torch.float64)  # noqa: E731
        kept = self.oracle(Step(i, step, cpu(q[0]), cpu(k), cpu(v), pos.cpu(), self.params,
                                self.states.setdefault(i, {})))
        if decoding:
            self._compare(i, step, int(pos[-1]), layer.attended_indices(), kept, pos.cpu(), k.shape[0])

    def _compare(self, i, step, p, read, kept, pos, Hkv):
        seen = pos[p - pos < self.window] if self.window else pos  # what full attention reads
        every = [set(seen.tolist())] * Hkv
        mine = every if read is None else [set(r[r >= 0].tolist()) for r in read.cpu()]
        theirs = every if kept is None else [{int(t) for t in row if int(t) >= 0} for row in _rows(kept)]
        if len(theirs) != Hkv:
            fail(self.where, f"oracle: at decode step {step} layer {i} the oracle returned {len(theirs)} rows, "
                              f"want one per KV head ({Hkv})")
        for h in range(Hkv):
            if mine[h] != theirs[h]:
                only_policy, only_oracle = sorted(mine[h] - theirs[h]), sorted(theirs[h] - mine[h])
                fail(self.where, f"oracle: decode step {step} (token {p}), layer {i}, KV head {h}: {self.spec} "
                                  f"attends {len(mine[h])} tokens, the oracle {len(theirs[h])}; only the "
                                  f"policy's: {_short(only_policy)}; only the oracle's: {_short(only_oracle)}")


def _rows(kept):
    return kept.tolist() if isinstance(kept, torch.Tensor) else [list(r) for r in kept]


def _short(tokens: list[int], most: int = 12) -> str:
    shown = ", ".join(map(str, tokens[:most]))
    return f"[{shown}{', ...' if len(tokens) > most else ''}]"

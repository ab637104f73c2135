"""softfreeze's Entropy-Guided Recovery: the spike rule and the ladder SR -> WR -> FR -> RR.

The paper ("Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery", Metinov et al., arXiv
2025, https://arxiv.org/abs/2512.11221) names this in Section 3.6 and leaves it as future work;
the design is minikv's (docs/design.md). After every forward the policy gets the next-token
logits (SoftFreeze.end_step). A spike: with at least `egr_window` previous entropies H (nats) of
this generation, the step's H exceeds their mean by more than max(egr_z * std, egr_min)
(`is_spike`). Each spike climbs one rung (`climb`):

    1 soft_reset()    SR: unfreeze the tokens whose remaining timer d_j is > 1
    2 window_reset()  WR: unfreeze the tokens frozen in the last `reset_steps` steps
    3 full_reset()    FR: unfreeze everything, clear every count and timer
    4 rewalk()        RR: full reset, then drop the KV of the last `rewalk_tokens` generated
                      tokens and ask the generation loop to regenerate them (StepAction.rewind)

Further spikes stay on rung 4; `egr_calm` steps without a spike bring the ladder back to the
bottom. Rewalk guard: at most `max_rewalks` per generation, and none until the generation has gone
past the position of the previous rewalk; a refused rewalk still runs the full reset. The rungs
act on every layer through the layers' own primitives (timers, frozen_at, unfreeze_where,
clear_counts, truncate), which both forms of a layer provide.
"""
from __future__ import annotations

import math

import torch

from ..contract import StepAction


class RecoveryLadder:
    """The rungs, mixed into SoftFreeze (which holds the parameters, layers and counters)."""

    def is_spike(self, H: float) -> bool:
        """A spike: H above the mean of the last egr_window entropies by max(egr_z * std, egr_min)."""
        past = self.entropies[-self.egr_window:]
        if len(past) < self.egr_window:
            return False
        mean = sum(past) / len(past)
        std = math.sqrt(sum((h - mean) ** 2 for h in past) / (len(past) - 1))
        return H > mean + max(self.egr_z * std, self.egr_min)

    def climb(self, rung: int, now: int) -> StepAction | None:
        if rung == 1:
            self.soft_reset()
        elif rung == 2:
            self.window_reset(now)
        elif rung == 3:
            self.full_reset()
        else:
            n = self.rewalk()
            return StepAction(rewind=n) if n else None
        return None

    def soft_reset(self) -> int:
        """SR: unfreeze the tokens whose remaining timer d_j is > 1 (after the last step)."""
        n = sum(layer.unfreeze_where(layer.timers() > 1) for layer in self.layers)
        return self._recovered("soft_resets", n)

    def window_reset(self, now: int | None = None) -> int:
        """WR: unfreeze the tokens frozen in the last reset_steps steps (steps now-N+1 .. now)."""
        now = self.steps - 1 if now is None else now
        n = sum(layer.unfreeze_where(layer.frozen_at[: layer.n_tok] > now - self.reset_steps) for layer in self.layers)
        return self._recovered("window_resets", n)

    def full_reset(self) -> int:
        """FR: unfreeze every token and clear every count and timer."""
        n = 0
        for layer in self.layers:
            n += layer.unfreeze_where(torch.ones(layer.n_tok, dtype=torch.bool, device=layer.frozen_at.device))
            layer.clear_counts()
        return self._recovered("full_resets", n)

    def rewalk(self) -> int:
        """RR: full reset, then forget the KV of the last rewalk_tokens generated tokens and
        return how many (0, after a full reset only, when the guard refuses)."""
        position = self.layers[0].n_tok - 1  # the position just decoded
        n = min(self.rewalk_tokens, self.layers[0].n_tok - self.prompt_len)
        self.full_reset()
        if n <= 0 or self.counters["rewalks"] >= self.max_rewalks or position <= self.rewalk_mark:
            self.counters["rewalks_refused"] += 1
            return 0
        for layer in self.layers:
            layer.truncate(layer.n_tok - n)
        del self.entropies[-n:]  # the entropies of the abandoned tokens
        self.rewalk_mark = position
        self.counters["rewalks"] += 1
        self.counters["rewalked_tokens"] += n
        return n

    def _recovered(self, rung: str, n: int) -> int:
        self.counters[rung] += 1
        self.counters["recovered_tokens"] += n
        return n

"""softfreeze: Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery (ASR-KF-EGR).

Paper: "Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery: Sublinear Memory Growth for
Efficient LLM Inference" (A. Metinov, G. M. Kudakeeva, B. uulu Nursultan, G. D. Kabaeva; arXiv
preprint, 2025; https://arxiv.org/abs/2512.11221). Read beside Sections 3.2-3.6 and Algorithm 1.

Every step, in every layer, a token j judged irrelevant (s_j of Eq. 2 below tau, outside the last
`window` = K tokens) has its count c_j raised and, once d_j = floor(sqrt(c_j) / softness) (Eq. 3,
softness = the paper's k) is > 0, its K/V moved to the host tier for d_j steps; then it comes
back bit for bit and is judged again. Where to read what:

    SoftFreeze (here)            parameters, bind, end_step: lines 3-15 after the last layer, EGR
    schedule.Algorithm1Layer     Algorithm 1 per layer, the paper's names: backend=reference
    recovery.RecoveryLadder      Entropy-Guided Recovery, the rungs SR, WR, FR, RR (Section 3.6)
    kernels/attention_relevance  lines 1-2: attention and s_j in one pass (reference.py)
    schedule_fast, layer_fast    the fast form of the same schedule, all layers at once (default)

Decisions (docs/design.md): a token frozen in a step keeps its timer that step (schedule.py);
score="relative" (the default) compares s_j / mean(s) over the active tokens with tau, because
Eq. 2 is unscaled and tau = 0.5 never fires on SmolLM2 (score="raw" is Eq. 2 as it is); the
defaults tau = 2.0, softness = 4 and their measurements are in docs/softfreeze.md. `history` is
the paper's W (None: counts never expire). Recovery is minikv's design (recovery.py).
"""
from __future__ import annotations

import math

import torch

from ..base import Policy, StepAction, register
from .layer_fast import SoftFreezeLayer
from .recovery import RecoveryLadder
from .schedule import Algorithm1Layer
from .schedule_fast import FreezeTiers


@register
class SoftFreeze(RecoveryLadder, Policy):
    """ASR-KF-EGR: sublinear soft freezing of low-relevance tokens to the host tier, with an
    entropy-guided recovery ladder."""

    name = "softfreeze"
    max_batch = 1

    def __init__(self, *, window: int = 32, tau: float = 2.0, softness: float = 4.0, history: int | None = None,
                 score: str = "relative", egr: bool = True, egr_window: int = 16, egr_z: float = 3.0,
                 egr_min: float = 1.0, egr_calm: int = 8, reset_steps: int = 8, rewalk_tokens: int = 4,
                 max_rewalks: int = 2, backend: str = "eager"):
        super().__init__(backend=backend)
        if not (isinstance(window, int) and window >= 0):
            raise ValueError(f"window (the paper's K, recent tokens never frozen) must be an int >= 0, got {window!r}")
        if not (isinstance(tau, (int, float)) and tau >= 0):
            raise ValueError(f"tau (relevance threshold) must be >= 0, got {tau!r}")
        if not (isinstance(softness, (int, float)) and softness > 0):
            raise ValueError(f"softness (the paper's k in Eq. 3) must be > 0, got {softness!r}")
        if history is not None and not (isinstance(history, int) and history >= 1):
            raise ValueError(f"history (the paper's W, steps) must be None or an int >= 1, got {history!r}")
        if score not in ("raw", "relative"):
            raise ValueError(f"score must be 'raw' (Eq. 2 as is) or 'relative' (s_j / mean s), got {score!r}")
        for name, value, low in (("egr_window", egr_window, 2), ("egr_calm", egr_calm, 1), ("reset_steps", reset_steps, 1),
                                 ("rewalk_tokens", rewalk_tokens, 1), ("max_rewalks", max_rewalks, 0)):
            if not (isinstance(value, int) and value >= low):
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        if not (egr_z >= 0 and egr_min >= 0):
            raise ValueError(f"egr_z and egr_min must be >= 0, got {egr_z!r}, {egr_min!r}")
        self.window, self.tau, self.softness, self.history, self.score = window, float(tau), float(softness), history, score
        self.egr, self.egr_window, self.egr_z, self.egr_min, self.egr_calm = egr, egr_window, egr_z, egr_min, egr_calm
        self.reset_steps, self.rewalk_tokens, self.max_rewalks = reset_steps, rewalk_tokens, max_rewalks
        # Eq. 3 gives d_j > 0 from c_j = c_min on: the smallest c with floor(sqrt(c) / k) >= 1
        self.c_min = next(c for c in range(1, 10**9) if math.floor(math.sqrt(c) / self.softness) >= 1)

    def validate(self, cfg) -> None:
        if cfg.sliding_window is not None:
            raise ValueError("softfreeze does not support sliding-window attention (cfg.sliding_window is set)")

    def bind(self, cfg, **kwargs) -> "SoftFreeze":
        super().bind(cfg, **kwargs)
        # Eq. 3 tabulated for the fast form, d = floor(sqrt(c) / k), one lookup per step. A count
        # grows at most once a step, and the steps of a generation are at most max_len plus the
        # tokens its (at most max_rewalks) rewalks regenerate
        c = torch.arange(self.max_len + self.max_rewalks * self.rewalk_tokens + 1, dtype=torch.float64)
        self.duration = torch.floor(torch.sqrt(c) / self.softness).long().to(self.tiers.device)
        if self.backend != "reference":  # the fast form: the tiers and state of all layers, stacked
            self.state = FreezeTiers(self, cfg.n_layers)
        self.scores: list[torch.Tensor | None] = [None] * cfg.n_layers  # each layer's s_j of this forward
        self.entropies: list[float] = []  # H of each step's next-token distribution, nats
        self.level = 0  # the ladder's current rung, 0 = calm
        self.calm = 0  # steps since the last spike
        self.prompt_len = 0
        self.rewalk_mark = -1  # position of the last rewalk; none again until past it
        self.counters = dict(spikes=0, soft_resets=0, window_resets=0, full_resets=0, rewalks=0,
                             rewalks_refused=0, rewalked_tokens=0, recovered_tokens=0)
        return self

    def make_layer(self, index: int):
        return Algorithm1Layer(self, index) if self.backend == "reference" else SoftFreezeLayer(self, index)

    # -- per step ----------------------------------------------------------------------------
    def end_step(self, logits: torch.Tensor | None = None) -> StepAction | None:
        now = self.steps  # index of the step that just ran (0 = prefill)
        if any(s is not None for s in self.scores):  # a forward ran since the last step
            if any(s is None for s in self.scores):
                raise RuntimeError("softfreeze: end_step after a forward that skipped some layers")
            self.freeze_and_thaw(self.scores, now)
            self.scores = [None] * len(self.layers)
        super().end_step(logits)
        if now == 0:
            self.prompt_len = self.layers[0].n_tok
        if logits is None:
            return None
        logp = torch.log_softmax(logits[0].float(), dim=-1)  # (V,)
        H = float(-(logp.exp() * logp).sum())
        spike = self.is_spike(H)
        self.entropies.append(H)
        if not (self.egr and spike):
            self.calm += 1
            if self.calm >= self.egr_calm:
                self.level = 0
            return None
        self.counters["spikes"] += 1
        self.calm = 0
        self.level = min(self.level + 1, 4)
        return self.climb(self.level, now)

    def freeze_and_thaw(self, scores: list[torch.Tensor], now: int) -> None:
        """Lines 3-15 of Algorithm 1 in every layer, on the s_j (Eq. 2) its attention gave in
        this forward: scores[l] over layer l's active tokens (benchmarks watch this call)."""
        if self.backend == "reference":
            for layer, s in zip(self.layers, scores):
                layer.step(s, now)
        else:
            self.state.schedule_all(scores, now)

    # -- accounting --------------------------------------------------------------------------
    def stats(self) -> dict:
        out = super().stats()
        total = self._mean(lambda layer: layer.n_tok)
        out.update(self.counters)
        out.update(
            total_tokens=total,
            compression=1 - out["device_tokens"] / total if total else 0.0,
            freezes=sum(layer.freezes for layer in self.layers),
            thaws=sum(layer.thaws for layer in self.layers),
            entropy_last=self.entropies[-1] if self.entropies else float("nan"),
        )
        return out

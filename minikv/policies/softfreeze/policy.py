"""softfreeze: Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery (ASR-KF-EGR).

Paper: "Adaptive Soft Rolling KV Freeze with Entropy-Guided Recovery: Sublinear Memory Growth for
Efficient LLM Inference" (A. Metinov, G. M. Kudakeeva, B. uulu Nursultan, G. D. Kabaeva; arXiv
preprint, 2025; https://arxiv.org/abs/2512.11221). Read beside Sections 3.2-3.6 and Algorithm 1.

Every step, in every layer, a token j judged irrelevant (its score s_j below tau, outside the last
`window` = K tokens) has its count c_j raised and, once d_j = floor(sqrt(c_j) / softness) (Eq. 3,
softness = the paper's k) is > 0, its K/V moved to the host tier for d_j steps; then it comes
back bit for bit and is judged again. Where to read what:

    SoftFreeze (here)            parameters, bind, end_step: lines 3-15 after the last layer, EGR
                                 (its stats(): accounting.py)
    schedule.Algorithm1Layer     Algorithm 1 per layer, the paper's names: backend=reference
    recovery.RecoveryLadder      Entropy-Guided Recovery, the rungs SR, WR, FR, RR (Section 3.6)
    kernels/attention_relevance  lines 1-2: attention and s_j in one pass (reference.py)
    schedule_fast, layer_fast    the fast form of the same schedule, all layers at once (the
                                 default; dispatch.py gives bind and make_layer the backend's form)

The paper's rules: `softfreeze:paper` (preset=paper: score=raw, tau=0.5, judge_prompt=true,
egr=false, the paper's Eq. 2, threshold and first step, and no recovery, which Sec. 3.6 leaves to
future work; k = 2 and K = 32 are the defaults already). Decisions
(docs/design.md, "softfreeze" and "The paper as a preset"): a token frozen in a step keeps its
timer that step (schedule.py). The prompt: the prefill forward generates the first token, so read
literally it is Algorithm 1's first step, whose line 2 scores every prompt token with the last
prompt position's query (judge_prompt=true, the preset's). The default leaves that judgement out
and the first decode step judges first: counted, it put the first freeze (c_j = k^2) on step
k^2 - 1 = 3, so the step that chooses whether to write the key after "The pass key is" ran with
part of the key frozen and lost a passkey full KV finds (docs/softfreeze.md, "Table 2"). The
score: score="raw" is Eq. 2 as it is and
score="relative" divides it by the mean s over the active tokens (Eq. 2 is unscaled: tau = 0.5
never fires on SmolLM2). Both rank tokens nearly opposite to the attention on SmolLM2 (a key a
head ignores has a large negative q.k, so a large |q.k|), so score="attention" (the default,
minikv's) scores a token by the largest softmax weight any head gives it, times |A|
(schedule.attention_share), and `follow` keeps the token after one a head reads for the next
step, which a copying head reads next (SoftFreeze.thaw_successors). The defaults (score=attention,
tau = 1, k = 2, follow = 0.1), the paper's (score=raw, tau = 0.5, k = 2), the former defaults
(score=relative, tau = 2, k = 4) and their measurements are in docs/softfreeze.md. `history` is
the paper's W (None: counts never expire). The paper proposes the recovery ladder (Sec. 3.6)
and leaves it to future work; its trigger and rungs here are minikv's design (recovery.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..contract import Policy, StepAction, param
from ..registry import register
from . import dispatch
from .accounting import FreezeStats
from .recovery import RecoveryLadder


@register
@dataclass(eq=False, kw_only=True)
class SoftFreeze(RecoveryLadder, FreezeStats, Policy):
    """ASR-KF-EGR: sublinear soft freezing of low-relevance tokens to the host tier, with an
    entropy-guided recovery ladder."""

    name = "softfreeze"
    max_batch = 1
    kernels = ("attention_relevance",)
    # Eq. 2 as it is, Sec. 4.1's tau = 0.50, the prefill's forward as the first generation step, and
    # no recovery: "Full implementation and evaluation of the recovery system is planned for future work"
    PAPER = dict(score="raw", tau=0.5, judge_prompt=True, egr=False)
    # the contract matrix's data (checks.PolicyChecks, "What check_policy reads")
    covering_spec = "softfreeze:tau=0"  # nothing is below relevance 0: nothing freezes
    small_spec = "softfreeze:softness=1"  # no budget: it freezes by relevance, from the first step on
    stats_keys = ("compression", "total_tokens", "freezes", "thaws", "spikes", "rewalks", "recovered_tokens")
    offloads = True
    reports_attended = False  # attended_indices() answers None though frozen tokens are not read
    window: int = param(32, "the paper's K: the most recent tokens, never frozen", low=0)
    tau: float = param(1.0, "relevance threshold: a token with s_j < tau is counted (line 3)", low=0)
    # k > 2^16 would need over 2^32 detections before a first freeze, more than any context
    # holds: the bound keeps the fast form's arithmetic (c_min) finite and loses no behaviour
    softness: float = param(2.0, "the paper's k in Eq. 3: d_j = floor(sqrt(c_j) / k)", above=0, high=2.0**16)
    history: int | None = param(None, "the paper's W: only the last W steps' detections count (none: all; "
                                      "capped by the context)", low=1)
    score: str = param("attention", "raw (Eq. 2 as is), relative (s_j / mean s over the layer) or attention "
                                   "(|A| * the largest softmax weight over heads; tau as is)",
                       choices=("raw", "relative", "attention"))
    follow: float | None = param(None, "keep (and bring back) the token after one a head weighs at least this "
                                       "much, for the next step: score=attention only (none: 0.1 with "
                                       "score=attention, off with the others; 0: off)", low=0, high=1)
    judge_prompt: bool = param(False, "Algorithm 1 runs on the prefill's forward too: the last prompt position's "
                                      "query judges the whole prompt, a first detection of each token below "
                                      "tau (false: the first decode step judges first)")
    egr: bool = param(True, "entropy-guided recovery on spikes of the next-token entropy")
    egr_window: int = param(16, "past entropies a spike is judged against", low=2)
    egr_z: float = param(3.0, "a spike: entropy above the mean by egr_z standard deviations...", low=0)
    egr_min: float = param(1.0, "...and by at least egr_min nats", low=0)
    egr_calm: int = param(8, "steps without a spike that bring the ladder back to its bottom", low=1)
    reset_steps: int = param(8, "window reset: unfreeze the tokens frozen in the last reset_steps steps", low=1)
    rewalk_tokens: int = param(4, "rewalk: generated tokens dropped and generated anew (capped by the context)",
                               low=1)
    max_rewalks: int = param(2, "most rewalks per generation", low=0)

    def __post_init__(self):
        super().__post_init__()
        if self.follow and self.score != "attention":
            raise ValueError(f"follow needs score=attention (a softmax weight to compare with), got score={self.score}")
        self.follow_weight = (0.1 if self.score == "attention" else 0.0) if self.follow is None else self.follow
        self.declared_history = self.history  # bind caps it by the context

    def validate(self, cfg) -> None:
        if cfg.sliding_window is not None:
            raise ValueError("softfreeze does not support sliding-window attention (cfg.sliding_window is set)")

    def max_rewind(self) -> int:
        # a rewalk drops up to rewalk_tokens tokens: the runtime's windows keep that many more
        return self.rewalk_tokens if self.max_rewalks else 0

    def bind(self, cfg, **kwargs) -> "SoftFreeze":
        # a count grows at most once a step, and every step that does not rewind adds a token, so
        # between two resets of the counts (full_reset, which every rewalk runs first) a count
        # reaches at most max_len: a history of W >= max_len steps counts every detection, and is
        # `none`, without a (layers, max_len, W) table of detection steps. Set before the layers
        # are made (in Policy.bind): they size that table by it
        W = self.declared_history
        self.history = None if W is None or W >= kwargs["max_len"] else W
        super().bind(cfg, **kwargs)
        # self.cfg: the layers this policy governs (a hybrid model's global ones, contract.Policy.bind)
        # the fast form's state of all layers stacked (dispatch.py; None: Algorithm1Layer, each its own)
        self.state = dispatch.stacked_state(self)
        self.scores: list[torch.Tensor | None] = [None] * self.cfg.n_layers  # each layer's s_j of this forward
        self.entropies: list[float] = []  # H of each step's next-token distribution, nats
        self.level = 0  # the ladder's current rung, 0 = calm
        self.calm = 0  # steps since the last spike
        self.prompt_len = 0
        self.rewalk_mark = -1  # position of the last rewalk; none again until past it
        self.counters = dict(followed=0, spikes=0, soft_resets=0, window_resets=0, full_resets=0, rewalks=0,
                             rewalks_refused=0, rewalked_tokens=0, recovered_tokens=0)
        return self

    def make_layer(self, index: int):
        return dispatch.make_layer(self, index)  # schedule.Algorithm1Layer, or a view of self.state

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
        # the rung taken; a rewalk asks the loop to feed its tokens again (StepAction.rewind)
        self.last_action = self.climb(self.level, now)
        return self.last_action

    def freeze_and_thaw(self, scores: list[torch.Tensor], now: int) -> None:
        """Lines 3-15 of Algorithm 1 in every layer, on the s_j (Eq. 2) its attention gave in
        this forward: scores[l] over layer l's active tokens (benchmarks watch this call)."""
        if self.state is not None:  # the same step for all layers at once, follow's restores in it
            self.counters["followed"] += self.state.schedule_all(scores, now, self.follow_weight)
            return
        # follow: the tokens a head read this step, taken before the schedule moves any
        read = None if not self.follow_weight else [layer.active_tokens()[s >= self.follow_weight * len(s)]
                                                    for layer, s in zip(self.layers, scores)]
        for layer, s in zip(self.layers, scores):
            layer.step(s, now)
        if read is not None:
            self.thaw_successors(read)

    def thaw_successors(self, read: list[torch.Tensor]) -> None:
        """follow (minikv's, beyond the paper): the token after one a head read is active for the
        next step. A head that copies (an induction head) reads token j + 1 right after j, and
        j + 1, idle until then, is what Algorithm 1 has frozen (a d = 1 freeze: absent every
        other step). read[l]: the tokens some head of layer l weighed >= follow this step."""
        for layer, tok in zip(self.layers, read):
            mask = torch.zeros(layer.n_tok, dtype=torch.bool, device=tok.device)
            mask[tok[tok + 1 < layer.n_tok] + 1] = True
            self.counters["followed"] += layer.unfreeze_where(mask)

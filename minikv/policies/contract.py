"""The policy contract: what every KV-cache policy implements (Policy), and what it builds per layer
(LayerKV). The registry and spec strings are registry.py's, the tier accounting stats.py's.

A Policy is built with its parameters (`make("streaming:sink=4,window=252")`), then bound to a
model (`policy.bind(cfg, device=..., dtype=..., max_len=...)`), which builds one LayerKV per
layer. The model's attention computes q, k, v, applies RoPE at the tokens' absolute positions and
hands them to `policy.layer(i)`:

    out = policy.layer(i).prefill(q, k, v, positions)   # once, over the prompt
    out = policy.layer(i).decode(q, k, v, positions)    # then once per generated token

    q (B, n_heads, T, D)   k, v (B, n_kv_heads, T, D)   positions (B, T) int64   out like q

`out` must be exactly what full attention returns over the tokens the policy lets that layer
see. Before the layers run, the model asks `policy.rope_positions(positions)` where to rotate q
and k: the absolute positions for every policy but one that renumbers (streaming), which answers
with cache positions, so that a token is rotated once, where it will be read. After the last
layer of each forward the model calls `policy.end_step(logits)`, the policy's per-step work; what
it asks of the generation loop (a rewind) it keeps in `last_action`, which the loop reads.
`policy.stats()` reports tiers and events at any time.

On a model with sliding-window layers (Gemma 3's local layers; a Mistral's, every layer) whose
window is shorter than max_len, the runtime keeps those layers' windows itself (window.py) and
the policy is bound to the global layers alone: `layer(i)` maps the model's layer index.

Every copy between the tiers (device: where attention runs; host: CPU memory) goes through the
policy's `Tiers` (tiers.py). What a decode step does not run, the classes inherit: the accounting
(stats.py: `stats()`, each layer's tokens and bytes per tier) and the checks (checks.py: of the
parameters, of bind's request, and what the contract matrix reads of a policy).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import ModelConfig
from ..models.attention import dense_attention  # noqa: F401  (re-exported: the attention `out` must equal)
from ..models.rope import RotaryEmbedding
from .checks import LayerChecks, PolicyChecks
from .overlap import make_layers
from .params import PRESETS, param
from .stats import LayerStats, TierStats
from .tiers import Tiers


@dataclass
class StepAction:
    """What a step asks of the generation loop (`Policy.last_action`, set by end_step).

    `rewind=n`: the policy has already removed the KV of the last n tokens fed to the model (at
    positions p-n+1 .. p, p the position just decoded). The loop drops the token it was about to
    feed and those n tokens from its output, then feeds the first of them again at its old
    position p-n+1; everything after it is generated anew under the policy's new state."""

    rewind: int = 0


class LayerKV(LayerStats, LayerChecks, ABC):
    """The KV state of one layer under one policy: what it keeps of the prompt, what attention
    reads at each decode step, and how many tokens per KV head that is (device_tokens). What else
    it holds per tier is LayerStats's (stats.py), what check_policy reads of it LayerChecks's."""

    def __init__(self, policy: "Policy", index: int):
        self.policy = policy
        self.index = index
        self.cfg = policy.cfg

    @abstractmethod
    def prefill(self, q, k, v, positions) -> torch.Tensor: ...

    @abstractmethod
    def decode(self, q, k, v, positions) -> torch.Tensor: ...

    @abstractmethod
    def device_tokens(self) -> int:
        """Tokens per KV head that attention reads on the device tier (mean over batch rows)."""


@dataclass(eq=False, kw_only=True)
class Policy(PolicyChecks, TierStats, ABC):
    """Base of all policies. A policy is a dataclass (as kvpress's presses are): its parameters
    are fields declared with `param` (default, bounds, one-line meaning), from which `make`'s
    parser, the checks (checks.py) and `--help` all derive. A subclass sets `name`, declares its
    fields, checks what its bounds cannot say (relations between parameters) in `__post_init__`
    after `super().__post_init__()`, and implements `make_layer`. What check_policy reads of it
    (covering_spec, small_spec, ...) it declares as checks.PolicyChecks lists."""

    name: ClassVar[str] = ""
    max_batch: ClassVar[int | None] = 1  # most policies follow one sequence; `full` takes any batch
    # the kernel operations (minikv/kernels/<op>) the policy runs with its backend: they decide
    # which backends it implements (kernels.policy_backends; none: reference and eager only)
    kernels: ClassVar[tuple[str, ...]] = ()
    PAPER: ClassVar[dict] = {}  # the parameter values of the paper's rules, which preset=paper selects
    PAPER_SIZES: ClassVar[dict] = {}  # the sizes the paper ran at: preset=paper takes those not given
    has_paper: ClassVar[bool] = True  # False for a baseline (full) that implements no paper

    backend: str = param("eager")
    preset: str | None = param(None, choices=PRESETS)

    def __post_init__(self):
        self.check_parameters()  # checks.py: the preset applied, every parameter in its bounds
        self.cfg: ModelConfig | None = None
        self.layers: list[LayerKV] = []
        self.windows: dict[int, LayerKV] = {}  # the model's local layers, kept by the runtime (window.py)
        self._by_index: list[LayerKV] = []
        self.steps = 0
        self.last_action: StepAction | None = None  # what the last step asks of the loop

    # -- binding ---------------------------------------------------------------------------
    def bind(self, cfg: ModelConfig, *, device, dtype: torch.dtype, max_len: int, batch_size: int = 1) -> "Policy":
        self.check_bind(cfg, max_len, batch_size)  # checks.py: the batch, the context, a global layer
        # local layers (window.py): a sliding window shorter than the sequence; the runtime keeps them
        from .window import WindowLayer, governed_config, local_windows  # (window.py subclasses LayerKV: no cycle)

        windows = local_windows(cfg, max_len)
        self.global_layers = [i for i in range(cfg.n_layers) if i not in windows]
        self.model_cfg, cfg = cfg, governed_config(cfg, max_len)
        self.cfg, self.dtype, self.max_len, self.batch_size = cfg, dtype, max_len, batch_size
        self.tiers = Tiers(device)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.validate(cfg)
        self.steps = 0
        self.last_action = None
        self.reset_counts()
        self.allocate_shared()
        self.layers = make_layers(self)  # make_layer's, beside the model where it overlaps (overlap.py)
        self.windows = {i: WindowLayer(self, i, w, w + self.max_rewind()) for i, w in windows.items()}
        # the model's layer index -> the policy's layer, or the runtime's window
        self._by_index = [self.windows.get(i) for i in range(self.model_cfg.n_layers)]
        for j, i in enumerate(self.global_layers):
            self._by_index[i] = self.layers[j]
        return self

    def allocate_shared(self) -> None:
        """Buffers the layers share (staging for recalls), allocated at bind before the layers."""

    @abstractmethod
    def make_layer(self, index: int) -> LayerKV: ...

    def overlaps(self) -> bool:  # whether a layer's next selection runs on a worker beside the model (overlap.py)
        return False

    def layer(self, index: int) -> LayerKV:
        """The KV of the model's layer `index`: the policy's, or the runtime's window (window.py)."""
        return self._by_index[index]

    def keeps_window(self, index: int) -> bool:
        """Whether the model's layer `index` is a local layer whose window the runtime keeps
        (its keys are then rotated at their absolute positions: models/decoder.py)."""
        return index in self.windows

    def max_rewind(self) -> int:
        """The most tokens one StepAction.rewind drops (softfreeze's rewalk): a window keeps
        that many slots more, so that the tokens fed again find the window they had."""
        return 0

    def all_layers(self) -> list[LayerKV]:
        """Every layer of the model in order: the policy's and the runtime's windows."""
        return self._by_index

    @property
    def bound(self) -> bool:
        return self.cfg is not None

    def rope_positions(self, positions: torch.Tensor) -> torch.Tensor:
        """positions (B, T) absolute -> the positions at which the model rotates this forward's
        q and k. Every policy that keeps absolute positions returns them as they are."""
        return positions

    # -- per step --------------------------------------------------------------------------
    def end_step(self, logits: torch.Tensor | None = None) -> StepAction | None:
        """Called by the model after every forward (prefill included), on the next-token logits
        (B, V). A policy that asks something of the loop (softfreeze's rewind) overrides this,
        calls it first, then sets `self.last_action` and returns it; the rest ask nothing."""
        self.count_step()
        self.steps += 1
        self.last_action = None
        return None

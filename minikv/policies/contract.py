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

Tiers: `device` is where attention runs (the model's device); `host` is CPU memory, pinned when
CUDA is present. On a CPU-only machine both are CPU memory: the copies still happen and the
accounting is real, but nothing is saved. Every copy between the tiers goes through the policy's
`Tiers` (tiers.py), which counts the bytes moved.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..config import ModelConfig
from ..kernels import check_backend
from ..models.attention import dense_attention  # noqa: F401  (re-exported: the attention `out` must equal)
from ..models.rope import RotaryEmbedding
from .params import PRESETS, apply_preset, check_fields, param, preset_conflicts
from .stats import TierStats
from .tiers import Tiers


@dataclass
class StepAction:
    """What a step asks of the generation loop (`Policy.last_action`, set by end_step).

    `rewind=n`: the policy has already removed the KV of the last n tokens fed to the model (at
    positions p-n+1 .. p, p the position just decoded). The loop drops the token it was about to
    feed and those n tokens from its output, then feeds the first of them again at its old
    position p-n+1; everything after it is generated anew under the policy's new state."""

    rewind: int = 0


class LayerKV(ABC):
    """The KV state of one layer under one policy."""

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

    def host_tokens(self) -> int:
        """Tokens per KV head held on the host tier."""
        return 0

    def allocated_device_tokens(self) -> int:
        """Token slots reserved on the device tier (preallocation counts)."""
        return self.device_tokens()

    def allocated_host_tokens(self) -> int:
        """Token slots reserved on the host tier (a preallocated host buffer counts in full)."""
        return self.host_tokens()

    def aux_bytes(self) -> tuple[int, int]:
        """(device, host) bytes this layer holds besides K and V slots: digests, trees, index
        tensors, staging buffers. Counted in the allocated figures of `Policy.stats`."""
        return 0, 0

    def attended_indices(self) -> torch.Tensor | None:
        """(Hkv, n) int64: the absolute indices of the tokens the last decode step's attention
        read, per KV head, -1 as padding; None when the layer reads every token. What attention
        recall (the share of full attention's mass a policy keeps) is measured against."""
        return None

    def budget_heads(self) -> range | list[int]:
        """The KV heads whose reads the policy's budget bounds (synckv: not its representative
        heads, which keep full KV). check_policy holds these to the declared small budget."""
        return range(self.cfg.n_kv_heads)


@dataclass(eq=False, kw_only=True)
class Policy(TierStats, ABC):
    """Base of all policies. A policy is a dataclass (as kvpress's presses are): its parameters
    are fields declared with `param` (default, bounds, one-line meaning), from which `make`'s
    parser, the checks below and `--help` all derive. A subclass sets `name`, declares its
    fields, checks what its bounds cannot say (relations between parameters) in `__post_init__`
    after `super().__post_init__()`, and implements `make_layer`."""

    name: ClassVar[str] = ""
    max_batch: ClassVar[int | None] = 1  # most policies follow one sequence; `full` takes any batch
    # the kernel operations (minikv/kernels/<op>) the policy runs with its backend: they decide
    # which backends it implements (kernels.policy_backends; none: reference and eager only)
    kernels: ClassVar[tuple[str, ...]] = ()

    # -- What check_policy reads (minikv.testing, the contract matrix): declared by each policy --
    # covering_spec: a spec whose budget covers any context of the tiny models (120 tokens), with
    #   small pages where it pages, so that KV really moves: it must give full KV's logits
    covering_spec: ClassVar[str | None] = None
    # small_spec, small_budget: a spec well below that context, and the most tokens per KV head
    #   (of budget_heads) any decode step's attention may read under it (None: no budget)
    small_spec: ClassVar[str | None] = None
    small_budget: ClassVar[int | None] = None
    # stats_keys: the keys stats() adds to the base ones
    stats_keys: ClassVar[tuple[str, ...]] = ()
    # offloads: at small_spec KV crosses to the host tier (and what comes back must be bit for bit)
    offloads: ClassVar[bool] = False
    # prefill_equals_decoding: the prompt's logits equal those of feeding it one token at a time
    prefill_equals_decoding: ClassVar[bool] = False
    # reports_attended: attended_indices() names what each decode step read, keys as the layer was
    #   given them (False: it answers None though it may read less, or it re-rotates keys)
    reports_attended: ClassVar[bool] = True

    PAPER: ClassVar[dict] = {}  # the parameter values of the paper's rules, which preset=paper selects
    PAPER_SIZES: ClassVar[dict] = {}  # the sizes the paper ran at: preset=paper takes those not given
    has_paper: ClassVar[bool] = True  # False for a baseline (full) that implements no paper

    backend: str = param("eager")
    preset: str | None = param(None, choices=PRESETS)

    def __new__(cls, *args, **kwargs):
        # preset=paper with one of the paper's parameters given another value is refused however
        # the policy is built (make's spec, or the class called): only the call's keywords tell
        # a value given from one left at its default, which apply_preset replaces
        preset_conflicts(cls, kwargs)
        policy = super().__new__(cls)
        policy._given = frozenset(kwargs)  # apply_preset: a size given beside preset=paper stays
        return policy

    def __post_init__(self):
        apply_preset(self, getattr(self, "_given", None))
        check_fields(self)
        # refuses a backend the policy does not implement; "reference" stays as given: policies
        # read it for their own forms
        check_backend(self.backend, self.kernels, self.name)
        self.cfg: ModelConfig | None = None
        self.layers: list[LayerKV] = []
        self.windows: dict[int, LayerKV] = {}  # the model's local layers, kept by the runtime (window.py)
        self._by_index: list[LayerKV] = []
        self.steps = 0
        self.last_action: StepAction | None = None  # what the last step asks of the loop

    # -- binding ---------------------------------------------------------------------------
    def bind(self, cfg: ModelConfig, *, device, dtype: torch.dtype, max_len: int, batch_size: int = 1) -> "Policy":
        if self.max_batch is not None and batch_size > self.max_batch:
            raise ValueError(f"policy {self.name!r} supports batch size <= {self.max_batch}, got {batch_size}")
        self.check_length(cfg, max_len)
        # local layers (window.py): a sliding window shorter than the sequence; the runtime keeps them
        from .window import governed_config, local_windows  # (window.py subclasses LayerKV: no cycle)

        windows = local_windows(cfg, max_len)
        self.global_layers = [i for i in range(cfg.n_layers) if i not in windows]
        if windows and not self.global_layers and self.name != "full":
            self.max_len = max_len
            self.validate(cfg)  # the policy's own word on a sliding-window model, where it has one
            raise ValueError(f"every layer of this model is a sliding window of {min(windows.values())} tokens, "
                             f"shorter than the sequence ({max_len}): the runtime keeps each window, and "
                             f"{self.name!r} has no global layer to govern (use full)")
        self.model_cfg, cfg = cfg, governed_config(cfg, max_len)
        self.cfg, self.dtype, self.max_len, self.batch_size = cfg, dtype, max_len, batch_size
        self.tiers = Tiers(device)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)
        self.validate(cfg)
        self.steps = 0
        self.last_action = None
        self.reset_counts()
        self.allocate_shared()
        self.layers = [self.make_layer(i) for i in range(cfg.n_layers)]
        self.windows = {}
        if windows:
            from .window import WindowLayer

            self.windows = {i: WindowLayer(self, i, w, w + self.max_rewind()) for i, w in windows.items()}
        # the model's layer index -> the policy's layer, or the runtime's window
        self._by_index = [self.windows.get(i) for i in range(self.model_cfg.n_layers)]
        for j, i in enumerate(self.global_layers):
            self._by_index[i] = self.layers[j]
        return self

    def check_length(self, cfg: ModelConfig, max_len: int) -> None:
        """Most policies keep absolute positions, so a sequence (prompt + new tokens) must fit
        the model's context. A policy that renumbers positions (streaming) overrides this."""
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt + new tokens = {max_len} exceeds the model's context of "
                f"{cfg.max_position_embeddings} tokens by {max_len - cfg.max_position_embeddings}"
            )

    def validate(self, cfg: ModelConfig) -> None:
        """Raise ValueError for parameters impossible with this model. Override as needed."""

    def allocate_shared(self) -> None:
        """Buffers the layers share (staging for recalls), allocated at bind before the layers."""

    @abstractmethod
    def make_layer(self, index: int) -> LayerKV: ...

    @classmethod
    def spec_for_model(cls, spec: str, cfg: ModelConfig, workdir) -> str:
        """The spec check_policy runs on a model it builds: `spec` itself, unless the policy needs
        a file made for that model (synckv: a head clustering), which it writes into workdir."""
        return spec

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
    def read_bound(self, budget: int) -> int:
        """The most tokens a decode step may read for one KV head of budget_heads at `budget`
        (what check_policy holds): the budget, unless the rule reads past it (synckv's union)."""
        return budget

    def end_step(self, logits: torch.Tensor | None = None) -> StepAction | None:
        """Called by the model after every forward (prefill included), on the next-token logits
        (B, V). A policy that asks something of the loop (softfreeze's rewind) overrides this,
        calls it first, then sets `self.last_action` and returns it; the rest ask nothing."""
        self.count_step()
        self.steps += 1
        self.last_action = None
        return None

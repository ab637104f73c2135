"""The policy contract: what every KV-cache policy implements, and the tiers it stores into.

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
layer of each forward the generation loop calls `policy.end_step(logits)`; `policy.stats()`
reports tiers and events at any time.

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
from ..models.attention import dense_attention, expand_kv  # noqa: F401  (re-exported for policies)
from ..models.rope import RotaryEmbedding
from .params import PRESETS, apply_preset, check_fields, declarations, param, parse_value, preset_conflicts, value_type
from .tiers import Tiers


@dataclass
class StepAction:
    """What end_step asks of the generation loop.

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
class Policy(ABC):
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
    has_paper: ClassVar[bool] = True  # False for a baseline (full) that implements no paper

    backend: str = param("eager")
    preset: str | None = param(None, choices=PRESETS)

    def __new__(cls, *args, **kwargs):
        # preset=paper with one of the paper's parameters given another value is refused however
        # the policy is built (make's spec, or the class called): only the call's keywords tell
        # a value given from one left at its default, which apply_preset replaces
        preset_conflicts(cls, kwargs)
        return super().__new__(cls)

    def __post_init__(self):
        apply_preset(self)
        check_fields(self)
        # refuses a backend the policy does not implement; "reference" stays as given: policies
        # read it for their own forms
        check_backend(self.backend, self.kernels, self.name)
        self.cfg: ModelConfig | None = None
        self.layers: list[LayerKV] = []
        self.windows: dict[int, LayerKV] = {}  # the model's local layers, kept by the runtime (window.py)
        self._by_index: list[LayerKV] = []
        self.steps = 0
        self._peak_device_tokens = 0.0
        self._decode_device_tokens = 0.0
        self.last_action: StepAction | None = None

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
        self._peak_device_tokens = 0.0
        self._decode_device_tokens = 0.0  # sum over decode steps of the mean device tokens per layer
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
    def end_step(self, logits: torch.Tensor | None = None) -> StepAction | None:
        """Called by the generation loop after every forward (prefill included)."""
        # over every layer of the model: a local layer's window is read each step too
        tokens = self._mean(lambda layer: layer.device_tokens(), self.all_layers())
        if self.steps > 0:  # a decode step: what its attention read (counted after the step)
            self._decode_device_tokens += tokens
        self.steps += 1
        self._peak_device_tokens = max(self._peak_device_tokens, tokens)
        return None

    # -- accounting ------------------------------------------------------------------------
    def _mean(self, fn, layers=None) -> float:
        """fn's mean over the policy's layers (or `layers`)."""
        layers = self.layers if layers is None else layers
        return sum(fn(layer) for layer in layers) / max(len(layers), 1)

    def aux_bytes(self) -> tuple[int, int]:
        """(device, host) bytes of buffers the policy shares between its layers (scratch,
        staging). Counted in the allocated figures of `stats`."""
        return 0, 0

    def token_bytes(self) -> int:
        """Bytes of K and V of one token in one layer, all KV heads."""
        return 2 * self.cfg.n_kv_heads * self.cfg.head_dim * torch.empty((), dtype=self.dtype).element_size()

    def stats(self) -> dict:
        """Tiers (tokens per KV head, mean over layers; bytes summed over layers and the batch)
        plus what the policy did. Subclasses extend with their own counters.

        Two byte figures per tier, the same way on both:
          device_bytes, host_bytes          K and V of the tokens held there now (used)
          device_bytes_allocated, ...       K and V slots reserved there (preallocated buffers
                                            in full) plus the policy's aux_bytes (digests,
                                            trees, staging buffers, shared scratch)"""
        layers = self.all_layers()  # the model's, local windows included: they hold KV too
        per_layer_device = [layer.device_tokens() for layer in layers]
        per_layer_host = [layer.host_tokens() for layer in layers]
        rows, tb = self.batch_size, self.token_bytes()
        aux_device, aux_host = self.aux_bytes()
        aux_device += sum(layer.aux_bytes()[0] for layer in layers)
        aux_host += sum(layer.aux_bytes()[1] for layer in layers)
        window_tokens = sum(w.device_tokens() for w in self.windows.values())
        return {
            "policy": self.name,
            "device_tokens": sum(per_layer_device) / len(layers),
            "host_tokens": sum(per_layer_host) / len(layers),
            "device_tokens_peak": max(self._peak_device_tokens, sum(per_layer_device) / len(layers)),
            # KV bytes attention read per decode step, mean over the steps (all layers and rows),
            # with each step's device tokens counted after the step (a policy that prunes after
            # attention, like streaming, read up to its prune size more)
            "kv_bytes_read_per_step": rows * len(layers) * tb * self._decode_device_tokens / max(self.steps - 1, 1),
            # of which the local layers' windows (window.py): layers, tokens per KV head summed, bytes
            "window_layers": len(self.windows),
            "window_tokens": window_tokens,
            "window_bytes": rows * window_tokens * tb,
            "device_bytes": round(rows * sum(per_layer_device) * tb),
            "host_bytes": round(rows * sum(per_layer_host) * tb),
            "device_bytes_allocated": rows * sum(l.allocated_device_tokens() for l in layers) * tb + aux_device,
            "host_bytes_allocated": rows * sum(l.allocated_host_tokens() for l in layers) * tb + aux_host,
            "bytes_to_host": self.tiers.bytes_to_host,
            "bytes_to_device": self.tiers.bytes_to_device,
            "device_tokens_per_layer": per_layer_device,
            "host_tokens_per_layer": per_layer_host,
        }


# -- spec strings ------------------------------------------------------------------------------

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a Policy subclass available by its `name` to make(), --policy,
    bench compare and minikv.hf (public as minikv.register_policy; docs/extending.md). A policy
    is a dataclass: write @register_policy above @dataclass(eq=False, kw_only=True)."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register_policy takes a subclass of minikv.policies.Policy, got {cls!r}")
    if not cls.name or not cls.name.replace("_", "").isalnum():
        raise ValueError(f"{cls.__name__}.name must be a word (letters, digits, _), got {cls.name!r}")
    old = _REGISTRY.get(cls.name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"policy name {cls.name!r} is taken by {old.__module__}.{old.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


register_policy = register


def discover() -> None:
    """Import the policies installed packages declare (entry-point group minikv.policies), once."""
    from ..plugins import load_entry_points

    load_entry_points()


def available() -> list[str]:
    discover()
    return sorted(_REGISTRY)


def parameters(cls: type[Policy]) -> dict:
    """name -> dataclass field of each parameter of a policy class (params.declarations)."""
    return declarations(cls)


def make(spec: "str | Policy", **overrides) -> Policy:
    """Build a policy from a spec string "name:key=value,key=value" (or pass a Policy through);
    "name:paper,..." is "name:preset=paper,..." (params.py, the paper as a preset).

    Unknown names or parameters raise ValueError listing what exists; each value is parsed as
    its parameter's type (its declaration, params.py), so `speculative=maybe` or `window=abc`
    fail here, with no model, as does whatever the policy's checks refuse.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a policy spec is a non-empty string like 'streaming:sink=4', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if name not in _REGISTRY:
        discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
    cls = _REGISTRY[name]
    known = parameters(cls)
    kwargs = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq and key in PRESETS:  # the alias NAME:paper for NAME:preset=paper
            key, eq, value = "preset", "=", key
        if not eq:
            raise ValueError(f"policy parameter {item!r} in {spec!r} is not of the form key=value")
        if key not in known:
            raise ValueError(f"policy {name!r} has no parameter {key!r}; parameters: {', '.join(known)}")
        if key in kwargs:  # not the last one silently: which did the user mean?
            raise ValueError(f"policy {name!r}: parameter {key!r} is given twice in {spec!r}")
        kind, nullable = value_type(known[key])
        kwargs[key] = parse_value(value.strip(), kind, nullable, where=f"policy {name!r}: {key}")
    for key in overrides:
        if key not in known:
            raise ValueError(f"policy {name!r} has no parameter {key!r}; parameters: {', '.join(known)}")
    kwargs.update(overrides)
    return cls(**kwargs)  # Policy.__new__ refuses a parameter given against preset=paper

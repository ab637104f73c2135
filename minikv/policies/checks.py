"""What is checked of a policy, none of which a decode step runs: its parameters when it is built,
the request when it is bound, and what the contract matrix (minikv.testing.check_policy) reads of
it. Policy and LayerKV (contract.py) inherit these as mixins, so a policy overrides any of them
(streaming's check_length, synckv's read_bound) as if they were written there.

    PolicyChecks.check_parameters   at construction: preset=paper's conflicts, each declared
                                    parameter's type and bounds (params.py), the backend
    PolicyChecks.check_bind         at bind: the batch size, the context, a model whose every layer
                                    is a sliding window the runtime keeps (window.py)
    PolicyChecks, "What check_policy reads"   the class-level declarations of the matrix
    LayerChecks                     per layer: attended_indices, budget_heads
"""
from __future__ import annotations

from typing import ClassVar

import torch

from ..config import ModelConfig
from ..kernels import check_backend
from .params import apply_preset, check_fields, preset_conflicts


class PolicyChecks:
    """Mixin of Policy: reads `name`, `max_batch`, `kernels` and `backend` of the policy."""

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

    def read_bound(self, budget: int) -> int:
        """The most tokens a decode step may read for one KV head of budget_heads at `budget`
        (what check_policy holds): the budget, unless the rule reads past it (synckv's union)."""
        return budget

    @classmethod
    def spec_for_model(cls, spec: str, cfg: ModelConfig, workdir) -> str:
        """The spec check_policy runs on a model it builds: `spec` itself, unless the policy needs
        a file made for that model (synckv: a head clustering), which it writes into workdir."""
        return spec

    # -- the parameters, at construction ---------------------------------------------------
    def __new__(cls, *args, **kwargs):
        # preset=paper with one of the paper's parameters given another value is refused however
        # the policy is built (make's spec, or the class called): only the call's keywords tell
        # a value given from one left at its default, which apply_preset replaces
        preset_conflicts(cls, kwargs)
        policy = super().__new__(cls)
        policy._given = frozenset(kwargs)  # apply_preset: a size given beside preset=paper stays
        return policy

    def check_parameters(self) -> None:
        """The preset's values in place (params.apply_preset), then every declared parameter's
        type, bounds and choices; refuses a backend the policy does not implement ("reference"
        stays as given: policies read it for their own forms)."""
        apply_preset(self, getattr(self, "_given", None))
        check_fields(self)
        check_backend(self.backend, self.kernels, self.name)

    # -- the request, at bind ----------------------------------------------------------------
    def check_bind(self, cfg: ModelConfig, max_len: int, batch_size: int) -> None:
        """Refuse a batch past max_batch, a sequence past the context (check_length), and a model
        whose every layer is a sliding window shorter than the sequence: the runtime keeps those
        (window.py), which leaves a policy other than full nothing to govern."""
        if self.max_batch is not None and batch_size > self.max_batch:
            raise ValueError(f"policy {self.name!r} supports batch size <= {self.max_batch}, got {batch_size}")
        self.check_length(cfg, max_len)
        from .window import local_windows  # (window.py subclasses LayerKV, which inherits this module: no cycle)

        windows = local_windows(cfg, max_len)
        if windows and len(windows) == cfg.n_layers and self.name != "full":
            self.max_len = max_len
            self.validate(cfg)  # the policy's own word on a sliding-window model, where it has one
            raise ValueError(f"every layer of this model is a sliding window of {min(windows.values())} tokens, "
                             f"shorter than the sequence ({max_len}): the runtime keeps each window, and "
                             f"{self.name!r} has no global layer to govern (use full)")

    def check_length(self, cfg: ModelConfig, max_len: int) -> None:
        """Most policies keep absolute positions, so a sequence (prompt + new tokens) must fit
        the model's context. A policy that renumbers positions (streaming) overrides this."""
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"prompt + new tokens = {max_len} exceeds the model's context of "
                f"{cfg.max_position_embeddings} tokens by {max_len - cfg.max_position_embeddings}"
            )

    def validate(self, cfg: ModelConfig) -> None:
        """Raise ValueError for parameters impossible with this model (bind calls it with the
        config of the layers the policy governs). Override as needed."""


class LayerChecks:
    """Mixin of LayerKV: what check_policy reads of one layer. Reads `cfg`."""

    def attended_indices(self) -> torch.Tensor | None:
        """(Hkv, n) int64: the absolute indices of the tokens the last decode step's attention
        read, per KV head, -1 as padding; None when the layer reads every token. What attention
        recall (the share of full attention's mass a policy keeps) is measured against."""
        return None

    def budget_heads(self) -> range | list[int]:
        """The KV heads whose reads the policy's budget bounds (synckv: not its representative
        heads, which keep full KV). check_policy holds these to the declared small budget."""
        return range(self.cfg.n_kv_heads)

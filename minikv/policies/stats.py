"""The tier accounting every policy reports (`Policy.stats()`): tokens and bytes on each tier, what
crossed between them, what a decode step read, and the threads decoding runs on. Policy inherits
TierStats and LayerKV inherits LayerStats (contract.py); the counts are derived from the layers'
state when asked, but for two per-step figures (the peak, and the tokens each decode step read),
which `count_step` adds up as the model ends each step.
"""
from __future__ import annotations

import torch


class LayerStats:
    """Mixin of LayerKV (contract.py): what one layer holds on each tier, besides what its attention
    reads (`device_tokens`, which every layer declares). Defaults for a layer that keeps nothing on
    the host and reserves no more than it holds."""

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


class TierStats:
    """Mixin of Policy (contract.py): reads `layers`, `cfg`, `dtype`, `batch_size`, `steps` and
    `tiers` of the bound policy."""

    def reset_counts(self) -> None:
        """At bind: a new sequence counts from nothing."""
        self._peak_device_tokens = 0.0
        self._decode_device_tokens = 0.0  # sum over decode steps of the mean device tokens per layer

    def count_step(self) -> None:
        """At each end_step, before `steps` advances: the step's device tokens, mean over layers."""
        # over every layer of the model: a local layer's window is read each step too
        tokens = self._mean(lambda layer: layer.device_tokens(), self.all_layers())
        if self.steps > 0:  # a decode step: what its attention read (counted after the step)
            self._decode_device_tokens += tokens
        self._peak_device_tokens = max(self._peak_device_tokens, tokens)

    def threads(self) -> int:
        """The OS threads the policy's decoding runs on besides torch's intra-op pool: its
        selection worker's, where it has one (the speed benchmark's fair count)."""
        worker = getattr(self, "worker", None)
        return worker.threads if worker is not None else 0

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

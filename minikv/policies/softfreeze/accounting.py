"""softfreeze's accounting, derived from state when `stats()` asks, none of which a decode step
runs: what SoftFreeze.stats() adds to the tier accounting (policies/stats.py), and what the
reference layer (schedule.Algorithm1Layer) holds per tier. The fast layer (layer_fast.py) answers
the same questions about its view of the stacked state itself."""
from __future__ import annotations


class FreezeStats:
    """Mixin of SoftFreeze: reads its layers, `counters` (the recovery ladder's and follow's,
    counted as they act) and `entropies`."""

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


class Algorithm1LayerStats:
    """Mixin of schedule.Algorithm1Layer: its tokens and bytes per tier (stats.LayerStats)."""

    def host_tokens(self) -> int:
        return self.n_frozen

    def allocated_device_tokens(self) -> int:
        return self.kv.shape[0]  # a row for every token the generation may hold

    def allocated_host_tokens(self) -> int:
        return self.kv_host.shape[0]

    def aux_bytes(self) -> tuple[int, int]:
        parts = [self.active, self.c, self.d, self.frozen_at, self.seen]
        return sum(t.numel() * t.element_size() for t in parts if t is not None), 0

"""freekv's statistics, recorded beside its rule (freekv.py), which never calls them: `Counts`
wraps four of the layer's functions and reads their arguments and results, and answers the
accounting (what the host holds, what attention read); `Reports` (the policy's) turns the counts
into the stats() figures.

    prefill         the pages recalled count from the first decode step    -> kv.pages_recalled
    decode          every decode step of the layer                         -> decode_steps
    drifted_heads   C_m per KV head at a step that chooses (more
                    candidates than K): the heads judged, the drifted ones -> head_steps,
                                                                              corrected_heads,
                                                                              corrected_steps
    select          the step's first selection with q_t (the correction's,
                    else the next step's) against what the slots hold (the
                    pages selected with q_{t-1}), per KV head, as sets     -> spec_equal,
                                                                              spec_compared

The counts are the layer's own: with overlap=true its select may run on the policy's worker
while the model thread runs the other layers, and stats() sums them after every layer's
selection has landed (overlap.py).
"""
from __future__ import annotations

import torch


class Counts:
    """Mixin before FreeKVLayer: the layer's counts and accounting (see the module docstring)."""

    def __init__(self, policy, index: int):
        super().__init__(policy, index)
        self.decode_steps = self.head_steps = self.corrected_heads = self.corrected_steps = 0
        self.spec_equal = self.spec_compared = 0
        self.comparing = False  # a step that chose: its first selection is compared with the slots

    def prefill(self, q, k, v, positions):
        out = super().prefill(q, k, v, positions)
        self.kv.pages_recalled = 0  # stats count recalls while decoding
        return out

    def decode(self, q, k, v, positions):
        self.decode_steps += 1
        return super().decode(q, k, v, positions)

    def drifted_heads(self, q_unit: torch.Tensor) -> list[bool]:
        drifted = super().drifted_heads(q_unit)
        self.head_steps += len(drifted)
        self.corrected_heads += sum(drifted)
        self.corrected_steps += any(drifted)
        self.comparing = True
        return drifted

    def select(self, q: torch.Tensor) -> torch.Tensor:
        pages = super().select(q)
        if self.comparing:
            self.comparing = False
            self.count_speculation(pages)
        return pages

    def count_speculation(self, exact: torch.Tensor) -> None:
        """Did the pages chosen with q_{t-1} (what the slots hold) equal `exact`, q_t's (Hkv, K)?"""
        # per KV head: do its selected slots hold exactly `exact`'s pages (as sets)?
        same = [set(want) - {-1} == set(held) - {-1} for want, held in zip(exact.tolist(), self.kv.held)]
        self.spec_equal += sum(same)
        self.spec_compared += len(same)

    def allocated_host_tokens(self) -> int:
        return self.pages.max_pages * self.kv.P  # the host tier is preallocated for max_len

    def attended_indices(self) -> torch.Tensor:
        return self.kv.read_indices()


class Reports:
    """Mixin before Policy (FreeKV): the staging buffers' bytes, and the counts in stats()."""

    def aux_bytes(self) -> tuple[int, int]:
        return self.staging.nbytes()

    def stats(self) -> dict:
        s = super().stats()  # (its device_tokens land every layer's selection: overlap.py)
        s.update(report([layer for layer in self.layers if isinstance(layer, Counts)], max(self.steps - 1, 0)))
        return s


def report(layers: list, decode_steps: int) -> dict:
    """The figures stats() adds, from the paged layers' counts (landed) and their stores."""
    total = {name: sum(getattr(layer, name) for layer in layers)
             for name in ("decode_steps", "head_steps", "corrected_heads", "corrected_steps", "spec_equal",
                          "spec_compared")}
    recalled = sum(layer.kv.pages_recalled for layer in layers)
    return {
        "correction_rate": total["corrected_heads"] / total["head_steps"] if total["head_steps"] else 0.0,
        "correction_step_rate": total["corrected_steps"] / total["decode_steps"] if total["decode_steps"] else 0.0,
        "pages_recalled": recalled,
        "pages_recalled_per_step": recalled / decode_steps if decode_steps else float(recalled),
        "speculative_exact_rate":
            total["spec_equal"] / total["spec_compared"] if total["spec_compared"] else float("nan"),
    }

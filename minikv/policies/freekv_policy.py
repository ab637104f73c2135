"""freekv's policy object (FreeKV): its parameters, their checks and the construction of its layers,
run when the policy is made and bound, never in a decode step. The rule its layers run, and the
paper it follows, are freekv.py's; their statistics freekv_counts.py's; the background form of
their next selection overlap.py's (FreeKV.overlaps says when)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..kernels.page_scores import GROUP_REDUCES
from .contract import LayerKV, Policy, param
from .freekv import FreeKVLayer
from .freekv_counts import Counts, Reports
from .full import FullLayer
from .host_pages import DIGESTS
from .paged_checks import check_freekv, check_freekv_model
from .pool import Staging
from .pool_fast import pool_attention
from .registry import register


# the layer that runs: the rule, with its statistics recorded beside it (freekv_counts.py)
CountedLayer = type("FreeKVLayer", (Counts, FreeKVLayer), {"__module__": __name__})


@register
@dataclass(eq=False, kw_only=True)
class FreeKV(Reports, Policy):
    """Speculative page retrieval with fine-grained correction over a paged, offloaded KV cache."""

    name = "freekv"
    max_batch = 1
    kernels = ("page_scores", "paged_attention", "page_gather", "page_layout", "decode_attention")  # skip_layers: full
    PAPER = dict(digest="minmax")  # the text's "min-max pooled keys (similar to Quest)"
    PAPER_SIZES = dict(budget=2048)  # "Budget B was fixed at 2048" (Experiments)
    # the contract matrix's data (contract.Policy, "What check_policy reads")
    covering_spec = "freekv:page_size=4,budget=160,sink=4,window=8"
    small_spec, small_budget = "freekv:page_size=4,budget=24,sink=4,window=8", 24
    stats_keys = ("correction_rate", "pages_recalled", "pages_recalled_per_step", "speculative_exact_rate")
    offloads = True

    page_size: int = param(32, low=1)
    budget: int = param(256, low=0, multiple_of="page_size")
    sink: int = param(32, low=0, multiple_of="page_size")
    window: int = param(32, low=0, multiple_of="page_size")
    tau: float = param(0.9, "correction threshold on the cosine of consecutive queries", low=-1.0, high=1.0)
    speculative: bool = param(True, "select with the previous step's query (speculative retrieval)")
    group_reduce: str = param("softmax_mean", "how a GQA group's page scores become one", choices=GROUP_REDUCES)
    digest: str = param("quant2", "page summary: quant2 (beyond the papers: Quest's box and 2-bit codes of each key, "
                                  "pages scored by their approximate attention mass), minmax (the paper's min-max "
                                  "pooled keys, Quest's bound) or arkvale (ArkVale's box, which FreeKV's code builds "
                                  "on)", choices=DIGESTS)
    skip_layers: int = param(0, low=0)
    rescore: int = param(0, "beyond the paper: shortlist rescore x K pages by the digest, keep the K whose keys "
                            "take the most exact attention (0: the paper's selection)", low=0)
    overlap: bool = param(True, "select the next step's pages on a worker thread while the model computes "
                                "(speculative, backend=eager; reference and triton stay synchronous): one more "
                                "thread, the same tokens")

    def __post_init__(self):
        super().__post_init__()
        check_freekv(self)  # paged_checks.py

    def validate(self, cfg):
        check_freekv_model(self, cfg)
        # the selected pages: the budget less sink, window and the partly filled last page, and never
        # more than the context has (a budget past it costs what full KV costs)
        declared = (self.budget - self.sink - self.window) // self.page_size - 1
        self.n_select = min(declared, math.ceil(self.max_len / self.page_size))

    def allocate_shared(self) -> None:
        # one pair of staging buffers for all layers (they recall one after another)
        self.staging = Staging((self.cfg.n_kv_heads * self.n_select, 2, self.page_size, self.cfg.head_dim),
                               self.dtype, self.tiers)
        # the pools' attention: the kernel, or on eager its fast form, the pool read in place
        self.pool_attention = pool_attention if self.backend == "eager" else None

    def overlaps(self) -> bool:
        # select_next beside the model (overlap.py) on backend=eager only: reference is the readable
        # form, and Triton's CPU interpreter is not thread-safe (on CUDA the recall already runs on a
        # side stream; the kernels untried here)
        return self.overlap and self.speculative and self.backend == "eager"

    def make_layer(self, index: int) -> LayerKV:
        return FullLayer(self, index) if index < self.skip_layers else CountedLayer(self, index)

"""synckv: representative heads choose, every m steps, the tokens their cluster reads (SyncKV).

Paper: "SyncKV: A Syncopated Scheduling Approach to KV Cache Compression for Efficient
Long-Context LLM Inference", anonymous authors, ICLR 2026 submission (withdrawn),
https://openreview.net/forum?id=542c8KxeQt (no arXiv version, no public code).

An offline clustering (Sec. 4.1; clusters.py, `python -m minikv.bench cluster-heads`) groups each
layer's KV heads into N_r clusters, each with a representative head (R-head); the others are
NR-heads. binding.py settles at bind the clustering each layer runs; a step only reads it. Where
to read what (Algorithm 1's lines):

    SyncKVLayer.prefill      lines 9-17: dense attention; R-heads keep their full KV on the
                             device, the NR-heads' KV goes whole to the host (bank.ContextBank)
    SyncKVLayer.initialize   Eqs. 3-4: I_0 = the top k of the R-head's attention from the last
                             prompt token (kernels/attention_topk), split by rho into the static
                             and the initial dynamic set
    SyncKVLayer.decode       line 22: R-heads over their full KV; lines 23-24: NR-heads over
                             static + dynamic + window (kernels/gathered_attention), the sets of
                             their own cluster or, nr_reads=union, the union over all clusters
                             (SyncKVLayer.read_slots); every m-th step anticipates, the others
                             are suspension steps (Eq. 8, lines 33-35)
    SyncKVLayer.top_dynamic  Eqs. 5-6, lines 26-31: the R-head's top k_dyn, max-pooled over its
                             GQA group (App. B.1), among the candidates; fetch_dynamic makes them
                             the dynamic sets and `fetch` copies them in (Eq. 7). With overlap=true
                             top_dynamic runs beside the model and the fetch lands at the layer's
                             next step (policies/overlap.py): the step's q and lse are all it
                             needs, as Sec. 4.5 overlaps the anticipation's work with the forward
    SyncKV.split             k = budget less the window ring's slots, into static and dynamic

The paper's rules: `synckv:paper` (preset=paper: wide_layers=0, nr_reads=union, window=0,
exclude_static=false, and N_r as Sec. 5.1 sets it, binding.paper_n_r, at bind). Decisions
(docs/design.md, "synckv" and "The paper as a preset"): the clustering unit is the KV head; Mem%
counts R-heads at full length. By default the last `window` tokens, whatever their origin, are
read by every head at every step; a token leaves the window only at a selection point
(`slide_window`), as a candidate, so between anticipations the window grows to window + m - 1
tokens and budget = k + window + m - 1 (window=0, the paper's: the NR-heads read the sets only,
budget = k, and the selections run over the whole attention vector). By default NR-heads read
their own cluster's sets (Secs. 4.1 and 4.4: they reuse the indices of "the R-Head of their
cluster"); Algorithm 1 lines 23-24 have every NR-head read the union over all clusters' sets,
nr_reads=union (an NR-head then reads up to N_r (k_static + k_dyn) + window tokens, each token
once; at N_r = 1 the two are the same). The dynamic set is chosen among the tokens before the
window its R-head has not made static (exclude_static=false: Eq. 6 as written, static tokens
included, each read once).
Table 3's ablations: offload=False is "w/o initialization", anticipation=False "w/o
anticipation", m=1 "w/o suspension". Beyond the paper, wide_layers gives the layers whose heads
agree least (by S, Eq. 2) more clusters than n_r (binding.widen; docs/synckv.md measures why). The
defaults, budget=512 and wide_layers=4 (full KV in the 4 layers whose heads agree least), are
that variant: on SmolLM2 it keeps natural-text needles and perplexity that wide_layers=0 loses,
and on Qwen2.5-Coder it ties it (docs/synckv.md).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..contract import Policy, param
from ..registry import register
from ..pool import Staging
from .accounting import Accounting, Report
from .binding import layer_clusterings, stand_in_spec
from .layer import SyncKVLayer

# the layer that runs: the rule, with its accounting beside it (accounting.py)
AccountedLayer = type("SyncKVLayer", (Accounting, SyncKVLayer), {"__module__": __name__})


@register
@dataclass(eq=False, kw_only=True)
class SyncKV(Report, Policy):
    """Representative heads anticipate every m steps; their clusters read only what they chose."""

    name = "synckv"
    max_batch = 1
    kernels = ("attention_topk", "decode_attention", "gathered_attention")
    # N_r clusters in every layer; Algorithm 1 lines 23-24: the union, no recent window; Eq. 6 over
    # the whole attention vector, static tokens included
    PAPER = dict(wide_layers=0, nr_reads="union", window=0, exclude_static=False)
    PAPER_SIZES = dict(n_r=None)  # "N_r to 2 for the Llama model and 1 for Qwen model": binding.paper_n_r
    # the contract matrix's data (contract.Policy, "What check_policy reads")
    covering_spec = "synckv:budget=160,window=32,m=3,wide_layers=0"
    small_spec, small_budget = "synckv:budget=48,window=8,m=3,wide_layers=0", 48  # of the NR-heads
    stats_keys = ("anticipation_steps", "tokens_fetched", "mem_percent", "clustering_file")
    offloads = True

    @classmethod
    def spec_for_model(cls, spec, cfg, workdir):
        return stand_in_spec(spec, cfg, workdir)  # binding.py: a model with no shipped clustering gets one

    budget: int = param(512, "most tokens a non-representative KV head reads on the device: static + dynamic "
                             "+ window (with nr_reads=union, every cluster's static + dynamic); capped by the "
                             "context", low=1)
    window: int = param(32, "most recent tokens, read by every head at every step (the new token included; 0: "
                            "none, the NR-heads read only the static and dynamic sets, as Algorithm 1 lines 23-24)",
                        low=0)
    rho: float = param(0.5, "static ratio: the share of k = budget - window slots chosen once (Eq. 4)",
                       low=0.0, high=1.0)
    m: int = param(5, "synchronization stride: every m-th step anticipates", low=1)
    n_r: int | None = param(1, "clusters (representative heads) per layer (none: the paper's for the model, 2 on "
                               "Llama-style models and 1 on Qwen, at most the KV heads less one)", low=1)
    clusters: str | None = param(None, "clustering file (none: the one shipped for this model)")
    offload: bool = param(True, "offload the other heads' KV to the host (false: w/o initialization)")
    anticipation: bool = param(True, "anticipation steps (false: the initial selection only)")
    wide_layers: int = param(4, "layers that take wide_n_r clusters instead of n_r (beyond the paper): the ones "
                                "whose heads agree least (lowest mean similarity S between heads, Eq. 2); capped "
                                "by the layers the policy governs (on a model with local and global layers, the "
                                "global ones); 0: N_r clusters in every layer, as the paper", low=0)
    wide_n_r: int = param(0, "clusters per layer in the wide layers (0: one per KV head, full KV there)", low=0)
    overlap: bool = param(False, "anticipation's selection on a worker thread while the model computes the next "
                                 "layers (backend=eager; reference and triton stay synchronous): one more thread, "
                                 "the same tokens")
    nr_reads: str = param("cluster", "what a non-representative head reads besides the window: its own cluster's "
                                     "static and dynamic sets (cluster) or the union over every cluster's "
                                     "(union: Algorithm 1 lines 23-24)", choices=("cluster", "union"))
    exclude_static: bool = param(True, "the dynamic set is chosen among the tokens not in its cluster's static set "
                                       "(false: Eq. 6 as written, the top k_dyn of the whole attention vector, so a "
                                       "dynamic slot may hold a static token, read once)")

    def __post_init__(self):
        super().__post_init__()
        # the window ring's slots: the tokens since the last selection point wait there for the bank
        # (with window=0 too: unread, they are the next selection's candidates); what the NR-heads
        # read of them, the window's share of the budget, is none with window=0
        grow = self.m - 1 if self.anticipation else 0
        self.ring = max(self.window, 1) + grow
        self.window_reads = self.window + grow if self.window else 0
        if self.budget <= self.window_reads:
            slots = "window + m - 1" if self.anticipation else "window"
            raise ValueError(f"budget must be an int > the recent window's slots ({slots} = {self.window_reads}): "
                             f"static + dynamic + window, got {self.budget!r}")

    def split(self, k: int) -> tuple[int, int]:
        """k selected slots -> (k_static, k_dyn): the split of Eq. 4, with k_dyn = floor((1 - rho) k) as
        defined under Eq. 6."""
        k_dyn = math.floor((1.0 - self.rho) * k + 1e-9)
        return k - k_dyn, k_dyn

    def validate(self, cfg):
        # k = budget - the ring's slots, split by rho; neither set holds more than the context: a
        # budget past it costs at most what full KV costs for each (a selection of k >= the
        # candidates takes them all, capped or not)
        k_static, k_dyn = self.split(self.budget - self.window_reads)
        self.k_static, self.k_dyn = min(k_static, self.max_len), min(k_dyn, self.max_len)
        if cfg.sliding_window is not None and cfg.sliding_window < self.max_len:
            raise ValueError("synckv does not combine with a sliding-window model (Mistral) shorter than max_len")
        # the clustering each layer runs, N_r clusters in every layer but the wide ones (binding.py)
        self.n_r_bound, self.clustering, self.clustering_file = layer_clusterings(self, cfg)

    def allocate_shared(self) -> None:
        # one pair of staging buffers for all layers (they fetch one after another), as large as the
        # most (head, token) rows a fetch moves: every NR-head, k_dyn tokens of each cluster it reads
        n_nr = max(self.cfg.n_kv_heads - len(layer["r_heads"]) for layer in self.clustering)
        n_sets = max(len(layer["clusters"]) for layer in self.clustering) if self.nr_reads == "union" else 1
        rows = n_nr * n_sets * self.k_dyn
        self.staging = Staging((2 * max(1, rows), self.cfg.head_dim), self.dtype, self.tiers) if self.offload else None

    def overlaps(self) -> bool:
        # the anticipation's top-k beside the model (overlap.py), backend=eager only (as freekv's)
        return self.overlap and self.anticipation and self.backend == "eager"

    def make_layer(self, index: int) -> SyncKVLayer:
        return AccountedLayer(self, index)

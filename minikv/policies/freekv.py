"""freekv: speculative page retrieval with fine-grained correction.

Paper: "FreeKV: Boosting KV Cache Retrieval for Efficient LLM Inference" (G. Liu, C. Li, Z. Ning,
J. Lin, Y. Yao, D. Ke, M. Guo, J. Zhao; ICLR 2026; https://arxiv.org/abs/2505.13109), whose pages
are summarised by "min-max pooled keys (similar to Quest)": "Quest: Query-Aware Sparsity for
Efficient Long-Context LLM Inference" (J. Tang et al., ICML 2024; https://arxiv.org/abs/2406.10774).
ArkVale's box comes from "ArkVale: Efficient Generative LLM Inference with Recallable Key-Value
Eviction" (R. Chen et al., NeurIPS 2024), which FreeKV's code (github.com/sjtu-zhao-lab/FreeKV)
builds on.

The KV cache goes to the host tier in pages of P = 32 tokens; the device keeps the sink pages, the
recent window and, per KV head, the K pages selected for the query. One decode step, as the
paper's flow (FreeKVLayer.decode):

    speculate            step t attends with the pages selected with q_{t-1} (already resident)
    correct              C_m = mean over the group of cos(q_t, q_{t-1}) per KV head; a head with
                         C_m < tau is drifted: one selection with q_t for all heads, the drifted
                         heads' pages recalled before attention (FreeKVLayer.correct)
    attend               sink + selected + window pages (paged.PagedKV.attend)
    select the next      after attention, q_t's pages for step t + 1 (FreeKVLayer.select_next),
                         recalled in the background (recall_next); with overlap=true the two run
                         beside the model's next layers (overlap.py schedules them: the rule
                         stays this synchronous code)

    FreeKVLayer.select   group-consistent top-K per KV head, S_m = sum_j softmax(P_{(m-1)G+j}) / G
                         (kernels/page_scores); P_h[n] = sum_d max(q_d lo_{n,d}, q_d hi_{n,d})
                         over a page's digest box (Quest's bound), or with digest=quant2 the coded
                         keys' mass P_h[n] = log sum_t exp(q . k^_t)
    host_pages.HostPages host pages (HND) and their digests lo, hi (host_pages.page_digest),
                         and quant2's 2-bit key codes (page_scores.pack_codes)
    paged.PagedKV        sink, window and selected slots; a recall copies only missing pages

The paper's rules: `freekv:paper` (preset=paper: digest=minmax, the min-max pooled keys of the
text, at the paper's budget B = 2048 unless a budget is given). Decisions (docs/design.md, "freekv"
and "The paper as a preset"): the default digest, digest=quant2, is beyond the papers: Quest's
min/max box plus a 2-bit code of every key in it, pages ranked by the attention their coded keys
would take (a bound ranks a natural-text needle's page low: docs/needle_mass.md); digest=arkvale is
ArkVale's box (centre +- mean |k - centre|, what FreeKV's code builds on). The page softmax scales
P_h by 1/sqrt(D); one selection serves every KV head of a step; the last `window` tokens are always
read, so budget = sink + window + P (the partly filled last page) + P K. speculative=False is plain
Quest: select with q_t and recall before every attention. Layers below `skip_layers` keep full KV.
rescore > 1 (not in the paper) lets the digests shortlist rescore x K pages and keeps the K whose
keys hold the most exact attention (FreeKVLayer.exact_mass_top). Backends: `reference` gathers the
device pages and attends densely, `eager` reads the pool in place (pool_fast.pool_attention),
`triton` runs the kernels. The policy object, its parameters (budget = 256, tau = 0.9 by default)
and its layers' construction are freekv_policy.py's; the statistics freekv_counts.py's.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..kernels.page_scores import page_scores
from .contract import dense_attention
from .host_pages import HostPages
from .paged import PagedKV
from .paged_stats import PagedLayer


class FreeKVLayer(PagedLayer):
    next_step = ("select_next", "recall_next")  # what overlap.py may run beside the model

    def __init__(self, policy, index: int):  # policy: freekv_policy.FreeKV, bound
        super().__init__(policy, index)
        cfg, P = policy.cfg, policy.page_size
        self.K = policy.n_select
        self.pages = HostPages(n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=P, max_len=policy.max_len,
                               dtype=policy.dtype, tiers=policy.tiers, digest=policy.digest)
        self.kv = PagedKV(candidates=self.pages, n_kv=cfg.n_kv_heads, head_dim=cfg.head_dim, page_size=P,
                          max_len=policy.max_len, n_sink=policy.sink // P, n_select=self.K,
                          n_window=policy.window // P + 1, dtype=policy.dtype, tiers=policy.tiers,
                          backend=policy.backend, staging=policy.staging, attention=policy.pool_attention)
        self.G = cfg.n_heads // cfg.n_kv_heads
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.prev_q = None  # (Hq, D) the previous step's query, float32, each head of unit norm

    # -- selection ---------------------------------------------------------------------------
    def select(self, q: torch.Tensor) -> torch.Tensor:
        """Group-consistent top-K candidate pages per KV head for q (1, Hq, D) -> (Hkv, K), -1 pads."""
        pages, n, pol = self.pages, self.kv.n_cand, self.policy
        if n:
            k = min(self.K, n)
            shortlist = min(n, k * pol.rescore) if pol.rescore > 1 else k
            codes = pages.codes[:, :, :n] if pages.codes is not None else None
            _, index = page_scores(q, pages.lo[:, :, :n], pages.hi[:, :, :n], pages.n_valid, shortlist, self.scale,
                                   pol.group_reduce, codes, backend=pol.backend)  # (1, Hkv, shortlist)
            index = self.exact_mass_top(q, index[0], k) if shortlist > k else index[0]  # (Hkv, k)
            out = index if k == self.K else F.pad(index, (0, self.K - k), value=-1)  # (Hkv, K)
            out = out.cpu()  # the bookkeeping is host-side: one small copy (and sync) on CUDA
        else:
            out = torch.full((self.kv.Hkv, self.K), -1, dtype=torch.int64)
        return out

    def exact_mass_top(self, q: torch.Tensor, shortlist: torch.Tensor, k: int) -> torch.Tensor:
        """Beyond the paper (rescore > 1): the digests' bound only shortlists rescore x K pages per
        KV head; their keys come over from the host and the K with the most exact attention mass
        win: a page's softmax mass over the shortlisted tokens, summed over the page, mean over the
        group's query heads (softmax_mean's pooling, on the true scores). A bound ranks a page by its
        most extreme key, and on natural text the needle's page is often not the one with the
        most extreme key (docs/needle_mass.md). q (1, Hq, D), shortlist (Hkv, S) -> (Hkv, k)."""
        H, S = shortlist.shape
        rows = shortlist.cpu()
        keys = self.pages.host[rows, torch.arange(H)[:, None], 0]  # (Hkv, S, P, D) gathered on the host
        keys = self.policy.tiers.to_device(keys, fresh=True).float()
        qg = q[0].float().view(H, self.G, -1)  # (Hkv, G, D)
        scores = torch.einsum("hgd,hspd->hgsp", qg, keys).mul_(self.scale)  # (Hkv, G, S, P)
        probs = scores.flatten(2).softmax(-1).view_as(scores)
        mass = probs.sum(-1).mean(1)  # (Hkv, S)
        best = mass.topk(k, dim=-1).indices  # (Hkv, k)
        return shortlist.gather(1, best.to(shortlist.device))

    @staticmethod
    def _unit(q: torch.Tensor) -> torch.Tensor:
        # q (1, Hq, D) -> (Hq, D) float32 with unit rows (as F.cosine_similarity normalises, eps 1e-8)
        q = q[0].float()
        return q / torch.linalg.vector_norm(q, dim=-1, keepdim=True).clamp_min_(1e-8)

    # -- the contract ------------------------------------------------------------------------
    def prefill(self, q, k, v, positions):
        # q (1, Hq, T, D); k, v (1, Hkv, T, D): dense attention over the prompt, then page it
        out = dense_attention(q, k, v)
        self.kv.prefill(k, v)
        q_last = q[:, :, -1]  # (1, Hq, D)
        self.prev_q = self._unit(q_last) if self.policy.speculative else None
        self.kv.recall(self.select(q_last))  # the pages the first decode step will read
        return out

    def decode(self, q, k, v, positions):
        # q (1, Hq, 1, D); k, v (1, Hkv, 1, D)
        q1 = q[:, :, 0]  # (1, Hq, D)
        self.kv.append(k, v)
        if not self.policy.speculative:
            return self.quest_step(q1)[:, :, None]
        # 1. speculate: the slots hold the pages selected with q_{t-1}; which heads drifted?
        q_unit = self._unit(q1)  # (Hq, D)
        choosing = self.kv.n_cand > self.K  # else every candidate is resident: nothing to choose
        drifted = self.drifted_heads(q_unit) if choosing else None  # (Hkv,) bools
        # 2. correct the drifted heads: q_t's pages, recalled before attention
        chosen = self.correct(q1, drifted) if drifted and any(drifted) else None
        # 3. attend
        out = self.kv.attend(q1)  # (1, Hq, D)
        # 4. select the next step's pages with q_t and recall them; a full last page makes the
        #    oldest window page a candidate first (roll), so that it competes
        rolled = self.kv.roll()
        self.recall_next(self.select_next(q1, chosen, drifted, rolled))
        self.prev_q = q_unit
        return out[:, :, None]

    def quest_step(self, q1: torch.Tensor) -> torch.Tensor:
        """speculative=False, plain Quest: select with q_t and recall on the critical path, then
        attend. q1 (1, Hq, D) -> (1, Hq, D)."""
        if self.kv.n_cand:
            self.kv.recall(self.select(q1))
        out = self.kv.attend(q1)
        self.kv.roll()
        return out

    def drifted_heads(self, q_unit: torch.Tensor) -> list[bool]:
        """The correction signal per KV head: C_m = mean over the group of cos(q_t, q_{t-1}) < tau.
        q_unit (Hq, D) unit rows -> (Hkv,) bools."""
        sim = (q_unit * self.prev_q).sum(-1)  # (Hq,) cosine similarities
        return (sim.view(-1, self.G).sum(1) / self.G < self.policy.tau).tolist()

    def correct(self, q1: torch.Tensor, drifted: list[bool]) -> torch.Tensor:
        """Fine-grained correction: one selection with q_t for every KV head; the drifted heads'
        pages are recalled now, before attention. -> the selection (Hkv, K)."""
        chosen = self.select(q1)
        self.kv.recall(chosen, heads=drifted)
        return chosen

    def select_next(self, q1: torch.Tensor, chosen, drifted, rolled: bool):
        """The pages step t + 1 reads, selected with q_t -> (pages (Hkv, K) or None, the KV heads
        that recall them: None for all). A correction's selection serves the heads it did not
        recall; a new candidate (rolled), or a step that chose without correcting, selects again
        for every head. Reads q1 (1, Hq, D) and the candidate store (lo, hi, codes, n_cand) only."""
        if rolled or (drifted is not None and chosen is None):
            return self.select(q1), None
        if chosen is not None:
            return chosen, [not d for d in drifted]  # the corrected heads hold these pages already
        return None, None  # every candidate is resident: nothing to choose

    def recall_next(self, selection) -> None:
        """select_next's pages into the slots, in the background (a side stream on CUDA)."""
        pages, heads = selection
        if pages is not None and (heads is None or any(heads)):
            self.kv.recall(pages, heads=heads, background=True)

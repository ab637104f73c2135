"""quant2-cost: what freekv's default digest (quant2) costs per selection, and whether an exact
shortlist from Quest's box bound could leave pages unscored.

    python -m minikv.bench quant2-cost --model qwen2.5-coder-0.5b --dtype bfloat16 --threads 1 \\
        --lengths 8000 16000 32000 --tokens 4096 --layers 3 12 21

Time: one page_scores call with codes (freekv's select) on random keys of the model's shape
(KV heads, group size, head dim) at each of --lengths context tokens (pages of 32), the median
of --repeats calls in CPU time (time.process_time: a shared machine's other load does not count),
its share in coded_logits (the codes' q . k^), and that time over all layers: the selection's
cost per decode step. At the longest length, the other ways to score the codes against the
reference's bit planes: k^ decoded through a 256 x 4 table and one (N P, D) x (D, G) product, a
256-entry table of w . c per byte of four channels, and integer products of the codes with w in
fixed point (approximate); `bit-equal` says whether the result equals the reference's bits.

Shortlist: a page's coded mass P_h[n] = log sum_t exp(s q . k^_t) / s is at most Quest's bound
U_h[n] + log(P) / s (the coded keys lie in the box). An exact shortlist must score every page
whose upper bound reaches the k-th largest page score: `must score` is that share with every
other page's score known exactly (the best any exact shortlist from this bound can do), for
random keys and for the model's real keys: the post-RoPE q and k of --layers from one prefill of
--tokens tokens of pydoc text (the pages of all but the last 32 keys, the last query).
`bound - mass` is how far the bound lies above a page's mass, `mass spread` how far apart the
pages' masses lie (max - min per query head), both averaged: the bound separates pages only
where the first is small beside the second.
"""
from __future__ import annotations

import math
import statistics
import sys
import time

import torch

from ...kernels.page_scores import GROUP_REDUCES, pack_codes, page_scores
from ...kernels.page_scores.reference import LEVELS, coded_logits
from ..common import add_common_arguments, load_model, print_table, text_ids, write_json
from .dci_recall import record_qk

P = 32  # freekv's page size
LEVEL = torch.tensor([[(v >> 2 * j) & 3 for j in range(4)] for v in range(256)], dtype=torch.float32)  # (256, 4)


def add_arguments(p) -> None:
    p.add_argument("--lengths", type=int, nargs="+", default=[8000, 16000, 32000],
                   help="context tokens (8000 16000 32000)")
    p.add_argument("--budget", type=int, default=1024, help="freekv's budget: K = (budget - 64) / 32 - 1 pages (1024)")
    p.add_argument("--tokens", type=int, default=4096, help="prefill tokens for the real keys (4096; 0: none)")
    p.add_argument("--layers", type=int, nargs="+", default=[3, 12, 21], help="layers whose keys are read (3 12 21)")
    p.add_argument("--repeats", type=int, default=15, help="timed calls per length (15)")
    add_common_arguments(p)


def check(args) -> None:
    if min(args.lengths) < 4 * P or args.repeats < 1 or args.tokens < 0 or min(args.layers) < 0:
        raise ValueError("--lengths must be >= 128, --repeats >= 1, --tokens >= 0, --layers >= 0")
    if (args.budget - 64) // P - 1 < 1:
        raise ValueError(f"--budget {args.budget} leaves no selected page (at least {64 + 2 * P})")


def random_layer(Hkv: int, G: int, D: int, n: int, seed: int = 0):
    """q (1, Hkv G, D), boxes lo, hi (1, Hkv, n, D) and codes of n random pages of P keys."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, Hkv, n, P, D, generator=g)
    lo, hi = keys.amin(3), keys.amax(3)
    return torch.randn(1, Hkv * G, D, generator=g), lo, hi, pack_codes(keys, lo, hi)


def cpu_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * statistics.median(times)


def page_bounds(q, lo, hi, codes):
    """Each page's coded mass P_h[n] and its bound (1) U_h[n] + log(P) / s, float64 (Hkv, G, n)."""
    Hkv, n, D = lo.shape[1:]
    s = 1 / math.sqrt(D)
    qg = q.float().view(Hkv, -1, D)
    mass = (coded_logits(qg, lo, hi, codes) * s).logsumexp(-1).double() / s
    lo_t, hi_t = lo[0].double().transpose(1, 2), hi[0].double().transpose(1, 2)
    q64 = qg.double()
    return mass, torch.bmm(q64.clamp_min(0), hi_t) + torch.bmm(q64.clamp_max(0), lo_t) + math.log(P) / s


def must_score(q, lo, hi, codes, k: int, reduce: str) -> float:
    """The share of pages whose Quest bound, every other page exact, reaches the k-th page score."""
    mass, upper = page_bounds(q, lo, hi, codes)
    s = 1 / math.sqrt(lo.shape[-1])
    if reduce == "softmax_mean":
        top = (mass * s).amax(-1, keepdim=True)
        total = torch.exp(mass * s - top).sum(-1, keepdim=True)
        score, bound = (torch.exp(mass * s - top) / total).mean(1), (torch.exp(upper * s - top) / total).mean(1)
    elif reduce == "mean":
        score, bound = mass.mean(1), upper.mean(1)
    else:
        score, bound = mass.amax(1), upper.amax(1)
    kth = score.sort(dim=-1, descending=True).values[:, k - 1:k]
    return float((bound >= kth - 1e-5 * kth.abs()).double().mean())  # the scores are float32: their rounding


def looseness(q, lo, hi, codes) -> dict:
    """How far the bound lies above a page's coded mass, and how far apart the pages' masses lie
    (per query head, max - min over the pages), both averaged."""
    mass, upper = page_bounds(q, lo, hi, codes)
    return {"gap": float((upper - mass).mean()), "spread": float((mass.amax(-1) - mass.amin(-1)).mean())}


# -- the other ways to score the codes: q . k^ (Hkv, G, n, P), as reference.coded_logits ---------

def decoded_gemm(qg, lo, hi, codes):
    Hkv, G, D = qg.shape
    n, _, nb = codes.shape[2:]
    lo, hi = lo[0].float(), hi[0].float()
    c = torch.nn.functional.embedding(codes[0].reshape(Hkv, n * P, nb).int(), LEVEL).view(Hkv, n, P, 4 * nb)[..., :D]
    keys = torch.addcmul(lo[:, :, None], c, ((hi - lo) / LEVELS)[:, :, None])  # k^ (Hkv, n, P, D)
    return torch.bmm(qg, keys.reshape(Hkv, n * P, D).transpose(1, 2)).view(Hkv, G, n, P)


def byte_table(qg, lo, hi, codes):
    Hkv, G, D = qg.shape
    n, _, nb = codes.shape[2:]
    lo, hi = lo[0].float(), hi[0].float()
    w = torch.nn.functional.pad(qg[:, :, None] * ((hi - lo) / LEVELS)[:, None], (0, 4 * nb - D))
    table = w.view(Hkv, G, n, nb, 4) @ LEVEL.t()  # (Hkv, G, n, nb, 256): w . c for every byte value
    at = codes[0].long()[:, None].expand(Hkv, G, n, P, nb).transpose(3, 4)
    return table.gather(4, at).sum(3) + torch.einsum("hgd,hnd->hgn", qg, lo)[..., None]


def fixed_point(qg, lo, hi, codes):
    Hkv, G, D = qg.shape
    n, _, nb = codes.shape[2:]
    lo, hi = lo[0].float(), hi[0].float()
    w = qg[:, :, None] * ((hi - lo) / LEVELS)[:, None]  # (Hkv, G, n, D)
    unit = w.abs().amax() / 2 ** 20
    wi = (w / unit).round().int().permute(0, 2, 3, 1).reshape(Hkv * n, D, G)
    c = torch.nn.functional.embedding(codes[0].reshape(Hkv * n, P, nb).int(), LEVEL).view(Hkv * n, P, 4 * nb)[..., :D]
    out = torch.bmm(c.int(), wi).float().view(Hkv, n, P, G).permute(0, 3, 1, 2) * unit
    return out + torch.einsum("hgd,hnd->hgn", qg, lo)[..., None]


FORMS = {"bit planes (reference)": lambda qg, lo, hi, codes: coded_logits(qg, lo, hi, codes),
         "k^ by a table, one GEMM": decoded_gemm, "256-entry table per byte": byte_table,
         "int32 products (approx.)": fixed_point}


def run(args) -> int:
    check(args)
    model, tok = load_model(args)
    cfg = model.cfg
    Hkv, G, D, L = cfg.n_kv_heads, cfg.n_heads // cfg.n_kv_heads, cfg.head_dim, cfg.n_layers
    k = (args.budget - 64) // P - 1
    rows = []
    for length in args.lengths:
        q, lo, hi, codes = random_layer(Hkv, G, D, length // P)
        qg, valid = q.float().view(Hkv, G, D), torch.tensor([length // P])
        select = cpu_ms(lambda: page_scores(q, lo, hi, valid, k, 1 / math.sqrt(D), "softmax_mean", codes), args.repeats)
        coded = cpu_ms(lambda: coded_logits(qg, lo, hi, codes), args.repeats)
        rows.append({"keys": "random", "tokens": length, "select_ms": select, "coded_share": coded / select,
                     **looseness(q, lo, hi, codes),
                     "step_ms": select * L, **{r: must_score(q, lo, hi, codes, k, r) for r in GROUP_REDUCES}})
        print(f"  {length} tokens: {select:.2f} ms a select", file=sys.stderr, flush=True)
    forms = []
    want = coded_logits(qg, lo, hi, codes)
    for name, form in FORMS.items():
        got = form(qg, lo, hi, codes)
        forms.append({"form": name, "ms": cpu_ms(lambda: form(qg, lo, hi, codes), args.repeats),
                      "bit_equal": "yes" if torch.equal(got, want) else "no",
                      "max_diff": float((got - want).abs().max())})
    if args.tokens:
        print(f"recording q and k of layers {args.layers} over {args.tokens} tokens ...", file=sys.stderr, flush=True)
        qk = record_qk(model, text_ids(tok, args.tokens), args.layers)
        for i in args.layers:
            q_all, keys = qk[i]  # (Hq, T, D), (Hkv, T, D)
            n = (args.tokens - P) // P  # the last page stays in the window
            pages = keys[:, :n * P].reshape(1, Hkv, n, P, D)
            lo, hi = pages.amin(3), pages.amax(3)
            q = q_all[None, :, -1]
            codes = pack_codes(pages, lo, hi)
            rows.append({"keys": f"layer {i}", "tokens": args.tokens, **looseness(q, lo, hi, codes),
                         **{r: must_score(q, lo, hi, codes, k, r) for r in GROUP_REDUCES}})
    print_table(rows, [("keys", "keys", ""), ("tokens", "tokens", "d"), ("select ms", "select_ms", ".2f"),
                       ("in coded_logits", "coded_share", ".0%"), (f"x {L} layers, ms", "step_ms", ".0f")]
                + [("bound - mass", "gap", ".0f"), ("mass spread", "spread", ".0f")]
                + [(f"must score, {r}", r, ".3f") for r in GROUP_REDUCES],
                title=f"\nfreekv digest=quant2, {args.model}: {Hkv} KV heads x {G}, D {D}, K = {k} pages, CPU time")
    print_table(forms, [("scoring the codes", "form", ""), ("ms", "ms", ".2f"), ("bit-equal", "bit_equal", ""),
                        ("max |diff|", "max_diff", ".1e")], title=f"\n{max(args.lengths)} tokens, one layer")
    write_json(args.json, {"benchmark": "quant2-cost", "model": args.model, "k": k, "rows": rows, "forms": forms})
    return 0

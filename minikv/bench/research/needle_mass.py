"""needle-mass: where a retrieval policy loses the needle, per layer and KV head.

    python -m minikv.bench needle-mass --policy freekv --policy icecache --budget 256 --seeds 0 1 2

Per task instance (passkey and niah_single_1 on natural text by default; the needle's token span
is inst.needles[0]) one prefill serves full KV and every policy. Full KV answers greedily; each
policy answers greedily too (its hit or miss), and a second copy of it is fed full KV's answer
(teacher forcing: every policy sees the same tokens). At each step of that answer, per layer and
KV head m, on the policy's own q and keys (recall_probe's shadow copy):

    mass_m   full attention's mass on the needle span, the largest over m's GQA group of query
             heads: a needle is read by a few retrieval heads, and the group's mean would dilute
             one head that reads it hard; the group shares one read set, so that head's loss is
             the group's
    held_m   the part of mass_m on tokens the policy read (layer.attended_indices())

held / mass, summed over heads, steps and instances (mass-weighted, so that heads that do not
look at the needle do not count), is the share of the needle's evidence the policy kept. For
freekv layers (candidates in consecutive host pages), also:

    oracle   the held mass of the page oracle: sink, window and the K candidate pages with the most
             full-attention mass (summed over the group): can pages of this size hold the needle?
    ranks    the needle page's rank (0 = best; its best page when it spans two) among the candidate
             pages, under the true page mass and under each page score (digest x group reduce,
             kernels/page_scores) computed with this step's query: rank < K means an exact
             (non-speculative) selection of that kind would read it
"""
from __future__ import annotations

import gc
import sys
from collections import defaultdict

import torch

from ...generate import decode_n_tokens, decode_one_token
from ...kernels.page_scores import GROUP_REDUCES, pack_codes, page_scores
from ...policies import make
from ...policies.host_pages import DIGESTS, HostPages, page_digest
from ..common import add_common_arguments, load_model, print_table, write_json
from ..compare_run import Bound, answer, bind, prefill_all
from ..passkey import with_budget
from ..recall_probe import RecallProbe, attended_mass, full_attention_probs
from ..tasks import haystacks, make_instance, string_match_all

COMMAND = "needle-mass"
ONE_NEEDLE = ("passkey", "niah_single_1")  # the tasks with one needle and a choice of haystack


# -- what is measured ----------------------------------------------------------------------------


def needle_mass(p: torch.Tensor, indices: torch.Tensor, span: tuple[int, int], G: int):
    """p (Hq, n) full attention, indices (Hkv, m) tokens read (-1 pads), span [a, b) the needle ->
    (mass, held) (Hkv,): per KV head, the needle mass of its group's query head that puts the most
    on the needle, and the part of it on tokens read."""
    a, b = span
    on_needle = torch.zeros_like(p)
    on_needle[:, a:b] = 1.0
    per_head = p[:, a:b].sum(-1).view(-1, G)  # (Hkv, G)
    held = attended_mass(p * on_needle, indices).view(-1, G)
    j = per_head.argmax(dim=1, keepdim=True)  # the group's query head that reads the needle most
    return per_head.gather(1, j)[:, 0], held.gather(1, j)[:, 0]


def needle_pages(span: tuple[int, int], first: int, P: int, n_cand: int) -> list[int]:
    """The candidate pages (candidate c holds tokens first + c P ..) that hold needle tokens."""
    a, b = span
    return [c for c in range(n_cand) if first + c * P < b and first + (c + 1) * P > a]


def best_rank(scores: torch.Tensor, pages: list[int]) -> torch.Tensor:
    """scores (Hkv, N) -> (Hkv,) the rank (0 = top) of the best-scored of `pages`."""
    return torch.stack([(scores > scores[:, c:c + 1]).sum(-1) for c in pages]).amin(0)


class NeedleProbe(RecallProbe):
    """A RecallProbe that records, per decode step and layer, the needle mass and what the policy
    held of it (and, for freekv's layers, the page oracle and the needle page's ranks)."""

    def __init__(self, policy, span: tuple[int, int]):
        super().__init__(policy)
        self.span = span
        self.records: list[dict] = []

    def measure(self, layer, q: torch.Tensor, n: int) -> None:
        # q (1, Hq, 1, D); the keys of tokens 0 .. n-1 are in the shadow copy
        indices = layer.attended_indices() if hasattr(layer, "attended_indices") else None
        if indices is None:
            return
        keys = self.keys[layer.index][:, :n]  # (Hkv, n, D)
        p = full_attention_probs(q[0, :, 0].float(), keys)  # (Hq, n)
        G = p.shape[0] // keys.shape[0]
        mass, held = needle_mass(p, indices, self.span, G)
        rec = {"layer": layer.index, "step": self.policy.steps - 1, "mass": mass, "held": held}
        if isinstance(getattr(getattr(layer, "kv", None), "candidates", None), HostPages):
            rec.update(self.pages(layer, q[0, :, 0], p, keys, G))
        self.records.append(rec)

    def pages(self, layer, q: torch.Tensor, p: torch.Tensor, keys: torch.Tensor, G: int) -> dict:
        """The page oracle's held needle mass and the needle page's ranks (see the module doc)."""
        kv = layer.kv
        length, n_cand = kv.last_read[:2]
        P, first = kv.P, kv.n_sink * kv.P
        cand = slice(first, first + n_cand * P)
        true = p.view(kv.Hkv, G, -1)[:, :, cand].sum(1).view(kv.Hkv, n_cand, P).sum(-1)  # (Hkv, n_cand)
        top = true.topk(min(kv.n_select, n_cand), dim=-1).indices  # (Hkv, K)
        tokens = (first + top[:, :, None] * P + torch.arange(P)).flatten(1)  # (Hkv, K P)
        always = torch.cat([torch.arange(first), torch.arange(first + n_cand * P, length)])
        _, oracle = needle_mass(p, torch.cat([always.expand(kv.Hkv, -1), tokens], 1), self.span, G)
        out = {"oracle": oracle}
        pages = needle_pages(self.span, first, P, n_cand)
        if pages:  # else the needle is in the sink or the window: always read
            out["rank/true"] = best_rank(true, pages)
            k = keys[:, cand].reshape(kv.Hkv, n_cand, P, -1).transpose(0, 1)  # (n_cand, Hkv, P, D)
            for digest in DIGESTS:
                lo, hi = (t.transpose(0, 1)[None] for t in page_digest(k, digest))  # (1, Hkv, n_cand, D)
                codes = pack_codes(k.transpose(0, 1)[None], lo, hi) if digest == "quant2" else None
                for reduce in GROUP_REDUCES:
                    scores, _ = page_scores(q[None], lo, hi, torch.tensor([n_cand]), 1, layer.scale, reduce, codes)
                    out[f"rank/{digest}/{reduce}"] = best_rank(scores[0], pages)
        return out


# -- one instance --------------------------------------------------------------------------------


def run_instance(model, tok, inst, specs: list[str], answers: bool = True) -> dict:
    """Full KV's answer, each policy's records under teacher forcing on it and (if `answers`) the
    policy's own answer."""
    gc.collect()  # a policy and its layers point at each other: free the last instance's caches first
    n, eos = len(inst.ids), set(tok.eos_ids)
    max_len = n + inst.max_new_tokens + 1
    # rows: full KV, each policy teacher-forced (probed), then each policy answering on its own
    plan = [("full", False)] + [(s, True) for s in specs] + ([(s, False) for s in specs] if answers else [])

    def row(i: int) -> Bound:
        spec, probed = plan[i]
        if not probed:
            return bind(model, spec, max_len, probe=False)
        policy = make(spec)
        probe = NeedleProbe(policy, inst.needles[0])
        return Bound(spec, policy.bind(model.cfg, device=model.device, dtype=model.dtype, max_len=max_len), probe)

    rows = [row(i) for i in range(len(plan))]
    logits = prefill_all(model, rows, inst.ids, row)
    new = decode_n_tokens(model, logits[0], torch.tensor([n], device=model.device), rows[0].policy,
                             inst.max_new_tokens, eos, (0.0, None, None), None)
    truth = new[0]  # full KV's answer, fed to every teacher-forced row
    out = {"task": inst.key, "seed": inst.seed, "depth": inst.depths[0], "full": hit(tok, truth, inst), "policies": {}}
    for j, spec in enumerate(specs):
        forced, agree = rows[1 + j], 0
        for t in range(len(truth) - 1):
            step = decode_one_token(model, torch.tensor([truth[t]]), torch.tensor([n + t]), forced.policy)
            agree += int(step[0].argmax()) == truth[t + 1]
        out["policies"][spec] = {"agree": f"{agree}/{len(truth) - 1}", "records": forced.probe.records,
                                 "K": getattr(forced.policy, "n_select", None)}
        if answers:
            i = 1 + len(specs) + j
            own = answer(model, tok, rows[i], logits[i], n, inst.max_new_tokens)
            out["policies"][spec].update(answer=own, hit=string_match_all([own], [inst.answers]) > 0)
    return out


def hit(tok, ids: list[int], inst) -> bool:
    return string_match_all([tok.decode([t for t in ids if t not in tok.eos_ids])], [inst.answers]) > 0


# -- the tables ----------------------------------------------------------------------------------


def per_head(results: list[dict], spec: str) -> list[dict]:
    """One row per (instance, step, layer, KV head) of `spec`'s records, the tensors as numbers."""
    rows = []
    for r in results:
        for rec in r["policies"][spec]["records"]:
            for h in range(len(rec["mass"])):
                rows.append({"task": r["task"], "seed": r["seed"], "layer": rec["layer"], "head": h,
                             "step": rec["step"], **{k: float(v[h]) for k, v in rec.items() if torch.is_tensor(v)}})
    return rows


def summary(rows: list[dict], key) -> list[dict]:
    """Rows grouped by key(row): mean needle mass, held share = sum held / sum mass, the page
    oracle's share, and the needle mass lost (summed)."""
    groups = defaultdict(list)
    for r in rows:
        groups[key(r)].append(r)
    out = []
    for k, g in groups.items():
        mass = sum(r["mass"] for r in g)
        held = sum(r["held"] for r in g)
        oracle = sum(r["oracle"] for r in g) if "oracle" in g[0] else None
        out.append({"group": k, "mass": mass / len(g), "held": held / mass if mass else None,
                    "oracle": oracle / mass if oracle is not None and mass else None, "lost": mass - held,
                    "n": len(g)})
    return out


def rank_table(rows: list[dict], K: int) -> list[dict]:
    """Per page score (and the true page mass): the share of the needle mass, over the records
    where the needle is in a candidate page, whose needle page ranks in the top K, first below
    them (rank K: one more page would read it), K+1 .. 2K-1, or further; the share the policy
    held on those records, and of the mass whose page this score ranks in the top K (for the
    policy's own score, below 1 is what speculation lost)."""
    rows = [r for r in rows if "rank/true" in r]
    total = sum(r["mass"] for r in rows)
    if not total:
        return []
    out = [{"score": "policy's reads (held share)", "top": sum(r["held"] for r in rows) / total}]
    for kind in [k for k in rows[0] if k.startswith("rank/")]:
        share = [sum(r["mass"] for r in rows if lo <= r[kind] < hi) / total for lo, hi in ((0, K), (K, K + 1),
                                                                                            (K + 1, 2 * K))]
        top = [r for r in rows if r[kind] < K]
        held = sum(r["held"] for r in top) / sum(r["mass"] for r in top) if top else None
        out.append({"score": kind[5:], "top": share[0], "next": share[1], "near": share[2], "far": 1 - sum(share),
                    "held": held})
    return out


def report(results: list[dict], specs: list[str], top_heads: int) -> None:
    share = {s: {x["group"]: x["held"] for x in summary(per_head(results, s), lambda r: (r["task"], r["seed"]))}
             for s in specs}  # per policy and instance: the share of the needle mass held
    inst = []
    for r in results:
        row = {"task": r["task"], "seed": r["seed"], "depth": r["depth"], "full": "hit" if r["full"] else "miss"}
        for j, s in enumerate(specs):
            p = r["policies"][s]
            held = share[s].get((r["task"], r["seed"]))
            own = {True: "hit", False: "miss", None: "-"}[p.get("hit")]
            row[f"p{j}"] = f"{own} {p['agree']} " + ("-" if held is None else f"{held:.2f}")
        inst.append(row)
    print_table(inst, [("task", "task", ""), ("seed", "seed", "d"), ("depth", "depth", ".2f"), ("full", "full", "")]
                + [(s, f"p{j}", "") for j, s in enumerate(specs)],
                title="\nper instance: the policy's own answer, its agreement with full KV's answer under teacher "
                      "forcing (steps), and the share of the needle mass it held")
    for s in specs:
        rows = per_head(results, s)
        if not rows:
            print(f"\n{s}: no layer reports attended_indices")
            continue
        cols = [("layer", "group", ""), ("needle mass", "mass", ".3f"), ("held share", "held", ".3f"),
                ("page oracle", "oracle", ".3f"), ("mass lost", "lost", ".2f")]
        print_table(sorted(summary(rows, lambda r: r["layer"]), key=lambda x: x["group"]), cols,
                    title=f"\n{s}: per layer (needle mass: mean over KV heads, steps, instances; shares weighted by it)")
        worst = sorted(summary(rows, lambda r: (r["layer"], r["head"])), key=lambda x: -x["lost"])[:top_heads]
        print_table(worst, [("(layer, KV head)", "group", "")] + cols[1:], title=f"\n{s}: the heads that lose the most")
        print_table(sorted(summary(rows, lambda r: "first" if r["step"] == 0 else "later"), key=lambda x: x["group"]),
                    [("decode step", "group", "")] + cols[1:],
                    title=f"\n{s}: first decode step (pages chosen with the prompt's last query) against later ones")
        K = results[0]["policies"][s].get("K")
        if K and any("rank/true" in r for r in rows):
            print_table(rank_table(rows, K), [("page score", "score", ""), (f"top {K}", "top", ".3f"),
                                              (f"rank {K}", "next", ".3f"), (f"{K + 1}..{2 * K - 1}", "near", ".3f"),
                                              ("below", "far", ".3f"), (f"held of top {K}", "held", ".3f")],
                        title=f"\n{s}: where the needle page ranks, with this step's query (share of needle mass, "
                              "records whose needle is in a candidate page)")


# -- the command ---------------------------------------------------------------------------------


def add_arguments(p) -> None:
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: freekv and icecache)")
    p.add_argument("--budget", type=int, default=256, help="budget for the policies that take one (256)")
    p.add_argument("--tasks", nargs="+", default=["passkey", "niah_single_1"], help="needle tasks")
    p.add_argument("--haystack", default="pydoc", choices=["noise", "pydoc"], help="haystack (pydoc)")
    p.add_argument("--length", type=int, default=4096, help="prompt length in tokens (4096)")
    p.add_argument("--seeds", type=int, nargs="+", default=list(range(10)), help="instances by seed (0..9)")
    p.add_argument("--top-heads", type=int, default=8, help="heads listed as losing the most (8)")
    p.add_argument("--no-answers", action="store_true",
                   help="skip the policies' own answers (hit/miss '-'): one prefill's attention less per policy")
    add_common_arguments(p)


def check(args) -> list[str]:
    specs = [with_budget(s, args.budget) for s in (args.policy or ["freekv", "icecache"])]
    for s in specs:
        make(s)  # a bad spec fails before the model loads
    offered = [t for t in ONE_NEEDLE if args.haystack in haystacks(t)]
    if any(t not in offered for t in args.tasks):
        raise ValueError(f"--tasks: the tasks with one needle and a {args.haystack} haystack are {', '.join(offered)}")
    if args.length < 64 or args.top_heads < 1:
        raise ValueError("--length must be >= 64 and --top-heads >= 1")
    return specs


def run(args) -> int:
    specs = check(args)
    model, tok = load_model(args)
    results = []
    for task in args.tasks:
        for seed in args.seeds:
            inst = make_instance(task, tok, args.length, seed, haystack=args.haystack)
            results.append(run_instance(model, tok, inst, specs, answers=not args.no_answers))
            print(f"  {inst.key} seed {seed}: done", file=sys.stderr, flush=True)
    report(results, specs, args.top_heads)
    write_json(args.json, {"benchmark": COMMAND, "model": args.model, "length": args.length, "specs": specs,
                           "rows": {s: per_head(results, s) for s in specs},
                           "instances": [{k: v for k, v in r.items() if k != "policies"}
                                         | {s: {k: v for k, v in p.items() if k != "records"}
                                            for s, p in r["policies"].items()} for r in results]})
    return 0

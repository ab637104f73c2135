"""dci-recall: recall@k of IceCache's DCI tree search against exact maximum inner product, on a
model's real keys and queries, and the share of keys the search scores.

    python -m minikv.bench dci-recall --keys 2000 4000 8000 --layers 2 9 16 23 29 --queries 16 --k 16

One prefill over the first max(--keys) + --queries tokens of the standard library's
pydoc_data.topics records the post-RoPE keys and queries of --layers. For each key count n, each
layer and each KV head, a DCI tree (minikv/policies/icecache/tree.py: the MIPS transform of Eqs. 2-3,
deterministic promotion, one shared projection) indexes the keys of positions 0..n-1; the queries
of the --queries positions right after n (each query head against its KV head's tree) search it
with the default parameters (field of view max(30, 0.0015 n), the closest 80% of each node's
children). recall@k = |keys found in the search's top k  and  in the exact top k| / k, averaged
over queries, heads and layers. `scored` is the mean share of the n keys the search scored
exactly. --exhaustive adds a row with parameters that score every key (recall must be 1).
"""
from __future__ import annotations

import sys

import torch

from ...policies import make
from ...policies.icecache.promotion import random_direction
from ...policies.icecache.search_fast import FastSearch, top_keys
from ...policies.icecache.tree import DCIForest
from ..common import add_common_arguments, load_model, print_table, text_ids, write_json


def record_qk(model, ids: list[int], layers: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Post-RoPE (q (Hq, T, D), k (Hkv, T, D)) of each listed layer, from one prefill of ids."""
    policy = make("full").bind(model.cfg, device=model.device, dtype=model.dtype, max_len=len(ids))
    found = {}
    for i in layers:
        layer = policy.layer(i)

        def prefill(q, k, v, positions, i=i, orig=layer.prefill):
            found[i] = (q[0].float().cpu(), k[0].float().cpu())
            return orig(q, k, v, positions)

        layer.prefill = prefill
    with torch.no_grad():
        model(torch.tensor([ids], device=model.device), policy=policy, logits_at=torch.tensor([len(ids) - 1]))
    return found


def tree_recall(q: torch.Tensor, keys: torch.Tensor, k: int, fov: int | None = None, prop: float = 0.8,
                seed: int = 0) -> tuple[float, float]:
    """q (Hq, Q, D) queries, keys (Hkv, n, D): one tree per KV head over the n keys, each query head
    searching its KV head's -> (mean recall@k against exact MIPS, mean share of keys scored)."""
    Hq, Q, D = q.shape
    H, n, _ = keys.shape
    forest = DCIForest(n_heads=H, head_dim=D, page_size=16, capacity=n, u=random_direction(D, seed))
    forest.build(keys)
    blocks = q.reshape(H, Hq // H * Q, D)  # the queries of the heads of each GQA group
    found = top_keys(FastSearch(forest), blocks, torch.arange(H), k, fov, prop).reshape(Hq * Q, k)
    exact = torch.bmm(blocks, keys.transpose(1, 2)).reshape(Hq * Q, n).topk(k, dim=1).indices
    hits = sum(len(set(a) & set(b)) for a, b in zip(found.tolist(), exact.tolist()))
    return hits / exact.numel(), forest.scored / forest.searched


def add_arguments(p) -> None:
    p.add_argument("--keys", type=int, nargs="+", default=[2000, 4000, 8000], help="keys per tree (2000 4000 8000)")
    p.add_argument("--layers", type=int, nargs="+", default=[2, 9, 16, 23, 29], help="layers to measure")
    p.add_argument("--queries", type=int, default=16, help="query positions right after the keys (16)")
    p.add_argument("--k", type=int, default=16, help="recall at k (16)")
    p.add_argument("--exhaustive", action="store_true", help="also search with fov = n, prop = 1 (exact)")
    add_common_arguments(p)


def check(args) -> None:
    """The flags that need no model (python -m minikv.bench calls this before loading it)."""
    for name, values in (("--keys", args.keys), ("--queries", [args.queries]), ("--k", [args.k])):
        if min(values) < 1:
            raise ValueError(f"{name} must be >= 1, got {min(values)}")
    if args.k > min(args.keys):
        raise ValueError(f"--k {args.k} is more than the smallest tree ({min(args.keys)} keys)")
    if min(args.layers) < 0:
        raise ValueError(f"--layers are layer indices >= 0, got {min(args.layers)}")


def run(args) -> int:
    check(args)
    model, tok = load_model(args)
    bad = [i for i in args.layers if not 0 <= i < model.cfg.n_layers]
    if bad:
        raise ValueError(f"--layers {bad} outside the model's layers 0..{model.cfg.n_layers - 1}")
    total = max(args.keys) + args.queries
    if total > model.cfg.max_position_embeddings:
        raise ValueError(f"{total} tokens exceed the model's context of {model.cfg.max_position_embeddings}")
    print(f"recording q and k of {len(args.layers)} layers over {total} tokens ...", file=sys.stderr, flush=True)
    qk = record_qk(model, text_ids(tok, total), args.layers)
    rows = []
    for n in args.keys:
        settings = [("default", None, 0.8)] + ([("exhaustive", n, 1.0)] if args.exhaustive else [])
        for name, fov, prop in settings:
            recalls, scored = [], []
            for i in args.layers:
                q, k = qk[i]
                r, s = tree_recall(q[:, n:n + args.queries], k[:, :n], args.k, fov, prop)
                recalls.append(r)
                scored.append(s)
            rows.append({"keys": n, "search": name, f"recall@{args.k}": sum(recalls) / len(recalls),
                         "min_layer_recall": min(recalls), "scored": sum(scored) / len(scored)})
            print(f"  {n} keys, {name}: recall@{args.k} {rows[-1][f'recall@{args.k}']:.3f}", file=sys.stderr, flush=True)
    print_table(rows, [("keys", "keys", "d"), ("search", "search", ""), (f"recall@{args.k}", f"recall@{args.k}", ".3f"),
                       ("worst layer", "min_layer_recall", ".3f"), ("keys scored", "scored", ".3f")],
                title=f"\nDCI tree recall@{args.k} vs exact MIPS, {args.model}, layers {args.layers}, "
                      f"{args.queries} queries x {model.cfg.n_heads} heads")
    write_json(args.json, {"benchmark": "dci-recall", "model": args.model, "layers": args.layers, "rows": rows})
    return 0

"""The clustering a SyncKV policy runs, settled once when it is bound to a model (policy.py's
`validate`), before any step: the file's clustering for N_r (clusters.py finds it), N_r as the
paper sets it for the model, the wide layers beyond the paper, every layer checked to partition
the model's KV heads; and the stand-in clustering the contract matrix runs on a model that ships
none. A decode step only reads the result, `policy.clustering`: per layer, the clusters and their
R-heads.
"""
from __future__ import annotations

import json
from pathlib import Path

from .clusters import (FORMAT, clustered_layers, config_sha256, file_layers, find_clustering, least_agreeing_layers,
                       read_file, read_similarity)


def paper_n_r(cfg) -> int:
    """N_r as the paper sets it (Sec. 5.1): "we set N_r to 2 for the Llama model and 1 for Qwen
    model" (App. D: N_r = 2 its default). Qwen2 models take 1, the others 2, and no model more
    than its KV heads less one: N_r = 2 of 2 KV heads makes both R-heads, full KV, nothing
    compressed (docs/design.md, "The paper as a preset")."""
    if cfg.model_type == "qwen2":
        return 1
    return max(1, min(2, cfg.n_kv_heads - 1))


def layer_clusterings(policy, cfg) -> tuple[int, list[dict], Path]:
    """-> (N_r, per governed layer {"clusters": [[heads]], "r_heads": [head]}, the file it came
    from): N_r clusters in every layer (n_r=none: the paper's), but in the wide layers (`widen`).
    cfg is the governed one (window.governed_config); the file is found by the model's config
    (policy.model_cfg, all its layers) and gives the global layers' clusterings, in order."""
    n_r = policy.n_r if policy.n_r is not None else paper_n_r(cfg)
    if n_r > cfg.n_kv_heads:
        raise ValueError(f"n_r must be <= the model's {cfg.n_kv_heads} KV heads, got {policy.n_r}")
    model, governed = policy.model_cfg, policy.global_layers  # the model's index of each governed layer
    clustering, file = find_clustering(model, n_r, policy.clusters, governed)
    if policy.wide_layers and not (policy.wide_n_r == 0 and n_r == cfg.n_kv_heads):  # else all R-heads
        clustering = widen(clustering, file, model, governed, n_r, policy.wide_layers, policy.wide_n_r)
    for i, layer in enumerate(clustering):
        heads = sorted(h for c in layer["clusters"] for h in c)
        ok = heads == list(range(cfg.n_kv_heads)) and len(layer["r_heads"]) == len(layer["clusters"])
        if not ok or any(r not in c for r, c in zip(layer["r_heads"], layer["clusters"])):
            raise ValueError(f"{file}: layer {i}'s clusters do not partition the KV heads")
    return n_r, clustering, file


def widen(clustering: list[dict], file: Path, cfg, governed: list[int], n_r: int, wide_layers: int,
          wide_n_r: int) -> list[dict]:
    """Uneven N_r over layers (beyond the paper): the wide_layers governed layers (the model's
    `governed`, cfg the model's config) whose heads agree least (by S, Eq. 2) take the file's
    clustering for wide_n_r clusters (their R-heads stay whole: Mem% rises by their share).
    wide_n_r = 0: a cluster per KV head, every head of those layers whole (full KV there)."""
    H = cfg.n_kv_heads
    wide_n_r = wide_n_r or H
    if not n_r < wide_n_r <= H:
        raise ValueError(f"wide_n_r must be > n_r ({n_r}) and <= the model's {H} KV heads, got {wide_n_r}")
    held = file_layers(read_file(file), cfg)
    S = read_similarity(file)[[held.index(i) for i in governed]]  # (governed layers, Hkv, Hkv)
    wide = least_agreeing_layers(S, min(wide_layers, len(governed)))
    if wide_n_r == H:
        more = [{"clusters": [[h] for h in range(H)], "r_heads": list(range(H))} for _ in governed]
    else:
        more, _ = find_clustering(cfg, wide_n_r, str(file), governed)
    return [more[i] if i in wide else layer for i, layer in enumerate(clustering)]


def stand_in_spec(spec: str, cfg, workdir) -> str:
    """The contract matrix's spec for a model (Policy.spec_for_model; cfg the model's, all its
    layers): a model with no shipped clustering gets one, written into workdir, for its clustered
    (global) layers as cluster-heads writes them: for N_r = 1, the first one cluster, the others
    two; for N_r = 2 (synckv:paper on a Llama-style model, paper_n_r), two in every layer."""
    try:
        find_clustering(cfg, 1)
        return spec
    except ValueError:
        H, held = cfg.n_kv_heads, clustered_layers(cfg)
        two = [list(range(H - 1)), [H - 1]] if H > 1 else [[0]]
        layers = [{"clusters": [list(range(H))], "r_heads": [0]}] + \
            [{"clusters": two, "r_heads": [c[-1] for c in two]}] * (len(held) - 1)
        doc = {"format": FORMAT, "model": {"name": "check_policy", "config_sha256": config_sha256(cfg),
                                           "weights_sha256": "-", "n_layers": cfg.n_layers, "n_kv_heads": H},
               "layers": held, "corpus": {}, "seed": 0, "similarity": [],
               "clusterings": {"1": layers, "2": [{"clusters": two, "r_heads": [c[-1] for c in two]}] * len(held)}}
        path = Path(workdir) / f"synckv_{config_sha256(cfg)[:12]}.json"
        path.write_text(json.dumps(doc))
        return f"{spec}{',' if ':' in spec else ':'}clusters={path}"

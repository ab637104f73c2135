"""cluster-heads: SyncKV's offline head clustering (Sec. 4.1, App. B.1) and Figure 2's observations.

    python -m minikv.bench cluster-heads --model smollm2 --out synckv_smollm2.json

Corpus: --docs documents of --doc-tokens tokens, consecutive pieces of the standard library's
pydoc_data.topics (standing in for the paper's 50 Wikipedia articles of 1,000 tokens). Each is
prefilled with full KV and decoded greedily for --steps steps; at every step each KV head's
attention (max-pooled over its GQA group's query heads, App. B.1) gives its top --topk tokens
over the whole context. Per layer, S[i, j] is the mean over steps and documents of the overlap
coefficient (Eq. 1) of heads i and j (Eq. 2); D = max(S) - S is clustered by seeded K-means on
its rows into N_r clusters for every N_r in --n-r (default: 1 .. the KV heads), and the member
nearest each centroid is the R-head. Writes a JSON file keyed by the model's identity (config and
weights checksums) that `synckv:clusters=FILE` reads; SmolLM2's ships with minikv. On a model with
local and global layers (Gemma 3) the file holds the global layers alone (clusters.clustered_layers):
the local layers keep their window whatever the policy.

Also printed, from the same run (the paper's Figure 2, on this model): (a) attention drift, the
overlap of each head's top-k set at decode step t with the one of the last prompt token, for t
in 10, 50, 200 where --steps reaches them; (b) temporal locality, the overlap between adjacent
steps; (c) intra- against inter-layer similarity: the mean overlap between two different heads
of one layer, against that between heads of two different layers.
"""
from __future__ import annotations

import sys
import time

import torch

from ...atomic import atomic_write
from ...cli import dumps
from ...generate import generate
from ...kernels.attention_topk import attention_topk
from ...kernels.decode_attention import decode_attention
from ...policies.full import Full, FullLayer
from ...policies.window import local_windows
from ...policies.synckv.clusters import SimilarityMeter, clustered_layers, make_document, overlap, weights_sha256
from ..common import add_common_arguments, load_model, long_text, print_table

DRIFT_STEPS = (10, 50, 200)


def add_arguments(p) -> None:
    p.add_argument("--out", required=True, metavar="FILE", help="the clustering JSON file to write")
    p.add_argument("--docs", type=int, default=50, help="documents (default 50, as the paper)")
    p.add_argument("--doc-tokens", type=int, default=1000, help="tokens per document (default 1000)")
    p.add_argument("--steps", type=int, default=32, help="greedy decoding steps per document (default 32)")
    p.add_argument("--topk", type=int, default=64, help="k of the top-k attention sets (default 64)")
    p.add_argument("--n-r", type=int, nargs="+", default=None, help="cluster counts N_r (default: 1 .. KV heads)")
    p.add_argument("--seed", type=int, default=0, help="K-means seed (default 0)")
    add_common_arguments(p)


class ProbeLayer(FullLayer):
    """Full KV that also records each KV head's top-k attention set of every step, under the
    model's index of its layer (the policy's layer `index` is the index-th global one)."""

    def _topk(self, q, length):
        # q (1, Hq, D) over the first `length` cached tokens -> (Hkv, k) token indices
        k, v = self.k[:, :, :length], self.v[:, :, :length]
        lengths = torch.tensor([length])
        _, lse = decode_attention(q, k, v, lengths, return_lse=True)
        _, index = attention_topk(q, k, lse, lengths, None, min(self.policy.topk, length))
        return index[0]

    def prefill(self, q, k, v, positions):
        out = super().prefill(q, k, v, positions)
        self.policy.record(self.policy.global_layers[self.index], self._topk(q[:, :, -1], k.shape[2]), k.shape[2],
                           prefill=True)
        return out

    def decode(self, q, k, v, positions):
        out = super().decode(q, k, v, positions)
        self.policy.record(self.policy.global_layers[self.index], self._topk(q[:, :, 0], self.longest), self.longest)
        return out


class Probe(Full):
    """The observer: accumulates Eq. 2's S and Figure 2's statistics while decoding."""

    max_batch = 1

    def __init__(self, *, topk: int = 64, n_layers: int = 1, n_kv: int = 1):
        super().__init__()
        self.topk = topk
        self.meter = SimilarityMeter(n_layers, n_kv)  # by the model's layer index
        self.drift = {t: [] for t in DRIFT_STEPS}  # step -> mean overlap with the prefill's set, per doc
        self.adjacent = []  # mean overlap of adjacent steps' sets, per step
        self.layer_sim = None  # (probed layers, probed layers) head-to-head, summed
        self.layer_sim_steps = 0

    def make_layer(self, index):
        return ProbeLayer(self, index)

    def start_doc(self):
        self.first, self.prev, self.now = {}, {}, {}

    def record(self, layer, index, length, prefill=False):
        if prefill:
            self.first[layer] = self.prev[layer] = index
            return
        self.meter.add(layer, index, length)
        self.now[layer] = (index, length)

    def end_step(self, logits=None):
        action = super().end_step(logits)
        if not self.now:
            return action
        step = self.steps - 1  # decode steps so far
        probed = sorted(self.now)  # the model's index of each probed layer
        sets = [self.now[i][0] for i in probed]
        length = self.now[probed[0]][1]
        diag = lambda a, b: float(torch.diagonal(overlap(a, b, length)).mean())  # noqa: E731
        self.adjacent.append(sum(diag(s, self.prev[i]) for i, s in zip(probed, sets)) / len(sets))
        if step in self.drift:
            self.drift[step].append(sum(diag(s, self.first[i]) for i, s in zip(probed, sets)) / len(sets))
        # Figure 2(c): every head against every head, averaged per (layer, layer) block
        H = sets[0].shape[0]
        o = overlap(torch.cat(sets), torch.cat(sets), length).view(len(sets), H, len(sets), H)
        if self.layer_sim is None:
            self.layer_sim = torch.zeros(len(sets), len(sets), dtype=torch.float64)
        self.layer_sim += o.sum(dim=(1, 3))
        self.layer_sim_steps += 1
        self.prev = dict(zip(probed, sets))
        self.now = {}
        return action

    def observations(self) -> dict:
        layer_sim = self.layer_sim if self.layer_sim is not None else torch.zeros(1, 1, dtype=torch.float64)
        n, H = layer_sim.shape[0], self.meter.total.shape[1]
        sums = layer_sim / max(self.layer_sim_steps, 1)
        eye = torch.eye(n, dtype=torch.bool)
        # intra: pairs of *different* heads of one layer (a head against itself is always 1)
        intra = float((sums.diagonal() - H).sum() / (n * H * (H - 1))) if H > 1 else float("nan")
        inter = float(sums[~eye].sum() / (n * (n - 1) * H * H)) if n > 1 else float("nan")
        mean = lambda xs: sum(xs) / len(xs) if xs else None  # noqa: E731
        return {"drift": {t: mean(v) for t, v in self.drift.items()}, "adjacent": mean(self.adjacent),
                "intra_layer": intra, "inter_layer": inter}


def documents(tok, n_docs: int, doc_tokens: int) -> list[list[int]]:
    """n_docs consecutive pieces of pydoc_data.topics, each of doc_tokens tokens (BOS first when
    the tokenizer adds one)."""
    bos = [tok.bos_id] if tok.add_bos and tok.bos_id is not None else []
    body = doc_tokens - len(bos)
    text = long_text()
    ids = tok.encode(text[: 6 * n_docs * body], add_bos=False)
    if len(ids) < n_docs * body:
        ids = tok.encode(text, add_bos=False)
    if len(ids) < n_docs * body:
        raise ValueError(f"pydoc_data.topics holds {len(ids)} tokens, fewer than {n_docs} x {body}")
    return [bos + ids[i * body:(i + 1) * body] for i in range(n_docs)]


def check(args) -> None:
    """The flags that need no model (python -m minikv.bench calls this before loading it)."""
    for name in ("docs", "doc_tokens", "steps", "topk"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")


def run(args) -> int:
    from ...config import ModelConfig
    from ...loading import resolve

    check(args)
    model_dir = resolve(args.model, progress=False)  # the config first: bad flags fail before the weights load
    cfg = ModelConfig.from_json(model_dir)
    bad = [n for n in args.n_r or [] if not 1 <= n <= cfg.n_kv_heads]
    if bad:
        raise ValueError(f"--n-r values must be in 1..{cfg.n_kv_heads} (the KV heads), got {bad}")
    if args.doc_tokens + args.steps > cfg.max_position_embeddings:
        raise ValueError(f"--doc-tokens + --steps exceeds the model's context of {cfg.max_position_embeddings}")
    # the probe governs (and so observes) the layers to cluster: on a Mistral, every layer within its window
    held = clustered_layers(cfg)
    if set(held) & set(local_windows(cfg, args.doc_tokens + args.steps + 1)):
        raise ValueError(f"--doc-tokens + --steps must stay within the model's sliding window of "
                         f"{cfg.sliding_window} (every layer has one)")
    model, tok = load_model(args)
    docs = documents(tok, args.docs, args.doc_tokens)
    probe = Probe(topk=args.topk, n_layers=cfg.n_layers, n_kv=cfg.n_kv_heads)
    t0 = time.perf_counter()
    for i, ids in enumerate(docs):
        probe.start_doc()
        generate(model, tok, ids, policy=probe, max_new_tokens=args.steps + 1, stop_at_eos=False)
        spent = time.perf_counter() - t0
        print(f"cluster-heads: document {i + 1}/{len(docs)} done, {spent:.0f} s, "
              f"~{spent / (i + 1) * (len(docs) - i - 1):.0f} s left", file=sys.stderr, flush=True)

    S = probe.meter.mean()[held]  # (clustered layers, Hkv, Hkv): the global ones on Gemma 3
    corpus = {"source": "pydoc_data.topics", "docs": args.docs, "doc_tokens": args.doc_tokens,
              "steps": args.steps, "topk": args.topk}
    doc = make_document(cfg, name=str(args.model), weights=weights_sha256(model_dir),
                        S=S, corpus=corpus, seed=args.seed, n_rs=args.n_r)
    atomic_write(args.out, dumps(doc, indent=1) + "\n")
    print_summary(S, doc)
    print_observations(probe.observations(), args)
    print(f"\nwrote {args.out}")
    return 0


def print_summary(S: torch.Tensor, doc: dict) -> None:
    rows = []
    H = S.shape[1]
    off = ~torch.eye(H, dtype=torch.bool)
    for j, (layer, s) in enumerate(zip(doc["layers"], S)):
        row = {"layer": layer, "min": float(s[off].min()) if H > 1 else None,
               "mean": float(s[off].mean()) if H > 1 else None, "max": float(s[off].max()) if H > 1 else None}
        for n, layers in doc["clusterings"].items():
            c = layers[j]
            row[f"N_r={n}"] = " ".join("{" + ",".join(f"{'*' if h == r else ''}{h}" for h in members) + "}"
                                       for members, r in zip(c["clusters"], c["r_heads"]))
        rows.append(row)
    cols = [("layer", "layer", "d"), ("S min", "min", ".3f"), ("S mean", "mean", ".3f"), ("S max", "max", ".3f")]
    cols += [(f"clusters N_r={n} (*R-head)", f"N_r={n}", "") for n in doc["clusterings"]]
    print_table(rows, cols, title="\nhead similarity S (overlap of top-k sets between two different KV heads) "
                                  "and clusters")


def print_observations(obs: dict, args) -> None:
    rows = [{"what": f"drift: overlap with the prefill's set after {t} steps", "value": v}
            for t, v in obs["drift"].items() if v is not None]
    rows.append({"what": "temporal locality: overlap of adjacent steps", "value": obs["adjacent"]})
    rows.append({"what": "intra-layer similarity (two heads of one layer)", "value": obs["intra_layer"]})
    rows.append({"what": "inter-layer similarity (heads of two layers)", "value": obs["inter_layer"]})
    print_table(rows, [("observation (Figure 2)", "what", ""), ("overlap", "value", ".3f")],
                title=f"\nFigure 2 on this model: top-{args.topk} sets, {args.docs} docs x {args.doc_tokens} tokens, "
                      f"{args.steps} steps")

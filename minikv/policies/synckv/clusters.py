"""SyncKV's offline head clustering (Sec. 4.1, Eqs. 1-2, Algorithm 1 lines 3-7, Appendix B.1),
and the clustering files the `synckv` policy reads.

Per layer, the similarity of KV heads i and j is the overlap coefficient (Eq. 1) of their top-k
attention sets, averaged over decoding steps and documents (Eq. 2); with GQA each KV head's map
is the max-pool of its query heads' maps (App. B.1; kernels/attention_topk). The distance
D = max(S) - S is clustered by K-means on its rows (App. B.1 step 3) into N_r clusters, and the
member nearest its cluster's centroid is the representative head (R-head, step 4).

`python -m minikv.bench cluster-heads` (bench/research/cluster_heads.py) runs a model over a corpus and
writes a JSON file holding, per layer, S and the clusterings for every N_r from 1 to the number
of KV heads. The file is keyed by the model's identity: a SHA-256 of its config (the only thing a
policy sees when it is bound) and one of its safetensors weights (recorded; checked by the
command and the tests, since a policy never sees the weights). SmolLM2's file ships in
minikv/policies/data/. On a model with local and global layers (Gemma 3) the file is the model's
(its config, all its layers) and holds the global layers' clusterings alone (`clustered_layers`;
docs/design.md, "Local and global layers"); a bound policy takes those it governs, in order.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

FORMAT = "minikv-synckv-clusters/1"
DATA_DIR = Path(__file__).resolve().parent.parent / "data"
COMMAND = "python -m minikv.bench cluster-heads --model MODEL --out FILE"


# -- similarity (Eqs. 1-2) ---------------------------------------------------------------------


def overlap(a: torch.Tensor, b: torch.Tensor, length: int) -> torch.Tensor:
    """Eq. 1 between every set of `a` and every set of `b`: a (Ha, k), b (Hb, k) token indices
    (distinct per row, -1 = none) of a context of `length` tokens -> (Ha, Hb) float64,
    |A ∩ B| / min(|A|, |B|)."""
    def one_hot(idx):  # (H, k) -> (H, length) float64 with a 1 at each listed token
        out = torch.zeros(idx.shape[0], length + 1, dtype=torch.float64)
        out.scatter_(1, torch.where(idx >= 0, idx, length), 1.0)
        return out[:, :length]
    ha, hb = one_hot(a), one_hot(b)
    sizes = torch.minimum(ha.sum(1)[:, None], hb.sum(1)[None, :]).clamp_min(1)
    return ha @ hb.T / sizes


class SimilarityMeter:
    """Running mean of Eq. 2 per layer: add(layer, index (Hkv, k), length) once per step."""

    def __init__(self, n_layers: int, n_kv: int):
        self.total = torch.zeros(n_layers, n_kv, n_kv, dtype=torch.float64)
        self.count = torch.zeros(n_layers, dtype=torch.float64)

    def add(self, layer: int, index: torch.Tensor, length: int) -> None:
        self.total[layer] += overlap(index, index, length)
        self.count[layer] += 1

    def mean(self) -> torch.Tensor:
        """(n_layers, Hkv, Hkv) S of Eq. 2."""
        return self.total / self.count.clamp_min(1)[:, None, None]


# -- clustering (App. B.1 steps 3-4) -----------------------------------------------------------


def kmeans(points: torch.Tensor, n: int, seed: int = 0, restarts: int = 10, iters: int = 100):
    """Lloyd's K-means with k-means++ seeding, the best of `restarts` by inertia, deterministic
    for a seed: points (N, F) -> labels (N,) int64, centroids (n, F) float64."""
    x = points.double()
    N = x.shape[0]
    if not 1 <= n <= N:
        raise ValueError(f"cannot make {n} clusters of {N} points")
    g = torch.Generator().manual_seed(seed)
    best = None
    for _ in range(restarts):
        # k-means++: each next centre drawn with probability proportional to its squared distance
        centres = [int(torch.randint(N, (1,), generator=g))]
        for _ in range(n - 1):
            d2 = torch.cdist(x, x[centres]).amin(1).square()
            if float(d2.sum()) == 0:  # every point sits on a centre: take the first unused one
                centres.append(next(i for i in range(N) if i not in centres))
            else:
                centres.append(int(torch.multinomial(d2 / d2.sum(), 1, generator=g)))
        c = x[centres].clone()
        for _ in range(iters):
            labels = torch.cdist(x, c).argmin(1)  # ties to the lower centre
            new = c.clone()
            for j in range(n):
                members = labels == j
                if members.any():
                    new[j] = x[members].mean(0)
                else:  # an empty cluster takes the point farthest from its centre
                    far = int(torch.cdist(x, c).gather(1, labels[:, None]).squeeze(1).argmax())
                    new[j] = x[far]
            if torch.equal(new, c):
                break
            c = new
        labels = torch.cdist(x, c).argmin(1)
        inertia = float(torch.cdist(x, c).gather(1, labels[:, None]).square().sum())
        if best is None or inertia < best[0] - 1e-12:
            best = (inertia, labels, c)
    return best[1], best[2]


def cluster_layer(S: torch.Tensor, n_r: int, seed: int = 0) -> dict:
    """S (Hkv, Hkv) -> {"clusters": [[heads]], "r_heads": [head]}: D = max(S) - S (App. B.1
    step 3), K-means on the rows of D, the member nearest its centroid as R-head (step 4; ties to
    the lower head). Clusters are listed by their lowest head, so equal partitions print alike."""
    D = S.max() - S
    labels, centroids = kmeans(D, n_r, seed)
    clusters, r_heads = [], []
    for j in range(n_r):
        members = [int(h) for h in torch.nonzero(labels == j).flatten()]
        if not members:
            continue
        dist = torch.linalg.vector_norm(D[members].double() - centroids[j], dim=1)
        r_heads.append(members[int(dist.argmin())])
        clusters.append(members)
    order = sorted(range(len(clusters)), key=lambda i: clusters[i][0])
    return {"clusters": [clusters[i] for i in order], "r_heads": [r_heads[i] for i in order]}


def least_agreeing_layers(S: torch.Tensor, n: int) -> list[int]:
    """S (n_layers, Hkv, Hkv) -> the n layers whose heads agree least: lowest mean of S off its
    diagonal (ties to the lower layer), sorted. Beyond the paper: the layers where one R-head
    speaks worst for the others, and so where keeping every head whole buys the most."""
    H = S.shape[1]
    if H < 2:
        raise ValueError("the head similarity needs at least 2 KV heads per layer")
    off = (S.sum((1, 2)) - S.diagonal(dim1=1, dim2=2).sum(1)) / (H * (H - 1))  # (n_layers,)
    order = sorted(range(len(off)), key=lambda i: (float(off[i]), i))
    return sorted(order[:n])


# -- identity and files ------------------------------------------------------------------------


# The config fields that name a model's shape: what minikv's loader and the transformers adapter
# (minikv.hf) both fill in, so that a policy bound through either finds the same file.
IDENTITY_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "n_layers", "n_heads",
                   "n_kv_heads", "head_dim", "max_position_embeddings", "rope_theta", "rotary_dim")


def config_sha256(cfg) -> str:
    """SHA-256 of a ModelConfig's identity fields as canonical JSON: what a bound policy sees."""
    fields = dataclasses.asdict(cfg)
    return hashlib.sha256(json.dumps({k: fields[k] for k in IDENTITY_FIELDS}, sort_keys=True).encode()).hexdigest()


def weights_sha256(model_dir: Path) -> str:
    """SHA-256 over the model's tensors: name, dtype, shape and bytes, in name order. Not over
    the files: safetensors writes its header's metadata in no fixed order, so two imports of
    the same GGUF differ in bytes while every tensor is equal."""
    from safetensors import safe_open

    from ...loading import safetensors_files

    h = hashlib.sha256()
    for file in safetensors_files(Path(model_dir)):
        with safe_open(str(file), "pt") as f:
            for name in sorted(f.keys()):
                t = f.get_tensor(name)
                h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
                h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def clustered_layers(cfg) -> list[int]:
    """The model's layers a clustering file holds: its global layers (no sliding window), the only
    ones a policy governs once the context passes the windows; every layer of a model with no
    window, or with a window on every layer (Mistral: synckv runs it only within its window, where
    every layer is global)."""
    layers = [i for i in range(cfg.n_layers) if cfg.layer_window(i) is None]
    return layers or list(range(cfg.n_layers))


def make_document(cfg, *, name: str, weights: str, S: torch.Tensor, corpus: dict, seed: int = 0,
                  n_rs=None) -> dict:
    """The clustering file's content: S (len(clustered_layers), Hkv, Hkv), the model's clustered
    layers in order -> clusterings for each N_r."""
    n_kv = cfg.n_kv_heads
    n_rs = list(n_rs or range(1, n_kv + 1))
    return {
        "format": FORMAT,
        "model": {"name": name, "config_sha256": config_sha256(cfg), "weights_sha256": weights,
                  "n_layers": cfg.n_layers, "n_kv_heads": n_kv},
        "layers": clustered_layers(cfg),  # the model's layer index of each clustering below
        "corpus": corpus,
        "seed": seed,
        "similarity": [[[round(float(x), 6) for x in row] for row in layer] for layer in S],
        "clusterings": {str(n): [cluster_layer(layer, n, seed) for layer in S] for n in n_rs},
    }


def read_file(path: Path) -> dict:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the SyncKV clustering file {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"{path} is not a SyncKV clustering file (format {FORMAT!r})")
    return doc


def file_layers(doc: dict, cfg) -> list[int]:
    """The model's layer index of each of a file's clusterings (a file without the field, as
    SmolLM2's shipped one, holds every clustered layer)."""
    return doc.get("layers", clustered_layers(cfg))


def read_similarity(path: Path) -> torch.Tensor:
    """S of Eq. 2 as a clustering file stores it: (the file's layers, Hkv, Hkv) float64."""
    S = read_file(path).get("similarity")
    try:
        S = torch.tensor(S, dtype=torch.float64)
    except (TypeError, ValueError):
        S = None
    if S is None or S.dim() != 3 or S.shape[1] != S.shape[2] or S.shape[0] == 0:
        raise ValueError(f"{path} holds no head similarity (field 'similarity': n_layers x Hkv x Hkv); make one "
                         f"with: {COMMAND}")
    return S


def find_clustering(cfg, n_r: int, path: str | None = None, layers=None) -> tuple[list[dict], Path]:
    """The clusters of the model's `layers` (default: every clustered layer) for N_r = n_r: from
    `path`, or else from the file shipped in minikv/policies/data whose config matches; cfg is the
    model's, all its layers. -> ([{"clusters", "r_heads"}] per layer of `layers`, file)."""
    want = config_sha256(cfg)
    files = [Path(path)] if path else sorted(DATA_DIR.glob("synckv_*.json"))
    for file in files:
        doc = read_file(file)
        if doc["model"]["config_sha256"] != want:
            if path:
                raise ValueError(f"{file} was made for another model ({doc['model']['name']}: config sha256 "
                                 f"{doc['model']['config_sha256'][:12]}, this one {want[:12]}); make one with: {COMMAND}")
            continue
        clusterings = doc["clusterings"].get(str(n_r))
        if clusterings is None:
            raise ValueError(f"{file} has no clustering for n_r={n_r} (it has {', '.join(doc['clusterings'])}); "
                             f"make one with: {COMMAND} --n-r {n_r}")
        held = file_layers(doc, cfg)
        if len(clusterings) != len(held) or held != clustered_layers(cfg):
            raise ValueError(f"{file} has {len(clusterings)} layers, the model {len(clustered_layers(cfg))} to "
                             f"cluster (its global layers)")
        want_layers = held if layers is None else list(layers)
        missing = [i for i in want_layers if i not in held]
        if missing:
            raise ValueError(f"{file} holds the model's global layers {held}; this run governs local layers "
                             f"{missing} too (a sequence within their window), which no clustering holds")
        return [clusterings[held.index(i)] for i in want_layers], file
    raise ValueError(f"no SyncKV head clustering for this model (config sha256 {want[:12]}); make one with: "
                     f"{COMMAND}, then use synckv:clusters=FILE")

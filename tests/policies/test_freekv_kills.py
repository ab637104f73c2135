"""freekv against an oracle with its own page digest and page score (docs/mutation.md): the oracle
of test_freekv.py ranks pages with the library's page_digest, pack_codes and page_scores, so a
formula bug they share passes it. Here every formula is written out from its definition, in
float64, and nothing of minikv's digests or scores is used:

    minmax, quant2   lo = min_t k_t, hi = max_t k_t                 (Quest's box, per channel)
    arkvale          c = (lo + hi) / 2, r = mean_t |k_t - c|, box [c - r, c + r]   (ArkVale's cuboid)
    bound            P_h[n] = sum_d max(q_d lo_d, q_d hi_d)
    quant2           k^_t = lo + c_t (hi - lo) / 3 with c_t the nearest of the 4 levels,
                     P_h[n] = (1 / s) log sum_t exp(s q . k^_t)
    group reduce     softmax_mean 1/G sum_j softmax(s P_j), mean 1/G sum_j P_j, max max_j P_j

then the top K per KV head, ties to the lower page. The cases are fixed (not drawn): a near-tie
between two pages could rank differently in float64 and in the policy's float32.

After the oracle, the kills among the rest of freekv.py's mutants (docs/mutation.md, freekv): the
statistics (counted only at the steps that choose, divided by the steps they count), the stores'
dtype, backend and shared staging, the background worker, the host tier, and the parameters' edges."""
import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make
from minikv.policies.worker import threads

from ..fixtures import DEVICE
from .test_freekv import run_against_oracle
from .test_freekv_paper import CFG, K, P, SINK, SPEC, WINDOW, PaperFreeKV


def own_box(pages: torch.Tensor, digest: str):
    """pages (Hkv, n, P, D) float64 -> lo, hi (Hkv, n, D)."""
    lo, hi = pages.min(2).values, pages.max(2).values
    if digest == "arkvale":
        centre = (lo + hi) / 2
        radius = (pages - centre[:, :, None]).abs().mean(2)
        lo, hi = centre - radius, centre + radius
    return lo, hi


def own_weights(qg: torch.Tensor, pages, lo, hi, digest: str, s: float) -> torch.Tensor:
    """P_h[n] for the G query heads qg (G, D) of one KV head: pages (n, P, D), lo, hi (n, D) -> (G, n)."""
    if digest != "quant2":
        return torch.maximum(qg[:, None] * lo, qg[:, None] * hi).sum(-1)
    width = (hi - lo)[:, None]  # (n, 1, D)
    levels = lo[:, None, :, None] + torch.arange(4.0, dtype=torch.float64) * width[..., None] / 3  # (n, 1, D, 4)
    c = (pages[..., None] - levels).abs().argmin(-1)  # (n, P, D): the nearest level
    k_hat = lo[:, None] + c * width / 3
    return torch.logsumexp(s * torch.einsum("gd,npd->gnp", qg, k_hat), -1) / s


def own_oracle(q, keys, P, n_sink, n_window, K, group_reduce="softmax_mean", digest="minmax"):
    """oracle_pages' contract (q (1, Hq, D), keys (1, Hkv, L, D) -> (Hkv, K), -1 pads), own formulas."""
    Hkv, L, D = keys.shape[1], keys.shape[2], keys.shape[3]
    n_cand = max(0, -(-L // P) - n_sink - n_window)
    out = torch.full((Hkv, K), -1)
    if n_cand == 0:
        return out
    pages = keys[0, :, n_sink * P:(n_sink + n_cand) * P].double().reshape(Hkv, n_cand, P, D)
    lo, hi = own_box(pages, digest)
    G, s = q.shape[1] // Hkv, D ** -0.5
    for m in range(Hkv):
        w = own_weights(q[0, m * G:(m + 1) * G].double(), pages[m], lo[m], hi[m], digest, s)  # (G, n)
        score = {"softmax_mean": lambda: torch.softmax(s * w, -1).mean(0), "mean": lambda: w.mean(0),
                 "max": lambda: w.max(0).values}[group_reduce]()
        top = sorted(range(n_cand), key=lambda n: (-float(score[n]), n))[:K]
        out[m, :len(top)] = torch.tensor(top)
    return out


def case(digest, group_reduce, mode, seed):
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=1,
                      n_heads=4, n_kv_heads=2, head_dim=16, max_position_embeddings=4096, rotary_dim=8)
    P = 4
    return dict(P=P, sink=P, window=P, budget=(1 + 1 + 1 + 2) * P, cfg=cfg, T=24, steps=6, mode=mode,
                group_reduce=group_reduce, digest=digest, seed=seed)


@pytest.mark.parametrize("group_reduce", ["softmax_mean", "mean", "max"])
@pytest.mark.parametrize("digest", ["minmax", "arkvale", "quant2"])
def test_selection_matches_an_oracle_with_its_own_digest_and_score(digest, group_reduce):
    for mode, seed in (("quest", 1), ("mixed", 2)):
        run_against_oracle(case(digest, group_reduce, mode, seed), oracle=own_oracle)


def test_own_oracle_tells_the_digests_apart():
    """The oracle is not blind to the digest: on the same keys and query, the three digests pick
    different pages somewhere (else the test above could not see a wrong digest)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 64, 16, generator=g, dtype=torch.float64) * torch.rand(1, 2, 64, 1, generator=g) * 3
    picks = {d: [own_oracle(torch.randn(1, 4, 16, generator=g.manual_seed(i), dtype=torch.float64), keys, 4, 1, 2, 3,
                            digest=d).tolist() for i in range(20)] for d in ("minmax", "arkvale", "quant2")}
    assert picks["minmax"] != picks["arkvale"] and picks["minmax"] != picks["quant2"]


def test_a_head_is_corrected_only_below_tau_and_each_correcting_step_counts_once():
    """C_m < tau drifts (a mean cosine exactly tau does not); freekv_counts records each judging
    step's heads, a correcting step once, and arms the step's one speculation comparison."""
    policy = make(SPEC.replace("tau=0.9", "tau=0.5")).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64)
    layer = policy.layers[0]
    G, D = CFG.n_heads // CFG.n_kv_heads, CFG.head_dim
    prev, now = torch.zeros(CFG.n_heads, D), torch.zeros(CFG.n_heads, D)
    prev[:, 0] = 1.0
    now[:, 0], now[:, 1] = 0.5, math.sqrt(3) / 2  # cos exactly 0.5 for KV head 0's queries...
    now[G:, 0], now[G:, 1] = 0.25, math.sqrt(15) / 4  # ...and 0.25 for KV head 1's
    layer.prev_q = prev.to(DEVICE)
    for _ in range(2):
        assert layer.drifted_heads(now.to(DEVICE)) == [False, True]
    assert layer.drifted_heads(prev.to(DEVICE)) == [False, False]
    assert (layer.corrected_steps, layer.corrected_heads, layer.head_steps) == (2, 2, 3 * CFG.n_kv_heads)
    q, k, v = (torch.randn(1, H, 30, D).to(DEVICE) for H in (CFG.n_heads, CFG.n_kv_heads, CFG.n_kv_heads))
    layer.prefill(q, k, v, None)  # its selection is compared: drifted_heads armed the comparison
    assert layer.spec_compared == CFG.n_kv_heads and not layer.comparing
    layer.select(q[:, :, -1])  # once per judging step
    assert layer.spec_compared == CFG.n_kv_heads


def test_prefill_output_the_unit_query_and_the_step_counts():
    """The prefill returns causal attention over the prompt; a query of norm below 1 is scaled up
    to unit rows too (the cosine of `drifted_heads`); recalls count from the first decode step."""
    from minikv.models.attention import dense_attention

    policy = make(SPEC).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64)
    layer = policy.layers[0]
    D = CFG.head_dim
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, 30, D, generator=g).to(DEVICE) for H in (CFG.n_heads, CFG.n_kv_heads, CFG.n_kv_heads))
    torch.testing.assert_close(layer.prefill(q, k, v, None), dense_attention(q, k, v))
    assert policy.stats()["pages_recalled"] == 0
    for _ in range(3):
        layer.decode(*(torch.randn(1, H, 1, D, generator=g).to(DEVICE) for H in (CFG.n_heads,) + (CFG.n_kv_heads,) * 2),
                     None)
        policy.end_step()
    assert layer.decode_steps == 3
    small = torch.randn(1, CFG.n_heads, D, generator=g) * 0.01
    norms = torch.linalg.vector_norm(layer._unit(small.to(DEVICE)), dim=-1)
    torch.testing.assert_close(norms.cpu(), torch.ones(CFG.n_heads))


# -- the rest of freekv.py (docs/mutation.md, freekv): its statistics, construction and checks --

def prompt(policy, T=30, seed=3):
    """Prefill every layer of `policy` with random q, k, v (1, H, T, D) of T tokens (CFG's heads) -> q, k, v."""
    g, D = torch.Generator().manual_seed(seed), CFG.head_dim
    q, k, v = (torch.randn(1, H, T, D, generator=g) for H in (CFG.n_heads, CFG.n_kv_heads, CFG.n_kv_heads))
    for layer in policy.layers:
        layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
    policy.end_step()
    return q, k, v


def test_the_speculation_hit_rate_counts_every_head_of_every_comparison():
    """speculative_exact_rate = the KV heads whose q_{t-1} pages (the slots) equal q_t's, over the
    heads compared, summed over comparisons; none compared yet: nan."""
    policy = make(SPEC).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64)
    assert math.isnan(policy.stats()["speculative_exact_rate"])
    layer = policy.layers[0]
    held = layer.select(prompt(policy)[0][:, :, -1].to(DEVICE))  # (Hkv, K): what prefill recalled into the slots
    other = held.clone()
    other[0, 0] = -1  # KV head 0 one page short: not the slots' pages
    for selection in (held, held, other):
        layer.count_speculation(selection)
    assert (layer.spec_equal, layer.spec_compared) == (5, 6)
    assert policy.stats()["speculative_exact_rate"] == 5 / 6


def test_the_step_counts_and_rates_count_only_steps_that_choose():
    """Heads are judged (C_m < tau) and speculation compared only at steps with more candidates
    than K (the transcription's paging says which); correction_step_rate = correcting layer-steps /
    layer-steps, pages_recalled_per_step = pages recalled / decode steps (prefill's end_step not
    one). An 18-token prompt leaves 2 candidates, K = 3: steps at L = 19 .. 24 choose nothing
    (L = 21 .. 24 with exactly K; pages leave the window at 20 and 24), L = 25 .. 29 choose. The
    query flips sign (cos -1 < tau) at L = 19, 22, 25, 28 and repeats (cos 1) at the others: 2
    correcting steps (25; 28, where a page also leaves the window) and 3 speculating ones."""
    policy = make(SPEC).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64)
    assert (policy.stats()["correction_step_rate"], policy.stats()["pages_recalled_per_step"]) == (0.0, 0.0)
    q, k, v = prompt(policy, T=18)
    q = q[:, :, -1]  # (1, Hq, D)
    paper = PaperFreeKV(CFG.n_groups)
    paper.prefill(q[0], k[0], v[0])
    g, D, layer, choosing = torch.Generator().manual_seed(4), CFG.head_dim, policy.layers[0], 0
    for L in range(19, 30):
        q = -q if L % 3 == 1 else q
        k, v = (torch.randn(1, CFG.n_kv_heads, 1, D, generator=g) for _ in range(2))
        layer.decode(q[:, :, None].to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
        policy.end_step()
        paper.decode(q[0], k[0, :, 0], v[0, :, 0])
        choosing += paper.choosing
    Hkv, s, recalled = CFG.n_kv_heads, policy.stats(), layer.kv.pages_recalled
    assert choosing == 5 and (layer.head_steps, layer.spec_compared) == (Hkv * 5, Hkv * 5)
    assert (layer.corrected_steps, layer.decode_steps) == (2, 11) and s["correction_step_rate"] == 2 / 11
    assert recalled > 0 and s["pages_recalled_per_step"] == recalled / 11


def test_the_stores_take_the_policys_dtype_backend_and_shared_staging():
    """Every layer's host pages, device pool and the one staging pair (shared by all layers, which
    recall one after another) hold the policy's dtype; the store runs the policy's backend."""
    cfg = ModelConfig(**{**CFG.__dict__, "n_layers": 2})
    policy = make(SPEC + ",backend=reference").bind(cfg, device=DEVICE, dtype=torch.bfloat16, max_len=64)
    staging = policy.staging
    assert {t.dtype for t in staging.host + staging.dev} == {torch.bfloat16}
    for layer in policy.layers:
        assert layer.kv.staging is staging and layer.kv.backend == "reference"
        assert layer.pages.host.dtype == layer.kv.pool.k_pages.dtype == torch.bfloat16


def test_the_worker_runs_in_the_background_only_where_it_may_and_outlives_a_bind():
    """overlap=true selects on a background thread for speculative eager runs only (reference is
    the readable form; plain Quest selects on the critical path); a new bind keeps the thread."""
    policy = make(SPEC).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64)
    worker = policy.worker
    assert worker.background is True
    assert policy.bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64).worker is worker
    assert threads(policy) == 1
    for other in (",backend=reference", ",overlap=false", ",speculative=false"):  # no thread beside the model
        assert threads(make(SPEC + other).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64)) == 0


def test_the_host_tier_holds_max_len_and_the_selection_the_context():
    """The host tier is preallocated for max_len tokens in whole pages; a budget past the context
    selects at most every page of it (it then costs what full KV costs)."""
    policy = make(SPEC).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=61)
    assert policy.layers[0].allocated_host_tokens() == math.ceil(61 / P) * P == 64
    big = make(SPEC.replace(f"budget={SINK + WINDOW + P + K * P}", "budget=4096"))
    assert big.bind(CFG, device=DEVICE, dtype=torch.float32, max_len=61).n_select == math.ceil(61 / P)


def test_the_budget_skip_layers_and_sliding_window_edges():
    """budget >= sink + window + 2 page_size (one page short is refused); skip_layers may be every
    layer; a sliding window of exactly max_len is no window."""
    with pytest.raises(ValueError, match="at least one selected page"):
        make(f"freekv:page_size={P},sink={SINK},window={WINDOW},budget={SINK + WINDOW + P}")
    cfg = ModelConfig(**{**CFG.__dict__, "n_layers": 2})
    policy = make(SPEC + ",skip_layers=2").bind(cfg, device=DEVICE, dtype=torch.float32, max_len=64)
    assert [type(layer).__name__ for layer in policy.layers] == ["FullLayer", "FullLayer"]
    make(SPEC).bind(ModelConfig(**{**CFG.__dict__, "sliding_window": 64}), device=DEVICE, dtype=torch.float32,
                    max_len=64)
    whole = r"^freekv does not combine with a sliding-window model \(Mistral\) shorter than max_len$"
    with pytest.raises(ValueError, match=whole):
        make(SPEC).bind(ModelConfig(**{**CFG.__dict__, "sliding_window": 63}), device=DEVICE, dtype=torch.float32,
                        max_len=64)

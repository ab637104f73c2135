"""freekv: group-consistent selection (every query head of a GQA group reads its KV head's pages,
the budget holds, the sink pages and the last `window` tokens are always read) against an oracle
that rebuilds the digests from the raw keys; speculation (pages chosen with q_{t-1}) and per-head
correction (tau: none, all, or some KV heads of a step); a budget covering the context equals
full KV (a small random model and SmolLM2); stats; parameter errors."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.config import ModelConfig
from minikv.kernels.page_scores import reference as ps_reference
from minikv.models.attention import dense_attention
from minikv.policies import make

from ..fixtures import DEVICE, ITEMS_PROMPT, greedy_logits

TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                   n_heads=6, n_kv_heads=2, head_dim=16, max_position_embeddings=4096, rotary_dim=16)


def oracle_scores(q, keys, P, n_sink, n_window, group_reduce="softmax_mean", digest="minmax"):
    """The page scores of every candidate page, from scratch and in float64, nothing of minikv's
    digests or scores used: q (1, Hq, D), keys (1, Hkv, L, D) of every token so far -> (Hkv, n)
    for the n pages before the window. Each page's box per channel: Quest's lo = min_t k_t, hi =
    max_t k_t (minmax, quant2) or ArkVale's c +- mean_t |k_t - c|, c = (lo + hi) / 2; a query
    head's weight P_h[n] = sum_d max(q_d lo_d, q_d hi_d), or with quant2 (1/s) log sum_t exp(s q .
    k^_t), k^_t the nearest of 4 levels across the box per channel; the group's score: each head's
    own softmax over the pages (of s P_h, s = 1/sqrt(D)), then their mean (softmax_mean, FreeKV's),
    or the mean or max of P_h."""
    Hkv, L, D = keys.shape[1], keys.shape[2], keys.shape[3]
    n_cand = max(0, -(-L // P) - n_sink - n_window)
    G, s = q.shape[1] // Hkv, 1 / math.sqrt(D)
    out = torch.zeros(Hkv, n_cand, dtype=torch.float64)
    if n_cand == 0:
        return out
    pages = keys[0, :, n_sink * P:(n_sink + n_cand) * P].double().reshape(Hkv, n_cand, P, D)
    for m in range(Hkv):
        lo, hi = pages[m].amin(1), pages[m].amax(1)  # (n, D)
        if digest == "arkvale":
            centre = (lo + hi) / 2
            radius = (pages[m] - centre[:, None]).abs().mean(1)
            lo, hi = centre - radius, centre + radius
        weights = []
        for j in range(G):
            qh = q[0, m * G + j].double()
            if digest == "quant2":
                width = (hi - lo)[:, None]  # (n, 1, D)
                levels = lo[:, None, :, None] + torch.arange(4.0, dtype=torch.float64) * width[..., None] / 3
                k_hat = lo[:, None] + (pages[m][..., None] - levels).abs().argmin(-1) * width / 3  # (n, P, D)
                weights.append(torch.logsumexp(s * (k_hat @ qh), -1) / s)
            else:
                weights.append(torch.maximum(qh * lo, qh * hi).sum(-1))  # Quest's bound, (n,)
        if group_reduce == "softmax_mean":  # softmax per head first, then the group mean
            heads = [torch.exp(s * w - (s * w).max()) for w in weights]
            out[m] = sum(e / e.sum() for e in heads) / G
        elif group_reduce == "mean":
            out[m] = sum(weights) / G
        else:
            out[m] = torch.stack(weights).amax(0)
    return out


def oracle_pages(q, keys, P, n_sink, n_window, K, group_reduce="softmax_mean", digest="minmax"):
    """The candidate pages a query selects, from oracle_scores: (Hkv, K) candidate numbers, the
    top K per KV head (equal scores: the lower page), -1 pads."""
    scores = oracle_scores(q, keys, P, n_sink, n_window, group_reduce, digest)
    out = torch.full((keys.shape[1], K), -1)
    for m, row in enumerate(scores.tolist()):
        top = sorted(range(len(row)), key=lambda n: (-row[n], n))[:K]
        out[m, :len(top)] = torch.tensor(top, dtype=torch.int64)
    return out


def read_pages(row, P, n_sink, n_cand):
    """The candidate pages among the tokens a KV head read."""
    return sorted({t // P - n_sink for t in row if n_sink * P <= t < (n_sink + n_cand) * P})


def near_tie(scores, got, want):
    """True when the pages `got` and `want` of one KV head differ only across a near-tie: their
    scores, sorted, agree within float32's rounding of the policy (1e-5 of the row's scale)."""
    a = sorted((float(scores[n]) for n in got), reverse=True)
    b = sorted((float(scores[n]) for n in want), reverse=True)
    scale = float(scores.abs().max()) if scores.numel() else 1.0
    return len(a) == len(b) and all(abs(x - y) <= 1e-5 * scale for x, y in zip(a, b))


def visible_tokens(pages, L, P, n_sink, n_window):
    """Per KV head, the token indices attention must read: sink, selected pages, window pages
    (n_window ring pages: the window / P full ones and the partly filled last one)."""
    n_pages = -(-L // P)
    first_window = max(n_sink, n_pages - n_window)
    out = []
    for row in pages.tolist():
        toks = list(range(min(L, n_sink * P)))
        for c in sorted(c for c in row if c >= 0):
            toks += range((n_sink + c) * P, (n_sink + c + 1) * P)
        toks += range(first_window * P, L)
        out.append(toks)
    return out


def oracle_attention(q, keys, values, toks):
    """Dense attention where query heads of group m read exactly toks[m]."""
    G = q.shape[1] // keys.shape[1]
    outs = []
    for m, t in enumerate(toks):
        idx = torch.tensor(t)
        outs.append(dense_attention(q[:, m * G:(m + 1) * G], keys[:, m:m + 1, idx], values[:, m:m + 1, idx]))
    return torch.cat(outs, dim=1)


@st.composite
def freekv_cases(draw, modes=("quest", "speculate", "correct", "mixed")):
    P = draw(st.sampled_from([2, 3, 4]))
    sink, window, select = draw(st.integers(0, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 3))
    n_kv, group = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                      n_heads=n_kv * group, n_kv_heads=n_kv, head_dim=draw(st.sampled_from([8, 16, 20])),
                      max_position_embeddings=4096, rotary_dim=8)
    return dict(P=P, sink=sink * P, window=window * P, budget=(sink + window + 1 + select) * P, cfg=cfg,
                T=draw(st.integers(1, 30)), steps=draw(st.integers(1, 12)), mode=draw(st.sampled_from(modes)),
                group_reduce=draw(st.sampled_from(["softmax_mean", "mean", "max"])),
                digest=draw(st.sampled_from(["minmax", "arkvale", "quant2"])), seed=draw(st.integers(0, 2**16)))


def spec_of(case, backend="eager"):
    tau = {"quest": 0.9, "speculate": -1.0, "correct": 1.0, "mixed": 0.5}[case["mode"]]
    return (f"freekv:page_size={case['P']},budget={case['budget']},sink={case['sink']},window={case['window']},"
            f"tau={tau},speculative={case['mode'] != 'quest'},group_reduce={case['group_reduce']},"
            f"digest={case['digest']},backend={backend}")


def corrected_heads(q1, prev, G, tau):
    """(Hkv,) bools, the correction rule written out: mean over the group of cos(q_t, q_{t-1}) < tau."""
    cos = torch.nn.functional.cosine_similarity(q1[0], prev[0], dim=-1)  # (Hq,)
    return cos.view(-1, G).mean(1) < tau


def run_against_oracle(case, backend="eager", oracle=None):
    """Run the policy on random q, k, v and check every decode step against `oracle` (default
    oracle_pages): the pages it reads, its attention output and its own account of both."""
    oracle = oracle or oracle_pages
    cfg = case["cfg"]
    # the policy on the test device, the oracle on the CPU: inputs go there, outputs come back
    policy = make(spec_of(case, backend)).bind(cfg, device=DEVICE, dtype=torch.float32, max_len=80)
    P, n_sink, n_window = case["P"], case["sink"] // case["P"], case["window"] // case["P"] + 1
    K, G, tau = policy.n_select, cfg.n_heads // cfg.n_kv_heads, policy.tau
    g = torch.Generator().manual_seed(case["seed"])
    keys, values, prev_q = [None] * cfg.n_layers, [None] * cfg.n_layers, [None] * cfg.n_layers
    for step in range(case["steps"] + 1):
        T = case["T"] if step == 0 else 1
        for i, layer in enumerate(policy.layers):
            q = torch.randn(1, cfg.n_heads, T, cfg.head_dim, generator=g)
            k = torch.randn(1, cfg.n_kv_heads, T, cfg.head_dim, generator=g)
            v = torch.randn(1, cfg.n_kv_heads, T, cfg.head_dim, generator=g)
            if step and case["mode"] == "mixed":  # some groups barely move (kept), the others jump
                steady = (torch.rand(cfg.n_kv_heads, generator=g) < 0.5).repeat_interleave(G)  # (Hq,)
                q[0, steady, 0] = prev_q[i][0, steady] + 0.05 * q[0, steady, 0]
            keys[i] = k if step == 0 else torch.cat((keys[i], k), 2)
            values[i] = v if step == 0 else torch.cat((values[i], v), 2)
            if step == 0:
                layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
                prev_q[i] = q[:, :, -1]
                continue
            out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None).cpu()
            q1 = q[:, :, 0]
            # per KV head: quest and a corrected head read the pages q_t chooses; speculation reads
            # those q_{t-1} chose
            if case["mode"] == "quest":
                fresh = torch.ones(cfg.n_kv_heads, dtype=torch.bool)
            else:
                fresh = corrected_heads(q1, prev_q[i], G, tau)
            args = (keys[i], P, n_sink, n_window, K, case["group_reduce"], case["digest"])
            pages = torch.where(fresh[:, None], oracle(q1, *args), oracle(prev_q[i], *args))
            L = keys[i].shape[2]
            # a near-tie the policy's float32 broke the other way: its pages hold the same scores
            n_cand = max(0, -(-L // P) - n_sink - n_window)
            for m, row in enumerate(layer.attended_indices().tolist()):
                got, want = read_pages(row, P, n_sink, n_cand), sorted(c for c in pages[m].tolist() if c >= 0)
                if got != want:
                    scores = oracle_scores(q1 if fresh[m] else prev_q[i], *args[:4], *args[5:])[m]
                    assert near_tie(scores, got, want), f"step {step}, layer {i}, KV head {m}: pages {got}, not {want}"
                    pages[m] = torch.tensor(got + [-1] * (K - len(got)))
            toks = visible_tokens(pages, L, P, n_sink, n_window)
            # group-consistent: every query head of group m reads toks[m], and nothing else
            torch.testing.assert_close(out[:, :, 0], oracle_attention(q1[:, :, None], keys[i], values[i], toks)[:, :, 0])
            # the policy's own account of what it read: the oracle's tokens, within the budget,
            # with every sink token and the last `window` tokens
            read = layer.attended_indices()  # (Hkv, n)
            for m, row in enumerate(read.tolist()):
                got = [t for t in row if t >= 0]
                assert sorted(got) == sorted(toks[m]) and len(got) <= case["budget"]
                assert set(range(min(L, case["sink"]))) <= set(got)
                assert set(range(max(0, L - case["window"]), L)) <= set(got)
            assert layer.device_tokens() <= case["budget"]  # (after the step's roll and background recall)
            prev_q[i] = q1
        policy.end_step()
    return policy


@settings(max_examples=25)
@given(case=freekv_cases())
def test_group_consistent_selection_budget_sink_window_hold(case):
    policy = run_against_oracle(case)
    s = policy.stats()
    assert 0 <= s["correction_rate"] <= 1 and s["pages_recalled"] >= 0
    if case["mode"] == "correct" and sum(getattr(layer, "head_steps", 0) for layer in policy.layers):
        assert s["correction_rate"] == 1.0  # cos < 1 for random queries: every head corrected
    if case["mode"] == "speculate":
        assert s["correction_rate"] == 0.0


@settings(max_examples=8)
@given(case=freekv_cases())
def test_group_consistent_selection_triton_backend_matches_oracle(case):
    case.update(steps=min(case["steps"], 5))
    run_against_oracle(case, backend="triton")


def accept_reference_backend(mp):
    """backend=reference (every operation by its reference; attention over the pool by gathering
    its pages, then dense) in the spec, whether or not the spec parser lists it yet."""
    import minikv.kernels as kernels
    if "reference" not in kernels.BACKENDS:
        mp.setattr(kernels, "BACKENDS", (*kernels.BACKENDS, "reference"))


@settings(max_examples=8)
@given(case=freekv_cases())
def test_reference_backend_matches_oracle_and_eager(case):
    """backend=reference reads the pool through the paged-attention reference (gather, dense),
    eager through pool_attention: both match the oracle, and they choose and recall the same."""
    with pytest.MonkeyPatch.context() as mp:
        accept_reference_backend(mp)
        ref = run_against_oracle(case, backend="reference")
    eager = run_against_oracle(case)
    keys = ("pages_recalled", "correction_rate", "device_tokens", "bytes_to_device")
    assert [ref.stats()[k] for k in keys] == [eager.stats()[k] for k in keys]


def test_the_group_consistent_oracle_takes_each_heads_softmax_before_the_mean():
    """A fixed case of FreeKV's reduction (softmax_mean, groups of 3 query heads, Quest's min/max
    box), whatever hypothesis draws: every step's pages and output are the independent oracle's,
    a softmax over the pages per query head, then the group mean. A mean of P_h taken without
    each head's softmax (group_reduce=mean) chooses other pages here, and the oracle says so."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                      n_heads=6, n_kv_heads=2, head_dim=16, max_position_embeddings=4096, rotary_dim=8)
    case = dict(P=2, sink=2, window=2, budget=12, cfg=cfg, T=40, steps=12, mode="quest",
                group_reduce="softmax_mean", digest="minmax", seed=11)
    run_against_oracle(case)
    with pytest.raises(AssertionError, match="pages"):
        run_against_oracle(case, oracle=lambda q, *args: oracle_pages(q, *args[:5], "mean", args[6]))


def test_mixed_correction_corrects_some_heads_and_not_others():
    """A fixed mixed case, so that the per-head path is exercised whatever hypothesis draws:
    over the run some KV heads are corrected and others keep their speculative pages."""
    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                      n_heads=6, n_kv_heads=3, head_dim=16, max_position_embeddings=4096, rotary_dim=8)
    case = dict(P=2, sink=2, window=2, budget=12, cfg=cfg, T=30, steps=10, mode="mixed",
                group_reduce="softmax_mean", digest="arkvale", seed=7)
    for backend in ("eager", "triton"):
        policy = run_against_oracle(case, backend)
        assert 0.2 < policy.stats()["correction_rate"] < 0.8


def tiny_model(seed=0):
    from minikv.models.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(TINY).eval().to(DEVICE)


@pytest.mark.parametrize("spec, message", [
    ("freekv:budget=100", "budget must be a non-negative multiple of page_size"),
    ("freekv:window=0", "window must be >= page_size"),
    ("freekv:budget=64", "at least one selected page"),
    ("freekv:tau=2", "tau"),
    ("freekv:group_reduce=median", "group_reduce"),
    ("freekv:digest=sphere", "digest"),
    ("freekv:skip_layers=-1", "skip_layers"),
    ("freekv:page_size=0", "page_size"),
])
def test_impossible_parameters(spec, message):
    with pytest.raises(ValueError, match=message):
        make(spec)


def test_skip_layers_keep_full_kv(device):
    policy = make("freekv:page_size=4,budget=24,sink=4,window=8,skip_layers=1").bind(
        TINY, device=device, dtype=torch.float32, max_len=90)
    assert type(policy.layers[0]).__name__ == "FullLayer" and type(policy.layers[1]).__name__ == "FreeKVLayer"
    with pytest.raises(ValueError, match="skip_layers"):
        make("freekv:skip_layers=3").bind(TINY, device=device, dtype=torch.float32, max_len=90)


def test_smollm2_retrieval_stats(smollm2):
    """SmolLM2, ~330 prompt tokens: a 128 token budget retrieves (pages recalled, speculation
    counted, budget held). A covering budget giving full KV's logits: test_contract's matrix."""
    model, tok = smollm2
    ids = torch.tensor([tok.encode(ITEMS_PROMPT)], device=DEVICE)
    T = ids.shape[1]
    assert 250 < T < 500
    _, policy = greedy_logits(model, ids, "freekv:budget=128", 5)
    s = policy.stats()
    assert s["device_tokens_peak"] <= 128 and s["host_tokens"] >= T - 128 - 32
    assert s["pages_recalled"] > 0 and 0 <= s["correction_rate"] <= 1
    assert 0 <= s["speculative_exact_rate"] <= 1


def test_smollm2_retrieves_a_passkey_that_a_window_of_the_same_budget_loses(smollm2):
    """About 1,200 tokens, key at 30% depth: freekv with a 128-token budget (sink, window and two
    selected pages) brings the key's page back and answers it; StreamingLLM holding the same 128
    tokens has dropped it."""
    from minikv.bench.passkey import build_prompt, draw_key, score
    from minikv.generate import generate

    model, tok = smollm2
    key = draw_key(0)
    ids = build_prompt(tok, 1200, 0.3, key)
    found = generate(model, tok, ids, policy="freekv:budget=128", max_new_tokens=7, stop_at_eos=False)
    assert score(found.text, key), found.text
    assert found.stats["device_tokens_peak"] <= 128 and found.stats["pages_recalled"] > 0
    lost = generate(model, tok, ids, policy="streaming:sink=4,window=124,R=1,slack=0,max_drop=0",
                    max_new_tokens=7, stop_at_eos=False)
    assert not score(lost.text, key), lost.text


def test_smollm2_default_digest_finds_a_natural_text_needle_arkvales_box_loses(smollm2):
    """compare's niah_single_1 on natural text (pydoc), 4,096 tokens, seed 0, budget 256 (6% of
    the KV): full KV answers; ArkVale's box (digest=arkvale, which FreeKV's code builds on) ranks
    the needle's page out of the top K and answers another number; the default, quant2, ranks pages by their coded
    keys' attention and answers as full KV does (docs/freekv.md: 17 of 20 such needles against
    the box's 3)."""
    from minikv.bench.tasks import make_instance, string_match_all
    from minikv.generate import generate

    model, tok = smollm2
    inst = make_instance("niah_single_1", tok, 4096, 0, haystack="pydoc")
    score = {}
    for spec in ("full", "freekv:budget=256,digest=arkvale", "freekv:budget=256"):
        r = generate(model, tok, inst.ids, policy=spec, max_new_tokens=inst.max_new_tokens, stop_at_eos=False)
        score[spec] = string_match_all([r.text], [inst.answers])
    assert make("freekv").digest == "quant2"
    assert score == {"full": 100.0, "freekv:budget=256,digest=arkvale": 0.0, "freekv:budget=256": 100.0}


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("depth", [0.1, 0.3, 0.5, 0.7, 0.9])
def test_smollm2_passkey_4k_budget_256(smollm2, depth, seed):
    """docs/freekv.md's table: at 4,000 tokens with a 256-token budget, freekv with ArkVale digests
    finds the key in all 15 trials, as full KV does (Quest's min/max misses depth 0.7, seed 0,
    at budgets 256 and 512: its page bound hides the key's page)."""
    from minikv.bench.passkey import build_prompt, draw_key, score
    from minikv.generate import generate

    model, tok = smollm2
    key = draw_key(seed)
    ids = build_prompt(tok, 4000, depth, key)
    r = generate(model, tok, ids, policy="freekv:budget=256,digest=arkvale", max_new_tokens=7, stop_at_eos=False)
    assert score(r.text, key), r.text


def exact_top_pages(q, host, n, G, K, among=None):
    """The K candidate pages (of `among`, default all n) with the most exact attention mass, per KV
    head, a loop over heads: softmax over the listed pages' tokens per query head, each page's
    share summed, the group's mean."""
    out = []
    for h in range(host.shape[1]):
        pages = list(range(n)) if among is None else among[h]
        keys = host[pages, h, 0].float()  # (S, P, D)
        qs = q[0, h * G:(h + 1) * G].float().to(keys.device)  # (G, D), beside the host pages
        p = (torch.einsum("gd,spd->gsp", qs, keys) / math.sqrt(q.shape[-1])).flatten(1).softmax(-1)
        mass = p.view(G, len(pages), -1).sum(-1).mean(0)  # (S,)
        out.append(sorted(pages[i] for i in mass.topk(K).indices.tolist()))
    return out


@pytest.mark.parametrize("rescore", [2, 100])
def test_rescore_keeps_the_shortlisted_pages_with_the_most_exact_attention(rescore):
    # beyond the paper: the box bound shortlists rescore x K pages, the keys' exact attention picks K
    spec = f"freekv:page_size=4,sink=4,window=4,budget=20,digest=arkvale,rescore={rescore}"  # K = 2 pages
    policy = make(spec).bind(TINY, device=DEVICE, dtype=torch.float32, max_len=80)
    plain = make("freekv:page_size=4,sink=4,window=4,budget=20,digest=arkvale").bind(
        TINY, device=DEVICE, dtype=torch.float32, max_len=80)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 64, 16, generator=g).to(DEVICE) for h in (6, 2, 2))
    k[0, :, 30] *= 4.0  # one loud key: the bounds favour its page, whatever its attention
    layer, base = policy.layers[0], plain.layers[0]
    layer.prefill(q, k, v, None)
    base.prefill(q, k, v, None)
    n, G = layer.kv.n_cand, 3
    q_new = torch.randn(1, 6, 16, generator=g).to(DEVICE)
    shortlist = [row[:min(n, 2 * rescore)] for row in
                 ps_reference.page_scores(q_new, layer.pages.lo[:, :, :n], layer.pages.hi[:, :, :n],
                                          layer.pages.n_valid, min(n, 2 * rescore), layer.scale)[1][0].tolist()]
    chosen = [sorted(row) for row in layer.select(q_new).tolist()]
    assert chosen == exact_top_pages(q_new, layer.pages.host, n, G, 2, among=shortlist)
    if rescore == 100:  # every candidate shortlisted: the exact best pages of all
        assert chosen == exact_top_pages(q_new, layer.pages.host, n, G, 2)
        assert chosen != [sorted(row) for row in base.select(q_new).tolist()]  # and not the bound's
    assert policy.tiers.bytes_to_device > plain.tiers.bytes_to_device  # the shortlist's keys crossed, counted

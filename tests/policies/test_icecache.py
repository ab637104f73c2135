"""icecache: GQA merge (every query head of a group reads the same pages, the budget holds, sink
and window always present) against an oracle that ranks the tree's pages from the raw keys;
insertion invariant at the policy (every token that left the window sits in exactly one host
page, bit for bit); IceCache(reuse); with a budget covering the whole context, icecache's logits
equal full KV's (a random checkpoint from reference/models and SmolLM2); retrieval on SmolLM2;
stats, attended_indices and parameter errors."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.config import ModelConfig
from minikv.models.attention import dense_attention
from minikv.policies import make
from minikv.policies.icecache.counts import tree_page
from minikv.policies.icecache.search import merge_group
from minikv.policies.tiers import backend_on

from ..fixtures import DEVICE, ITEMS_PROMPT, greedy_logits

TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=4,
                   n_heads=6, n_kv_heads=2, head_dim=16, max_position_embeddings=4096, rotary_dim=16)
EXHAUSTIVE = "fov=100000,prop=1"


def oracle_pages(layer, q, keys, n_tree):
    """The pages an exhaustive search selects, from scratch: per query head, the tree's pages
    ranked by the largest q.k over their keys (the keys the layer holds: tree ids < n_tree),
    the first K; the group's lists interleaved, the first K distinct. -> (Hkv, K), -1 pads."""
    f, K, G = layer.forest, layer.K, q.shape[1] // layer.forest.H
    P0 = layer.kv.n_sink * layer.kv.P  # tree id t is token P0 + t
    if max(f.n_pages) <= K:
        return torch.tensor([list(range(n)) + [-1] * (K - n) for n in f.n_pages])
    lists = []
    for j in range(q.shape[1]):
        h = j // G
        best = []
        for p in range(f.n_pages[h]):
            toks = [t for t in tree_page(f, h, p) if t < n_tree]
            best.append(max(float(keys[0, h, P0 + t] @ q[0, j]) for t in toks) if toks else float("-inf"))
        best = torch.tensor(best)
        top = best.topk(min(K, len(best))).indices
        top = torch.where(best[top] > float("-inf"), top, -1).tolist()
        lists.append(top + [-1] * (K - len(top)))
    return torch.tensor([merge_group(lists[h * G:(h + 1) * G], K) for h in range(f.H)])


def tokens_read(layer, pages, L, n_cand):
    """Per KV head, the tokens attention must read: sink, the pages' tokens, window."""
    kv = layer.kv
    P, n_sink = kv.P, kv.n_sink
    out = []
    for h, row in enumerate(pages.tolist()):
        toks = list(range(min(L, n_sink * P)))
        for p in row:
            if p >= 0:
                toks += [n_sink * P + t for t in tree_page(layer.forest, h, p) if t < n_cand * P]
        toks += range((n_sink + n_cand) * P, L)
        out.append(toks)
    return out


def group_attention(q, keys, values, toks):
    """Dense attention where the query heads of group m read exactly toks[m]."""
    G = q.shape[1] // keys.shape[1]
    outs = [dense_attention(q[:, m * G:(m + 1) * G], keys[:, m:m + 1, torch.tensor(t)], values[:, m:m + 1, torch.tensor(t)])
            for m, t in enumerate(toks)]
    return torch.cat(outs, dim=1)


def check_host_pages(layer, keys, values):
    """Every token that left the window sits in exactly one host page, bit for bit."""
    kv, f, pages = layer.kv, layer.forest, layer.kv.candidates
    P0, n_tree = kv.n_sink * kv.P, kv.n_cand * kv.P
    for h in range(kv.Hkv):
        seen = 0
        for p in range(f.n_pages[h]):
            toks = [t for t in tree_page(f, h, p) if t < n_tree]
            assert int(pages.fill[h, p]) == len(toks) <= kv.P
            idx = torch.tensor(toks, dtype=torch.int64) + P0
            assert torch.equal(pages.host[p, h, 0, :len(toks)], keys[0, h, idx])
            assert torch.equal(pages.host[p, h, 1, :len(toks)], values[0, h, idx])
            seen += len(toks)
        assert seen == n_tree


@st.composite
def icecache_cases(draw):
    P = draw(st.sampled_from([2, 4]))
    sink, window, select = draw(st.integers(0, 2)), draw(st.integers(1, 3)), draw(st.integers(1, 4))
    return dict(P=P, sink=sink * P, window=window * P, budget=(sink + window + select) * P,
                T=draw(st.integers(1, 120)), steps=draw(st.integers(1, 12)), reuse=draw(st.integers(1, 3)),
                exhaustive=draw(st.booleans()), fov=draw(st.sampled_from([None, 1, 2])), seed=draw(st.integers(0, 2**16)))


def spec_of(case, backend="eager"):
    search = EXHAUSTIVE if case["exhaustive"] else f"fov={case['fov']}" if case.get("fov") else ""
    return (f"icecache:page_size={case['P']},budget={case['budget']},sink={case['sink']},window={case['window']},"
            f"skip_layers=1,reuse_every={case['reuse']},backend={backend}" + (f",{search}" if search else ""))


def check_slot_lengths_at_attention(layer, log):
    """Wrap layer.kv.attend: when attention reads the pool, every selected slot's valid length is
    its page's fill (0 when empty), whatever the last recall did (copied pages, or only dropped
    some). Each recall is logged as (pages copied, slots emptied) into `log`."""
    kv, attend, recall = layer.kv, layer.kv.attend, layer.kv.recall

    def checked_attend(q):
        held = kv.resident  # (Hkv, K)
        fill = kv.candidates.fill.gather(1, held.clamp_min(0))
        want = torch.where(held >= 0, fill, 0)
        got = kv.pool.page_lens[0, :, kv.n_sink:kv.w0].to(torch.int64).cpu()  # beside the host's fills
        assert torch.equal(got, want), f"slot lengths {got.tolist()} != page fills {want.tolist()}"
        return attend(q)

    def logged_recall(selection, *args, **kwargs):
        before = kv.resident >= 0
        copied = recall(selection, *args, **kwargs)
        log.append((copied, int((before & (kv.resident < 0)).sum())))
        return copied

    kv.attend, kv.recall = checked_attend, logged_recall


def shrink_every_other_selection(layer):
    """Wrap layer.select: every other call returns the previous selection with its second half
    dropped, as a small field of view does on a long context when a search scores keys of fewer
    pages than the step before. The recall then copies nothing and only empties slots."""
    select, last, calls = layer.select, [None], [0]

    def shrunk(q):
        calls[0] += 1
        if calls[0] % 2 == 0 and last[0] is not None:
            out = last[0].clone()
            out[:, (out.shape[1] + 1) // 2:] = -1
        else:
            out = select(q)
        last[0] = out
        return out

    layer.select = shrunk


def run_against_oracle(case, backend="eager", recalls=None):
    # the policy on the test device, the oracle on the CPU: inputs go there, outputs come back
    policy = make(spec_of(case, backend)).bind(TINY, device=DEVICE, dtype=torch.float32, max_len=160)
    recalls = [] if recalls is None else recalls
    for layer in policy.layers[1:]:  # skip_layers=1
        check_slot_lengths_at_attention(layer, recalls)
        if case.get("shrink"):
            shrink_every_other_selection(layer)
    g = torch.Generator().manual_seed(case["seed"])
    n = TINY.n_layers
    keys, values, last_q = [None] * n, [None] * n, [None] * n
    for step in range(case["steps"] + 1):
        T = case["T"] if step == 0 else 1
        selected = {}  # anchor layer -> the pages its exhaustive search selects this step
        for i, layer in enumerate(policy.layers):
            q = torch.randn(1, TINY.n_heads, T, TINY.head_dim, generator=g)
            if step > 1 and case.get("drift") is not None:  # a query that barely moves from the last step's
                q = last_q[i] + case["drift"] * q
            last_q[i] = q
            k = torch.randn(1, TINY.n_kv_heads, T, TINY.head_dim, generator=g)
            v = torch.randn(1, TINY.n_kv_heads, T, TINY.head_dim, generator=g)
            keys[i] = k if step == 0 else torch.cat((keys[i], k), 2)
            values[i] = v if step == 0 else torch.cat((values[i], v), 2)
            on = [t.to(DEVICE) for t in (q, k, v)]
            if step == 0:
                layer.prefill(*on, torch.arange(T, device=DEVICE)[None])
                continue
            if i < 1:  # skip_layers: full KV
                layer.decode(*on, torch.tensor([[keys[i].shape[2] - 1]], device=DEVICE))
                assert layer.attended_indices() is None  # reads everything
                continue
            n_cand, L = layer.kv.n_cand, keys[i].shape[2]
            out = layer.decode(*on, None).cpu()
            read = layer.attended_indices()  # (Hkv, n) what the policy says it read
            toks = [sorted(t for t in row.tolist() if t >= 0) for row in read]
            # group-consistent: every query head of group m reads toks[m], and nothing else
            torch.testing.assert_close(out[:, :, 0], group_attention(q, keys[i], values[i], toks)[:, :, 0])
            P = case["P"]
            for t in toks:  # the budget holds; sink and window always present
                assert len(t) <= case["budget"] and len(set(t)) == len(t)
                assert set(range(min(L, case["sink"]))) <= set(t)
                assert set(range(max(case["sink"], (case["sink"] // P + n_cand) * P), L)) <= set(t)
            assert layer.device_tokens() <= case["budget"]
            if case["exhaustive"] and n_cand:
                if layer.anchor is None:
                    selected[i] = oracle_pages(layer, q[:, :, 0], keys[i], n_cand * P)
                anchor = i if layer.anchor is None else policy.layers.index(layer.anchor)
                want = tokens_read(layer, selected[anchor], L, n_cand)
                assert [sorted(t) for t in want] == toks
            check_host_pages(layer, keys[i], values[i])
        policy.end_step()
    return policy


@settings(max_examples=12)
@given(case=icecache_cases())
def test_gqa_merge_budget_sink_window_hold(case):
    policy = run_against_oracle(case)
    s = policy.stats()
    assert s["pages_recalled"] >= 0 and 0 < s["mean_page_fill"] <= 1 or s["host_tokens"] == 0


@settings(max_examples=1)
@given(case=icecache_cases())
def test_gqa_merge_triton_backend(case):
    case.update(steps=min(case["steps"], 2), T=min(case["T"], 30))
    run_against_oracle(case, backend="triton")


@pytest.mark.parametrize("fov", [1, 2])
def test_slot_lengths_equal_page_fills_when_a_recall_only_drops_pages(fov):
    """When the selection shrinks between steps (a small field of view on a long context: the
    search scores keys of fewer pages), a recall drops pages and copies none: the slots it keeps
    must still read their partly filled pages' true counts, not page_size."""
    recalls = []
    for seed in range(3):
        case = dict(P=4, sink=4, window=4, budget=4 * 6, T=100, steps=12, reuse=1, exhaustive=False, fov=fov,
                    shrink=True, seed=seed)
        run_against_oracle(case, recalls=recalls)
    assert any(copied == 0 and emptied for copied, emptied in recalls)  # the path was taken


def test_reuse_layers_share_the_anchor_tree_and_selection(device):
    """IceCache(reuse), reuse_every = 3 after 2 full layers: layers 2 and 5 own trees, 3-4 and 6
    reuse them (same pages, their own KV)."""
    cfg = ModelConfig(**{**TINY.__dict__, "n_layers": 7})
    policy = make("icecache:page_size=4,budget=32,sink=4,window=8,reuse_every=3").bind(
        cfg, device=device, dtype=torch.float32, max_len=200)
    kinds = [type(layer).__name__ for layer in policy.layers]
    assert kinds[:2] == ["FullLayer"] * 2 and set(kinds[2:]) == {"IceCacheLayer"}
    owners = [None if layer.anchor is None else policy.layers.index(layer.anchor) for layer in policy.layers[2:]]
    assert owners == [None, 2, 2, None, 5]
    assert policy.layers[3].forest is policy.layers[2].forest


def test_smollm2_retrieval_stats(smollm2):
    """SmolLM2, ~330 prompt tokens: a 96 token budget (sink 32, window 32, two retrieved pages)
    searches the trees (keys scored, pages recalled, budget held). A covering budget giving full
    KV's logits, and backend=reference decoding the default's tokens: test_contract's matrix."""
    model, tok = smollm2
    ids = torch.tensor([tok.encode(ITEMS_PROMPT)], device=DEVICE)
    T = ids.shape[1]
    assert 250 < T < 500
    _, policy = greedy_logits(model, ids, "icecache:budget=96", 5)
    s = policy.stats()
    assert s["device_tokens_peak"] <= (96 * 28 + 2 * (T + 5)) / 30  # 28 icecache layers, 2 full
    assert max(s["device_tokens_per_layer"][2:]) <= 96
    assert s["host_tokens"] >= (T - 64) * 28 / 30 - 16
    assert s["pages_recalled"] > 0 and 0 < s["keys_scored_fraction"] <= 1
    assert 0 < s["mean_page_fill"] <= 1
    read = policy.layers[10].attended_indices()
    assert read.shape[0] == 3 and ((read >= 0).sum(1) <= 96).all()
    assert policy.layers[0].attended_indices() is None


def test_smollm2_retrieves_a_passkey_with_a_small_budget(smollm2):
    """About 1,200 tokens, key at 30% depth: icecache with a 128-token budget (2 sink pages, 2
    window pages, 4 retrieved pages of 16) answers it."""
    from minikv.bench.passkey import build_prompt, draw_key, score
    from minikv.generate import generate

    model, tok = smollm2
    key = draw_key(0)
    ids = build_prompt(tok, 1200, 0.3, key)
    found = generate(model, tok, ids, policy="icecache:budget=128", max_new_tokens=7, stop_at_eos=False)
    assert score(found.text, key), found.text
    assert found.stats["pages_recalled"] > 0 and max(found.stats["device_tokens_per_layer"][2:]) <= 128


@pytest.mark.parametrize("spec, message", [
    ("icecache:budget=100", "budget must be a non-negative multiple of page_size"),
    ("icecache:window=0", "window must be >= page_size"),
    ("icecache:budget=64", "at least one retrieved page"),
    ("icecache:skip_layers=-1", "skip_layers"),
    ("icecache:reuse_every=0", "reuse_every"),
    ("icecache:fov=0", "fov"),
    ("icecache:prop=0", "prop"),
    ("icecache:prop=1.5", "prop"),
    ("icecache:batch=0", "batch"),
    ("icecache:page_size=0", "page_size"),
    ("icecache:simple=4", "need descent=greedy"),
    ("icecache:composite=2", "need descent=greedy"),
    ("icecache:descent=greedy", "batch=1"),
    ("icecache:ratio=1", "ratio"),
])
def test_impossible_parameters(spec, message):
    with pytest.raises(ValueError, match=message):
        make(spec)


def test_a_union_needs_a_page_per_query_head():
    """gqa=union gives each of a group's G query heads K // G pages: K < G cannot hold it."""
    with pytest.raises(ValueError, match="gqa=union gives each of a group's 3 query heads"):
        make("icecache:gqa=union,page_size=4,sink=4,window=8,budget=20").bind(TINY, device=DEVICE, dtype=torch.float32,
                                                                            max_len=100)


@pytest.mark.parametrize("rules, fast", [("promotion=random,gqa=union", True), ("paper", False)])
def test_the_papers_rules_choose_the_same_pages_on_every_backend(rules, fast):
    """promotion=random and gqa=union change only the tree's levels and the merge, so the batched
    search (backend eager) runs them and selects the reference's pages at every step; the greedy
    descent of icecache:paper has one form, pdci.py, which every backend runs (no batched search
    is built beside its trees)."""
    spec = f"icecache:{rules},page_size=4,sink=4,window=8,budget=36,skip_layers=0"
    runs = []
    for backend in ("eager", "reference"):
        policy = make(f"{spec},backend={backend}").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=500)
        assert all((layer.searcher is not None) == (fast and backend == "eager") for layer in policy.layers)
        g = torch.Generator().manual_seed(0)
        chosen = []
        for step in range(16):
            T = 460 if step == 0 else 1
            for layer in policy.layers:
                q, k, v = (torch.randn(1, H, T, TINY.head_dim, generator=g).to(DEVICE)
                           for H in (TINY.n_heads, TINY.n_kv_heads, TINY.n_kv_heads))
                (layer.prefill if step == 0 else layer.decode)(q, k, v, None)
                if step:
                    chosen.append(layer.selection.tolist())
            policy.end_step()
        runs.append(chosen)
    assert runs[0] == runs[1]
    assert any(-1 in row for sel in runs[0] for row in sel)  # the union is smaller than K at times


@settings(max_examples=4)
@given(case=icecache_cases())
def test_gqa_merge_reference_backend(case):
    """backend=reference (search.py's loops) holds the same budget, sink, window and, with
    exhaustive parameters, selects the oracle's pages."""
    case.update(steps=min(case["steps"], 4), T=min(case["T"], 60))
    run_against_oracle(case, backend="reference")


def test_on_cuda_the_host_tier_runs_eager_and_the_device_tier_its_backend():
    """icecache beside a GPU, checked without one: the tree's keys and the host pages stay on the
    host (the paper's Sec. 4.3), so the DCI scores and the gather into the pinned staging buffer
    run eager there, while the scatter into the slots and the paged attention run triton on the
    device. The routing is a pure function of (tier, backend, device); the policy is inspected
    with tiers that say "cuda", never run."""
    from types import SimpleNamespace

    assert backend_on("host", "triton", "cuda") == "eager"
    assert backend_on("device", "triton", "cuda") == "triton"
    assert [backend_on(tier, "triton", "cpu") for tier in ("host", "device")] == ["triton", "triton"]
    with pytest.raises(ValueError, match="tier"):
        backend_on("disk", "triton", "cpu")
    policy = make("icecache:page_size=4,budget=32,sink=4,window=8,backend=triton")
    policy.max_len, policy.tiers = 64, SimpleNamespace(device=torch.device("cuda"))
    policy.validate(TINY)
    assert (policy.search, policy.host_backend) == ("triton", "eager")
    # on this machine's test device both tiers run triton: the search's kernel, the gather's, the
    # scatter's and the attention's
    bound = make("icecache:page_size=4,budget=32,sink=4,window=8,skip_layers=0,backend=triton").bind(
        TINY, device=DEVICE, dtype=torch.float32, max_len=64)
    layer = bound.layers[0]
    host = "eager" if DEVICE.type == "cuda" else "triton"
    assert (layer.searcher.backend, layer.kv.gather_backend) == (host, host)
    assert (layer.kv.backend, layer.kv.pool.backend) == ("triton", "triton")

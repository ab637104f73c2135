"""icecache against test_icecache_paper's transcription where mutation testing (docs/mutation.md)
found wrong implementations the other tests pass: a short prompt, so the tree starts with no
page, then fewer pages than a step selects (a tree of at most k pages is read whole, without a
search), and grows past k while decoding; the pages recalled, summed over the steps; and the
tree's insert across promotions (levels by the counter, the nearest parent). Then the rest of
tree.py and policy.py: the build past one block of the parent product, its levels and pages, Eqs.
2-3 below norm 1, the prefill's output, the model's dtype, a budget past the tree, the seed, the
checks, the statistics and the bytes reported."""
import math
from dataclasses import replace

import pytest
import torch

from minikv.policies import make
from minikv.policies.icecache import search_fast
from minikv.policies.icecache.counts import CountedForest, forest_bytes, tree_page
from minikv.policies.icecache.promotion import level_of, levels_of, random_direction, random_directions
from minikv.policies.icecache.search import field_of_view, merge_group, page_lists, query
from minikv.policies.icecache.tree import DCIForest

from ..fixtures import DEVICE
from . import test_icecache_paper as paper
from .test_icecache import check_host_pages, run_against_oracle


def test_a_short_prompt_reads_every_page_until_the_tree_outgrows_k():
    rows, trees, _, policy = paper.run(paper.SPEC, T=6, steps=40, seed=2)
    paper.check(rows, trees)
    n_pages = {row.n_pages for row in rows}
    assert {0, 1, paper.K} <= n_pages and max(n_pages) > paper.K  # none, fewer than k, k, more
    # line 23's copies, summed over the steps: what the paged stores counted
    assert policy.stats()["pages_recalled"] == sum(layer.kv.pages_recalled for layer in policy.layers) > 0


def test_insert_promotes_by_the_counter_and_takes_the_nearest_older_parent():
    """DCIForest.insert across promotions (tree ids 99, 199, ... reach level 2; 499 level 3):
    every point's level is the counter's, whatever the chunks; the point that opens a level adopts
    the old top level; a level-1 point's parent is the nearest (largest sim, with c the running
    maximum norm as of its chunk) of the level-2 points inserted before it."""
    H, D, n, chunk = 2, 8, 620, 16
    g = torch.Generator().manual_seed(4)
    keys = torch.randn(H, n, D, generator=g, dtype=torch.float64) * (1 + torch.rand(H, n, 1, generator=g, dtype=torch.float64))
    forest = DCIForest(n_heads=H, head_dim=D, page_size=4, capacity=n, u=random_direction(D))
    forest.build(keys[:, :90])
    for a in range(90, n, chunk):
        forest.insert(keys[:, a:a + chunk])
    assert forest.level[:n].tolist() == levels_of(torch.arange(n)).tolist()
    assert forest.top == 3
    two = [t for t in range(n) if level_of(t) == 2]  # 99, 199, 299, 399, 599
    assert forest.parent[:, two].tolist() == [[499] * len(two)] * H and forest.parent[:, 499].tolist() == [-1] * H
    assert forest.parent[:, :99].tolist() == [[99] * 99] * H  # the top level when 99 opened level 2
    sq = keys.square().sum(-1)  # (H, n)
    for t in range(100, n):
        if level_of(t) != 1:
            continue
        end = min(n, 90 + (t - 90) // chunk * chunk + chunk)  # t's chunk was stored with c over keys[:, :end]
        c2 = sq[:, :end].amax(1, keepdim=True)  # (H, 1)
        older = torch.tensor([u for u in two + [499] if u < t and level_of(u) == 2])
        sim = (keys[:, t:t + 1] * keys[:, older]).sum(-1) + ((c2 - sq[:, t:t + 1]).sqrt() * (c2 - sq[:, older]).sqrt())
        got = forest.parent[:, t]
        for h in range(H):
            best = float(sim[h].max())
            assert int(got[h]) in older.tolist()
            assert float(sim[h, older.tolist().index(int(got[h]))]) >= best - 1e-4  # float32 near-ties aside


@pytest.mark.parametrize("backend", ["reference", "eager"])
def test_the_policys_field_of_view_reaches_the_search(backend):
    # a field of view of 1 node per level: each layer's select is PAGE-SELECT with that fov (the
    # reference search.page_lists, group-merged), and on this tree it chooses other pages than
    # the default fov would, so a select that dropped the policy's fov would be seen
    spec = (f"icecache:page_size={paper.P},sink={paper.SINK},window={paper.WINDOW},"
            f"budget={paper.SINK + paper.WINDOW + paper.K * paper.P},skip_layers=0,fov=1,prop=0.25,backend={backend}")
    T = 2400
    policy = make(spec).bind(paper.CFG, device=DEVICE, dtype=torch.float32, max_len=T + 1)
    layer, G = policy.layers[0], paper.CFG.n_groups
    g = torch.Generator().manual_seed(5)
    H, Hkv, D = paper.CFG.n_heads, paper.CFG.n_kv_heads, paper.CFG.head_dim
    q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
    f, K, differs = layer.forest, layer.K, 0
    for _ in range(8):
        q1 = torch.randn(1, H, D, generator=g)
        want = torch.tensor([merge_group(group, K) for group in page_lists(f, q1[0], K, 1, 0.25, policy.batch)])
        assert [set(row) - {-1} for row in layer.select(q1.to(DEVICE)).tolist()] == [set(row) - {-1} for row in want.tolist()]
        wide = torch.tensor([merge_group(group, K) for group in page_lists(f, q1[0], K, field_of_view(f.n), 0.25,
                                                                            policy.batch)])
        differs += [set(r) for r in want.tolist()] != [set(r) for r in wide.tolist()]
    assert differs  # the field of view changes the choice on this tree


# -- the rest of tree.py and policy.py (docs/mutation.md, "icecache", the second round) ---------------

def nearest_parent_gap(f, keys, h, level):
    """For head h's points on `level`: sim to the nearest point one level up minus sim to the
    parent the tree gave (0 where the parent is the nearest; float32 rounding aside), from the
    keys in float64 and the tree's c. -> (n_level,) float64; asserts each parent is one level up."""
    ids, up = f.level_ids(level), f.level_ids(level + 1)
    par = f.parent[h, ids]
    assert (f.level[par] == level + 1).all() and torch.isin(par, up).all(), "a parent is a point one level up"
    k, c2 = keys[h].double(), float(f.c[h]) ** 2
    sq = k.square().sum(-1)
    tail = (c2 - sq).clamp_min(0).sqrt()
    sim = k[ids] @ k[up].T + tail[ids, None] * tail[None, up]  # (n_level, n_up), Eq. 2's T_K distance as sim
    return sim.max(1).values - sim.gather(1, f.pos_in_level[par][:, None])[:, 0]


def test_build_gives_every_point_its_nearest_parent_past_one_block():
    """Algorithm 2 over more level-1 points than one block of the parent product (4,096): every
    point's parent is its nearest point one level up, on every level (the existing tests built at
    most 4,000 keys)."""
    H, D, n = 1, 8, 4400
    keys = torch.randn(H, n, D, generator=torch.Generator().manual_seed(6))
    f = DCIForest(n_heads=H, head_dim=D, page_size=16, capacity=n, u=random_direction(D))
    f.build(keys)
    assert f.level_ids(1).numel() > 4096 and f.top == 4
    for level in range(1, f.top):
        assert float(nearest_parent_gap(f, keys, 0, level).max()) < 1e-4


def test_levels_follow_the_forests_counter_and_pages_the_projections():
    """Algorithm 2 and the insert with the forest's own promotion periods (first 7, nxt 2, not the
    module's defaults): each point's level is the counter's, built or inserted; the build cuts each
    node (the children of one parent) into pages of at most P in projection order, ties (duplicate
    keys) to the older point."""
    H, D, n, n0, P = 2, 8, 600, 400, 4
    g = torch.Generator().manual_seed(7)
    keys = torch.randn(H, n // 3, D, generator=g)[:, torch.randint(0, n // 3, (n,), generator=g)]  # duplicates
    f = DCIForest(n_heads=H, head_dim=D, page_size=P, capacity=n, u=random_direction(D), first=7, nxt=2)
    f.build(keys[:, :n0])
    for h in range(H):
        want = set()
        for parent in set(f.parent[h, :n0].tolist()):
            children = sorted((t for t in range(n0) if int(f.parent[h, t]) == parent),
                              key=lambda t: (float(f.proj[h, t]), t))
            want |= {tuple(children[i:i + P]) for i in range(0, len(children), P)}
        assert {tuple(tree_page(f, h, p)) for p in range(f.n_pages[h])} == want
    for a in range(n0, n, 50):
        f.insert(keys[:, a:a + 50])
    levels = levels_of(torch.arange(n), 7, 2)
    assert f.level[:n].tolist() == levels.tolist() and f.top == int(levels.max()) == 8  # t = 447: 7 * 2^6


def test_the_transform_of_keys_and_queries_shorter_than_one():
    """Eqs. 2-3 do not assume norms of 1: keys all shorter than 1 give c = their largest norm
    (< 1) and u.T_K(k) at that c; T_Q(q) = q/|q| makes a query's projection independent of its
    length, however short."""
    D = 8
    g = torch.Generator().manual_seed(8)
    keys = torch.randn(1, 50, D, generator=g) * 0.02
    f = DCIForest(n_heads=1, head_dim=D, page_size=4, capacity=50, u=random_direction(D))
    f.build(keys)
    c = keys[0].double().norm(dim=-1).max()
    assert float(c) < 1 and abs(float(f.c[0]) - float(c)) < 1e-9
    k = keys[0].double()
    t_k = torch.cat((k / c, (1 - k.square().sum(-1, keepdim=True) / c**2).clamp_min(0).sqrt()), -1)
    torch.testing.assert_close(f.proj[0, :50].double(), t_k @ f.u.double(), atol=1e-5, rtol=0)
    q = torch.randn(3, D, generator=g)
    torch.testing.assert_close(f.query_projection(q * 1e-3), f.query_projection(q))


def test_the_prefill_is_causal_attention_and_reads_nothing_after():
    """Line 8: the prefill's output is dense causal attention over the prompt (each query head on
    its group's KV head); before any decode step the layer reports no read (None)."""
    policy = make(paper.SPEC).bind(paper.CFG, device=DEVICE, dtype=torch.float32, max_len=40)
    layer, G = policy.layers[0], paper.CFG.n_groups
    H, Hkv, D, T = paper.CFG.n_heads, paper.CFG.n_kv_heads, paper.CFG.head_dim, 30
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(1, h, T, D, generator=g) for h in (H, Hkv, Hkv))
    out = layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
    assert layer.attended_indices() is None
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for j in range(H):
        s = (q[0, j] @ k[0, j // G].T / D**0.5).masked_fill(~causal, float("-inf"))
        torch.testing.assert_close(out[0, j].cpu(), torch.softmax(s, -1) @ v[0, j // G])


def test_a_bfloat16_model_keeps_its_kv_in_bfloat16():
    """The host pages, the device pool and the output are the model's dtype (bfloat16, half the
    bytes of float32), the offloaded tokens sit in their host pages bit for bit, and the output is
    attention over what the layer says it read."""
    T, steps, bf = 40, 12, torch.bfloat16
    policy = make(paper.SPEC).bind(paper.CFG, device=DEVICE, dtype=bf, max_len=T + steps)
    layer, G = policy.layers[0], paper.CFG.n_groups
    H, Hkv, D = paper.CFG.n_heads, paper.CFG.n_kv_heads, paper.CFG.head_dim
    g = torch.Generator().manual_seed(10)
    draw = lambda *shape: torch.randn(*shape, generator=g).to(bf)  # noqa: E731
    keys, values = draw(1, Hkv, T, D), draw(1, Hkv, T, D)
    layer.prefill(draw(1, H, T, D).to(DEVICE), keys.to(DEVICE), values.to(DEVICE), None)
    for _ in range(steps):
        q, k, v = draw(1, H, 1, D), draw(1, Hkv, 1, D), draw(1, Hkv, 1, D)
        keys, values = torch.cat((keys, k), 2), torch.cat((values, v), 2)
        out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
        assert out.dtype == bf
        for j, row in enumerate(layer.attended_indices()[torch.arange(H) // G].tolist()):
            t = torch.tensor([i for i in row if i >= 0])
            kk, vv = keys[0, j // G, t].float(), values[0, j // G, t].float()
            want = torch.softmax(q[0, j, 0].float() @ kk.T / D**0.5, -1) @ vv
            torch.testing.assert_close(out[0, j, 0].float().cpu(), want, atol=2e-2, rtol=2e-2)
        policy.end_step()
    assert layer.kv.candidates.host.dtype == bf and layer.kv.pool.k_pages.dtype == bf and layer.kv.n_cand
    check_host_pages(layer, keys, values)


def test_a_budget_past_the_tree_reads_every_page_and_no_more():
    """A budget of more pages than a tree over the context can hold selects as many as it can
    hold (DCIForest.max_pages: the full pages plus one open page per parent) and reads the whole
    context: dense attention over every token."""
    P, sink, window, T, steps = 4, 4, 8, 390, 4
    spec = f"icecache:page_size={P},sink={sink},window={window},budget={sink + window + 1000 * P},skip_layers=0"
    policy = make(spec).bind(paper.CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    layer, G = policy.layers[0], paper.CFG.n_groups
    assert layer.K == layer.forest.max_pages == (T + steps) // P + (T + steps) // 100 + 2
    H, Hkv, D = paper.CFG.n_heads, paper.CFG.n_kv_heads, paper.CFG.head_dim
    g = torch.Generator().manual_seed(11)
    keys, values = torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    layer.prefill(torch.randn(1, H, T, D, generator=g).to(DEVICE), keys.to(DEVICE), values.to(DEVICE), None)
    for _ in range(steps):
        q, k, v = (torch.randn(1, h, 1, D, generator=g) for h in (H, Hkv, Hkv))
        keys, values = torch.cat((keys, k), 2), torch.cat((values, v), 2)
        out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)[0, :, 0].cpu()
        want = torch.stack([torch.softmax(q[0, j, 0] @ keys[0, j // G].T / D**0.5, -1) @ values[0, j // G]
                            for j in range(H)])
        torch.testing.assert_close(out, want)
        policy.end_step()


def test_the_seed_picks_one_unit_direction_for_every_layer():
    """u is drawn from the policy's seed: the same seed the same vector (of norm 1), another seed
    another; the policy's trees project on it."""
    u = random_direction(8, 3)
    assert torch.equal(u, random_direction(8, 3)) and not torch.equal(u, random_direction(8, 4))
    assert u.dtype == torch.float32 and abs(float(u.double().norm()) - 1) < 1e-6
    policy = make(paper.SPEC + ",seed=3").bind(paper.CFG, device=DEVICE, dtype=torch.float32, max_len=40)
    assert torch.equal(policy.U[0], u) and torch.equal(policy.layers[0].forest.u, u)
    assert torch.equal(policy.U, random_directions(8, 8, 3)) and torch.equal(policy.layers[1].forest.U, policy.U)


def test_what_the_policy_and_the_tree_refuse():
    """skip_layers up to the model's layers (all full), not past; a sliding window no shorter than
    max_len; the tree's capacity and its one build; the messages say the numbers."""
    base = f"icecache:page_size=4,sink=4,window=8,budget={4 + 8 + 4 * 3}"
    full = make(base + ",skip_layers=2").bind(paper.CFG, device=DEVICE, dtype=torch.float32, max_len=40)
    assert [type(layer).__name__ for layer in full.layers] == ["FullLayer"] * 2
    with pytest.raises(ValueError, match="skip_layers must be <= the model's 2 layers, got 3"):
        make(base + ",skip_layers=3").bind(paper.CFG, device=DEVICE, dtype=torch.float32, max_len=40)
    mistral = replace(paper.CFG, sliding_window=64)
    make(base + ",skip_layers=0").bind(mistral, device=DEVICE, dtype=torch.float32, max_len=64)
    with pytest.raises(ValueError, match=r"^icecache does not combine with a sliding-window model \(Mistral\) "
                                         r"shorter than max_len$"):
        make(base + ",skip_layers=0").bind(mistral, device=DEVICE, dtype=torch.float32, max_len=65)
    with pytest.raises(ValueError, match="window >= 2 \\* page_size = 32 "):
        make("icecache:paper,window=16,page_size=16")
    f = DCIForest(n_heads=1, head_dim=4, page_size=4, capacity=10, u=random_direction(4))
    f.build(torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match=r"^build\(\) indexes an empty forest; use insert\(\) to add keys$"):
        f.build(torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="holds at most 10 keys, 12 asked"):
        f.insert(torch.randn(1, 7, 4))


def test_the_reference_search_is_counted_where_it_reads_the_keys():
    """backend=reference counts its keys scored beside search.py (counts.CountedForest): each
    query adds every key indexed to `searched` and exactly the keys its dict holds (every key
    Algorithm 4 scored, Flag = True) to `scored`; the layer's forest is a CountedForest, and a
    selection through the policy adds as much as the queries run alone."""
    H, D, n = 2, 8, 700
    g = torch.Generator().manual_seed(21)
    keys = torch.randn(H, n, D, generator=g)
    f = CountedForest(n_heads=H, head_dim=D, page_size=4, capacity=n, u=random_direction(D))
    f.build(keys[:, :400])
    f.insert(keys[:, 400:])
    assert (f.scored, f.searched) == (0, 0)  # building reads no key through the search's accessor
    sizes = []
    for j in range(3):
        scored = query(f, torch.randn(D, generator=g), j % H, fov=3, prop=0.5, batch=4)
        sizes.append(len(scored))
    assert f.searched == 3 * n and f.scored == sum(sizes) < 3 * n  # the tree pruned: not every key
    spec = f"icecache:page_size={paper.P},sink={paper.SINK},window={paper.WINDOW},budget=24,skip_layers=0"
    policy = make(spec + ",backend=reference,fov=2,prop=0.5").bind(paper.CFG, device=DEVICE, dtype=torch.float32,
                                                                    max_len=400)
    layer = policy.layers[0]
    Hq, Hkv = paper.CFG.n_heads, paper.CFG.n_kv_heads
    layer.prefill(*(torch.randn(1, h, 390, paper.CFG.head_dim, generator=g).to(DEVICE) for h in (Hq, Hkv, Hkv)), None)
    tree = layer.forest
    assert type(tree) is CountedForest and max(tree.n_pages) > layer.K
    q = torch.randn(1, Hq, paper.CFG.head_dim, generator=g)
    G = Hq // Hkv
    alone = sum(len(query(tree, q[0, j], j // G, 2, 0.5, policy.batch)) for j in range(Hq))
    before = tree.scored
    layer.select(q.to(DEVICE))
    assert tree.scored - before == alone and tree.searched == 2 * Hq * tree.n


def test_stats_count_recalls_per_decode_step_keys_scored_and_page_fill():
    """The stats after the prefill (no decode step yet: no page recalled per step) and after
    decode steps: pages recalled per decode step, the share of the tree's keys the searches scored
    (1 with exhaustive parameters: every key, at every search), the mean fill of the pages."""
    T, steps = 120, 6
    policy = make(paper.SPEC + ",fov=100000,prop=1.0").bind(paper.CFG, device=DEVICE, dtype=torch.float32,
                                                           max_len=T + steps)
    layer, f = policy.layers[0], policy.layers[0].forest
    H, Hkv, D = paper.CFG.n_heads, paper.CFG.n_kv_heads, paper.CFG.head_dim
    g = torch.Generator().manual_seed(12)
    layer.prefill(*(torch.randn(1, h, T, D, generator=g).to(DEVICE) for h in (H, Hkv, Hkv)), None)
    policy.end_step()
    s = policy.stats()
    assert (s["pages_recalled"], s["pages_recalled_per_step"]) == (0, 0.0)
    assert math.isnan(s["keys_scored_fraction"])  # no search yet
    for _ in range(steps):
        layer.decode(*(torch.randn(1, h, 1, D, generator=g).to(DEVICE) for h in (H, Hkv, Hkv)), None)
        policy.end_step()
    s = policy.stats()
    assert max(f.n_pages) > paper.K  # the search ran
    assert s["pages_recalled"] == layer.kv.pages_recalled > 0
    assert s["pages_recalled_per_step"] == pytest.approx(layer.kv.pages_recalled / steps)
    assert s["keys_scored_fraction"] == 1.0
    fills = [len(tree_page(f, h, p)) for h in range(f.H) for p in range(f.n_pages[h])]
    assert s["mean_page_fill"] == pytest.approx(sum(fills) / (len(fills) * paper.P))


def test_the_host_bytes_count_the_tree_once_and_every_tensor_of_it():
    """IceCache(reuse): the anchor's host bytes exceed its reuse layer's by its tree's bytes (the
    tree counted once), which are every tensor the tree holds (u aside: one vector shared by all
    layers) plus its batched search's; the host pages are the slots allocated."""
    cfg = replace(paper.CFG, n_layers=2)
    policy = make("icecache:page_size=4,budget=24,sink=4,window=8,skip_layers=0,reuse_every=2").bind(
        cfg, device=DEVICE, dtype=torch.float32, max_len=160)
    anchor, reuse = policy.layers
    H, Hkv, D, T = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, 150
    g = torch.Generator().manual_seed(13)
    for layer in policy.layers:
        layer.prefill(*(torch.randn(1, h, T, D, generator=g).to(DEVICE) for h in (H, Hkv, Hkv)), None)
    for layer in policy.layers:
        layer.decode(*(torch.randn(1, h, 1, D, generator=g).to(DEVICE) for h in (H, Hkv, Hkv)), None)
    f = anchor.forest
    assert reuse.forest is f and sum(w.nbytes() for w in f.watchers) > 0
    tensors = [t for name, t in vars(f).items() if isinstance(t, torch.Tensor) and name != "u"]
    assert forest_bytes(f) == sum(t.numel() * t.element_size() for t in tensors) + sum(w.nbytes() for w in f.watchers)
    (dev_a, host_a), (dev_r, host_r) = anchor.aux_bytes(), reuse.aux_bytes()
    assert dev_a == dev_r and host_a - host_r == forest_bytes(f)
    pages = anchor.kv.candidates
    assert pages.aux_bytes() == (0, pages.fill.numel() * pages.fill.element_size())
    assert anchor.allocated_host_tokens() * policy.token_bytes() == pages.host.numel() * pages.host.element_size()


def test_equal_projections_in_large_nodes_go_to_the_older_point():
    """Nodes of about 100 children (one point in 100 opens a node) over keys drawn from 40
    (so many projections are equal): the reference query scans each node's children in projection
    order, ties to the older point, and scores exactly the keys the batched search scores. torch's
    CPU sort without stable=True reorders equal values in rows longer than 16."""
    H, n, D = 2, 1200, 8
    g = torch.Generator().manual_seed(14)
    keys = torch.randn(H, 40, D, generator=g)[:, torch.randint(0, 40, (n,), generator=g)]
    f = DCIForest(n_heads=H, head_dim=D, page_size=4, capacity=n, u=random_direction(D))
    fs = search_fast.FastSearch(f)
    f.build(keys)
    q = torch.randn(H, 3, D, generator=g)
    ids, scores = search_fast.search(fs, q, torch.arange(H), 2, 0.5, 4)  # fov 2, prop 0.5, batches of 4
    for h in range(H):
        for j in range(3):
            assert set(ids[h][scores[h, j] > float("-inf")].tolist()) == set(query(f, q[h, j], h, 2, 0.5, 4))


def test_pages_of_one_token():
    """page_size=1: the first token that leaves the window builds the tree (tree id 0) and the
    second is inserted into it (tree id 1), the cases where the first candidate page's first token
    is 0 or 1; the outputs, the pages read and the host pages against test_icecache's oracle."""
    policy = run_against_oracle(dict(P=1, sink=1, window=2, budget=5, T=3, steps=8, reuse=1, exhaustive=True,
                                     fov=None, seed=0))
    assert policy.layers[1].forest.n >= 5

"""IceCache's index and query: the MIPS transform (Eqs. 2-3) turns maximum inner product into
nearest neighbour and stays exact when the maximum norm c grows; the promotion counter; the
insertion invariant (every key in exactly one page of at most page_size keys sharing one parent,
whatever the sequence of inserts, level growth included); the fast forms (search_fast,
pages_fast) against the readable Algorithms 3-4 (search.py): same scored keys and same pages, at
the default and at small fields of view, ties included; DCI recall against exact maximum inner
product on random keys and on SmolLM2's keys (exhaustive parameters give recall 1.0 and the
exact pages).

The tree and its search live on the host tier (icecache's design: policies/tiers.backend_on runs
them eager beside a GPU), so these tests build their keys on the CPU whatever the test device
(CPU_ONLY in tests/fixtures.py); SmolLM2 records its keys where it runs."""
import math

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from minikv.kernels.dci_scores.reference import float_order
from minikv.policies.icecache import pages_fast, search_fast
from minikv.policies.icecache.counts import tree_page
from minikv.policies.icecache.promotion import level_of, levels_of, random_direction
from minikv.policies.icecache.search import (CLOSEST, field_of_view, find_page_index, merge_group, page_lists,
                                             query, scan_node)
from minikv.policies.icecache.layout import build_layout, node_windows, visited_per_node, window_starts
from minikv.policies.icecache.search_fast import few_float_orders, top_keys
from minikv.policies.icecache.tree import DCIForest


def forest_of(keys, P=16, first=100, nxt=5, capacity=None, seed=0):
    H, n, D = keys.shape
    return DCIForest(n_heads=H, head_dim=D, page_size=P, capacity=capacity or n, u=random_direction(D, seed),
                     first=first, nxt=nxt)


def exact_top(keys, q, heads, k):
    """Exact MIPS: q (B, G, D) blocks of head heads[b] -> (B, G, k) key ids of largest q.k."""
    return torch.bmm(q.float(), keys[heads].float().transpose(1, 2)).topk(k, dim=2).indices


def recall(found, exact):
    k = found.shape[-1]
    pairs = zip(found.reshape(-1, k).tolist(), exact.reshape(-1, k).tolist())
    return sum(len(set(a) & set(b) - {-1}) for a, b in pairs) / exact.numel()


# -- the transform -------------------------------------------------------------------------------

def test_mips_transform_makes_the_nearest_key_the_largest_inner_product():
    """Eqs. 2-3 written out: |T_Q(q) - T_K(k)|^2 = 2 - 2 q.k / (|q| c), and the key-to-key
    similarity the tree uses is 1 - |T_K(a) - T_K(b)|^2 / 2 times c^2; the forest's projections are
    u.T_K(k), and after keys with a larger norm arrive they equal a projection from scratch."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 300, 8, generator=g, dtype=torch.float64).float() * torch.rand(1, 300, 1, generator=g) * 3
    f = forest_of(keys[:, :200], capacity=300)
    f.build(keys[:, :200])
    q = torch.randn(8, generator=g)

    def t_k(k, c):
        return torch.cat((k / c, (1 - k.square().sum(-1, keepdim=True) / c**2).clamp_min(0).sqrt()), -1)

    c = float(f.c[0])
    assert math.isclose(c, float(keys[0, :200].norm(dim=-1).max()), rel_tol=1e-6)
    tk = t_k(keys[0, :200].double(), c)
    tq = torch.cat((q / q.norm(), torch.zeros(1))).double()
    dist = (tk - tq).square().sum(-1)
    assert torch.allclose(dist, 2 - 2 * (keys[0, :200].double() @ q.double()) / (q.norm().double() * c), atol=1e-6)
    assert int(dist.argmin()) == int((keys[0, :200] @ q).argmax())
    sim = f._similarity(keys[:, :5], f.sq[:, :5], f.key_rows(torch.arange(200)), f.sq[:, :200])[0].double()  # (5, 200)
    half_sq = (tk[:5, None] - tk[None]).square().sum(-1) / 2
    assert torch.allclose(1 - sim / c**2, half_sq, atol=1e-5)
    assert torch.equal(sim.argmax(1), half_sq.argmin(1))
    u = f.u.double()
    assert torch.allclose(f.proj[0, :200].double(), tk @ u, atol=1e-5)
    assert torch.allclose(f.query_projection(q[None]).double(), (tq @ u)[None], atol=1e-6)
    # longer keys arrive: c grows, and every projection is that of the new transform
    big = keys[:, 200:] * 4
    f.insert(big)
    c_new = float(f.c[0])
    assert c_new > c and math.isclose(c_new, float(big[0].norm(dim=-1).max()), rel_tol=1e-6)
    all_keys = torch.cat((keys[0, :200], big[0])).double()
    assert torch.allclose(f.proj[0, :300].double(), t_k(all_keys, c_new) @ u, atol=1e-5)


def test_promotion_counter():
    """Deterministic promotion in token order: every 100th point to level 2, every 5th of those
    higher (the authors' ratio_1 = 0.01, ratio_2 = 0.2); field of view max(30, 0.0015 n)."""
    levels = [level_of(t) for t in range(12500)]
    assert levels[:99] == [1] * 99 and levels[99] == 2 and levels[499] == 3 and levels[2499] == 4
    assert levels[12499] == 5 and sum(x >= 2 for x in levels) == 125 and sum(x >= 3 for x in levels) == 25
    assert field_of_view(100) == 30 and field_of_view(40_000) == 60
    assert levels_of(torch.arange(12500)).tolist() == levels


def test_few_float_orders_equal_float_order():
    x = torch.tensor([[0.0, -0.0, 1.5, -1.5], [3e38, -3e38, 1e-45, -1e-45], [float("inf"), float("-inf"), 2.0, -2.0]])
    assert torch.equal(few_float_orders(x), float_order(x))
    order = few_float_orders(x).view(-1).argsort(stable=True)
    assert torch.equal(x.view(-1)[order], x.view(-1).sort(stable=True).values)


def test_merge_group_round_robin_first_k_distinct():
    assert merge_group([[3, 1, 2], [1, 5, -1]], 3) == [3, 1, 5]
    assert merge_group([[3, 3, -1], [-1, -1, -1]], 3) == [3, -1, -1]
    assert merge_group([[0, 1], [2, 3], [4, 5]], 4) == [0, 2, 4, 1]


def nearest_run(x, pq, m):
    """The definition: indices of the m projections nearest pq (distinct values: one answer)."""
    return sorted(sorted(range(len(x)), key=lambda i: abs(x[i] - pq))[:m])


@given(n=st.integers(1, 60), prop=st.sampled_from([0.3, 0.5, 0.8, 1.0]), fov=st.sampled_from([0, 1, 2, 30]),
       batch=st.sampled_from([1, 4, 128]), seed=st.integers(0, 1000))
def test_scan_node_takes_the_nearest_children(n, prop, fov, batch, seed):
    """search.scan_node (the two-cursor scan) takes the visited_per_node nearest projections:
    the whole node when the field of view covers it, else batches until max(fov, ceil(prop n))."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randperm(1000, generator=g)[:n].float() / 1000).sort().values.tolist()
    pq = float(torch.rand(1, generator=g))
    lo, hi = scan_node(x, pq, fov, prop, batch)
    m = int(visited_per_node(torch.tensor([n]), prop, fov, batch))
    assert hi - lo == m and list(range(lo, hi)) == nearest_run(x, pq, m)


@given(n=st.integers(1, 60), prop=st.sampled_from([0.3, 0.5, 0.8, 1.0]), fov=st.sampled_from([0, 2, 30]),
       batch=st.sampled_from([1, 4, 128]), ties=st.booleans(), seed=st.integers(0, 1000))
def test_node_windows_equal_scan_node(n, prop, fov, batch, ties, seed):
    """The fast form of a node's scan (pair sums and one searchsorted per node and query) keeps
    exactly the run search.scan_node keeps, ties in projection and equidistant pairs included."""
    g = torch.Generator().manual_seed(seed)
    nodes = torch.randint(0, 5, (n,), generator=g).sort().values
    x = torch.randint(0, 8 if ties else 1000, (n,), generator=g).float() / 1000
    order = torch.argsort(nodes * 10 + x, stable=True)
    x, nodes = x[order], nodes[order]
    node_of = torch.unique_consecutive(nodes, return_inverse=True)[1]
    N = int(node_of[-1]) + 1
    start = torch.tensor([int((node_of == j).nonzero()[0]) for j in range(N)])
    size = torch.bincount(node_of, minlength=N)
    # ties: queries on the grid too, so that some sit exactly between two projections
    twice_pq = 2 * (torch.randint(0, 8, (1, 4, 1), generator=g).float() / 1000 if ties else torch.rand(1, 4, 1, generator=g))
    pair_key, m = node_windows(x[None], node_of[None], start[None], size[None], prop, fov, batch)
    lo = window_starts(pair_key, torch.arange(N)[None] * 2**32, float_order(twice_pq))  # (1, 4, N)
    for j in range(N):
        run = x[start[j]:start[j] + size[j]].tolist()
        for g_ in range(4):
            a, b = scan_node(run, float(twice_pq[0, g_, 0]) / 2, fov, prop, batch)
            assert (int(lo[0, g_, j]) - int(start[j]), int(m[0, j])) == (a, b - a)


def test_visited_per_node_follows_the_authors_scan():
    """M-DCI's scan of a node with one simple index: a node the field of view covers is scored
    whole; otherwise batches of 128 projections until max(fov, ceil(0.8 size)) are scored."""
    size = torch.tensor([1, 5, 30, 31, 100, 128, 129, 160, 161, 200, 500, 1000])
    assert visited_per_node(size, 0.8, fov=30, batch=128).tolist() == \
        [1, 5, 30, 31, 100, 128, 128, 128, 161, 200, 500, 896]
    assert visited_per_node(size, 0.8).tolist() == [1, 4, 24, 25, 80, 103, 104, 128, 129, 160, 400, 800]


def reference_pages(f, q, heads, k, fov, prop, batch):
    """search.query then find_page_index for every query of every block -> (B, G, k), -1 pads."""
    rows = [[find_page_index(f, int(h), query(f, q[b, j], int(h), fov, prop, batch), k) for j in range(q.shape[1])]
            for b, h in enumerate(heads.tolist())]
    return torch.tensor([[p + [-1] * (k - len(p)) for p in row] for row in rows])


@settings(max_examples=15)
@given(n=st.integers(20, 400), fov=st.sampled_from([1, 2, 5, None]), prop=st.sampled_from([0.5, 0.8]),
       batch=st.sampled_from([1, 4, 128]), seed=st.integers(0, 1000), policy_heads=st.booleans())
def test_fast_search_scores_the_reference_keys(n, fov, prop, batch, seed, policy_heads):
    """search_fast.search (all heads and queries at once, per-node windows, the one batched
    descent) scores exactly the keys search.query's loops over levels and nodes score, for every
    query of every block, with the same scores, at the default field of view and at small ones.
    Half the keys are built, searched (the search keeps per-level layouts) and the rest inserted
    in chunks: no stale layout survives."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, n, 8, generator=g)
    keys[:, n // 2 + 3] *= 3  # a longer key arrives late: c grows, every projection changes
    f = forest_of(keys, P=4, first=7, nxt=3, seed=seed)
    f.build(keys[:, :n // 2])
    q = torch.randn(2, 3, 8, generator=g)
    heads = torch.tensor([0, 1]) if policy_heads else torch.tensor([1, 0])
    fov_ = field_of_view(n) if fov is None else fov
    fs = search_fast.FastSearch(f)
    search_fast.search(fs, q, heads, fov_, prop, batch)
    for a in range(n // 2, n, 11):
        f.insert(keys[:, a:a + 11])
        search_fast.search(fs, q, heads, fov_, prop, batch)
    ids, scores = search_fast.search(fs, q, heads, fov_, prop, batch)
    for b in range(2):
        h = int(heads[b])
        for j in range(3):
            seen = scores[b, j] > float("-inf")
            found = ids[b][seen]
            reference = query(f, q[b, j], h, fov, prop, batch)
            assert set(found.tolist()) == set(reference)
            torch.testing.assert_close(scores[b, j][seen], torch.tensor([reference[t] for t in found.tolist()]))


def drawn_forest(seed, n, ties, policy_heads):
    """-> (draw, keys (2, n, 8), the forest over them, the heads' order). ties: small integers,
    so that every q.k is exact whatever order a product sums in, and equal scores are equal bit
    for bit (many equal page maxima)."""
    g = torch.Generator().manual_seed(seed)
    draw = (lambda *shape: torch.randint(-2, 3, shape, generator=g).float()) if ties else \
        (lambda *shape: torch.randn(*shape, generator=g))
    keys = draw(2, n, 8)
    heads = torch.tensor([0, 1]) if policy_heads else torch.tensor([1, 0])
    return draw, keys, forest_of(keys, P=4, first=7, nxt=3, seed=seed), heads

@settings(max_examples=20)
@given(n=st.integers(20, 500), fov=st.sampled_from([1, 2, 5, None]), prop=st.sampled_from([0.5, 0.8]),
       batch=st.sampled_from([1, 4, 128]), k=st.sampled_from([1, 3, 12, 40]), candidates=st.sampled_from([1, 4]),
       ties=st.booleans(), seed=st.integers(0, 1000), policy_heads=st.booleans())
def test_fast_page_choice_equals_the_reference(n, fov, prop, batch, k, candidates, ties, seed, policy_heads):
    """Both fast page choices, pages_fast.select_pages (one product with every page-major key
    row and the candidate bound; the eager default) and search_fast.select_pages (gathered keys,
    the Triton backend's way), pick exactly search.find_page_index's pages after search.query,
    after the build and after every insert, whether the bound holds or every page is computed,
    with tied scores (duplicate keys) broken to the lower page; and the policy's merge of a
    group's lists equals the reference's (search.page_lists, merge_group)."""
    draw, keys, f, heads = drawn_forest(seed, n, ties, policy_heads)
    ps, fs = pages_fast.PageSearch(f), search_fast.FastSearch(f)  # both watch the tree
    f.build(keys[:, :n // 2])
    for a in range(n // 2, n + 37, 37):
        f.insert(keys[:, a - 37:min(a, n)]) if a > n // 2 else None
        q = draw(2, 3, 8)
        fov_ = field_of_view(f.n) if fov is None else fov
        reference = reference_pages(f, q, heads, k, fov, prop, batch)
        assert torch.equal(ps.select_pages(q, heads, k, fov_, prop, batch, candidates), reference)
        assert torch.equal(fs.select_pages(q, heads, k, fov_, prop, batch), reference)
    merged = [merge_group(group, k) for group in ps.select_pages(q, None, k, fov_, prop, batch).tolist()]
    assert [merge_group(group, k) for group in page_lists(f, q.reshape(6, 8), k, fov, prop, batch)] == merged


@settings(max_examples=20)
@given(n=st.integers(10, 300), chunk=st.integers(1, 40), ties=st.booleans(), seed=st.integers(0, 1000))
def test_layouts_merged_after_inserts_equal_a_fresh_build(n, chunk, ties, seed):
    """A level's layout is kept across inserts and the points that joined it are merged into its
    order (no sort of the level again): after each insert every level's layout equals one built
    from scratch, field by field, equal projections (duplicate keys) included."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(2, n, 8, generator=g)
    if ties:
        keys = keys[:, torch.randint(0, max(n // 3, 1), (n,), generator=g)]
    f = forest_of(keys, P=4, first=7, nxt=3, seed=seed)
    fs = search_fast.FastSearch(f)
    f.build(keys[:, :n // 2])
    for a in range(n // 2, n, chunk):
        for level in range(f.top, 0, -1):
            fs.layout(level, 0.8, 5, 4)  # kept, to be merged at the next request
        f.insert(keys[:, a:a + chunk])
        for level in range(f.top, 0, -1):
            kept, fresh = fs.layout(level, 0.8, 5, 4), build_layout(f, level, 0.8, 5, 4)
            assert kept.whole == fresh.whole
            for name, x, y in zip(kept._fields, kept[:-1], fresh[:-1]):
                assert torch.equal(x, y), name


@settings(max_examples=20)
@given(lists=st.lists(st.lists(st.integers(-1, 9), max_size=8), min_size=1, max_size=5), k=st.integers(1, 12))
def test_merge_group_equals_the_round_robin_loop(lists, k):
    """merge_group (the rounds through dict.fromkeys, first occurrence kept) equals the loop over
    rounds and heads that appends each page not yet merged, ragged lists and -1 pads included."""
    merged = []
    for j in range(max(map(len, lists))):
        for pages in lists:
            if j < len(pages) and pages[j] >= 0 and pages[j] not in merged:
                merged.append(pages[j])
    assert merge_group(lists, k) == merged[:k] + [-1] * (k - len(merged[:k]))


@settings(max_examples=15)
@given(n=st.integers(20, 400), fov=st.sampled_from([1, 2, 3]), prop=st.sampled_from([0.5, 0.8]),
       batch=st.sampled_from([1, 4, 128]), k=st.sampled_from([2, 5, 12]), ties=st.booleans(),
       seed=st.integers(0, 1000), policy_heads=st.booleans())
def test_page_choice_fallback_and_visited_equal_the_reference(n, fov, prop, batch, k, ties, seed, policy_heads):
    """One candidate per selected page and a small field of view make the candidate bound fail
    often; the fallback then computes every page of the nodes each query opened, and the pages
    are still search.py's, ties included (after the build and after every insert). On every level
    of the descent, search_fast.visited (one gather where the level's nodes are read whole) marks
    exactly the points the window test in_window marks."""
    draw, keys, f, heads = drawn_forest(seed, n, ties, policy_heads)
    ps = pages_fast.PageSearch(f)
    f.build(keys[:, :n // 2])
    for a in range(n // 2, n + 37, 37):
        f.insert(keys[:, a - 37:min(a, n)]) if a > n // 2 else None
        q = draw(2, 3, 8)
        reference = reference_pages(f, q, heads, k, fov, prop, batch)
        assert torch.equal(ps.select_pages(q, heads, k, fov, prop, batch, 1), reference)
        layouts = [lay.select(heads) for lay in ps.layouts(prop, fov, batch)]
        S = torch.bmm(q, f.slot_keys[heads].transpose(1, 2))

        def score(i, lay, lo):
            s = S.gather(2, lay.col[:, None].expand(2, 3, -1))
            return s.masked_fill(~search_fast.in_window(lay.pos_info[:, None], lo), float("-inf"))

        twice_pq = 2 * f.query_projection(q.reshape(6, 8)).view(2, 3, 1)
        for lay, lo, _ in search_fast.descend(f, twice_pq, layouts, fov, score):
            assert torch.equal(search_fast.visited(lay, lo), search_fast.in_window(lay.pos_info[:, None], lo))
    event(f"candidate bound failed: {ps.exhaustive_choices > 0}")


def test_page_choice_when_the_candidate_bound_fails():
    """A field of view of 1 scores few keys: most pages with the largest keys are not visited,
    one candidate per page is too few, the bound fails, and every page is computed: still the
    reference's pages."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(2, 3000, 16, generator=g)
    f = forest_of(keys)
    ps = pages_fast.PageSearch(f)
    f.build(keys)
    q = torch.randn(2, 3, 16, generator=g)
    heads = torch.arange(2)
    reference = reference_pages(f, q, heads, 8, 1, 0.5, CLOSEST)
    assert ps.exhaustive_choices == 0
    assert torch.equal(ps.select_pages(q, heads, 8, 1, 0.5, 128, candidates=1), reference)
    assert ps.exhaustive_choices == 1
    assert torch.equal(ps.select_pages(q, heads, 8, 1, 0.5, 128, candidates=40), reference)
    assert ps.exhaustive_choices == 1, "with 320 candidates the bound holds"


# -- insertion invariant ---------------------------------------------------------------------------

def check_pages(f, keys):
    """Every key in exactly one page, at most P per page, a page's keys share one parent, the
    fills count them, the index keeps the keys; each parent is one level up."""
    H, n = f.H, f.n
    for h in range(H):
        seen = torch.zeros(n, dtype=torch.int64)
        for p in range(f.n_pages[h]):
            toks = tree_page(f, h, p)
            assert 1 <= len(toks) <= f.P
            assert len({int(f.parent[h, t]) for t in toks}) == 1, "a page is the children of one parent"
            for s, t in enumerate(toks):
                assert (int(f.page_of[h, t]), int(f.slot_of[h, t])) == (p, s)
            seen[toks] += 1
        assert seen.tolist() == [1] * n, "every key in exactly one page"
        assert f.n_pages[h] <= f.max_pages
        par = f.parent[h, :n]
        lv = f.level[:n]
        top = lv == f.top
        assert (par[top] == -1).all() and (par[~top] >= 0).all()
        assert torch.equal(lv[par[~top]], lv[~top] + 1), "a parent is one level up"
    assert torch.equal(f.key_rows(torch.arange(n)), keys.float())
    held = torch.zeros(H, f.slot_keys.shape[1], dtype=torch.bool).scatter_(1, f.rows_of(torch.arange(n)), True)
    assert not f.slot_keys[~held].any(), "a row that holds no key is zero"


def check_insert_parents(f, keys, new):
    """The points new (tree ids) just inserted: each one below the top has as parent its nearest
    point one level up among those inserted before it (largest sim under the c of this insert,
    to float32 rounding), or, where none was (the level opened after it), the first point of
    that level, which adopted it."""
    c2 = (f.c.double() ** 2)[:, None]
    k = keys.double()
    for t in new:
        level = int(f.level[t])
        if level == f.top:
            assert (f.parent[:, t] == -1).all()
            continue
        up = f.level_ids(level + 1)
        before = up[up < t]
        if len(before) == 0:
            assert (f.parent[:, t] == up[0]).all(), "adopted by the level's first point"
            continue
        sq = k.square().sum(-1)  # (H, n)
        sim = torch.einsum("hd,hnd->hn", k[:, t], k[:, before]) + \
            ((c2 - sq[:, before]).clamp_min(0) * (c2 - sq[:, t:t + 1]).clamp_min(0)).sqrt()  # (H, |before|)
        got = sim.gather(1, (before[None] == f.parent[:, t, None]).float().argmax(1, keepdim=True))[:, 0]
        assert torch.isin(f.parent[:, t], before).all(), "a parent is an older point one level up"
        assert (got >= sim.max(1).values - 1e-4 * c2[:, 0]).all(), "the parent is the nearest point one level up"


@settings(max_examples=25)
@given(n0=st.integers(0, 120), inserts=st.lists(st.tuples(st.integers(1, 20), st.booleans()), max_size=8),
       P=st.sampled_from([2, 4, 16]), first=st.sampled_from([3, 10, 100]), seed=st.integers(0, 1000))
def test_insertion_invariant(n0, inserts, P, first, seed):
    """After the build and after any sequence of inserts (some with longer keys, growing c; small
    promotion periods open new top levels), the pages partition the keys, and each inserted
    point's parent is the exact nearest one level up."""
    g = torch.Generator().manual_seed(seed)
    H, D = 2, 8
    total = n0 + sum(m for m, _ in inserts)
    f = forest_of(torch.zeros(H, 1, D), P=P, first=first, nxt=2, capacity=max(total, 1), seed=seed)
    keys = torch.randn(H, n0, D, generator=g)
    f.build(keys)
    if n0:
        check_pages(f, keys)
    for m, longer in inserts:
        new = torch.randn(H, m, D, generator=g) * (3 if longer else 1)
        a = f.n
        f.insert(new)
        keys = torch.cat((keys, new), 1)
        check_pages(f, keys)
        if a:  # (into an empty tree, insert builds it)
            check_insert_parents(f, keys, range(a, f.n))
    # exhaustive search still exact after all of it
    if f.n:
        q = torch.randn(2, 3, D, generator=g)
        heads = torch.tensor([1, 0])
        k = min(5, f.n)
        found = top_keys(search_fast.FastSearch(f), q, heads, k, fov=f.n, prop=1.0)
        assert torch.equal(found, exact_top(keys, q, heads, k))


def test_build_parent_is_the_nearest_point_one_level_up():
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(2, 1000, 16, generator=g)
    f = forest_of(keys)
    f.build(keys)
    up = f.level_ids(2)
    for h in range(2):
        for t in [0, 17, 998]:
            c2 = float(f.c[h]) ** 2
            sim = keys[h, up] @ keys[h, t] + ((c2 - f.sq[h, up]).clamp_min(0) * (c2 - f.sq[h, t]).clamp_min(0)).sqrt()
            assert int(f.parent[h, t]) == int(up[sim.argmax()])


# -- DCI recall ------------------------------------------------------------------------------------

def test_dci_recall_random_keys():
    """Gaussian keys (no structure for the tree to find), 4,000 per head, 32 queries per head:
    recall@16 at the default parameters is at least 0.955. Measured over seeds 0-9: 0.964 to
    0.982 (seed 0: 0.972); but the search scores 91-93% of the keys here, so this shows little
    selectivity (a random subset of that share reaches 0.909 to 0.927, 0.944 at best of 200
    draws): test_dci_recall_is_selective is the one that does. The fast search finds the
    reference's top 16 (search.query's loops, on 4 of the queries), and exhaustive parameters find
    the exact top 16 and the exact pages (those of the largest max q.k over their keys)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(3, 4000, 64, generator=g)
    q = torch.randn(3, 32, 64, generator=g)
    heads = torch.arange(3)
    f = forest_of(keys)
    fs, ps = search_fast.FastSearch(f), pages_fast.PageSearch(f)
    f.build(keys)
    exact = exact_top(keys, q, heads, 16)
    found = top_keys(fs, q, heads, 16)
    assert recall(found, exact) >= 0.955
    # the tree pruned: with the authors' scan (batches of 128 projections, nodes the field of view
    # covers scored whole) it scores 91% of 4,000 keys
    assert f.scored / f.searched < 0.95
    scored = [[query(f, q[h, j], h) for j in range(4)] for h in range(3)]
    reference = torch.tensor([[sorted(s, key=lambda t: -s[t])[:16] for s in row] for row in scored])
    assert recall(found[:, :4], reference) == 1.0
    # scoring exactly 80% of each node (batch 1) and nothing more: below 80%
    f.scored = f.searched = 0
    top_keys(fs, q, heads, 16, batch=1)
    assert f.scored / f.searched < 0.8
    assert torch.equal(top_keys(fs, q, heads, 16, fov=f.n, prop=1.0), exact)
    pages = ps.select_pages(q[:, :4], heads, 12, f.n, 1.0, CLOSEST)
    for h in range(3):
        for j in range(4):
            best = torch.stack([(keys[h, tree_page(f, h, p)] @ q[h, j]).max() for p in range(f.n_pages[h])])
            assert pages[h, j].tolist() == best.topk(12).indices.tolist()
            assert find_page_index(f, h, query(f, q[h, j], h, f.n, 1.0), 12) == pages[h, j].tolist()


def random_subset_recall(exact, n, share, draws, seed=1):
    """recall@k of `draws` random subsets of round(share n) of the n keys, one subset per draw for
    every query: the recall of a search that picks as many keys as the tree scores, blindly."""
    g = torch.Generator().manual_seed(seed)
    rows = exact.reshape(-1, exact.shape[-1]).tolist()
    out = []
    for _ in range(draws):
        picked = set(torch.randperm(n, generator=g)[:round(share * n)].tolist())
        out.append(sum(len(set(row) & picked) for row in rows) / exact.numel())
    return out


def test_dci_recall_is_selective():
    """The tree finds the top keys by scoring few of them: at a field of view of 10 and one
    projection a step (batch 1), the search scores at most 30% of 4,000 keys per head and its
    recall@16 beats a random subset of the same size by a margin. Gaussian keys: the search scores
    25.9% and finds 0.496 of the top 16 (seed 0); a random 25.9% finds 0.26 on average, 0.285 at
    best of 200 draws. Keys around 64 centres (closer to a model's): 26.4%, recall 0.870 against
    0.26 at random. The bars (0.45, 0.80) fail every random subset drawn."""
    g = torch.Generator().manual_seed(0)
    H, n, D = 3, 4000, 64
    gauss = torch.randn(H, n, D, generator=g), torch.randn(H, 32, D, generator=g)
    centres = torch.randn(H, 64, D, generator=g) * 2
    pick = lambda m: centres.gather(1, torch.randint(64, (H, m, 1), generator=g).expand(-1, -1, D))  # noqa: E731
    mixed = pick(n) + torch.randn(H, n, D, generator=g), pick(32) + torch.randn(H, 32, D, generator=g)
    for (keys, q), bar in ((gauss, 0.45), (mixed, 0.80)):
        f = forest_of(keys)
        fs = search_fast.FastSearch(f)
        f.build(keys)
        exact = exact_top(keys, q, torch.arange(H), 16)
        found = top_keys(fs, q, torch.arange(H), 16, fov=10, prop=0.8, batch=1)
        share = f.scored / f.searched
        assert share <= 0.30
        assert recall(found, exact) >= bar
        assert max(random_subset_recall(exact, n, share, 50)) < bar  # a blind pick of as many keys fails it


def test_dci_recall_smollm2_keys(smollm2):
    """Keys and queries recorded from SmolLM2 (layers 4, 15, 27; 1,000 keys of documentation text,
    the next 8 positions' queries): recall@16 at the default parameters, averaged over the three
    layers, is at least 0.96 (measured 0.971 with the tree's seed 0, 0.971 to 0.978 over seeds
    0-3; layer 15 alone 0.934 to 0.959). At 1,000 keys the field of view covers most nodes and
    the search scores 96-99.7% of the keys, so a random subset of that share does as well: the
    random-key test is the one that separates the tree from a random pick (the README's bench runs
    2k-8k keys). Exhaustive parameters give 1.0."""
    from minikv.bench.common import text_ids
    from minikv.bench.research.dci_recall import record_qk, tree_recall

    model, tok = smollm2
    qk = record_qk(model, text_ids(tok, 1008), [4, 15, 27])
    recalls = []
    for q, k in qk.values():
        r, scored = tree_recall(q[:, 1000:1008], k[:, :1000], 16)
        recalls.append(r)
        assert scored < 1.0
        exact, _ = tree_recall(q[:, 1000:1008], k[:, :1000], 16, fov=1000, prop=1.0)
        assert exact == 1.0
    assert sum(recalls) / len(recalls) >= 0.96, recalls

"""icecache against test_icecache_paper's transcription where mutation testing (docs/mutation.md)
found wrong implementations the other tests pass: a short prompt, so the tree starts with no
page, then fewer pages than a step selects (a tree of at most k pages is read whole, without a
search), and grows past k while decoding; the pages recalled, summed over the steps; and the
tree's insert across promotions (levels by the counter, the nearest parent)."""
import pytest
import torch

from minikv.policies import make
from minikv.policies.icecache.search import field_of_view, page_select
from minikv.policies.icecache.tree import DCIForest, level_of, levels_of, random_direction

from ..fixtures import DEVICE
from . import test_icecache_paper as paper


def test_a_short_prompt_reads_every_page_until_the_tree_outgrows_k():
    T, steps = 6, 40
    policy = make(paper.SPEC).bind(paper.CFG, device=DEVICE, dtype=torch.float32, max_len=T + steps)
    layer, ref = policy.layers[0], paper.PaperIceCache(paper.CFG.n_groups)
    g = torch.Generator().manual_seed(2)
    H, Hkv, D = paper.CFG.n_heads, paper.CFG.n_kv_heads, paper.CFG.head_dim
    q, k, v = torch.randn(1, H, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D, generator=g)
    layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
    ref.prefill(k[0], v[0])
    n_pages = set()
    for _ in range(steps):
        q, k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)
        n_pages.add(max(layer.forest.n_pages))
        out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)[0, :, 0].cpu()
        want, reads, pages = ref.decode(q[0, :, 0], k[0, :, 0], v[0, :, 0], layer.forest)
        assert [set(r) - {-1} for r in layer.attended_indices().tolist()] == reads
        if layer.selection is not None:
            assert [set(p for p in row if p >= 0) for row in layer.selection.tolist()] == [set(p) for p in pages]
        torch.testing.assert_close(out, want)
        policy.end_step()
    assert {0, 1, paper.K} <= n_pages and max(n_pages) > paper.K  # none, fewer than k, k, more
    # line 23's copies, summed over the steps: what the paged store counted
    assert policy.stats()["pages_recalled"] == layer.kv.pages_recalled > 0


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
    # reference search.page_select, group-merged), and on this tree it chooses other pages than
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
        want = page_select(f, q1[0], K, 1, 0.25, policy.batch)
        assert [set(row) - {-1} for row in layer.select(q1.to(DEVICE)).tolist()] == [set(row) - {-1} for row in want.tolist()]
        wide = page_select(f, q1[0], K, field_of_view(f.n), 0.25, policy.batch)
        differs += [set(r) for r in want.tolist()] != [set(r) for r in wide.tolist()]
    assert differs  # the field of view changes the choice on this tree

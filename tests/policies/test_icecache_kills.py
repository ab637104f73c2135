"""icecache against test_icecache_paper's transcription where mutation testing (docs/mutation.md)
found wrong implementations the other tests pass: a short prompt, so the tree starts with no
page, then fewer pages than a step selects (a tree of at most k pages is read whole, without a
search), and grows past k while decoding; the pages recalled, summed over the steps."""
import torch

from minikv.policies import make

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

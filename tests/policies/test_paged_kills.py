"""paged.py where mutation testing (docs/mutation.md) found wrong implementations the other tests
pass: test_paged.py locates pages with the store's own slot_of, so a slot map that is wrong for
the writer and the checker alike passes it. Here the pool's order is written out from its
definition (sink slots 0.., then n_select selected slots, then the window's ring, window page p
in slot n_sink + n_select + (p - n_sink) mod n_window), with geometries where 2 n_sink is not a
multiple of n_window, and what attention reads and the device holds is counted from it."""
import pytest
import torch

from .test_paged import H, make_store, tokens


@pytest.mark.parametrize("n_sink, n_window", [(1, 3), (2, 3), (0, 2), (3, 2)])
def test_pages_sit_in_sink_select_window_order(n_sink, n_window):
    P, n_select, T = 4, 2, 41
    k, v = tokens(T, 7)
    store = make_store(P, n_sink, n_select, n_window)
    w0 = n_sink + n_select
    for L in range(1, T + 1):
        store.append(k[:, :, L - 1:L], v[:, :, L - 1:L])
        store.roll()
        first_window, lens = n_sink + store.n_cand, store.pool.page_lens[0]  # lens (H, S)
        for p in list(range(min(n_sink, -(-L // P)))) + list(range(first_window, -(-L // P))):
            s = p if p < n_sink else w0 + (p - n_sink) % n_window
            n = min(P, L - p * P)
            assert lens[:, s].tolist() == [n] * H
            assert torch.equal(store.pool.k_pages[s, :n], k[0, :, p * P:p * P + n].transpose(0, 1))
            assert torch.equal(store.pool.v_pages[s, :n], v[0, :, p * P:p * P + n].transpose(0, 1))
        assert lens[:, n_sink:w0].eq(0).all()  # the selected slots: empty before a recall
    first_window = n_sink + store.n_cand
    window = list(range(first_window * P, T))
    assert store.device_tokens() == n_sink * P + len(window)
    # a recall of two candidates per head: the pages come in whole, attention reads sink, them, window
    pick = [[0, 2], [1, 0]]
    assert store.recall(torch.tensor(pick)) == 4
    store.attend(torch.randn(1, H, k.shape[-1]).to(k.device))
    for h, row in enumerate(store.read_indices().tolist()):
        chosen = [t for c in sorted(pick[h]) for t in range((n_sink + c) * P, (n_sink + c + 1) * P)]
        assert [t for t in row if t >= 0] == list(range(n_sink * P)) + chosen + window
    assert store.device_tokens() == n_sink * P + len(window) + n_select * P

"""paged.py where mutation testing (docs/mutation.md) found wrong implementations the other tests
pass: test_paged.py locates pages with the store's own slot_of, so a slot map that is wrong for
the writer and the checker alike passes it. Here the pool's order is written out from its
definition (sink slots 0.., then n_select selected slots, then the window's ring, window page p
in slot n_sink + n_select + (p - n_sink) mod n_window), with geometries where 2 n_sink is not a
multiple of n_window, and what attention reads and the device holds is counted from it."""
import pytest
import torch

from .test_paged import D, H, make_store, tokens


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


def decoded_store(P, n_sink, n_select, seed):
    """A store (window of 2 pages) fed 8 pages of tokens one at a time, rolling as decoding does:
    -> (store, the keys fed)."""
    k, v = tokens(8 * P, seed)
    store = make_store(P, n_sink, n_select, 2)
    for t in range(k.shape[2]):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        store.roll()
    return store, k


@pytest.mark.parametrize("dropped_head", [0, 1])
def test_a_recall_that_only_empties_a_slot_empties_its_length(dropped_head):
    # a recall that copies nothing and only frees a slot (here candidate 0's, in either head)
    # must still zero that slot's length, or attention keeps reading the page that left; the
    # selected slots' lengths are each held page's fill, -1 none: written from the definition
    P, n_sink, n_select = 4, 1, 2
    store, k = decoded_store(P, n_sink, n_select, seed=3)
    held = [[1, 3], [1, 3]]
    held[dropped_head] = [0, 2]  # only the dropping head holds candidate 0
    assert store.recall(torch.tensor(held)) == 4
    keep = [list(row) for row in held]
    keep[dropped_head] = [-1, 2]  # that head lets candidate 0 go, and nothing is copied
    assert store.recall(torch.tensor(keep)) == 0
    lens = store.pool.page_lens[0, :, n_sink:n_sink + n_select].tolist()  # (H, n_select)
    for h, held in enumerate(store.held):
        assert sorted(c for c in held if c >= 0) == sorted(c for c in keep[h] if c >= 0)
        assert lens[h] == [P if c >= 0 else 0 for c in held]
    store.attend(torch.randn(1, H, D).to(k.device))
    read = [t for t in store.read_indices()[dropped_head].tolist() if t >= 0]
    assert not set(range(n_sink * P, (n_sink + 1) * P)) & set(read)  # candidate 0's tokens are not read


def test_a_grown_page_leaves_its_slot_and_only_its_slot():
    # icecache's pages grow: a store that names candidate 2 of head 0 as changed empties the slot
    # holding it (held -1, length 0, so attention stops reading the stale copy and the next
    # recall copies it again) and leaves every other slot as it was
    P, n_sink, n_select = 4, 1, 2
    store, _ = decoded_store(P, n_sink, n_select, seed=4)
    store.recall(torch.tensor([[0, 2], [2, 1]]))
    before = [list(row) for row in store.held]
    store.candidates.offload = lambda k, v, first: [[2], []]  # what a growing store reports
    store.store(None, None, store.n_cand)
    for h in range(H):
        for j, c in enumerate(before[h]):
            gone = h == 0 and c == 2
            assert store.held[h][j] == (-1 if gone else c)
            assert store.held_lens[h][j] == (0 if gone else P)
            assert store.pool.page_lens[0, h, n_sink + j] == (0 if gone else P)
    assert store.pool.page_lens[0, :, :n_sink].eq(P).all()  # the sink slots untouched
    assert store.recall(torch.tensor(before)) == 1  # the next recall copies the grown page again

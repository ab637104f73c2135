"""paged.py: the paged storage's invariants token by token (sink and window on the device, the
partly filled last page counted exactly, every offloaded page kept bit for bit on the host in HND
layout with its digest), prefill equals appends, and incremental recall (only missing pages move,
into the slots of dropped pages)."""
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from minikv.policies.host_pages import HostPages, page_digest
from minikv.policies.paged import PagedKV
from minikv.policies.pool import Staging
from minikv.policies.tiers import Tiers

from ..fixtures import DEVICE

H, D = 2, 8


def make_store(P=4, n_sink=1, n_select=2, n_window=2, max_len=200, digest="minmax"):
    tiers = Tiers(DEVICE)
    pages = HostPages(n_kv=H, head_dim=D, page_size=P, max_len=max_len, dtype=torch.float32, tiers=tiers, digest=digest)
    staging = Staging((max(1, H * n_select), 2, P, D), torch.float32, tiers)
    return PagedKV(candidates=pages, n_kv=H, head_dim=D, page_size=P, max_len=max_len, n_sink=n_sink,
                   n_select=n_select, n_window=n_window, dtype=torch.float32, tiers=tiers, backend="eager",
                   staging=staging)


def tokens(T, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, H, T, D, generator=g).to(DEVICE), torch.randn(1, H, T, D, generator=g).to(DEVICE)


def check_layout(store, k, v):
    """Sink pages and the window on the device, candidates on the host, digests of the host keys."""
    P, L = store.P, store.length
    n_pages = -(-L // P)
    for p in range(min(n_pages, store.n_sink)):
        s = store.slot_of(p)
        n = min(P, L - p * P)
        assert store.pool.page_lens[0, :, s].tolist() == [n] * H
        assert torch.equal(store.pool.k_pages[s, :n], k[0, :, p * P:p * P + n].transpose(0, 1))
    first_window = store.n_sink + store.n_cand
    assert n_pages - first_window <= store.n_window  # the window never outgrows its ring
    for p in range(first_window, n_pages):
        s = store.slot_of(p)
        n = min(P, L - p * P)
        assert store.pool.page_lens[0, :, s].tolist() == [n] * H  # the partly filled last page: n < P
        assert torch.equal(store.pool.k_pages[s, :n], k[0, :, p * P:p * P + n].transpose(0, 1))
        assert torch.equal(store.pool.v_pages[s, :n], v[0, :, p * P:p * P + n].transpose(0, 1))
    for c in range(store.n_cand):
        p = store.n_sink + c
        pages = store.candidates
        hk, hv = pages.host[c, :, 0], pages.host[c, :, 1]  # (H, P, D): one contiguous HND block per head
        host_k, host_v = (x[0, :, p * P:(p + 1) * P].to(hk.device) for x in (k, v))  # compared on the host
        assert torch.equal(hk, host_k) and torch.equal(hv, host_v)
        assert pages.host[c, 0].is_contiguous()
        lo, hi = page_digest(hk[None].to(pages.lo.device), pages.digest)  # where the digests live
        assert torch.equal(pages.lo[0, :, c], lo[0]) and torch.equal(pages.hi[0, :, c], hi[0])
    assert store.device_tokens() <= (store.n_sink + store.n_select + store.n_window) * P


@given(T=st.integers(1, 40), steps=st.integers(0, 30), P=st.sampled_from([1, 3, 4]), n_sink=st.integers(0, 2),
       n_window=st.integers(1, 3), seed=st.integers(0, 1000))
def test_appends_keep_sink_window_and_host_pages(T, steps, P, n_sink, n_window, seed):
    k, v = tokens(T + steps, seed)
    store = make_store(P, n_sink, 2, n_window)
    store.prefill(k[:, :, :T], v[:, :, :T])
    check_layout(store, k, v)
    for t in range(T, T + steps):
        store.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        check_layout(store, k, v)  # before the roll: the last page may be full
        store.roll()
        check_layout(store, k, v)


@given(T=st.integers(1, 60), P=st.sampled_from([2, 4]), n_window=st.integers(1, 3), seed=st.integers(0, 1000))
def test_prefill_equals_token_by_token(T, P, n_window, seed):
    k, v = tokens(T, seed)
    a = make_store(P, 1, 2, n_window)
    a.prefill(k, v)
    b = make_store(P, 1, 2, n_window)
    b.prefill(k[:, :, :1], v[:, :, :1])
    b.roll()
    for t in range(1, T):
        b.append(k[:, :, t:t + 1], v[:, :, t:t + 1])
        b.roll()
    assert (a.length, a.n_cand) == (b.length, b.n_cand)
    assert torch.equal(a.pool.page_lens, b.pool.page_lens)
    assert torch.equal(a.candidates.host[:a.n_cand], b.candidates.host[:b.n_cand])
    for s, n in enumerate(a.pool.page_lens[0, 0].tolist()):  # valid tokens only: past them a slot holds stale data
        assert torch.equal(a.pool.k_pages[s, :n], b.pool.k_pages[s, :n]) and torch.equal(a.pool.v_pages[s, :n], b.pool.v_pages[s, :n])


def test_arkvale_digest_is_a_box_around_the_centre():
    k = torch.randn(3, H, 4, D, device=DEVICE)
    lo, hi = page_digest(k, "arkvale")
    centre = (k.amin(2) + k.amax(2)) / 2
    torch.testing.assert_close((lo + hi) / 2, centre)
    torch.testing.assert_close((hi - lo) / 2, (k - centre[:, :, None]).abs().mean(2))
    with pytest.raises(ValueError, match="digest"):
        page_digest(k, "sphere")


def test_recall_is_incremental_and_fills_dropped_slots():
    P = 4
    k, v = tokens(60, 0)
    store = make_store(P, n_sink=1, n_select=3, n_window=1)
    store.prefill(k, v)  # 15 pages: 1 sink, 14 candidates (the last page is full, the window rolled)
    assert store.n_cand == 14
    assert store.recall(torch.tensor([[0, 5, 9], [1, 2, -1]], device=DEVICE)) == 5
    assert store.tiers.bytes_to_device == 5 * 2 * P * D * 4
    before = store.resident.clone()
    # head 0 keeps 5 and 9 and gets 7 in the slot of 0; head 1 keeps everything
    assert store.recall(torch.tensor([[9, 7, 5], [2, 1, -1]], device=DEVICE)) == 1
    slot = int((before[0] == 0).nonzero())
    assert store.resident[0, slot] == 7 and store.resident[1].tolist() == before[1].tolist()
    for h in range(H):
        for j, c in enumerate(store.resident[h].tolist()):
            s = store.n_sink + j
            if c < 0:
                assert store.pool.page_lens[0, h, s] == 0
                continue
            p = store.n_sink + c
            assert store.pool.page_lens[0, h, s] == P
            assert torch.equal(store.pool.k_pages[s, :, h], k[0, h, p * P:(p + 1) * P])
            assert torch.equal(store.pool.v_pages[s, :, h], v[0, h, p * P:(p + 1) * P])
    # only some heads: head 1 keeps its pages whatever the selection says for it
    assert store.recall(torch.tensor([[9, 7, 5], [11, 12, 13]], device=DEVICE),
                        heads=torch.tensor([False, False], device=DEVICE)) == 0


def test_impossible_window():
    with pytest.raises(ValueError, match="n_window"):
        make_store(n_window=0)


@given(st.integers(1, 4), st.integers(1, 6), st.sampled_from([1, 2, 3]), st.integers(0, 2**31 - 1))
def test_attend_reads_the_pool_as_the_page_table_says(P, S, G, seed):
    """The eager attend (pool_attention: the identity table, the pool read in place) equals the
    paged_attention reference, which gathers what the table lists: partly filled and unused slots
    masked per KV head, whatever the hidden slots hold."""
    from minikv.kernels.paged_attention import paged_attention
    from minikv.policies.pool_fast import pool_attention
    g = torch.Generator().manual_seed(seed)
    k, v = torch.randn(S, P, H, D, generator=g), torch.randn(S, P, H, D, generator=g)
    lens = torch.randint(0, P + 1, (1, H, S), generator=g, dtype=torch.int32)
    lens[0, :, 0] = torch.randint(1, P + 1, (H,), generator=g, dtype=torch.int32)  # a token per head
    q = torch.randn(1, H * G, D, generator=g)
    table = torch.arange(S, dtype=torch.int32).expand(1, H, S).contiguous()
    k, v, lens, q, table = (x.to(DEVICE) for x in (k, v, lens, q, table))  # drawn on the CPU, run on the device
    want = paged_attention(q, k, v, table, lens)
    got = pool_attention(q, k, v, table, lens)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    k2 = k.clone()
    k2[(torch.arange(P, device=DEVICE) >= lens[0, :, :, None]).permute(1, 2, 0)] = 1e4  # hidden keys change nothing
    torch.testing.assert_close(pool_attention(q, k2, v, table, lens), want, rtol=1e-5, atol=1e-6)


def test_the_store_holds_exactly_max_len_tokens():
    """A prompt of max_len tokens fits; one more, by prefill or by append, is refused by name."""
    store = make_store(max_len=40)  # 10 pages of 4
    k, v = tokens(40, seed=1)
    store.prefill(k, v)
    with pytest.raises(ValueError, match=r"^the sequence outgrew max_len \(40 tokens\)$"):
        store.append(*tokens(1, seed=2))
    with pytest.raises(ValueError, match=r"^41 tokens exceed the capacity of 10 pages of 4$"):
        make_store(max_len=40).prefill(*tokens(41, seed=3))


def test_the_pools_index_tensors_are_counted_in_bytes():
    """aux_bytes: the page table and the page lengths, int32 each, (1, Hkv, S), beside the digests
    (lo, hi: (1, Hkv, max_pages, D) float32 each)."""
    store = make_store(P=4, n_sink=1, n_select=2, n_window=2, max_len=40)  # S = 5 slots, 10 pages
    assert store.aux_bytes() == (2 * (H * 5) * 4 + 2 * (H * 10 * D) * 4, 0)

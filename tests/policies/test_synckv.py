"""synckv: against an oracle that recomputes, step by step, what Algorithm 1 says each head reads.
Anticipation exactly every m-th step (Eqs. 5-7), suspension steps read the sets the last
anticipation chose and move nothing (Eq. 8), the static set never leaves the device (Eq. 4),
nothing offloaded is lost, a budget covering the context equals full KV (a tiny random checkpoint
and SmolLM2), the ablation switches, stats, attended_indices, parameter errors."""
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.config import ModelConfig
from minikv.kernels.attention_topk import reference as topk_reference
from minikv.kernels.decode_attention import reference as attn_reference
from minikv.models.attention import dense_attention
from minikv.policies import make

from .test_freekv import accept_reference_backend  # at import: inside a @given test it reads as nesting
from minikv.policies.synckv.clusters import FORMAT, config_sha256

from ..fixtures import DEVICE, ITEMS_PROMPT, greedy_logits

TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                   n_heads=6, n_kv_heads=3, head_dim=16, max_position_embeddings=4096, rotary_dim=16)
# layer 0: one cluster (R-head 1); layer 1: {0, 2} led by 2, and head 1 alone (nobody to serve)
TINY_CLUSTERS = [{"clusters": [[0, 1, 2]], "r_heads": [1]}, {"clusters": [[0, 2], [1]], "r_heads": [2, 1]}]


def write_clusters(path, cfg, layers, n_r=1):
    doc = {"format": FORMAT, "model": {"name": "test", "config_sha256": config_sha256(cfg), "weights_sha256": "-",
                                       "n_layers": cfg.n_layers, "n_kv_heads": cfg.n_kv_heads},
           "corpus": {}, "seed": 0, "similarity": [], "clusterings": {str(n_r): layers}}
    path.write_text(json.dumps(doc))
    return str(path)


@pytest.fixture(scope="module")
def tiny_clusters(tmp_path_factory):
    return write_clusters(tmp_path_factory.mktemp("synckv") / "tiny.json", TINY, TINY_CLUSTERS)


def expected_selection(q1, keys, layer, k_top, n_cand, static):
    """Eqs. 5-6 from scratch: each R-head's attention over all its keys (its lse), max-pooled over
    its group, top k_top among the first n_cand tokens not in its cluster's static set."""
    if k_top == 0:  # rho = 1: there is no dynamic set
        return [[] for _ in layer.r_heads]
    G = TINY.n_groups
    rq = [h * G + g for h in layer.r_heads for g in range(G)]
    kr = keys[:, layer.r_heads]
    L = kr.shape[2]
    _, lse = attn_reference.decode_attention(q1[:, rq], kr, kr, torch.tensor([L]), return_lse=True)
    keep = torch.ones(1, len(layer.r_heads), n_cand, dtype=torch.bool)
    for c, s in enumerate(static):
        keep[0, c, [t for t in s if t < n_cand]] = False
    _, top = topk_reference.attention_topk(q1[:, rq], kr[:, :, :n_cand], lse, torch.tensor([n_cand]), keep, k_top)
    return [sorted(t for t in row if t >= 0) for row in top[0].tolist()]


def oracle_attention(q1, keys, values, reads):
    """Dense attention where the query heads of KV head m read exactly the tokens reads[m]."""
    G = TINY.n_groups
    outs = [dense_attention(q1[:, m * G:(m + 1) * G, None], keys[:, m:m + 1, t], values[:, m:m + 1, t])
            for m, t in enumerate(torch.tensor(r) for r in reads)]
    return torch.cat(outs, dim=1)[:, :, 0]


@st.composite
def synckv_cases(draw):
    window, m, anticipation = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.booleans())
    ring = window + m - 1 if anticipation else window  # the window's slots: the budget is more
    return dict(window=window, budget=ring + draw(st.integers(1, 14)), rho=draw(st.sampled_from([0.0, 0.3, 0.5, 1.0])),
                m=m, T=draw(st.integers(1, 30)), steps=draw(st.integers(1, 14)),
                offload=draw(st.booleans()), anticipation=anticipation, seed=draw(st.integers(0, 2**16)))


def run_against_oracle(case, clusters, backend="eager"):
    spec = (f"synckv:budget={case['budget']},window={case['window']},rho={case['rho']},m={case['m']},wide_layers=0,"
            f"offload={case['offload']},anticipation={case['anticipation']},clusters={clusters},backend={backend}")
    # the policy on the test device, the oracle on the CPU: inputs go there, outputs come back
    policy = make(spec).bind(TINY, device=DEVICE, dtype=torch.float32, max_len=80)
    g = torch.Generator().manual_seed(case["seed"])
    T, W = case["T"], case["window"]
    keys, values = [None] * TINY.n_layers, [None] * TINY.n_layers
    static = [None] * TINY.n_layers
    # the recent window is [start, L): the last W tokens as of the next step, set at each selection
    # point (the prefill, every anticipation; every step w/o anticipation), prompt tail included
    start = [max(0, T + 1 - W)] * TINY.n_layers
    for step in range(case["steps"] + 1):
        n = T if step == 0 else 1
        for i, layer in enumerate(policy.layers):
            q = torch.randn(1, TINY.n_heads, n, TINY.head_dim, generator=g)
            k = torch.randn(1, TINY.n_kv_heads, n, TINY.head_dim, generator=g)
            v = torch.randn(1, TINY.n_kv_heads, n, TINY.head_dim, generator=g)
            keys[i] = k if step == 0 else torch.cat((keys[i], k), 2)
            values[i] = v if step == 0 else torch.cat((values[i], v), 2)
            if step == 0:
                layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None)
                # Eqs. 3-4: I_0 = top-k of the R-head's attention from the last prompt token,
                # among the tokens before the window
                chosen = expected_selection(q[:, :, -1], keys[i], layer, policy.k_static + policy.k_dyn, start[i],
                                            [[] for _ in layer.clusters])
                assert [sorted(s + [t for t in d if t >= 0]) for s, d in zip(layer.static, layer.dynamic)] == chosen
                static[i] = [list(s) for s in layer.static]
                assert all(len(s) == min(policy.k_static, start[i]) for s in static[i])
                if layer.nr_heads:
                    check_device_and_host(layer, keys[i], values[i], T, start[i])
                continue
            before = (policy.tiers.bytes_to_device, [list(d) for d in layer.dynamic], layer.anticipations)
            L = keys[i].shape[2]
            out = layer.decode(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), None).cpu()
            window = list(range(start[i], L))
            assert len(window) >= min(W, L)  # the last W tokens are always read
            # what each KV head read: R-heads everything, NR-heads static + dynamic + window
            reads = layer.attended_indices()
            expect_reads = {h: list(range(L)) for h in layer.r_heads}
            for h, c in zip(layer.nr_heads, layer.nr_cluster):
                expect_reads[h] = sorted(static[i][c] + [t for t in before[1][c] if t >= 0] + window)
                assert len(expect_reads[h]) <= case["budget"]  # the budget holds
            if reads is None:
                assert all(len(r) == L for r in expect_reads.values())
            else:
                got = [sorted(t for t in row if t >= 0) for row in reads.tolist()]
                assert got == [expect_reads[h] for h in range(TINY.n_kv_heads)]
            torch.testing.assert_close(out[:, :, 0], oracle_attention(q[:, :, 0], keys[i], values[i],
                                                                       [expect_reads[h] for h in range(TINY.n_kv_heads)]))
            assert layer.static == static[i]  # the static set never changes...
            anticipating = case["anticipation"] and bool(layer.nr_heads) and step % case["m"] == 0
            assert layer.anticipations == before[2] + anticipating
            if layer.nr_heads and (anticipating or not case["anticipation"]):  # a selection point
                start[i] = max(start[i], L + 1 - W)
            if not anticipating:  # suspension (Eq. 8): nothing selected, nothing moved
                assert [list(d) for d in layer.dynamic] == before[1]
                assert policy.tiers.bytes_to_device == before[0]
            else:  # anticipation (Eqs. 5-7): the R-head's top k_dyn among the tokens before the window
                want = expected_selection(q[:, :, 0], keys[i], layer, policy.k_dyn, start[i], static[i])
                for c, members in enumerate(layer.clusters):
                    if len(members) > 1:
                        assert sorted(t for t in layer.dynamic[c] if t >= 0) == want[c]
            check_device_and_host(layer, keys[i], values[i], T, start[i])
        policy.end_step()
    return policy


def check_device_and_host(layer, keys, values, T, start):
    """...and stays on the device bit for bit, as do the dynamic and window slots; the host bank
    holds every token that left the device (all the prompt, generated tokens past the window)."""
    L = keys.shape[2]
    assert list(layer.window_tokens()) == list(range(start, L))
    for j, (h, c) in enumerate(zip(layer.nr_heads, layer.nr_cluster)):
        for t in layer.read_tokens(c):
            s = layer.slot_of(t, c)
            assert (torch.equal(layer.bank.store_k[0, j, s].cpu(), keys[0, h, t])  # the device's rows, on the host
                    and torch.equal(layer.bank.store_v[0, j, s].cpu(), values[0, h, t]))
        if layer.offload:
            banked = max(T, start)
            assert torch.equal(layer.bank.bank_k[j, :banked], keys[0, h, :banked])
            assert torch.equal(layer.bank.bank_v[j, :banked], values[0, h, :banked])
    assert torch.equal(layer.kr[0, :, :L].cpu(), keys[0, layer.r_heads])


@settings(max_examples=12)
@given(case=synckv_cases())
def test_anticipation_every_m_steps_suspension_reads_the_last_choice_and_moves_nothing(case, tiny_clusters):
    policy = run_against_oracle(case, tiny_clusters)
    s = policy.stats()
    expected = case["steps"] // case["m"] if case["anticipation"] else 0
    assert s["anticipation_steps"] == expected
    if not case["offload"]:
        assert s["bytes_to_host"] == 0 and s["bytes_to_device"] == 0 and s["mem_percent"] == 100.0


@settings(max_examples=2)
@given(case=synckv_cases())
def test_triton_backend_matches_oracle(case, tiny_clusters):
    case.update(steps=min(case["steps"], 5), T=min(case["T"], 20))
    run_against_oracle(case, tiny_clusters, backend="triton")


@settings(max_examples=4)
@given(case=synckv_cases())
def test_reference_backend_matches_oracle_and_eager(case, tiny_clusters):
    """backend=reference: every operation by its reference (what eager runs for synckv, whose
    NR-heads read gathered slots, not a page pool): the oracle's reads, eager's fetches."""
    with pytest.MonkeyPatch.context() as mp:
        accept_reference_backend(mp)
        ref = run_against_oracle(case, tiny_clusters, backend="reference")
    eager = run_against_oracle(case, tiny_clusters)
    keys = ("tokens_fetched", "anticipation_steps", "bytes_to_device", "bytes_to_host", "device_tokens")
    assert [ref.stats()[k] for k in keys] == [eager.stats()[k] for k in keys]


def test_the_prompts_last_tokens_are_read_by_every_head_from_the_first_step(tiny_clusters):
    """The recent window starts in the prompt: at the first decode step the NR-heads read the
    prompt's last window - 1 tokens and the new one, from the device, besides I_0 (chosen among
    the tokens before them); each NR-head's output equals dense attention over exactly those."""
    policy = make(f"synckv:budget=24,window=8,m=4,wide_layers=0,clusters={tiny_clusters}").bind(TINY, device=DEVICE,
                                                                                   dtype=torch.float32, max_len=64)
    g = torch.Generator().manual_seed(1)
    layer, T = policy.layers[0], 40  # one cluster {0, 1, 2} led by 1: NR-heads 0 and 2
    q, k, v = (torch.randn(1, h, T, 16, generator=g).to(DEVICE) for h in (6, 3, 3))
    layer.prefill(q, k, v, None)
    q1, k1, v1 = (torch.randn(1, h, 1, 16, generator=g).to(DEVICE) for h in (6, 3, 3))
    out = layer.decode(q1, k1, v1, None)
    keys, values = torch.cat((k, k1), 2), torch.cat((v, v1), 2)
    tail = list(range(T - 7, T + 1))
    read = layer.attended_indices()
    chosen = layer.static[0] + [t for t in layer.dynamic[0] if t >= 0]
    assert len(chosen) == 24 - (8 + 4 - 1) and max(chosen) < T - 7  # I_0 = k tokens before the window
    for h in layer.nr_heads:
        assert sorted(t for t in read[h].tolist() if t >= 0) == sorted(chosen + tail)
    expect = oracle_attention(q1[:, :, 0], keys, values, [sorted(chosen + tail) if h != 1 else list(range(T + 1))
                                                          for h in range(3)])
    torch.testing.assert_close(out[:, :, 0], expect)
    assert layer.host_tokens() == 2 * T / 3  # the bank still holds the whole prompt


def test_smollm2_small_budget_anticipates(smollm2):
    """SmolLM2 with the shipped clustering, ~330 prompt tokens, 6 steps (a budget covering the
    context giving full KV's logits: test_contract's matrix): the paper's rule (wide_layers=0) at budget 96 reads at most 96
    tokens per NR-head, the last 32 tokens among them (the recent window, prompt tail included),
    fetches at every 5th step and keeps Mem% = (1 + 2 * read / L) / 3 (one R-head of 3 KV heads at
    full length); the default also keeps the 4 layers whose heads agree least whole."""
    from minikv.policies.synckv.clusters import least_agreeing_layers, read_similarity

    model, tok = smollm2
    ids = torch.tensor([tok.encode(ITEMS_PROMPT)], device=DEVICE)
    T = ids.shape[1]
    L = T + 6
    assert 250 < T < 500
    logits = {}
    for spec in ("synckv:budget=96,wide_layers=0", "synckv:budget=96"):
        logits[spec], policy = greedy_logits(model, ids, spec, 6)
        if spec.startswith("synckv:budget=96"):
            s = policy.stats()
            assert s["anticipation_steps"] == 1 and s["tokens_fetched"] > 0
            wide = [] if "wide_layers=0" in spec else least_agreeing_layers(read_similarity(policy.clustering_file), 4)
            assert [i for i, layer in enumerate(policy.layers) if not layer.nr_heads] == wide
            read = [len(layer.read_tokens(0)) if i not in wide else L for i, layer in enumerate(policy.layers)]
            assert max(r for i, r in enumerate(read) if i not in wide) <= 96
            expected = 100 * sum(1 + 2 * r / L for r in read) / 3 / len(read)
            assert abs(s["mem_percent"] - expected) < 1e-9
            for layer in policy.layers:  # every NR-head read the last 32 tokens, the prompt's last 26 among them
                rows = layer.attended_indices()
                assert all(set(range(L - 32, L)) <= set(rows[h].tolist()) for h in layer.nr_heads)


def test_every_head_an_r_head_is_full_kv(tmp_path):
    clusters = write_clusters(tmp_path / "all.json", TINY, [{"clusters": [[0], [1], [2]], "r_heads": [0, 1, 2]}] * 2, n_r=3)
    policy = make(f"synckv:n_r=3,budget=8,window=2,clusters={clusters}").bind(TINY, device=DEVICE, dtype=torch.float32,
                                                                              max_len=40)
    g = torch.Generator().manual_seed(0)
    layer = policy.layers[0]
    layer.prefill(*(torch.randn(1, h, 20, 16, generator=g).to(DEVICE) for h in (6, 3, 3)), None)
    layer.decode(*(torch.randn(1, h, 1, 16, generator=g).to(DEVICE) for h in (6, 3, 3)), None)
    assert layer.attended_indices() is None and layer.host_tokens() == 0 and layer.device_tokens() == 21


@pytest.mark.parametrize("spec, message", [
    ("synckv:budget=36", r"budget must be an int > the recent window's slots \(window \+ m - 1 = 36\)"),
    ("synckv:budget=32,anticipation=off", r"budget must be an int > the recent window's slots \(window = 32\)"),
    ("synckv:window=-1", "window must be an int >= 0"),
    ("synckv:rho=1.5", "rho"),
    ("synckv:m=0", "synchronization stride"),
    ("synckv:n_r=0", "n_r"),
    ("synckv:offload=maybe", "offload is a boolean"),
])
def test_impossible_parameters(spec, message):
    with pytest.raises(ValueError, match=message):
        make(spec)


def test_a_model_without_a_clustering_names_the_command(tmp_path, device):
    with pytest.raises(ValueError, match="python -m minikv.bench cluster-heads"):
        make("synckv").bind(TINY, device=device, dtype=torch.float32, max_len=40)
    other = write_clusters(tmp_path / "other.json", ModelConfig(**{**TINY.__dict__, "vocab_size": 65}), TINY_CLUSTERS)
    with pytest.raises(ValueError, match="made for another model"):
        make(f"synckv:wide_layers=0,clusters={other}").bind(TINY, device=device, dtype=torch.float32, max_len=40)
    with pytest.raises(ValueError, match="no clustering for n_r=2"):
        make(f"synckv:n_r=2,wide_layers=0,clusters={write_clusters(tmp_path / 't.json', TINY, TINY_CLUSTERS)}").bind(
            TINY, device=device, dtype=torch.float32, max_len=40)


# -- beyond the paper: uneven N_r over layers ---------------------------------


def test_least_agreeing_layers_are_the_lowest_mean_similarity_off_the_diagonal():
    from minikv.policies.synckv.clusters import least_agreeing_layers
    eye = torch.eye(3, dtype=torch.float64)
    S = torch.stack([eye + s * (1 - eye) for s in (0.5, 0.2, 0.9, 0.2)])
    S[2, 0, 1] = S[2, 1, 0] = 0.0  # layer 2: mean (0.9 * 4 + 0) / 6 = 0.6, still above 0.5
    assert least_agreeing_layers(S, 1) == [1]  # ties to the lower layer
    assert least_agreeing_layers(S, 2) == [1, 3]
    assert least_agreeing_layers(S, 3) == [0, 1, 3]
    S[0] = 0.5 * eye + 0.3 * (1 - eye)  # the diagonal does not count: layer 1 (0.2) still agrees least
    assert least_agreeing_layers(S, 1) == [1]


WIDE_CLUSTERS = [{"clusters": [[0, 1], [2]], "r_heads": [1, 2]}, {"clusters": [[0], [1, 2]], "r_heads": [0, 2]}]
ALL_HEADS = [{"clusters": [[0], [1], [2]], "r_heads": [0, 1, 2]}] * 2


@pytest.mark.parametrize("wide_n_r, layer1", [(0, ALL_HEADS[1]), (2, WIDE_CLUSTERS[1]), (3, ALL_HEADS[1])])
def test_wide_layers_take_more_clusters_in_the_least_agreeing_layers(tmp_path, wide_n_r, layer1):
    path = write_clusters(tmp_path / "s.json", TINY, TINY_CLUSTERS)
    doc = json.loads(open(path).read())
    doc["similarity"] = [[[1, .6, .6], [.6, 1, .6], [.6, .6, 1]], [[1, .3, .6], [.3, 1, .3], [.6, .3, 1]]]
    doc["clusterings"].update({"2": WIDE_CLUSTERS, "3": ALL_HEADS})
    open(path, "w").write(json.dumps(doc))
    policy = make(f"synckv:budget=12,window=2,m=2,wide_layers=1,wide_n_r={wide_n_r},clusters={path}").bind(
        TINY, device=DEVICE, dtype=torch.float32, max_len=40)
    # layer 1 agrees least: it takes the wider clustering, layer 0 keeps n_r = 1's
    assert [{"clusters": layer.clusters, "r_heads": layer.r_heads} for layer in policy.layers] == [TINY_CLUSTERS[0], layer1]
    g = torch.Generator().manual_seed(0)
    for layer in policy.layers:
        layer.prefill(*(torch.randn(1, h, 30, 16, generator=g).to(DEVICE) for h in (6, 3, 3)), None)
        layer.decode(*(torch.randn(1, h, 1, 16, generator=g).to(DEVICE) for h in (6, 3, 3)), None)
    assert (policy.layers[1].attended_indices() is None) == (wide_n_r != 2)
    # Mem%: the R-heads whole (31 tokens), the NR-heads their reads
    whole = [len(layer.r_heads) * 31 / 3 for layer in policy.layers]
    nr = [layer.nr_read() / 3 for layer in policy.layers]
    assert policy.stats()["mem_percent"] == pytest.approx(100 * sum(whole + nr) / 62)
    with pytest.raises(ValueError, match=r"wide_n_r must be > n_r \(1\) and <= the model's 3"):
        make(f"synckv:wide_layers=1,wide_n_r=4,clusters={path}").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=40)
    # more wide layers than the model has (the default, 4, on this 2-layer model): every layer is wide
    policy = make(f"synckv:budget=12,window=2,m=2,clusters={path}").bind(TINY, device=DEVICE, dtype=torch.float32,
                                                                        max_len=40)
    assert [layer.r_heads for layer in policy.layers] == [[0, 1, 2], [0, 1, 2]]
    doc["similarity"] = []
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(ValueError, match="holds no head similarity"):
        make(f"synckv:wide_layers=1,clusters={path}").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=40)


def test_a_clustering_that_does_not_partition_the_heads_is_refused(tmp_path, device):
    bad = write_clusters(tmp_path / "bad.json", TINY, [TINY_CLUSTERS[0], {"clusters": [[0, 2]], "r_heads": [2]}])
    with pytest.raises(ValueError, match="layer 1's clusters do not partition the KV heads"):
        make(f"synckv:wide_layers=0,clusters={bad}").bind(TINY, device=device, dtype=torch.float32, max_len=40)

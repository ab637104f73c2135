"""bench needle-mass: the needle's mass, what a policy's reads held of it, and the needle page's ranks,
on hand-made attention and on a freekv layer whose keys put the needle in a known page."""
import pytest
import torch

from minikv.bench.research.needle_mass import NeedleProbe, best_rank, needle_mass, needle_pages, rank_table
from minikv.policies import make

from ...fixtures import DEVICE
from ..test_attention_recall import tiny_cfg


def test_needle_mass_takes_the_group_head_that_reads_the_needle_and_its_held_part():
    # 4 query heads, 2 KV heads (G = 2), 6 tokens, needle = tokens 2 and 3
    p = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.1, 0.1],    # KV head 0: head 0 puts 0.2 on the needle
                      [0.1, 0.1, 0.3, 0.3, 0.1, 0.1],    #            head 1 puts 0.6: the group's
                      [0.1, 0.1, 0.4, 0.0, 0.4, 0.0],    # KV head 1: head 2 puts 0.4: the group's
                      [0.9, 0.1, 0.0, 0.0, 0.0, 0.0]])
    read = torch.tensor([[0, 3, -1],   # KV head 0 read token 3 of the needle, not token 2
                         [2, 4, 5]])   # KV head 1 read token 2, all of its needle mass
    mass, held = needle_mass(p, read, (2, 4), G=2)
    assert mass.tolist() == pytest.approx([0.6, 0.4])
    assert held.tolist() == pytest.approx([0.3, 0.4])


def test_needle_pages_and_ranks():
    # candidates of 16 tokens from token 32: a needle over [40, 70) lies in candidates 0, 1, 2
    assert needle_pages((40, 70), 32, 16, 4) == [0, 1, 2]
    assert needle_pages((48, 64), 32, 16, 4) == [1]  # exactly candidate 1: its neighbours hold none
    assert needle_pages((10, 20), 32, 16, 4) == []  # in the sink
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.7], [0.1, 0.2, 0.3, 0.4]])
    assert best_rank(scores, [1, 2]).tolist() == [2, 1]  # head 0: page 2 is third; head 1: page 2 second


def drive_freekv(decoy: bool, steps: int = 3):
    """One freekv layer (pages of 4, sink 4, window 4, budget 16: K = 1 selected page) over 40
    prompt tokens whose needle, tokens 12..15, is candidate page 2 (keys 4 e_0); with `decoy`,
    tokens 20..23 (candidate 4) hold keys 6 e_0, which every page score and the true mass rank
    first. Only query head 1 (of KV head 0's group 0..2) looks along e_0."""
    g = torch.Generator().manual_seed(0)
    policy = make("freekv:page_size=4,sink=4,window=4,budget=16,speculative=false")
    probe = NeedleProbe(policy, (12, 16))
    policy.bind(tiny_cfg(n_layers=1), device=DEVICE, dtype=torch.float32, max_len=64)
    layer = policy.layer(0)
    T, D = 40, 8
    k = 0.1 * torch.randn(1, 2, T + steps, D, generator=g)
    k[0, :, 12:16, 0] = 4.0
    if decoy:
        k[0, :, 20:24, 0] = 6.0
    v = torch.randn(1, 2, T + steps, D, generator=g)
    q = torch.zeros(1, 6, 1, D)
    q[0, 1, 0, 0] = 4.0
    qd, kd, vd = q.to(DEVICE), k.to(DEVICE), v.to(DEVICE)  # the layer's copies; the oracle below reads k
    layer.prefill(qd.expand(1, 6, T, D), kd[:, :, :T], vd[:, :, :T], torch.arange(T, device=DEVICE)[None])
    for t in range(T, T + steps):
        layer.decode(qd, kd[:, :, t:t + 1], vd[:, :, t:t + 1], torch.tensor([[t]], device=DEVICE))
    expected = torch.softmax(k[0, 0, :, 0] * 4.0 / D ** 0.5, dim=0)  # head 1 over all T + steps tokens
    return probe.records, expected[12:16].sum().item()


def test_freekv_reading_the_needle_page_holds_its_mass():
    records, mass = drive_freekv(decoy=False)
    last = records[-1]
    assert last["mass"][0].item() == pytest.approx(mass, rel=1e-5)
    assert last["held"][0].item() == pytest.approx(mass, rel=1e-5)  # K = 1 page: the needle's
    assert last["oracle"][0].item() == pytest.approx(mass, rel=1e-5)
    assert all(last[f"rank/{d}/{r}"][0] == 0 for d in ("minmax", "arkvale") for r in ("softmax_mean", "mean", "max"))
    assert last["rank/true"][0] == 0


def test_freekv_reading_a_decoy_page_holds_nothing_of_the_needle():
    records, head1 = drive_freekv(decoy=True)
    last = records[-1]
    uniform = 4 / 43  # heads 0 and 2 (q = 0) spread their mass evenly: 4 needle tokens of 43
    assert head1 < uniform  # the decoy draws head 1's mass: the group's largest needle mass is theirs
    assert last["mass"][0].item() == pytest.approx(uniform, rel=1e-5)
    assert last["held"][0].item() == 0.0  # the one selected page is the decoy
    assert last["oracle"][0].item() == 0.0  # the best page by true mass is the decoy too
    assert last["rank/true"][0] == 1 and last["rank/arkvale/softmax_mean"][0] == 1


def test_rank_table_weights_by_needle_mass():
    rows = [{"mass": 0.5, "held": 0.5, "rank/true": 0, "rank/x": 2},
            {"mass": 0.3, "held": 0.0, "rank/true": 1, "rank/x": 0},
            {"mass": 0.2, "held": 0.1, "rank/true": 5, "rank/x": 2},
            {"mass": 0.9, "held": 0.9}]  # needle in the window: no rank, not counted
    table = {r["score"]: r for r in rank_table(rows, K=2)}
    assert table["policy's reads (held share)"]["top"] == pytest.approx(0.6)
    assert (table["true"]["top"], table["true"]["next"], table["true"]["near"], table["true"]["far"]) == \
        pytest.approx((0.8, 0.0, 0.0, 0.2))
    assert (table["x"]["top"], table["x"]["next"]) == pytest.approx((0.3, 0.7))
    assert table["true"]["held"] == pytest.approx(0.5 / 0.8)  # of the two records true ranks top 2
    assert table["x"]["held"] == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--tasks", "niah_multivalue"], "tasks with one needle"),  # four needles: one span would mislead
    (["--tasks", "vt"], "tasks with one needle and a pydoc haystack are passkey, niah_single_1"),
    (["--policy", "freekv:digest=sphere"], "digest"),
    (["--length", "10"], "--length"),
])
def test_bad_flags_are_one_line_errors(argv, message):
    from minikv.bench.__main__ import main

    with pytest.raises(ValueError, match=message):
        main(["--check", "needle-mass", *argv])

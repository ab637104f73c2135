"""softfreeze's batched schedule (FreezeTiers.schedule_all: Algorithm 1 for all layers at once)
against its per-layer reference (schedule_layer, one layer after the other), step by step on random
relevance scores: after every step both hold the same tokens in the same slots, the same K/V bit
for bit on both tiers, and the same counts, timers and counters."""
from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.policies import make
from minikv.policies.softfreeze_schedule import NOT_FROZEN

from .test_softfreeze import TINY


def twin_tiers(spec: str, n_layers: int, max_len: int):
    cfg = replace(TINY, n_layers=n_layers)
    bind = lambda: make(spec).bind(cfg, device="cpu", dtype=torch.float32, max_len=max_len).state  # noqa: E731
    return bind(), bind()


def assert_same(a, b, where: str) -> None:
    for name in ("n_act", "n_tok", "n_frozen", "freezes", "thaws"):
        assert getattr(a, name) == getattr(b, name), f"{where}: {name}"
    for l in range(a.L):
        n, T = a.n_act[l], a.n_tok[l]
        assert torch.equal(a.slots[:, l, :n], b.slots[:, l, :n]), f"{where}, layer {l}: slot tokens or counts"
        assert torch.equal(a.kv[l, :n], b.kv[l, :n]), f"{where}, layer {l}: active K/V"
        for name in ("count", "thaw_at", "frozen_at", "on_host") + (("seen",) if a.seen is not None else ()):
            assert torch.equal(getattr(a, name)[l, :T], getattr(b, name)[l, :T]), f"{where}, layer {l}: {name}"
        frozen = (a.thaw_at[l, :T] != NOT_FROZEN).nonzero()[:, 0]
        assert torch.equal(a.kv_host[l, frozen], b.kv_host[l, frozen]), f"{where}, layer {l}: frozen K/V"


def run_twins(spec, n_layers, n_prompt, steps, seed, ops=(), discrete=False):
    """Drive a (batched) and b (per layer) with the same tokens and scores; compare every step.
    ops[t] in {"", "grow", "unfreeze"}: after step t, grow a's buffers only (the batched step
    must not depend on the capacity), or unfreeze the same random tokens in both (a rung)."""
    a, b = twin_tiers(spec, n_layers, n_prompt + steps)
    g = torch.Generator().manual_seed(seed)
    Hkv, D = a.Hkv, a.D
    for l in range(n_layers):
        k, v = torch.randn(Hkv, n_prompt, D, generator=g), torch.randn(Hkv, n_prompt, D, generator=g)
        a.fill(l, k, v)
        b.fill(l, k, v)
    for t in range(steps):
        if t:
            for l in range(n_layers):
                k, v = torch.randn(1, Hkv, 1, D, generator=g), torch.randn(1, Hkv, 1, D, generator=g)  # as decode gets them
                a.append(l, k, v)
                b.append(l, k, v)
        # scores from a few values make ties with tau (and with the relative threshold) common
        scores = [torch.randint(0, 4, (n,), generator=g).float() / 2 if discrete else torch.rand(n, generator=g) * 2
                  for n in a.n_act]
        a.schedule_all(scores, t)
        for l, s in enumerate(scores):
            b.schedule_layer(l, s, t)
        assert_same(a, b, f"step {t}")
        op = ops[t] if t < len(ops) else ""
        if op == "grow":
            a.reserve(a.cap + 1)
        elif op == "unfreeze":
            for l in range(n_layers):
                frozen = (a.thaw_at[l, : a.n_tok[l]] != NOT_FROZEN).nonzero()[:, 0]
                pick = frozen[torch.rand(len(frozen), generator=g) < 0.5]
                a.restore(l, pick)
                b.restore(l, pick)
        assert_same(a, b, f"after step {t} and {op!r}")
    return a


@settings(max_examples=30, deadline=None)
@given(n_layers=st.integers(1, 4), n_prompt=st.integers(1, 40), steps=st.integers(1, 40),
       window=st.integers(0, 6), tau=st.sampled_from([0.3, 0.5, 1.0, 1.5]), softness=st.sampled_from([0.5, 1.0, 2.0]),
       history=st.none() | st.integers(1, 8), score=st.sampled_from(["raw", "relative"]), discrete=st.booleans(),
       ops=st.lists(st.sampled_from(["", "", "", "grow", "unfreeze"]), max_size=40), seed=st.integers(0, 2**16))
def test_batched_schedule_equals_the_per_layer_schedule(n_layers, n_prompt, steps, window, tau, softness, history,
                                                         score, discrete, ops, seed):
    spec = f"softfreeze:window={window},tau={tau},softness={softness},history={history},score={score},egr=false"
    run_twins(spec, n_layers, n_prompt, steps, seed, ops, discrete)


def test_batched_schedule_over_a_long_run_with_every_kind_of_move():
    # softness 1: d grows past 1 within the run; relative tau 1: about half the slots are low
    for history in (None, 6):
        spec = f"softfreeze:window=4,tau=1.0,softness=1,history={history},egr=false"
        a = run_twins(spec, n_layers=3, n_prompt=50, steps=120, seed=7, ops=["", "", "", "", "grow", "unfreeze"] * 20)
        assert min(a.freezes) > 100 and min(a.thaws) > 100 and min(a.n_frozen) > 0
        assert len(set(a.n_act)) > 1, "the layers should differ in their active tokens"
        # a token's K/V goes to the host once: its refreezes (most freezes here) copy nothing
        assert a.p.tiers.bytes_to_host == int(a.on_host.sum()) * a.p.token_bytes() > 0
        assert sum(a.freezes) > 2 * int(a.on_host.sum())


def test_appended_slots_read_as_written():
    """append records the new slot's fields (token, c_j = 0) and writes them when something
    reads the slots: read after every append, or only once after many appends across growths
    of the buffers (a growth copies the slots, so it writes what is pending first), they are
    the same."""
    eager, lazy = twin_tiers("softfreeze", n_layers=3, max_len=300)
    g = torch.Generator().manual_seed(0)
    for l in range(3):
        k, v = torch.randn(eager.Hkv, 5, eager.D, generator=g), torch.randn(eager.Hkv, 5, eager.D, generator=g)
        eager.fill(l, k, v)
        lazy.fill(l, k, v)
    eager.slots[1].fill_(7)  # stale counts in the free slots: an append must reset its own
    lazy.slots[1].fill_(7)
    cap = lazy.cap
    for t in range(150):
        for l in range(3):
            k, v = torch.randn(1, eager.Hkv, 1, eager.D, generator=g), torch.randn(1, eager.Hkv, 1, eager.D, generator=g)
            eager.append(l, k, v)
            lazy.append(l, k, v)
            assert eager.slots is not None  # a read after every append
    assert lazy.cap > cap and lazy.appended  # grown on the way, fields still pending
    for l in range(3):
        n = lazy.n_act[l]
        assert lazy.slots[0, l, :n].tolist() == list(range(155))
        assert lazy.slots[1, l, 5:n].tolist() == [0] * 150
        assert torch.equal(lazy.slots[:, l, :n], eager.slots[:, l, :n])
        assert torch.equal(lazy.kv[l, :n], eager.kv[l, :n])
    assert not lazy.appended

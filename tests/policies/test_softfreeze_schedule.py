"""softfreeze's fast form (schedule_fast.FreezeTiers.schedule_all: Algorithm 1 for all layers at
once, the default backend) against the library's reference (schedule.Algorithm1Layer, one layer
after the other, backend=reference), step by step on random relevance scores, through random
growths of the fast buffers and random rungs of the recovery ladder: after every step both have
frozen and kept the same tokens, with the same timers d_j, counts c_j, freeze steps and move
counters, and hold every token's K/V bit for bit on the tier where it belongs."""
from dataclasses import replace

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.testing import assert_close

from ..fixtures import DEVICE
from .test_softfreeze import TINY, Driver, script_relevance


def twins(spec: str, n_layers: int, max_len: int, seed: int) -> tuple[Driver, Driver]:
    """The fast form and the reference, fed the same q, k, v (one seed)."""
    cfg = replace(TINY, n_layers=n_layers)
    return tuple(Driver(f"{spec},backend={b}", max_len, seed, cfg=cfg) for b in ("eager", "reference"))


def assert_same(fast, ref, where: str) -> None:
    now = fast.policy.steps - 1
    for l, (a, b) in enumerate(zip(fast.policy.layers, ref.policy.layers)):
        at = f"{where}, layer {l}"
        assert a.n_tok == b.n_tok, at
        assert sorted(a.active_tokens().tolist()) == b.active_tokens().tolist(), f"{at}: active tokens"
        assert torch.equal(a.frozen_tokens(), b.frozen_tokens()), f"{at}: frozen tokens"
        assert torch.equal(a.timers(), b.timers()), f"{at}: timers d_j"
        assert torch.equal(a.counts(), b.counts()), f"{at}: counts c_j"
        assert torch.equal(a.frozen_at[: a.n_tok], b.frozen_at[: b.n_tok]), f"{at}: freeze steps"
        assert (a.freezes, a.thaws, a.n_frozen) == (b.freezes, b.thaws, b.n_frozen), f"{at}: counters"
    # follow's restores, done inside the fast form's schedule, counted as the reference counts them
    assert fast.policy.counters["followed"] == ref.policy.counters["followed"], f"{where}: followed"
    fast.check_invariants()  # K/V bit for bit against what was fed, on the right tier
    ref.check_invariants()


def run_twins(spec, n_layers, n_prompt, steps, seed, ops=(), discrete=False):
    """ops[t] after step t: "" nothing, "grow" (the fast buffers only: the fast step must not
    depend on its capacity), "unfreeze" (the same random tokens in both), or a rung."""
    fast, ref = twins(spec, n_layers, n_prompt + steps + 1, seed)
    g = torch.Generator().manual_seed(seed)
    # scores on a grid of 2^-9 (or of 1/2 to make ties with tau common): every sum of them is
    # exact in float32, so a layer's mean, and the relative threshold, do not depend on the order
    # of the tokens (slot order in the fast form, token order in the reference)
    grid = 2 if discrete else 2 ** 9
    table = torch.randint(0, 2 * grid, (steps + 1, n_prompt + steps + 1), generator=g).float() / grid
    script_relevance(table, fast.policy)
    script_relevance(table, ref.policy)
    for t in range(steps):
        fast.step(n_prompt if t == 0 else 1)
        ref.step(n_prompt if t == 0 else 1)
        assert_same(fast, ref, f"step {t}")
        op = ops[t] if t < len(ops) else ""
        if op == "grow":
            fast.policy.state.reserve(fast.policy.state.cap + 1)
        elif op == "unfreeze":
            for a, b in zip(fast.policy.layers, ref.policy.layers):
                pick = (torch.rand(a.n_tok, generator=g) < 0.5).to(DEVICE)
                assert a.unfreeze_where(pick) == b.unfreeze_where(pick)
        elif op in ("soft_reset", "window_reset", "full_reset"):
            assert getattr(fast.policy, op)() == getattr(ref.policy, op)()
        assert_same(fast, ref, f"after step {t} and {op!r}")
    return fast


@settings(max_examples=30, deadline=None)
@given(n_layers=st.integers(1, 4), n_prompt=st.integers(1, 40), steps=st.integers(1, 40),
       window=st.integers(0, 6), tau=st.sampled_from([0.3, 0.5, 1.0, 1.5]), softness=st.sampled_from([0.5, 1.0, 2.0]),
       history=st.none() | st.integers(1, 8), score=st.sampled_from(["raw", "relative", "attention"]),
       follow=st.sampled_from([None, 0.05, 0.2]), discrete=st.booleans(),
       ops=st.lists(st.sampled_from(["", "", "", "grow", "unfreeze", "soft_reset", "window_reset", "full_reset"]),
                    max_size=40),
       seed=st.integers(0, 2**16))
def test_fast_schedule_equals_the_reference_algorithm_1(n_layers, n_prompt, steps, window, tau, softness, history,
                                                       score, follow, discrete, ops, seed):
    # (the scripted scores stand in for s_j, so score=attention is tau on them as they are;
    # follow, which only that score takes, reads them as |A| x a softmax weight)
    follow = follow if score == "attention" else None
    spec = (f"softfreeze:window={window},tau={tau},softness={softness},history={history},score={score},"
            f"follow={follow},egr=false")
    run_twins(spec, n_layers, n_prompt, steps, seed, ops, discrete)


def test_fast_schedule_over_a_long_run_with_every_kind_of_move():
    # softness 1: d grows past 1 within the run; relative tau 1: about half the slots are low
    for history in (None, 6):
        spec = f"softfreeze:window=4,tau=1.0,softness=1,history={history},egr=false"
        fast = run_twins(spec, n_layers=3, n_prompt=50, steps=120, seed=7,
                         ops=["", "", "", "", "grow", "unfreeze"] * 20)
        state = fast.policy.state
        assert min(state.freezes) > 100 and min(state.thaws) > 100 and min(state.n_frozen) > 0
        assert len(set(state.n_act)) > 1, "the layers should differ in their active tokens"
        # a token's K/V goes to the host once: its refreezes (most freezes here) copy nothing
        assert fast.policy.tiers.bytes_to_host == int(state.on_host.sum()) * fast.policy.token_bytes() > 0
        assert sum(state.freezes) > 2 * int(state.on_host.sum())


def test_appended_slots_read_as_written():
    """append records the new slot's fields (token, c_j = 0) and writes them when something
    reads the slots: read after every append, or only once after many appends across growths
    of the buffers (a growth copies the slots, so it writes what is pending first), they are
    the same."""
    from minikv.policies import make

    bind = lambda: make("softfreeze").bind(replace(TINY, n_layers=3), device=DEVICE, dtype=torch.float32,  # noqa: E731
                                           max_len=300).state
    eager, lazy = bind(), bind()
    g = torch.Generator().manual_seed(0)
    for l in range(3):
        k, v = (torch.randn(eager.Hkv, 5, eager.D, generator=g).to(DEVICE) for _ in "kv")
        eager.fill(l, k, v)
        lazy.fill(l, k, v)
    eager.slots[1].fill_(7)  # stale counts in the free slots: an append must reset its own
    lazy.slots[1].fill_(7)
    cap = lazy.cap
    for t in range(150):
        for l in range(3):
            k, v = (torch.randn(1, eager.Hkv, 1, eager.D, generator=g).to(DEVICE) for _ in "kv")
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


@settings(max_examples=20, deadline=None)
@given(Hkv=st.sampled_from([1, 2, 3]), G=st.sampled_from([1, 3]), D=st.sampled_from([8, 16, 48, 64]),
       A=st.integers(1, 300), scale=st.sampled_from([0.1, 1.0, 8.0]), seed=st.integers(0, 2**16))
def test_one_pass_attention_score_equals_the_reference_pair(Hkv, G, D, A, scale, seed):
    """The fast layer's lines 1-2 with score=attention (layer_fast.attention_with_share: one
    product with K) give the reference's score bit for bit (schedule.attention_share, which reads
    K again) and the attention the kernel's reference computes, on strided slot views as the fast
    layer reads them."""
    from minikv.kernels.attention_relevance import attention_relevance
    from minikv.policies.softfreeze.layer_fast import attention_with_share
    from minikv.policies.softfreeze.schedule import attention_share

    g = torch.Generator().manual_seed(seed)
    kv = (torch.randn(A + 5, 2, Hkv, D, generator=g) * scale).to(DEVICE)  # (slots, 2, Hkv, D) as FreezeTiers holds them
    k, v = kv[:A, 0].transpose(0, 1)[None], kv[:A, 1].transpose(0, 1)[None]  # (1, Hkv, A, D) views
    q = (torch.randn(1, Hkv * G, D, generator=g) * scale).to(DEVICE)
    out, s = attention_with_share(q, k, v)
    assert torch.equal(s, attention_share(q, k))
    expected, _ = attention_relevance(q, k, v, None, backend="eager")
    # the two take their products in other orders: a logit of size L rounds by ~eps L in float32,
    # which scales its softmax weight by exp(+-eps L) and moves the output by up to that times
    # max |v| (at scale 8 the logits reach ~250: both forms then lie ~1e-4 from float64, the
    # reference the farther); below that, the dtype's tolerance
    logits = torch.einsum("hgd,had->hga", q[0].view(Hkv, G, D).double(), k[0].double()) / D**0.5
    eps = torch.finfo(torch.float32).eps
    atol = max(2 * eps * logits.abs().max().item() * v.abs().max().item(), 1e-5)
    assert_close(out, expected, torch.float32, atol=atol)

"""softfreeze (ASR-KF-EGR), both forms (backend=reference: Algorithm 1 per layer; eager: the
all-layers schedule): Eq. 3's schedule hand-computed on a scripted token; the tier invariants
(active and frozen partition all tokens, K/V bit for bit) under random steps and recovery rungs;
attention equals dense attention over the active tokens; each rung of the recovery ladder;
parameter errors; SmolLM2 (the reference decodes the default's tokens). The fast form against
the reference, step by step: test_softfreeze_schedule.py."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.config import ModelConfig
from minikv.testing import assert_close
from minikv.models.attention import dense_attention
from minikv.policies import make

from ..fixtures import DEVICE

TINY = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                   n_heads=6, n_kv_heads=2, head_dim=16, max_position_embeddings=4096, rotary_dim=16)


class Driver:
    """Feeds random q, k, v to every layer of a bound policy, step by step, and remembers every
    token's K/V as computed (the oracle for 'restored bit for bit')."""

    def __init__(self, spec, max_len=200, seed=0, q_scale=1.0, cfg=TINY):
        self.cfg = cfg
        self.policy = make(spec).bind(cfg, device=DEVICE, dtype=torch.float32, max_len=max_len)
        self.g = torch.Generator().manual_seed(seed)
        self.q_scale = q_scale
        self.k_all = [[] for _ in range(cfg.n_layers)]  # per layer: list of (Hkv, D) per token
        self.v_all = [[] for _ in range(cfg.n_layers)]
        self.outs = []

    def _rand(self, *shape):
        return torch.randn(*shape, generator=self.g).to(DEVICE)  # drawn on the CPU: the same on every device

    def step(self, T=1, logits=None):
        p, cfg = self.policy, self.cfg
        for i, layer in enumerate(p.layers):
            q = self._rand(1, cfg.n_heads, T, cfg.head_dim) * self.q_scale
            k, v = self._rand(1, cfg.n_kv_heads, T, cfg.head_dim), self._rand(1, cfg.n_kv_heads, T, cfg.head_dim)
            if p.steps == 0:
                out = layer.prefill(q, k, v, torch.arange(T, device=DEVICE)[None])
            else:
                active = layer.active_tokens().tolist() + [layer.n_tok]  # what attention may read
                out = layer.decode(q, k, v, torch.tensor([[layer.n_tok]], device=DEVICE))
                self.outs.append((i, q, active, out))
            self.k_all[i].extend(k[0].unbind(1))
            self.v_all[i].extend(v[0].unbind(1))
        action = p.end_step(logits)
        return action

    def forget(self, n):
        for i in range(self.cfg.n_layers if n else 0):  # (del x[-0:] would empty x)
            del self.k_all[i][-n:], self.v_all[i][-n:]

    def check_invariants(self):
        for i, layer in enumerate(self.policy.layers):
            n = layer.n_tok
            assert len(self.k_all[i]) == n
            active = layer.active_tokens().tolist()
            frozen = layer.frozen_tokens().tolist()
            # a partition of 0..n-1: nothing duplicated, nothing lost
            assert len(set(active)) == len(active), "a token is active twice"
            assert not set(active) & set(frozen), "a token is both active and frozen"
            assert sorted(active + frozen) == list(range(n)), "a token is lost"
            assert layer.n_frozen == len(frozen) and layer.host_tokens() == len(frozen)
            assert layer.device_tokens() == len(active) <= layer.allocated_device_tokens()
            K, V = torch.stack(self.k_all[i], 1), torch.stack(self.v_all[i], 1)  # (Hkv, n, D)
            # bit for bit: active slots on the device tier, frozen tokens on the host tier (compared
            # on the host)
            k_act, v_act = layer.active_kv()
            k_frozen, v_frozen = layer.frozen_kv(torch.tensor(frozen, dtype=torch.int64))
            K, V = K.cpu(), V.cpu()
            assert torch.equal(k_act.cpu(), K[:, active]) and torch.equal(v_act.cpu(), V[:, active])
            assert torch.equal(k_frozen.cpu(), K[:, frozen]) and torch.equal(v_frozen.cpu(), V[:, frozen])
            timers = layer.timers()
            assert (timers[frozen] > 0).all(), "a due token was not restored"
            assert (timers[active] == 0).all()


# -- the schedule: Eq. 3 by hand, the relative score ----------------------------------------------


def script_relevance(table, policy):
    """Every layer's s_j (Eq. 2) becomes table[step, j]; the attention itself runs as it is. The
    benchmarks' way in: an instance attribute over the layer's `attend`."""
    table = table.to(DEVICE)  # indexed by the layer's active tokens, on the test device
    for layer in policy.layers:
        def attend(q, layer=layer, real=layer.attend):
            out, _ = real(q)
            return out, table[policy.steps, layer.active_tokens()]
        layer.attend = attend


BACKENDS = ["eager", "reference"]


# token 0 of a 2-token prompt, always below tau, everything else never, softness 2: c = 1..3 ->
# d = 0; c = 4..15 -> d = 1; c = 16 -> d = 2 (Sec. 3.4's examples). A token frozen at step t with
# d_j = d is absent from the attentions of steps t+1 .. t+d and judged again at step t+d+1.
# The default (judge_prompt=false): detections at steps 1, 2, 3 (c = 1..3), c = 4 at step 4 ->
# frozen, absent at 5 only, back at 6 with c = 5 -> absent at 7, ... c = 15 at step 26 (absent
# 27); c = 16 at step 28 -> d = 2: absent at 29 and 30, judged again at 31 (c = 17, d = 2),
# absent 32, 33; c = 18 at 34, absent 35, 36; c = 19 at 37, absent 38, 39 (the last step): c = 19
ABSENT_DEFAULT = [5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 30, 32, 33, 35, 36, 38, 39]
# judge_prompt=true (the paper's reading): the prefill (step 0) is the first detection, so every
# step comes one earlier: c = 4 at step 3 (absent 4), ..., c = 15 at 25 (absent 26); c = 16 at
# 27 (absent 28, 29), c = 17 at 30 (absent 31, 32), c = 18 at 33 (34, 35), c = 19 at 36 (37, 38),
# c = 20 at step 39
ABSENT_PROMPT_JUDGED = [4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 29, 31, 32, 34, 35, 37, 38]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("judge_prompt, expected, count", [(False, ABSENT_DEFAULT, 19), (True, ABSENT_PROMPT_JUDGED, 20)])
def test_one_always_irrelevant_token_hand_computed(backend, judge_prompt, expected, count):
    steps = 40
    table = torch.ones(steps, 64)
    table[:, 0] = 0.0  # token 0 is always below tau; everything else never is
    flag = ",judge_prompt=true" if judge_prompt else ""  # the default is false
    d = Driver(f"softfreeze:window=1,tau=0.5,softness=2,score=raw,egr=false,backend={backend}{flag}", max_len=64)
    script_relevance(table, d.policy)
    absent = []
    d.step(2)
    for t in range(1, steps):
        if 0 not in d.policy.layers[0].active_tokens().tolist():
            absent.append(t)
        d.step(1)
    assert absent == expected
    assert int(d.policy.layers[0].counts()[0]) == count


@pytest.mark.parametrize("backend", BACKENDS)
def test_relative_score_divides_by_the_mean(backend):
    steps, n = 6, 10
    table = torch.rand(steps, n + steps, generator=torch.Generator().manual_seed(1)) * 50
    common = f"softfreeze:window=0,softness=1,egr=false,judge_prompt=true,backend={backend}"  # judged at prefill
    raw = Driver(f"{common},tau=20,score=raw", max_len=n + steps)
    rel = Driver(f"{common},tau=0.8,score=relative", max_len=n + steps)
    script_relevance(table, rel.policy)
    script_relevance(table, raw.policy)
    rel.step(n)
    s = table[0, :n]
    assert set(rel.policy.layers[0].frozen_tokens().tolist()) == set((s / s.mean() < 0.8).nonzero()[:, 0].tolist())
    raw.step(n)
    assert set(raw.policy.layers[0].frozen_tokens().tolist()) == set((s < 20).nonzero()[:, 0].tolist())


def one_token_read(T: int, j: int):
    """q, k, v (prefill shapes) where every head reads token j alone (q.k = 4 against -40)."""
    e = torch.zeros(TINY.head_dim)
    e[0] = 1.0
    q = (4 * e).expand(1, TINY.n_heads, T, TINY.head_dim)
    k = (-10 * e).repeat(1, TINY.n_kv_heads, T, 1)
    k[:, :, j] = e
    return q, k, torch.randn(1, TINY.n_kv_heads, T, TINY.head_dim, generator=torch.Generator().manual_seed(0))


def frozen_after_prefill(spec: str, q, k, v) -> list[int]:
    """Layer 0's frozen tokens after a prefill of q, k, v and its end_step, the prompt judged by
    its last position's query (judge_prompt)."""
    p = make(spec + ",judge_prompt=true").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=16)
    for layer in p.layers:
        layer.prefill(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), torch.arange(q.shape[2], device=DEVICE)[None])
    p.end_step()
    return p.layers[0].frozen_tokens().tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_score_keeps_the_token_attention_reads(backend):
    # every head reads token 0 (q.k = 4), none the others (q.k = -40). Eq. 2's |q.k| ranks them
    # the other way: relative s_0 = 4 / 35.5 < 1, so score=relative freezes the token every head
    # reads and keeps the rest; score=attention (|A| x max_h softmax weight: ~8 for token 0, ~0
    # for the others) freezes the others. softness 1: d_j = 1 from the first detection on
    T = 8
    q, k, v = one_token_read(T, 0)
    common = f"softfreeze:window=0,tau=1,softness=1,egr=false,backend={backend}"
    assert frozen_after_prefill(common + ",score=relative", q, k, v) == [0]
    assert frozen_after_prefill(common + ",score=attention,follow=0", q, k, v) == list(range(1, T))


@pytest.mark.parametrize("backend", BACKENDS)
def test_follow_keeps_the_token_after_the_one_read(backend):
    # token 3 is read, token 4 (idle, so frozen by Algorithm 1) is what a copying head reads next
    q, k, v = one_token_read(8, 3)
    common = f"softfreeze:window=0,tau=1,softness=1,egr=false,score=attention,backend={backend}"
    assert frozen_after_prefill(common + ",follow=0", q, k, v) == [0, 1, 2, 4, 5, 6, 7]
    assert frozen_after_prefill(common + ",follow=0.5", q, k, v) == [0, 1, 2, 5, 6, 7]
    assert frozen_after_prefill(common, q, k, v) == [0, 1, 2, 5, 6, 7]  # the default follow, 0.1


# -- tiers, attention, invariants under random steps and rungs ---------------------------------


@settings(max_examples=15)
@given(n_prompt=st.integers(1, 40), ops=st.lists(st.sampled_from(["step"] * 6 + ["sr", "wr", "fr", "rr"]), min_size=1, max_size=50),
       window=st.integers(0, 6), tau=st.floats(0.2, 1.5), softness=st.sampled_from([0.5, 1.0, 2.0]),
       history=st.none() | st.integers(1, 8), seed=st.integers(0, 2**16), backend=st.sampled_from(BACKENDS))
def test_tiers_partition_tokens_and_keep_kv_bit_for_bit(n_prompt, ops, window, tau, softness, history, seed, backend):
    spec = (f"softfreeze:window={window},tau={tau},softness={softness},history={history},egr=false,max_rewalks=100,"
            f"backend={backend}")
    d = Driver(spec, max_len=n_prompt + len(ops) + 1, seed=seed)
    d.step(n_prompt)
    d.check_invariants()
    for op in ops:
        p = d.policy
        if op == "step":
            d.step(1)
        elif op == "sr":
            p.soft_reset()
        elif op == "wr":
            p.window_reset()
        elif op == "fr":
            p.full_reset()
            assert all(layer.n_frozen == 0 and int(layer.counts().sum()) == 0 for layer in p.layers)
        elif op == "rr":
            p.rewalk_mark = -1  # lift the guard: this test wants rewalks anywhere
            n = p.rewalk()
            assert n == min(p.rewalk_tokens, p.layers[0].n_tok + n - p.prompt_len)
            d.forget(n)
        d.check_invariants()
    assert d.policy.stats()["freezes"] == sum(layer.freezes for layer in d.policy.layers)


@pytest.mark.parametrize("backend", ["eager", "triton", "reference"])
def test_attention_reads_exactly_the_active_tokens(backend):
    # q scaled so that relevance varies a lot: some tokens freeze, some come back
    steps = 8 if backend == "triton" else 30
    d = Driver(f"softfreeze:window=3,tau=0.7,softness=1,backend={backend}", max_len=60, seed=3, q_scale=2.0)
    d.step(17)
    for _ in range(steps):
        d.step(1)
    assert d.policy.stats()["freezes"] > 0 and d.policy.stats()["thaws"] > 0
    for i, q, active, out in d.outs:  # active: the tokens before the step plus the new one, last
        K = torch.stack(d.k_all[i], 1)[None, :, active]  # (1, Hkv, A, D)
        V = torch.stack(d.v_all[i], 1)[None, :, active]
        expected = dense_attention(q, K, V)  # q (1, Hq, 1, D): the last key is itself, all visible
        assert_close(out, expected, torch.float32, name=f"layer {i}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_freezing_is_full_attention(backend):
    # tau = 0: nothing is ever below it; the policy is the full cache
    full = make("full").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=40)
    d = Driver(f"softfreeze:tau=0,backend={backend}", max_len=40)
    g = torch.Generator().manual_seed(5)
    for t in range(12):
        T = 9 if t == 0 else 1
        for i in range(TINY.n_layers):
            q = torch.randn(1, 6, T, 16, generator=g).to(DEVICE)
            k, v = torch.randn(1, 2, T, 16, generator=g).to(DEVICE), torch.randn(1, 2, T, 16, generator=g).to(DEVICE)
            fn = "prefill" if t == 0 else "decode"
            a = getattr(full.layers[i], fn)(q, k, v, None if t else torch.arange(T, device=DEVICE)[None].expand(1, T))
            b = getattr(d.policy.layers[i], fn)(q, k, v, None)
            assert_close(b, a, torch.float32)
        full.end_step(None)
        d.policy.end_step(None)
    assert d.policy.stats()["freezes"] == 0 and d.policy.stats()["compression"] == 0


# -- the recovery ladder -------------------------------------------------------------------------


@pytest.fixture(params=BACKENDS)
def backend(request):
    return request.param


def frozen_state(backend, seed=0, steps=25, **params):
    params["backend"] = backend
    spec = "softfreeze:window=2,tau=1.2,softness=0.5,egr=false," + ",".join(f"{k}={v}" for k, v in params.items())
    d = Driver(spec.rstrip(","), max_len=80, seed=seed, q_scale=2.0)
    d.step(30)
    for _ in range(steps):
        d.step(1)
    return d


def test_soft_reset_unfreezes_timers_above_one(backend):
    d = frozen_state(backend)
    before = [(layer.frozen_tokens(), layer.timers().clone()) for layer in d.policy.layers]
    long_ = sum(int((timer[tok] > 1).sum()) for tok, timer in before)
    short = sum(int((timer[tok] == 1).sum()) for tok, timer in before)
    assert long_ > 0 and short > 0, "the setup should have both kinds of timers"
    assert d.policy.soft_reset() == long_
    for (tok, timer), layer in zip(before, d.policy.layers):
        still = set(layer.frozen_tokens().tolist())
        assert still == {t for t in tok.tolist() if timer[t] == 1}
    d.check_invariants()
    assert d.policy.stats()["soft_resets"] == 1 and d.policy.stats()["recovered_tokens"] == long_


def test_window_reset_unfreezes_what_was_frozen_in_the_last_n_steps(backend):
    d = frozen_state(backend, reset_steps=1)
    now = d.policy.steps - 1
    before = [(layer.frozen_tokens().tolist(), layer.frozen_at.clone()) for layer in d.policy.layers]
    recent = sum(sum(1 for t in tok if at[t] == now) for tok, at in before)
    assert recent > 0 and recent < sum(len(tok) for tok, _ in before)
    assert d.policy.window_reset() == recent
    for (tok, at), layer in zip(before, d.policy.layers):
        assert set(layer.frozen_tokens().tolist()) == {t for t in tok if at[t] < now}
    d.check_invariants()
    assert d.policy.stats()["window_resets"] == 1


def test_full_reset_clears_everything(backend):
    d = frozen_state(backend, history=5)
    assert d.policy.stats()["host_tokens"] > 0
    d.policy.full_reset()
    for layer in d.policy.layers:
        assert layer.n_frozen == 0 and layer.n_act == layer.n_tok
        assert int(layer.counts().sum()) == 0 and (layer.timers() == 0).all()
    d.check_invariants()
    d.step(1)  # counts start over: c = 1 -> d = floor(2 * 1) = 2 with softness 0.5, so some freeze again
    d.check_invariants()
    assert d.policy.stats()["full_resets"] == 1


def test_rewalk_drops_the_last_tokens_and_is_guarded(backend):
    d = frozen_state(backend, rewalk_tokens=4, max_rewalks=1)
    n_tok = d.policy.layers[0].n_tok
    assert d.policy.rewalk() == 4
    d.forget(4)
    for layer in d.policy.layers:
        assert layer.n_tok == n_tok - 4 and layer.n_frozen == 0
    d.check_invariants()
    for _ in range(6):  # regenerate past the old position
        d.step(1)
    assert d.policy.rewalk() == 0, "the budget of one rewalk is spent"
    assert d.policy.stats()["rewalks"] == 1 and d.policy.stats()["rewalks_refused"] == 1
    d.check_invariants()

    d = frozen_state(backend, rewalk_tokens=4, max_rewalks=5)
    assert d.policy.rewalk() == 4
    d.forget(4)
    d.step(1)
    assert d.policy.rewalk() == 0, "no second rewalk before passing the first one's position"
    assert d.policy.stats()["full_resets"] == 2  # a refused rewalk still resets


def uniform_over(m, V=1024):
    """Logits whose distribution is uniform over m tokens: entropy log(m) nats."""
    logits = torch.full((1, V), -1e4, device=DEVICE)  # where a model's logits are
    logits[0, :m] = 0.0
    return logits


def test_ladder_climbs_one_rung_per_spike_and_falls_back_when_calm(backend):
    d = Driver(f"softfreeze:egr_window=4,egr_calm=3,egr_z=0,egr_min=1,rewalk_tokens=2,backend={backend}", max_len=80)
    d.step(5, logits=uniform_over(1))
    for _ in range(4):  # calm: entropy 0
        assert d.step(1, logits=uniform_over(1)) is None
    assert d.policy.level == 0 and d.policy.stats()["spikes"] == 0
    levels, rewinds = [], []
    for i in range(5):  # entropies 1.39, 2.77, 4.16, 5.55, 6.93: each > mean of the last 4 + 1
        action = d.step(1, logits=uniform_over(4 ** (i + 1)))
        rewinds.append(action.rewind if action else 0)
        if action:
            d.forget(action.rewind)
        levels.append(d.policy.level)
        d.check_invariants()
    stats = d.policy.stats()
    assert levels == [1, 2, 3, 4, 4]
    assert stats["spikes"] == 5 and stats["soft_resets"] == 1 and stats["window_resets"] == 1
    # rung 3, rung 4 (a rewalk starts with a full reset), and the refused second rewalk
    assert stats["full_resets"] == 3 and stats["rewalks"] == 1 and stats["rewalks_refused"] == 1
    assert rewinds == [0, 0, 0, 2, 0]
    for _ in range(3):  # egr_calm quiet steps: back to the bottom
        d.step(1, logits=uniform_over(1))
    assert d.policy.level == 0


def test_is_spike_rule():
    p = make("softfreeze:egr_window=4,egr_z=2,egr_min=0.5").bind(TINY, device=DEVICE, dtype=torch.float32, max_len=8)
    p.entropies = [1.0, 1.2, 0.8, 1.0]  # mean 1, std 0.163
    assert not p.is_spike(1.49)  # above 2 std but within egr_min
    assert p.is_spike(1.51)
    p.entropies = [1.0, 3.0, 1.0, 3.0]  # mean 2, std 1.155
    assert not p.is_spike(4.2) and p.is_spike(4.4)
    p.entropies = [1.0, 1.0, 1.0]  # fewer than egr_window entropies: never a spike
    assert not p.is_spike(100.0)


@pytest.mark.parametrize("spec, message", [
    ("softfreeze:window=-1", "window"), ("softfreeze:tau=-0.1", "tau"), ("softfreeze:softness=0", "softness"),
    ("softfreeze:history=0", "history"), ("softfreeze:score=cosine", "score"), ("softfreeze:egr_window=1", "egr_window"),
    ("softfreeze:rewalk_tokens=0", "rewalk_tokens"), ("softfreeze:backend=cuda", "backend"),
    ("softfreeze:score=relative,follow=0.1", "follow"), ("softfreeze:score=attention,follow=1.5", "follow"),
])
def test_impossible_parameters(spec, message):
    with pytest.raises(ValueError, match=message):
        make(spec)


def test_sliding_window_models_are_refused():
    # a window shorter than the sequence; one as long is no window (policies/window.py): it runs
    from dataclasses import replace

    with pytest.raises(ValueError, match="sliding"):
        make("softfreeze").bind(replace(TINY, sliding_window=16), device=DEVICE, dtype=torch.float32, max_len=17)
    bound = make("softfreeze").bind(replace(TINY, sliding_window=16), device=DEVICE, dtype=torch.float32, max_len=16)
    assert bound.cfg.sliding_window is None


# -- SmolLM2 -------------------------------------------------------------------------------------


def check_real_invariants(policy):
    for layer in policy.layers:
        active = layer.active_tokens().tolist()
        frozen = layer.frozen_tokens().tolist()
        assert sorted(active + frozen) == list(range(layer.n_tok))


def test_smollm2_generation_freezes_and_stays_coherent(smollm2):
    import minikv

    model, tok = smollm2
    prompt = "Explain in detail how a steam engine works."
    policy = make("softfreeze")
    result = minikv.generate(model, tok, prompt, chat=True, policy=policy, max_new_tokens=100, stop_at_eos=False)
    stats = result.stats
    check_real_invariants(policy)
    assert stats["total_tokens"] == stats["prompt_tokens"] + 99
    assert stats["device_tokens"] + stats["host_tokens"] == stats["total_tokens"]
    assert stats["freezes"] > 0 and stats["thaws"] > 0 and stats["bytes_to_host"] > 0
    assert stats["compression"] > 0.2, stats["compression"]
    assert "steam" in result.text.lower()


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompt(key: str, depth: int) -> str:
    """Table 2's task: a 5-digit key after `depth` of 60 filler blocks (~1,500 tokens in all)."""
    parts = [FILLER] * 60
    parts.insert(depth, f"The pass key is {key}. Remember it. {key} is the pass key. ")
    return ("There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
            + "".join(parts) + "What is the pass key?")


def run_passkey(smollm2, key, depth):
    import minikv

    model, tok = smollm2
    policy = make("softfreeze")  # the defaults: the same settings as Table 1's compression
    result = minikv.generate(model, tok, passkey_prompt(key, depth), chat=True, policy=policy, max_new_tokens=24)
    assert 1300 < result.stats["prompt_tokens"] < 1800, result.stats["prompt_tokens"]
    check_real_invariants(policy)
    return result, policy


def test_smollm2_passkey_in_1500_tokens_of_filler(smollm2):
    # Table 2 (the paper's key, in the middle of the filler), greedy, at the default settings
    result, policy = run_passkey(smollm2, "44181", 30)
    assert "44181" in result.text, result.text
    # the key is still retrieved after the first freeze (step k^2 = 4: its tokens are absent from
    # step 5, which writes the first digit): the answer goes on and repeats it
    assert result.stats["new_tokens"] == 24 and result.text.count("44181") == 2, result.text
    # ...while the decode steps read on average at most 65% of the KV (0.61 measured). Not the
    # compression after the last step: d = 1 freezes alternate, so it swings with the parity of
    # the step count (0.31 after step 23 here, 0.61 after step 22)
    read = result.stats["kv_bytes_read_per_step"] / (policy.cfg.n_layers * policy.token_bytes())  # tokens a layer read
    assert result.stats["freezes"] > 0 and read < 0.65 * result.stats["total_tokens"], read / result.stats["total_tokens"]


@pytest.mark.slow
@pytest.mark.parametrize("key, depth", [("38612", 3), ("27849", 45), ("51374", 50)])
def test_smollm2_passkey_other_keys_and_depths(smollm2, key, depth):
    # depths where full KV passes too: SmolLM2-135M fails with full KV at depths 8 and 15 of 60.
    # Nothing is frozen before step 5 (the first freeze: c_j = k^2 = 4 at step 4), so the step
    # that chooses between the key (' ') and ' the' after "The pass key is" is full KV's (margins
    # 0.59, 1.25, 1.18 here); judging the prompt too froze the key's tokens for that step and
    # lost depth 3 (docs/softfreeze.md, "Table 2")
    result, _ = run_passkey(smollm2, key, depth)
    assert key in result.text, result.text


@pytest.mark.slow
def test_smollm2_long_pass_perplexity_near_full_kv(smollm2):
    # bench compare's long pass (quick preset): 2,048 tokens of pydoc_data.topics prefilled, 32
    # fed one at a time. The defaults stay within 1.2x of full KV's perplexity (1.02x measured)
    # while reading at most 62% of its KV on average (61.1%: the forwards up to step 4 read it
    # whole, nothing being frozen before c_j = k^2 = 4 detections; 59.8% with judge_prompt=true,
    # one forward fewer). Eq. 2's score froze the attended tokens: 4.1x at 72%, the prompt judged
    from minikv.bench.common import text_ids
    from minikv.bench.compare_run import bind, lockstep_long_pass

    model, tok = smollm2
    ids = text_ids(tok, 2048 + 32)
    full, sf = lockstep_long_pass(model, ids, 2048, [bind(model, s, len(ids), probe=False)
                                                       for s in ("full", "softfreeze")], rebind=None)
    assert full["kv_share_mean"] == 1.0
    assert sf["ppl"] <= 1.2 * full["ppl"], (sf["ppl"], full["ppl"])
    assert sf["kv_share_mean"] <= 0.62, sf["kv_share_mean"]

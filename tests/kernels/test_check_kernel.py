"""minikv.testing.check_kernel as a kernel author uses it: an implementation written from the
operation's definition (not from minikv's reference) passes, and each planted bug fails with an
AssertionError that names the input (the operation, its shapes and drawn parameters) and the
error. Then kernels by name: a registered backend runs a whole policy, and a policy refuses a
backend it does not implement."""
import collections
import functools
import math

import pytest
import torch

import minikv.kernels as kernels
from minikv.generate import generate
from minikv.kernels import register_backend
from minikv.policies import available, make
from minikv.testing import check_kernel
from minikv.testing.selection import unpack_codes

# examples per planted bug: a bug that shows in one drawn input of ten (ties need integer data,
# duplicated pages and a tie at the cut) escapes 100 draws once in ~40,000 runs
BUG_HUNT = 100


# -- decode_attention, from its definition ---------------------------------------------------------


def my_decode_attention(q, k, v, lengths, scale=None, window=None, return_lse=False, bug=None):
    """softmax(q k^T * scale) v over slots [lengths - window, lengths), GQA by repeating K and V."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    if scale is None:
        scale = 1 / D if bug == "scale" else 1 / math.sqrt(D)
    n = lengths[:, None] + (1 if bug == "length" else 0)  # (B, 1)
    slot = torch.arange(L, device=q.device)
    visible = slot < n  # (B, L)
    if window is not None:
        visible &= slot >= n - window - (1 if bug == "window" else 0)
    k = k.float().repeat_interleave(Hq // Hkv, dim=1)  # (B, Hq, L, D)
    v = v.float().repeat_interleave(Hq // Hkv, dim=1).masked_fill(~visible[:, None, :, None], 0.0)
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k) * scale
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    lse = scores.logsumexp(-1)  # (B, Hq)
    out = torch.einsum("bhl,bhld->bhd", (scores - lse[..., None]).exp(), v).to(q.dtype)
    return (out, lse) if return_lse else out


def test_decode_attention_from_its_definition_passes():
    check_kernel("decode_attention", my_decode_attention)


@pytest.mark.parametrize("bug, drawn", [("length", "lengths="), ("scale", "scale="), ("window", "window=")])
def test_decode_attention_planted_bugs_fail_naming_the_input(bug, drawn):
    with pytest.raises(AssertionError) as failure:
        check_kernel("decode_attention", functools.partial(my_decode_attention, bug=bug), examples=BUG_HUNT)
    message = str(failure.value)
    assert message.startswith("decode_attention(B=") and drawn in message and "D=" in message
    assert "relative RMS" in message or "NaN" in message or "lse" in message


def no_max_subtracted(q, k, v, lengths, scale=None, window=None, return_lse=False):
    """The softmax as its formula reads, exp(s) / sum exp(s), in float32: right while every row's
    sum of exp(s) stays in float32's range."""
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    scale = scale if scale is not None else 1 / math.sqrt(D)
    slot = torch.arange(L, device=q.device)
    visible = slot < lengths[:, None]
    if window is not None:
        visible &= slot >= lengths[:, None] - window
    k = k.float().repeat_interleave(Hq // Hkv, dim=1)
    v = v.float().repeat_interleave(Hq // Hkv, dim=1).masked_fill(~visible[:, None, :, None], 0.0)
    e = torch.einsum("bhd,bhld->bhl", q.float(), k).mul(scale).exp().masked_fill(~visible[:, None], 0.0)
    total = e.sum(-1)  # (B, Hq): inf once the scores pass ~88.7
    out = (torch.einsum("bhl,bhld->bhd", e, v) / total[..., None]).to(q.dtype)
    return (out, total.log()) if return_lse else out


def pv_in_cache_dtype(q, k, v, lengths, scale=None, window=None, return_lse=False):
    """The weights right (float32, max subtracted), but P.V summed in the cache's dtype, token by
    token, as a kernel whose accumulator is declared bfloat16 sums it."""
    out, lse = my_decode_attention(q, k, v, lengths, scale, window, return_lse=True)
    B, Hq, D = q.shape
    Hkv, L = k.shape[1], k.shape[2]
    scores = torch.einsum("bhd,bhld->bhl", q.float(), k.float().repeat_interleave(Hq // Hkv, dim=1))
    p = (scores * (scale if scale is not None else 1 / math.sqrt(D)) - lse[..., None]).exp()  # (B, Hq, L)
    slot = torch.arange(L, device=q.device)
    visible = slot < lengths[:, None]
    if window is not None:
        visible &= slot >= lengths[:, None] - window
    p = p.masked_fill(~visible[:, None], 0.0).to(v.dtype)
    v = v.repeat_interleave(Hq // Hkv, dim=1).masked_fill(~visible[:, None, :, None], 0.0)
    acc = torch.zeros(B, Hq, D, dtype=v.dtype, device=q.device)
    for j in range(L):
        acc = acc + p[:, :, j, None] * v[:, :, j]  # rounded to the cache dtype at every token
    out = acc.to(q.dtype)
    return (out, lse) if return_lse else out


def test_a_softmax_without_the_max_subtracted_overflows_and_is_told_so():
    """Loud draws spread the scaled scores by 50 (|s| past 100): the sum of exp(s) overflows float32,
    and the failure says so rather than blaming a poisoned read."""
    with pytest.raises(AssertionError, match=r"loud=True.*(an overflow|lse)") as failure:
        check_kernel("decode_attention", no_max_subtracted, dtypes=[torch.float32], examples=BUG_HUNT)
    assert "poisoned" not in str(failure.value)


def test_pv_summed_in_bfloat16_is_caught():
    with pytest.raises(AssertionError, match=r"dtype=bfloat16.*relative RMS"):
        check_kernel("decode_attention", pv_in_cache_dtype, dtypes=[torch.bfloat16], examples=BUG_HUNT)
    check_kernel("decode_attention", pv_in_cache_dtype, dtypes=[torch.float32], examples=10)  # right in float32


# -- paged_attention, from its definition: gather each KV head's listed tokens, dense attention ---


def my_paged_attention(q, k_pages, v_pages, page_table, page_lens, scale=None, return_lse=False, bug=None):
    B, Hq, D = q.shape
    Hkv = k_pages.shape[2]
    G = Hq // Hkv
    scale = scale if scale is not None else (1 / D if bug == "scale" else 1 / math.sqrt(D))
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    for b in range(B):
        for m in range(Hkv):
            extra = 1 if bug == "length" else 0
            slots = [(int(s), t) for s, n in zip(page_table[b, m], page_lens[b, m]) for t in range(int(n) + extra * (int(n) > 0))]
            slots = [(s, t) for s, t in slots if t < k_pages.shape[1]]
            keys = torch.stack([k_pages[s, t, m] for s, t in slots]).float()  # (n, D)
            values = torch.stack([v_pages[s, t, m] for s, t in slots]).float()
            for j in range(G):
                h = m * G + j if bug != "gqa" else (m + j * Hkv) % Hq  # the group's heads, or interleaved
                scores = keys @ q[b, h].float() * scale
                out[b, h] = (torch.softmax(scores, 0) @ values).to(q.dtype)
                lse[b, h] = scores.logsumexp(0)
    return (out, lse) if return_lse else out


def test_paged_attention_from_its_definition_passes():
    check_kernel("paged_attention", my_paged_attention)


@pytest.mark.parametrize("bug", ["length", "scale", "gqa"])
def test_paged_attention_planted_bugs_fail_naming_the_input(bug):
    with pytest.raises(AssertionError) as failure:
        check_kernel("paged_attention", functools.partial(my_paged_attention, bug=bug), examples=BUG_HUNT)
    message = str(failure.value)
    assert message.startswith("paged_attention(B=") and "tokens=" in message and "P=" in message


# -- page_scores, from its definition: Quest's bound (or the coded keys' mass), group reduction, top k


def my_page_scores(q, lo, hi, n_valid, k, scale=1.0, group_reduce="softmax_mean", codes=None, bug=None):
    B, Hq, D = q.shape
    Hkv, N = lo.shape[1], lo.shape[2]
    G = Hq // Hkv
    scores = torch.full((B, Hkv, N), float("-inf"), device=q.device)
    index = torch.full((B, Hkv, k), -1, dtype=torch.int64, device=q.device)
    for b in range(B):
        n = min(int(n_valid[b]) + (1 if bug == "length" else 0), N)
        if n == 0:
            continue
        qg = q[b].float().view(Hkv, G, 1, D)
        if codes is None:  # sum_d max(q_d lo_d, q_d hi_d)
            P = torch.maximum(qg * lo[b, :, None, :n].float(), qg * hi[b, :, None, :n].float()).sum(-1)  # (Hkv, G, n)
        else:  # log sum_t exp(scale q . k^_t) / scale
            keys = unpack_codes(codes[b, :, :n], lo[b, :, :n], hi[b, :, :n])  # (Hkv, n, P, D)
            P = torch.einsum("mgd,mntd->mgnt", qg[:, :, 0], keys).mul(scale).logsumexp(-1) / scale
        s = {"softmax_mean": lambda: torch.softmax(P * (1.0 if bug == "scale" else scale), -1).mean(1),
             "mean": lambda: P.mean(1), "max": lambda: P.amax(1)}[group_reduce]()  # (Hkv, n)
        scores[b, :, :n] = s
        order = torch.sort(s.flip(-1) if bug == "ties" else s, dim=-1, descending=True, stable=True).indices
        if bug == "ties":  # ties to the higher page
            order = n - 1 - order
        index[b, :, :min(k, n)] = order[:, :k]
    return scores, index


def test_page_scores_from_its_definition_passes():
    check_kernel("page_scores", my_page_scores)


@pytest.mark.parametrize("bug", ["length", "scale", "ties"])
def test_page_scores_planted_bugs_fail_naming_the_input(bug):
    with pytest.raises(AssertionError) as failure:
        check_kernel("page_scores", functools.partial(my_page_scores, bug=bug), examples=BUG_HUNT)
    message = str(failure.value)
    assert message.startswith("page_scores(B=") and "n_valid=" in message and "reduce=" in message


def test_check_kernel_takes_a_backend_name_and_refuses_an_unknown_one():
    check_kernel("rope_delta", "eager", examples=5)
    with pytest.raises(ValueError, match="no backend 'nobody' is registered for rope_delta"):
        check_kernel("rope_delta", "nobody")
    with pytest.raises(ValueError, match="unknown kernel operation"):
        check_kernel("decode_attn", my_decode_attention)


# -- kernels by name: a policy end to end on a user's kernel ----------------------------------------


@pytest.fixture
def counted_backend():
    """decode_attention registered as backend 'counted': my_decode_attention, counting its calls."""
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return my_decode_attention(*args)

    register_backend("decode_attention", "counted", counted)
    yield calls
    del kernels._REGISTRY["decode_attention"]["counted"]


@pytest.mark.parametrize("spec", ["streaming:sink=4,window=16", "full"])
def test_a_registered_backend_runs_a_whole_policy(smollm2, counted_backend, spec):
    """The policy on backend=counted decodes with the user's kernel (every layer, every step) and
    greedy-decodes what the default backend does; streaming prunes its ~60-token prompt."""
    model, tok = smollm2
    prompt = "The three primary colours are red, yellow and blue. " * 5
    runs = {b: generate(model, tok, prompt, policy=f"{spec}{',' if ':' in spec else ':'}backend={b}",
                        max_new_tokens=6, stop_at_eos=False) for b in ("eager", "counted")}
    decode_steps = 5  # the first new token comes from the prefill
    assert len(counted_backend) == decode_steps * model.cfg.n_layers
    assert runs["counted"].token_ids == runs["eager"].token_ids


def test_policies_refuse_a_backend_they_do_not_implement(counted_backend):
    with pytest.raises(ValueError, match="policy 'softfreeze' does not implement backend 'counted'"):
        make("softfreeze:backend=counted")  # it runs attention_relevance only
    for name in ("synckv", "freekv"):  # decode_attention: synckv's own, freekv's full skip_layers
        assert make(f"{name}:backend=counted").backend == "counted"


def test_a_policy_without_kernels_refuses_triton():
    from dataclasses import dataclass

    from minikv.policies.contract import Policy

    @dataclass(eq=False, kw_only=True)
    class NoKernels(Policy):
        name = "nokernels"

        def make_layer(self, index):
            raise NotImplementedError

    assert NoKernels(backend="reference").backend == "reference"
    with pytest.raises(ValueError, match="policy 'nokernels' does not implement backend 'triton' .it runs no kernel"):
        NoKernels(backend="triton")


def test_register_backend_refuses_builtin_names_and_unknown_ops():
    with pytest.raises(ValueError, match="built in"):
        register_backend("decode_attention", "triton", my_decode_attention)
    with pytest.raises(ValueError, match="unknown kernel operation"):
        register_backend("flash_attention", "mine", my_decode_attention)
    with pytest.raises(ValueError, match="identifier"):
        register_backend("decode_attention", "my,kernel", my_decode_attention)


@pytest.mark.weights  # `bench speed` loads the real SmolLM2
def test_bench_speed_runs_a_registered_backend(counted_backend, capsys):
    """`bench speed` takes the backend's name in its policy spec (a module registering it is
    imported in its process): the flags check accepts it, and a short run decodes on it."""
    from minikv.bench.__main__ import main

    assert main(["--check", "speed", "--policy", "streaming:backend=counted"]) == 0
    with pytest.raises(ValueError, match="unknown kernel backend 'uncounted'"):
        main(["--check", "speed", "--policy", "streaming:backend=uncounted"])
    # CPU_ONLY: the run's plumbing, whatever the test device
    assert main(["speed", "--threads", "1", "--prompt-lengths", "24", "--new-tokens", "3", "--repeats", "1",
                 "--warmup", "0", "--device", "cpu", "--policy", "full:backend=counted"]) == 0
    assert len(counted_backend) > 0 and "full:backend=counted" in capsys.readouterr().out


# budgets below the ~60-token context, so that every policy selects, pages or frees
SMALL_SPECS = {"full": "full", "streaming": "streaming:sink=4,window=16", "softfreeze": "softfreeze",
               "freekv": "freekv:page_size=4,budget=32,sink=4,window=8,skip_layers=1",
               "icecache": "icecache:page_size=4,budget=32,sink=4,window=8",
               "synckv": "synckv:budget=48,window=8,wide_layers=0"}


@pytest.fixture
def everywhere():
    """Every operation registered as backend 'everywhere': its reference, counting calls per op."""
    calls = collections.Counter()
    for op in kernels.OPS:
        def counted(*args, op=op, reference=kernels.lookup(op, "reference")):
            calls[op] += 1
            return reference(*args)
        register_backend(op, "everywhere", counted)
    yield calls
    for op in kernels.OPS:
        del kernels._REGISTRY[op]["everywhere"]


@pytest.mark.parametrize("name", available())
def test_a_policy_declares_every_kernel_it_runs(smollm2, everywhere, name):
    """On a backend that implements every operation, a policy calls exactly operations it
    declares in `kernels` (so that a backend it accepts is one it runs), and the ones it
    declares for its own layers (all but full's decode_attention in skip_layers) at least once."""
    model, tok = smollm2
    small = SMALL_SPECS.get(name, name)  # a policy not listed runs at its defaults
    policy = make(small)
    spec = f"{small}{',' if ':' in small else ':'}backend=everywhere"
    generate(model, tok, "The three primary colours are red, yellow and blue. " * 5, policy=spec,
             max_new_tokens=4, stop_at_eos=False)
    assert set(everywhere) <= set(policy.kernels), f"{name} ran {dict(everywhere)}, declares {policy.kernels}"
    assert set(everywhere) == set(policy.kernels), f"{name} declares {policy.kernels}, ran {dict(everywhere)}"


@pytest.mark.parametrize("env, before, examples", [(None, "", 30), ("dev", "", 300), (None, "mine", 7)])
def test_importing_minikv_testing_loads_the_profile_hypothesis_profile_names(env, before, examples):
    """A script gets minikv's "ci" profile (30 examples per property), $HYPOTHESIS_PROFILE's when set,
    and keeps a profile of its own loaded before the import."""
    import os
    import subprocess
    import sys

    own = ("from hypothesis import settings; settings.register_profile('mine', max_examples=7); "
           "settings.load_profile('mine'); ") if before else ""
    script = own + "import minikv.testing; from hypothesis import settings; print(settings.default.max_examples)"
    environ = {k: v for k, v in os.environ.items() if k != "HYPOTHESIS_PROFILE"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**environ, **({"HYPOTHESIS_PROFILE": env} if env else {})})
    assert p.stdout.split() == [str(examples)], p.stderr


def test_minikv_testing_without_hypothesis_says_what_to_install():
    import subprocess
    import sys

    script = "import sys; sys.modules['hypothesis'] = None; import minikv.testing"  # as if not installed
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 1
    assert p.stderr.strip().splitlines()[-1] == (
        "ImportError: minikv.testing needs hypothesis: pip install 'minikv[test]' (or pip install hypothesis)")

"""h2o against its paper, transcribed here independently of the library: Algorithm 1 of "H2O:
Heavy-Hitter Oracle for Efficient Generative Inference of Large Language Models" (Zhang et al.,
NeurIPS 2023, https://arxiv.org/abs/2306.14048) with Section 4's recent window, step by step on
random queries, keys and values: each step's attention output and the set each KV head keeps.
The contract (budget, stats, backends, SmolLM2) is checked by test_contract's matrix."""
from __future__ import annotations

import math

import pytest
import torch

from minikv.config import ModelConfig
from minikv.policies import make

from ..fixtures import DEVICE

CFG = ModelConfig(model_type="llama", vocab_size=10, hidden_size=32, intermediate_size=8, n_layers=1, n_heads=4,
                  n_kv_heads=2, head_dim=8, max_position_embeddings=256)  # GQA: 2 query heads per KV head


def paper_h2o(q, k, v, budget, window, prompt):
    """q (n, Hq, D), k, v (n, Hkv, D) -> (outputs (n - prompt, Hq, D) of the decode steps, the kept
    sets S_i per KV head after each of them).

    The cache holds k_paper = budget - 1 tokens; at step i, G_i = S_{i-1} + {i} is attended and every
    token of G_i adds the attention it received (over the query heads of its group) to its score F;
    if |G_i| > k_paper, the token u with the smallest F leaves (u = argmax_v F(G_i - {v})), the
    `window` most recent tokens excepted. The prompt is attended whole: its tokens' scores are the
    column sums of its causal attention, and one eviction keeps the window and the largest scores."""
    n, Hq, D = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    cache = budget - 1

    def weights(i, qh, S, h):  # softmax of q_i . k_j / sqrt(D) over the tokens j of S
        logits = [float(q[i, qh] @ k[j, h]) / math.sqrt(D) for j in S]
        top = max(logits)
        e = [math.exp(x - top) for x in logits]
        return [x / sum(e) for x in e]

    def evict(S, F):  # keep the window's most recent and the largest F of the rest
        recent = sorted(S)[-window:] if window else []
        rest = sorted((j for j in S if j not in recent), key=lambda j: (-F[j], j))
        return sorted(recent + rest[:cache - len(recent)])

    S, F = [[] for _ in range(Hkv)], [dict() for _ in range(Hkv)]
    for h in range(Hkv):  # the prompt
        for i in range(prompt):
            S[h].append(i)
            F[h][i] = 0.0
            for g in range(G):
                for j, w in zip(S[h], weights(i, h * G + g, S[h], h)):
                    F[h][j] += w
        if len(S[h]) > cache:
            S[h] = evict(S[h], F[h])
    outs, kept = [], []
    for i in range(prompt, n):  # Algorithm 1, one token at a time
        out = torch.zeros(Hq, D, dtype=torch.float64)
        for h in range(Hkv):
            S[h] = S[h] + [i]  # G_i
            F[h][i] = 0.0
            for g in range(G):
                w = weights(i, h * G + g, S[h], h)
                out[h * G + g] = sum(wj * v[j, h].double() for wj, j in zip(w, S[h]))
                for j, wj in zip(S[h], w):
                    F[h][j] += wj
            if len(S[h]) > cache:
                S[h] = evict(S[h], F[h])
        outs.append(out)
        kept.append([list(s) for s in S])
    return torch.stack(outs), kept


def run_layer(spec, q, k, v, prompt):
    """The policy's layer 0 driven directly: prefill `prompt` tokens, then one decode step per token."""
    policy = make(spec).bind(CFG, device=DEVICE, dtype=torch.float32, max_len=q.shape[0])
    layer = policy.layers[0]
    # (n, H, D) -> (1, H, b - a, D) on the test device; the outputs come back beside the CPU oracle's
    per = lambda x, a, b: x[a:b].permute(1, 0, 2)[None].to(DEVICE)
    layer.prefill(per(q, 0, prompt), per(k, 0, prompt), per(v, 0, prompt), torch.arange(prompt, device=DEVICE)[None])
    outs, kept = [], []
    for i in range(prompt, q.shape[0]):
        out = layer.decode(per(q, i, i + 1), per(k, i, i + 1), per(v, i, i + 1), torch.tensor([[i]], device=DEVICE))
        outs.append(out[0, :, 0].cpu())
        kept.append([sorted(layer.pos[h, :layer.n].tolist()) for h in range(CFG.n_kv_heads)])
    return torch.stack(outs), kept, policy


def random_qkv(n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n, CFG.n_heads, CFG.head_dim, generator=g) * 2  # sharp attention: scores differ
    k = torch.randn(n, CFG.n_kv_heads, CFG.head_dim, generator=g) * 2
    v = torch.randn(n, CFG.n_kv_heads, CFG.head_dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("backend", ["reference", "eager"])
@pytest.mark.parametrize("budget, window, prompt", [(8, 3, 4), (8, 0, 4), (6, 5, 2), (10, 4, 30), (44, 3, 4), (64, 3, 4)])
def test_each_step_is_algorithm_1(backend, budget, window, prompt):
    """Outputs and kept sets, step by step over 40 decode steps; window=0 is Algorithm 1 alone
    (the new token itself may leave), a prompt of 30 > budget - 1 is evicted once after it; a
    budget of the whole context (44 = 4 + 40: one eviction at the last step) and beyond it (none)."""
    q, k, v = random_qkv(prompt + 40, seed=budget * 100 + window * 10 + prompt)
    expect, expect_kept = paper_h2o(q, k, v, budget, window, prompt)
    got, kept, policy = run_layer(f"h2o:budget={budget},window={window},backend={backend}", q, k, v, prompt)
    for step, (a, b) in enumerate(zip(kept, expect_kept)):
        assert a == b, f"step {step}: kept {a}, the paper keeps {b}"
    torch.testing.assert_close(got, expect.float(), rtol=1e-5, atol=1e-5)
    assert policy.layers[0].device_tokens() == min(budget - 1, prompt + 40)
    assert policy.stats()["tokens_evicted"] == max(0, prompt + 40 - (budget - 1))


def test_attended_indices_are_the_step_s_tokens_new_one_included():
    q, k, v = random_qkv(20, seed=3)
    _, kept, policy = run_layer("h2o:budget=6,window=2", q, k, v, 4)
    read = policy.layers[0].attended_indices()  # the last step: what was kept before it, plus token 19
    assert read.shape == (2, 6) and all(sorted(read[h].tolist()) == sorted(kept[-2][h] + [19]) for h in range(2))


def test_group_scores_sum_over_the_query_heads():
    """GQA: a KV head's accumulated score is the sum of its query heads' attention (module
    docstring); after the prompt, each token's score is its column sum over both heads."""
    q, k, v = random_qkv(5, seed=7)
    policy = make("h2o:budget=64,window=2").bind(CFG, device=DEVICE, dtype=torch.float32, max_len=8)
    layer = policy.layers[0]
    per = lambda x: x.permute(1, 0, 2)[None].to(DEVICE)
    layer.prefill(per(q), per(k), per(v), torch.arange(5, device=DEVICE)[None])
    logits = torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, dim=1)) / math.sqrt(CFG.head_dim)
    w = torch.softmax(logits.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf")), dim=-1)  # (Hq, t, s)
    torch.testing.assert_close(layer.score[:, :5].cpu(), w.sum(1).view(2, 2, 5).sum(1))
    assert (w.sum(1).view(2, 2, 5).sum(1).sum(1) - 10).abs().max() < 1e-5  # 5 queries x 2 heads, each mass 1


@pytest.mark.parametrize("spec, message", [
    ("h2o:budget=8,window=8", "window must be <= budget - 1 = 7 "),
    ("h2o:budget=1", "budget"),
    ("h2o:window=-1", "window"),
])
def test_impossible_parameters(spec, message):
    with pytest.raises(ValueError, match=message):
        make(spec)


def test_prefill_attends_the_prompt_and_sums_its_columns_by_blocks(monkeypatch):
    """The prefill's output is causal attention over the prompt, and the scores summed block by
    block of queries (3 blocks of 2 here) are the column sums of the whole attention."""
    import minikv.policies.h2o as h2o

    monkeypatch.setattr(h2o, "PREFILL_CHUNK", 2)
    q, k, v = random_qkv(5, seed=11)
    policy = make("h2o:budget=64,window=2").bind(CFG, device=DEVICE, dtype=torch.float32, max_len=8)
    per = lambda x: x.permute(1, 0, 2)[None].to(DEVICE)
    out = policy.layers[0].prefill(per(q), per(k), per(v), torch.arange(5, device=DEVICE)[None])
    logits = torch.einsum("thd,shd->hts", q, k.repeat_interleave(2, dim=1)) / math.sqrt(CFG.head_dim)
    w = torch.softmax(logits.masked_fill(torch.ones(5, 5).triu(1).bool(), float("-inf")), dim=-1)  # (Hq, t, s)
    torch.testing.assert_close(out[0].cpu(), torch.einsum("hts,shd->htd", w, v.repeat_interleave(2, dim=1)))
    torch.testing.assert_close(policy.layers[0].score[:, :5].cpu(), w.sum(1).view(2, 2, 5).sum(1))


def test_attended_indices_before_the_cache_is_full():
    q, k, v = random_qkv(6, seed=5)
    policy = make("h2o:budget=16,window=2").bind(CFG, device=DEVICE, dtype=torch.float32, max_len=12)
    layer = policy.layers[0]
    per = lambda x, a, b: x[a:b].permute(1, 0, 2)[None].to(DEVICE)
    layer.prefill(per(q, 0, 5), per(k, 0, 5), per(v, 0, 5), torch.arange(5, device=DEVICE)[None])
    layer.decode(per(q, 5, 6), per(k, 5, 6), per(v, 5, 6), torch.tensor([[5]], device=DEVICE))
    assert layer.attended_indices().tolist() == [list(range(6))] * 2  # 6 of 12 slots: none evicted yet


def test_equal_scores_keep_the_earlier_token_in_a_long_cache():
    """_keep with 40 tokens of scores in exact ties (more than 16: torch's unstable sort reorders
    them): of equal scores the earlier token stays, as the transcription's evict does."""
    policy = make("h2o:budget=30,window=3").bind(CFG, device=DEVICE, dtype=torch.float32, max_len=64)
    score = torch.tensor([1.0, 2.0, 3.0, 2.0] * 10, device=DEVICE).expand(2, 40)  # (Hkv, n)
    pos = torch.arange(40, device=DEVICE).expand(2, 40)
    kept = policy.layers[0]._keep(score, pos)  # 29 of 40: the window 37..39 and 26 of the rest
    rest = sorted(range(37), key=lambda j: (-float(score[0, j]), j))[:26]
    assert kept.tolist() == [sorted(rest + [37, 38, 39])] * 2


def test_default_window_is_half_the_cache():
    assert [make(f"h2o:budget={b}").window for b in (9, 10, 2)] == [4, 4, 0]
    assert isinstance(make("h2o:budget=10").window, int)


def test_outputs_and_cache_in_the_model_dtype():
    q, k, v = (x.to(torch.bfloat16) for x in random_qkv(12, seed=2))
    for backend in ("reference", "eager"):
        policy = make(f"h2o:budget=6,window=2,backend={backend}").bind(CFG, device=DEVICE, dtype=torch.bfloat16,
                                                                          max_len=12)
        layer = policy.layers[0]
        per = lambda x, a, b: x[a:b].permute(1, 0, 2)[None].to(DEVICE)
        assert layer.prefill(per(q, 0, 8), per(k, 0, 8), per(v, 0, 8), torch.arange(8, device=DEVICE)[None]).dtype \
            == torch.bfloat16
        out = layer.decode(per(q, 8, 9), per(k, 8, 9), per(v, 8, 9), torch.tensor([[8]], device=DEVICE))
        assert out.dtype == layer.k.dtype == layer.v.dtype == torch.bfloat16, backend


def test_a_sliding_window_shorter_than_the_context_is_refused():
    import dataclasses

    for window, ok in ((16, False), (32, True)):
        cfg = dataclasses.replace(CFG, sliding_window=window)
        if ok:
            make("h2o:budget=8").bind(cfg, device=DEVICE, dtype=torch.float32, max_len=32)
        else:
            with pytest.raises(ValueError, match="^h2o does not combine with a sliding-window model \\(Mistral\\)"):
                make("h2o:budget=8").bind(cfg, device=DEVICE, dtype=torch.float32, max_len=32)


def test_stats_and_sizes_over_two_layers():
    import dataclasses

    policy = make("h2o:budget=12,window=3").bind(dataclasses.replace(CFG, n_layers=2), device=DEVICE,
                                                dtype=torch.float32, max_len=32)
    policy.layers[0].evicted, policy.layers[1].evicted = 3, 5
    assert {k: policy.stats()[k] for k in ("budget", "window", "tokens_evicted")} == \
        {"budget": 12, "window": 3, "tokens_evicted": 4.0}
    layer = policy.layers[1]
    assert layer.allocated_device_tokens() == 12  # slots per KV head (head_dim is 8)
    assert layer.aux_bytes() == (CFG.n_kv_heads * 12 * (8 + 4), 0)  # pos int64 and score float32 per slot

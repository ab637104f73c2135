"""speed benchmark: policies take turns run by run, medians per policy, the `TPOT x full` ratio,
the achieved bandwidth and the peak device tokens each policy reports, on SmolLM2 with short
prompts; the context-length figure."""
import argparse
import json

import pytest
import torch

from minikv.bench import speed as bench


def test_policies_alternate_and_rows_report_each_policy(smollm2, tmp_path, monkeypatch):
    model, tok = smollm2
    monkeypatch.setattr(bench, "load_model", lambda args: (model, tok))
    order = []
    real_generate = bench.generate

    def recording_generate(*a, policy, **kw):
        order.append(policy.name)  # an unbound Policy (speed times its select and recall once bound)
        return real_generate(*a, policy=policy, **kw)

    monkeypatch.setattr(bench, "generate", recording_generate)
    out, png = tmp_path / "speed.json", tmp_path / "speed.png"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    window = "streaming:sink=4,window=12,R=1,slack=0,max_drop=0"
    args = parser.parse_args(["--prompt-lengths", "24", "--new-tokens", "6", "--repeats", "2", "--warmup", "1",
                              "--policy", window, "--policy", "full", "--json", str(out), "--png", str(png)])
    assert bench.run(args) == 0
    assert order == ["streaming", "full"] * 3  # one warm-up round, two timed rounds, policies in turn
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["policy"] for r in rows] == [window, "full"]
    stream, full = rows
    # ratios are this / full, whatever the order of the policies
    assert result["baseline"] == "full" and full["tpot_vs_base"] == 1.0
    assert stream["tpot_vs_base"] == pytest.approx(stream["tpot_s"] / full["tpot_s"])
    assert full["device_tokens_peak"] == 24 + 6 - 1  # the last token is sampled, never cached
    assert stream["device_tokens_peak"] <= 16
    assert full["overhead_share"] is None and all(r["tpot_s"] > 0 and r["ttft_s"] > 0 for r in rows)
    # bandwidth: weights (the tied embedding once, as the output head) plus the KV attention read
    model_bytes = sum(p.numel() * 4 for p in model.parameters())
    kv_token = 2 * model.cfg.n_layers * model.cfg.n_kv_heads * model.cfg.head_dim * 4  # all layers
    # decode steps 1..5 read 25..29 tokens of KV (mean 27); streaming never more than 16
    assert model.cfg.tie_word_embeddings  # SmolLM2: the embedding is read whole, as the output head
    assert full["bytes_per_token"] == pytest.approx(model_bytes + 27 * kv_token)
    assert model_bytes < stream["bytes_per_token"] <= model_bytes + 16 * kv_token
    assert result["read_bandwidth_gb_s"] > 0
    for r in rows:
        assert r["bandwidth_gb_s"] == pytest.approx(r["bytes_per_token"] / r["tpot_s"] / 1e9)
        assert r["bandwidth_share"] == pytest.approx(r["bandwidth_gb_s"] / result["read_bandwidth_gb_s"])
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("name", ["pythia_partial", "llama_gqa3"])
def test_weight_bytes_count_an_untied_embedding_as_one_row(reference_dir, name):
    """A decode step reads one row of an untied input embedding, all of a tied one (the head)."""
    from minikv.generate import weight_bytes_per_step
    from minikv.loading import load_model

    model = load_model(reference_dir / "models" / name, device="cpu", dtype=torch.bfloat16)
    every = sum(p.numel() * 2 for p in model.parameters())
    embedding = model.embed.weight
    if model.cfg.tie_word_embeddings:
        assert weight_bytes_per_step(model) == every
    else:
        assert weight_bytes_per_step(model) == every - embedding.numel() * 2 + embedding.shape[1] * 2


def test_lockstep_decodes_what_generate_decodes(smollm2):
    """--lockstep: one shared prefill, policies in turn step by step; each policy's tokens are
    those a run of its own produces. streaming at a budget below the prompt prunes inside the
    prefill (its prefill output differs from full KV's): it is prefilled on its own, not an error."""
    from minikv.bench.common import text_ids
    from minikv.bench.speed import lockstep_runs
    from minikv.generate import generate

    model, tok = smollm2
    ids = text_ids(tok, 200)
    specs = ["full", "streaming:budget=64", "icecache:budget=96"]
    found = lockstep_runs(model, ids, specs, 4)
    for spec in specs:
        alone = generate(model, tok, ids, policy=spec, max_new_tokens=4, stop_at_eos=False)
        assert found[spec]["token_ids"] == alone.token_ids and found[spec]["tpot_s"] > 0
        assert found[spec]["bytes_per_token"] > 0 and found[spec]["bandwidth_gb_s"] > 0


def test_select_and_recall_are_timed_from_outside_the_policy():
    """freekv carries no clock: the benchmark's timers, installed when generate binds the policy,
    time every layer's select and every storage's recall, and leave the methods as they were."""
    from contextlib import ExitStack

    from minikv.config import ModelConfig
    from minikv.policies import make
    from minikv.policies.freekv import FreeKVLayer

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=48, intermediate_size=64, n_layers=2,
                      n_heads=6, n_kv_heads=3, head_dim=16, max_position_embeddings=4096, rotary_dim=8)
    totals = {}
    with bench.timers_once_bound(make("freekv:page_size=2,budget=12,sink=2,window=2"), totals) as policy:
        policy.bind(cfg, device="cpu", dtype=torch.float32, max_len=60)
        g = torch.Generator().manual_seed(0)
        x = lambda H, T: torch.randn(1, H, T, cfg.head_dim, generator=g)
        for layer in policy.layers:
            layer.prefill(x(6, 30), x(3, 30), x(3, 30), None)
        for _ in range(4):
            for layer in policy.layers:
                layer.decode(x(6, 1), x(3, 1), x(3, 1), None)
    assert totals["select"] > 0 and totals["recall"] > 0
    assert "select_s" not in policy.stats()  # the policy keeps no timers of its own
    assert "bind" not in vars(policy) and all("select" not in vars(layer) and "recall" not in vars(layer.kv)
                                               for layer in policy.layers if isinstance(layer, FreeKVLayer))
    stats = bench.add_timers({}, totals)
    assert stats == {"select_s": totals["select"], "recall_s": totals["recall"]}
    with ExitStack() as stack:  # the lockstep path: on a bound policy
        spent = {}
        bench.time_select_and_recall(policy, spent, stack)
        policy.layers[0].decode(x(6, 1), x(3, 1), x(3, 1), None)
    assert spent["select"] > 0

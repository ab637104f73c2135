"""speed benchmark: policies take turns run by run, medians per policy, the `vs first` ratio and
the peak device tokens each policy reports, on SmolLM2 with short prompts."""
import argparse
import json

import pytest

from minikv.bench import speed as bench


def test_policies_alternate_and_rows_report_each_policy(smollm2, tmp_path, monkeypatch):
    model, tok = smollm2
    monkeypatch.setattr(bench, "load_model", lambda args: (model, tok))
    order = []
    real_generate = bench.generate

    def recording_generate(*a, policy, **kw):
        order.append(policy)
        return real_generate(*a, policy=policy, **kw)

    monkeypatch.setattr(bench, "generate", recording_generate)
    out = tmp_path / "speed.json"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    window = "streaming:sink=4,window=12,R=1,slack=0,max_drop=0"
    args = parser.parse_args(["--prompt-lengths", "24", "--new-tokens", "6", "--repeats", "2", "--warmup", "1",
                              "--policy", "full", "--policy", window, "--json", str(out)])
    assert bench.run(args) == 0
    assert order == ["full", window] * 3  # one warm-up round, two timed rounds, policies in turn
    rows = json.loads(out.read_text())["rows"]
    assert [r["policy"] for r in rows] == ["full", window]
    full, stream = rows
    assert full["vs_first"] == 1.0
    assert stream["vs_first"] == pytest.approx(full["tpot_s"] / stream["tpot_s"])
    assert full["device_tokens_peak"] == 24 + 6 - 1  # the last token is sampled, never cached
    assert stream["device_tokens_peak"] <= 16
    assert full["overhead_share"] is None and all(r["tpot_s"] > 0 and r["ttft_s"] > 0 for r in rows)


def test_lockstep_decodes_what_generate_decodes(smollm2):
    """--lockstep: one shared prefill, policies in turn step by step; each policy's tokens are
    those a run of its own produces."""
    from minikv.bench.common import text_ids
    from minikv.bench.speed import lockstep_runs
    from minikv.generate import generate

    model, tok = smollm2
    ids = text_ids(tok, 200)
    specs = ["full", "icecache:budget=96"]
    found = lockstep_runs(model, ids, specs, 4)
    for spec in specs:
        alone = generate(model, tok, ids, policy=spec, max_new_tokens=4, stop_at_eos=False)
        assert found[spec]["token_ids"] == alone.token_ids and found[spec]["tpot_s"] > 0

"""speed benchmark: policies take turns run by run, medians per policy, the `TPOT x full` ratio,
the achieved bandwidth and the peak device tokens each policy reports, on SmolLM2 with short
prompts; the context-length figure."""
import argparse
import json

import pytest
import torch

from minikv.bench import speed as bench
from minikv.bench import speed_ratios as ratios

from ..fixtures import DEVICE


def test_policies_alternate_and_rows_report_each_policy(smollm2, tmp_path, monkeypatch):
    model, tok = smollm2
    monkeypatch.setattr(bench, "load_model", lambda args: (model, tok))
    order = []
    real_generate = bench.generate

    def recording_generate(*a, policy, **kw):
        order.append(policy.name)  # an unbound Policy (timed_generate probes it once bound)
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
    # the policy's part of the step (full KV's: its attention) is a share of it, the weights the rest
    assert all(0 < r["policy_share"] < 1 for r in rows)
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

    model = load_model(reference_dir / "models" / name, device=DEVICE, dtype=torch.bfloat16)
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


@pytest.mark.parametrize("spec", ["icecache:budget=96", "freekv:budget=128"])
def test_select_and_recall_are_timed_from_outside(smollm2, spec):
    """icecache and freekv carry no clock (no perf_counter in their code); the speed benchmark
    times their layers' select and their recall with bench/probes.py, and reports their shares
    of decoding, run by run and in lockstep: the selection and recall made inside a decode step
    (not the prefill's, nor a worker thread's beside the model), so they are part of the policy's
    share by construction, however loaded the machine."""
    import pathlib

    import minikv.policies.freekv as freekv
    import minikv.policies.icecache as icecache
    from minikv.bench.common import text_ids

    sources = [pathlib.Path(freekv.__file__), *pathlib.Path(icecache.__file__).parent.glob("*.py")]
    assert not [p.name for p in sources if "perf_counter" in p.read_text()]
    model, tok = smollm2
    ids = text_ids(tok, 200)
    stats = bench.timed_generate(model, tok, ids, spec, 5)
    assert stats["select_s"] > 0 and stats["recall_s"] > 0
    row = bench.summarize([stats], 5)
    assert 0 < row["select_share"] < 1 and 0 < row["recall_share"] < 1
    assert row["overhead_share"] == pytest.approx(row["select_share"] + row["recall_share"])
    # select and recall run inside the layers' decode: the policy's part holds them and more
    assert row["overhead_share"] < row["policy_share"] < 1
    found = bench.lockstep_runs(model, ids, ["full", spec], 4)
    assert found[spec]["select_s"] > 0 and "select_s" not in found["full"]
    assert found[spec]["policy_s"] > found[spec]["select_s"] and found["full"]["policy_s"] > 0


def test_overhead_share_counts_a_policy_that_times_selection_but_no_recall():
    # softfreeze's layers have a select() and no recall(): its share is the selection's alone
    from minikv.bench.speed import share

    runs = [{"tpot_s": 0.1, "select_s": 0.3}, {"tpot_s": 0.2, "select_s": 0.3}]
    assert share(runs, ("select_s", "recall_s"), new_tokens=4) == pytest.approx((1.0 + 0.5) / 2)
    assert share(runs, ("recall_s",), new_tokens=4) is None


def test_threads_are_counted_and_ratios_compare_full_kv_on_as_many_threads(smollm2, tmp_path, monkeypatch):
    """--full-threads 1 2 with --threads 1: full KV runs on one and on two intra-op threads in the
    same lockstep run; freekv with its worker counts 1 + 1 threads and divides by full on two,
    freekv:overlap=false counts 1 and divides by full on one. The thread count each run used is
    the one set around its steps."""
    model, tok = smollm2
    monkeypatch.setattr(bench, "load_model", lambda args: (model, tok))
    seen, real_decode = [], bench.decode_one_token

    def recording_decode(model, token, position, policy):
        seen.append((policy.name, getattr(policy, "overlap", None), torch.get_num_threads()))
        return real_decode(model, token, position, policy)

    monkeypatch.setattr(bench, "decode_one_token", recording_decode)
    out = tmp_path / "speed.json"
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    spec = "freekv:page_size=8,budget=48,sink=8,window=8"
    args = parser.parse_args(["--threads", "1", "--lockstep", "--prompt-lengths", "120", "--new-tokens", "4",
                              "--full-threads", "1", "2", "--policy", f"{spec},overlap=false", "--policy", spec,
                              "--json", str(out)])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert bench.policy_runs(args) == [f"{spec},overlap=false", spec, "full", "full@2"]
        assert bench.run(args) == 0
    finally:
        torch.set_num_threads(before)
    rows = {r["policy"]: r for r in json.loads(out.read_text())["rows"]}
    assert {p: r["threads"] for p, r in rows.items()} == {f"{spec},overlap=false": 1, spec: 2, "full": 1, "full@2": 2}
    assert rows[spec]["tpot_vs_base"] == pytest.approx(rows[spec]["tpot_s"] / rows["full@2"]["tpot_s"])
    sync = rows[f"{spec},overlap=false"]
    assert sync["tpot_vs_base"] == pytest.approx(sync["tpot_s"] / rows["full"]["tpot_s"])
    assert {(name, overlap, n) for name, overlap, n in seen} == {("freekv", False, 1), ("freekv", True, 1),
                                                                  ("full", None, 1), ("full", None, 2)}


def test_full_threads_below_one_is_refused():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(ValueError, match="--full-threads must be >= 1"):
        bench.check(parser.parse_args(["--full-threads", "0"]))


def test_figure_plots_each_policy_as_a_ratio_to_full_kv_of_the_same_length():
    """The context figure's data (ratio_curves): TPOT over full KV's at the same prompt length,
    whatever the absolute times (the machine's load changed between lengths here: full KV took
    twice as long at 1,000 tokens as at 8,000), full KV the 1.0 line; a length full KV lacks is
    not plotted."""
    rows = [dict(policy=p, prompt_tokens=n, tpot_s=t) for p, n, t in [
        ("full", 1000, 0.400), ("streaming", 1000, 0.420), ("softfreeze", 1000, 0.300),
        ("full", 8000, 0.200), ("streaming", 8000, 0.080), ("softfreeze", 8000, 0.250),
        ("streaming", 16000, 0.1)]]
    curves = ratios.ratio_curves(rows, ["streaming", "full", "softfreeze"], "full")
    assert list(curves) == ["streaming", "full", "softfreeze"]
    assert curves["full"] == ([1000, 8000], [1.0, 1.0])
    assert curves["streaming"][0] == [1000, 8000]
    assert curves["streaming"][1] == pytest.approx([1.05, 0.4])
    assert curves["softfreeze"][1] == pytest.approx([0.75, 1.25])


def test_the_lockstep_prefill_runs_on_prefill_threads_and_decoding_on_each_policys(smollm2, monkeypatch):
    """--prefill-threads 2 with --threads 1: the shared prefill (timed for no policy) on two
    intra-op threads, every decode step on the policy's own count, and the count before comes back."""
    model, tok = smollm2
    seen, real_prefill, real_decode = [], bench.shared_prefill, bench.decode_one_token

    def recording_prefill(*args, **kwargs):
        seen.append(("prefill", torch.get_num_threads()))
        return real_prefill(*args, **kwargs)

    def recording_decode(model, token, position, policy):
        seen.append((policy.name, torch.get_num_threads()))
        return real_decode(model, token, position, policy)

    monkeypatch.setattr(bench, "shared_prefill", recording_prefill)
    monkeypatch.setattr(bench, "decode_one_token", recording_decode)
    ids = bench.text_ids(tok, 40)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        found = bench.lockstep_runs(model, ids, ["full", "full@2"], new_tokens=3, warmup=0, prefill_threads=2)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert seen[0] == ("prefill", 2)
    assert sorted(set(seen[1:])) == [("full", 1), ("full", 2)]
    assert found["full"]["token_ids"] == found["full@2"]["token_ids"]


def test_prefill_threads_go_with_lockstep():
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for argv in (["--prefill-threads", "2"], ["--lockstep", "--prefill-threads", "0"]):
        with pytest.raises(ValueError, match="--prefill-threads must be >= 1 and goes with --lockstep"):
            bench.check(parser.parse_args(argv))


def test_figure_divides_a_policy_with_a_worker_by_full_kv_on_as_many_threads():
    rows = [dict(policy=p, prompt_tokens=8000, tpot_s=t, threads=n) for p, t, n in [
        ("full", 0.300, 1), ("full@2", 0.200, 2), ("freekv", 0.150, 2), ("freekv:overlap=false", 0.240, 1)]]
    curves = ratios.ratio_curves(rows, ["full", "full@2", "freekv", "freekv:overlap=false"], "full")
    assert curves["full"][1] == [1.0] and curves["full@2"][1] == [1.0]
    assert curves["freekv"][1] == pytest.approx([0.75])  # against full@2, not full's 0.5
    assert curves["freekv:overlap=false"][1] == pytest.approx([0.8])


def test_a_run_on_more_threads_than_any_full_run_divides_by_full_on_the_most():
    """freekv on two intra-op threads and its worker (3 threads on a 2-core machine) against full
    KV on two, not on one."""
    rows = [dict(policy=p, prompt_tokens=16000, tpot_s=t, threads=n) for p, t, n in [
        ("full@1", 0.240, 1), ("full", 0.170, 2), ("freekv", 0.210, 3)]]
    assert ratios.same_threads_baseline(rows, rows[2], "full@1")["policy"] == "full"
    assert ratios.ratio_curves(rows, ["freekv"], "full@1")["freekv"][1] == pytest.approx([0.210 / 0.170])

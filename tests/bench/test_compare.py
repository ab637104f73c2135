"""compare: which rows run, the derived numbers and tables, --include, and a tiny real run."""
import json

import pytest

from minikv.bench.__main__ import main
from minikv.bench.compare import configs
from minikv.bench.compare_report import annotate, markdown
from minikv.policies import available
from minikv.policies.registry import _REGISTRY, parameters


def test_every_policy_at_every_budget_and_full_first():
    rows = configs(None, [64, 256])
    assert rows[0] == {"spec": "full", "policy": "full", "budget": None}
    for name in available():
        mine = [r for r in rows if r["policy"] == name]
        takes = "budget" in parameters(_REGISTRY[name]) and name != "full"
        assert [r["budget"] for r in mine] == ([64, 256] if takes else [None])
    assert [r["spec"] for r in configs(["streaming:budget=100", "streaming:R=1"], [64])] == \
        ["full", "streaming:budget=100", "streaming:R=1,budget=64"]
    with pytest.raises(ValueError, match="unknown policy"):
        configs(["nope"], [64])
    with pytest.raises(ValueError, match="no parameter"):
        configs(["streaming:nope=1"], [64])


def fake_result():
    def row(policy, budget, scores, tpot, source="minikv", **extra):
        return {"source": source, "policy": policy, "spec": policy, "budget": budget, "scores": scores,
                "kv_mean_tokens": 100.0, "kv_peak_tokens": 120.0, "kv_share_mean": 0.5, "kv_share_peak": 0.6,
                "recall": extra.get("recall"), "error": None,
                "long": {"tpot_s": tpot, "ppl": 5.0, "device_tokens_peak": 50.0, "kv_share_peak": 0.25,
                         "bytes_to_device": 2**20, "bytes_to_host": 0}}
    return {"benchmark": "compare", "model": "smollm2", "settings": {"length": 1024, "seeds": [0]},
            "oracle": {"64": 0.9},
            "rows": [row("full", None, {"niah_single_1": 100.0, "cwe": 10.0, "vt": 60.0}, 0.02),
                     row("freekv", 64, {"niah_single_1": 50.0, "cwe": 0.0, "vt": 20.0}, 0.01, recall=0.8)]}


def test_weak_tasks_are_marked_and_left_out_of_the_mean():
    result = fake_result()
    annotate(result)
    assert result["weak_tasks"] == ["cwe"]
    free = result["rows"][1]
    assert free["mean"] == pytest.approx(35.0)  # (50 + 20) / 2, cwe left out
    assert free["mean_aggregation"] == pytest.approx(20.0)
    assert free["tpot_ratio"] == pytest.approx(0.5)
    text = markdown(result)
    assert "| cwe † |" in text and "left out of the means" in text
    assert "| freekv | 64 | 50 | 35.0 |" not in text  # niah and vt are in different tables
    assert "| freekv | 64 | 50 | 50.0 | 100 | 120 | 50 | 0.50 |" in text
    assert "| oracle (best top-b) | 64 |" in text and "0.800" in text


def test_the_report_says_where_and_how_long_each_merged_run_ran():
    result = fake_result()
    epyc = {"cpu": "AMD EPYC", "cpu_threads": 1, "gpu": None}
    result.update(machine=epyc, wall_s=750.0,
                  included=[{"file": "a.json", "machine": {"cpu": "Xeon", "cpu_threads": 2}},
                            {"file": "b.json", "machine": epyc, "wall_s": 450.0},
                            {"file": "c.json", "machine": epyc}])
    annotate(result)
    text = markdown(result)
    assert "Run on AMD EPYC, 1 thread(s), no GPU: 3 run(s), 7.5-12.5 min wall each, 20 in all (1 not recorded); " \
           "Xeon, 2 thread(s), no GPU, wall time not recorded." in text


def test_a_budget_the_spec_sets_itself_goes_to_the_budget_column():
    result = fake_result()
    result["rows"][1].update(policy="synckv", spec="synckv:budget=512,wide_layers=4", budget=None)
    annotate(result)
    assert "| synckv:wide_layers=4 | 512 | 50 |" in markdown(result)


def test_memory_curves_put_each_policy_at_the_memory_it_used():
    from minikv.bench.compare_figures import memory_curves

    result = fake_result()
    result["rows"][1]["kv_share_mean"] = 0.25
    result["rows"][0]["long"]["kv_share_mean"] = 1.0
    result["rows"][1]["long"].update(kv_share_mean=0.1, ppl=7.5)
    annotate(result)
    curves = memory_curves(result["rows"])
    (mem, score, ci), = curves["accuracy"]["freekv"]
    assert mem == 25.0 and score == pytest.approx(35.0) and ci == result["rows"][1]["mean_ci"]
    assert curves["ppl"] == {"full": [(100.0, 1.0, None)], "freekv": [(10.0, 1.5, None)]}


def test_include_merges_rows_into_tables_and_json(tmp_path):
    base, extra = tmp_path / "base.json", tmp_path / "kvpress.json"
    base.write_text(json.dumps(fake_result()))
    press = fake_result()
    press["source"] = "kvpress"
    for r in press["rows"]:
        r["source"] = "kvpress"
    press["rows"][1]["policy"] = "snapkv"
    extra.write_text(json.dumps(press))
    out = tmp_path / "out"
    assert main(["compare", "--from", str(base), "--include", str(extra), "--out", str(out)]) == 0
    merged = json.loads((out / "compare.json").read_text())
    assert [(r["source"], r["policy"]) for r in merged["rows"]] == [
        ("minikv", "full"), ("minikv", "freekv"), ("kvpress", "full"), ("kvpress", "snapkv")]
    md = (out / "compare.md").read_text()
    assert "| snapkv (kvpress) | 64 |" in md
    assert (out / "accuracy.png").stat().st_size > 1000 and (out / "recall.png").exists()
    assert (out / "accuracy_mem.png").stat().st_size > 1000


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    from minikv.cli import run_command  # what `python -m minikv.bench` runs main through

    assert run_command(main, ["compare", "--from", str(tmp_path / "missing.json")]) == 2
    assert run_command(main, ["compare", "--tasks", "qa_1"]) == 2
    assert run_command(main, ["compare", "--policy", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)


def test_a_tiny_real_run_writes_tables_json_and_figures(smollm2, tmp_path, monkeypatch):
    import minikv.bench.common as common

    monkeypatch.setattr(common, "load_model", lambda args: smollm2)
    import minikv.bench.compare as compare

    monkeypatch.setattr(compare, "load_model", lambda args: smollm2)
    out = tmp_path / "out"
    argv = ["compare", "--policy", "full", "--tasks", "niah_single_1", "long", "--length", "300", "--long-prompt", "64",
            "--long-steps", "4", "--budget", "32", "--out", str(out)]
    assert main(argv) == 0
    result = json.loads((out / "compare.json").read_text())
    (row,) = result["rows"]
    assert row["policy"] == "full" and row["error"] is None
    assert row["scores"] == {"niah_single_1": 100.0}
    assert row["kv_share_mean"] == pytest.approx(1.0) and row["kv_peak_tokens"] >= 300
    assert row["long"]["steps"] == 3 and row["long"]["tpot_s"] > 0 and row["tpot_ratio"] == 1.0
    assert 0 < result["oracle"]["32"] < 1
    assert result["machine"]["cpu"] and result["machine"]["torch"]
    md = (out / "compare.md").read_text()
    assert "| policy | budget | niah_single_1 | mean | KV mean | KV peak | Mem% | TPOT x full |" in md
    assert (out / "accuracy.png").exists() and (out / "tpot_memory.png").exists()


@pytest.mark.slow
def test_quick_preset_streaming_loses_needles_full_kv_finds(smollm2, tmp_path, monkeypatch):
    # the quick preset's prompts (1,024 tokens) with their needles before the last 64 tokens:
    # a 64-token window cannot answer what full KV answers
    import minikv.bench.compare as compare

    monkeypatch.setattr(compare, "load_model", lambda args: smollm2)
    argv = ["compare", "--policy", "streaming", "--budget", "64", "--seeds", "0", "--tasks", "passkey", "niah_single_1",
            "niah_multikey_2", "long", "--out", str(tmp_path)]
    assert main(argv) == 0
    full, stream = json.loads((tmp_path / "compare.json").read_text())["rows"]
    assert full["scores"] == {"passkey": 100.0, "niah_single_1": 100.0, "niah_multikey_2": 100.0}
    assert full["mean"] == 100.0 and stream["mean"] < 50
    assert stream["kv_peak_tokens"] <= 64 and stream["long"]["device_tokens_peak"] <= 64
    assert stream["long"]["ppl"] > full["long"]["ppl"]


def test_shared_prefill_rows_answer_as_separate_runs_do(smollm2):
    # the compare run prefills a prompt once for the rows that can share it (streaming prefills
    # alone), then each row decodes on its own cache: the answers, and the long pass's perplexity
    # in lockstep, must be those of one run per policy
    from minikv import generate
    from minikv.bench.compare_run import bind, lockstep_long_pass, long_pass, prefill_all, answer, shares_prefill
    from minikv.bench.common import text_ids
    from minikv.bench.tasks import make_instance

    model, tok = smollm2
    specs = ["full", "streaming:budget=64", "freekv:budget=96,page_size=8,sink=8,window=16",
             "synckv:budget=64,wide_layers=0", "icecache:budget=96,page_size=8,skip_layers=28"]
    inst = make_instance("niah_single_1", tok, 300, 0)
    n = len(inst.ids) + inst.max_new_tokens
    rows = [bind(model, s, n, [32] if s == "full" else ()) for s in specs]
    assert [shares_prefill(r) for r in rows] == [True, False, True, True, True]
    logits = prefill_all(model, rows, inst.ids, rebind=None)
    for spec, b, lg in zip(specs, rows, logits):
        alone = generate(model, tok, inst.ids, policy=spec, max_new_tokens=inst.max_new_tokens).text
        assert answer(model, tok, b, lg, len(inst.ids), inst.max_new_tokens) == alone, spec
        assert len(b.device) >= 1 and b.seq[0] == len(inst.ids)
    ids = text_ids(tok, 200)
    lock = lockstep_long_pass(model, ids, 180, [bind(model, s, 200, probe=False) for s in specs], rebind=None)
    for spec, got in zip(specs, lock):
        assert got["steps"] == 19
        assert got["ppl"] == pytest.approx(long_pass(model, ids, 180, spec)["ppl"], rel=1e-5), spec


def test_include_of_a_second_minikv_run_keeps_one_full_row_and_each_runs_ratio(tmp_path):
    # a compare run split in two (each with its own full KV): the merged table has one full row,
    # and each row's TPOT ratio is against the full KV of the run that measured it
    first, second = fake_result(), fake_result()
    second["rows"][1].update(policy="icecache", spec="icecache:budget=64")
    for run, full_tpot in ((first, 0.02), (second, 0.04)):
        for r in run["rows"]:
            r["long"]["tpot_x_full"] = r["long"]["tpot_s"] / full_tpot
    second["rows"][1]["long"]["tpot_s"] = 0.03
    second["rows"][1]["long"]["tpot_x_full"] = 0.75
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(first))
    b.write_text(json.dumps(second))
    out = tmp_path / "out"
    assert main(["compare", "--from", str(a), "--include", str(b), "--out", str(out)]) == 0
    merged = json.loads((out / "compare.json").read_text())
    assert [r["policy"] for r in merged["rows"]] == ["full", "freekv", "icecache"]
    assert [r["tpot_ratio"] for r in merged["rows"]] == [1.0, 0.5, 0.75]


def test_cells_carry_their_95_percent_intervals_and_haystacks_are_named():
    from minikv.bench.compare import task_haystacks

    assert task_haystacks("niah_single_1", ["noise", "pydoc"]) == ["noise", "pydoc"]
    assert task_haystacks("niah_multikey_2", ["noise", "pydoc"]) == ["noise"]  # its own distractors, once
    assert task_haystacks("cwe", ["pydoc"]) == ["noise"]
    result = fake_result()
    hits = [100.0] * 18 + [0.0] * 2
    for r in result["rows"]:
        r["answers"] = [{"task": t, "score": s} for t in ("niah_single_1", "niah_single_1@pydoc")
                        for s in (hits if r["policy"] == "full" else hits[::-1][:10] + [0.0] * 10)]
        r["scores"] = {"niah_single_1": 90.0 if r["policy"] == "full" else 10.0,
                       "niah_single_1@pydoc": 90.0 if r["policy"] == "full" else 10.0}
        r["intervals"] = {t: [69.9, 97.2] if r["policy"] == "full" else [2.8, 30.1] for t in r["scores"]}
    annotate(result)
    full, free = result["rows"]
    assert full["mean_ci"][0] < 90 < full["mean_ci"][1] and free["mean_ci"][1] < full["mean_ci"][0]
    text = markdown(result)
    assert "| niah_single_1 | niah_single_1@pydoc |" in text
    assert "| full | all | 90 (70-97) | 90 (70-97) |" in text
    assert "95% interval" in text and "natural text" in text


def test_variants_of_one_policy_are_labelled_by_their_parameters():
    from minikv.bench.compare_report import label

    assert label({"policy": "freekv", "spec": "freekv:page_size=16,budget=256", "budget": 256}) == "freekv:page_size=16"
    assert label({"policy": "freekv", "spec": "freekv:budget=256", "budget": 256}) == "freekv"
    assert label({"policy": "synckv", "spec": "synckv:budget=512", "budget": None}) == "synckv"  # 512: its column
    assert label({"policy": "snapkv", "source": "kvpress", "spec": "x"}) == "snapkv (kvpress)"


def test_a_run_split_by_seeds_merges_into_the_run_over_all_seeds(smollm2, tmp_path, monkeypatch):
    # runs split over processes pool their instances: seeds 0-1 and seed 2 merged give what one run
    # over seeds 0-2 gives (scores, intervals, Mem%, recall, the oracle), and an overlap is refused
    import minikv.bench.compare as compare

    monkeypatch.setattr(compare, "load_model", lambda args: smollm2)
    common = ["compare", "--policy", "full", "--policy", "freekv", "--tasks", "niah_single_1", "--length", "256",
              "--budget", "128"]
    for name, seeds in (("a", ["0", "1"]), ("b", ["2"]), ("all", ["0", "1", "2"]), ("ab", ["1", "2"])):
        assert main(common + ["--seeds", *seeds, "--json", str(tmp_path / f"{name}.json")]) == 0
    out = tmp_path / "out"
    assert main(["compare", "--from", str(tmp_path / "a.json"), "--include", str(tmp_path / "b.json"),
                 "--json", str(out)]) == 0
    merged, whole = json.loads(out.read_text()), json.loads((tmp_path / "all.json").read_text())
    assert merged["settings"]["seeds"] == [0, 1, 2]
    for m, w in zip(merged["rows"], whole["rows"], strict=True):
        assert m["spec"] == w["spec"] and m["instances"] == w["instances"] == {"niah_single_1": 3}
        assert m["scores"] == w["scores"] and m["intervals"] == w["intervals"]
        assert sorted(a["seed"] for a in m["answers"]) == [0, 1, 2]
        for key in ("kv_mean_tokens", "kv_share_mean", "kv_peak_tokens", "recall"):
            assert m[key] == (None if w[key] is None else pytest.approx(w[key], rel=1e-9)), key
    assert merged["oracle"] == pytest.approx(whole["oracle"], rel=1e-9)
    assert main(["compare", "--from", str(tmp_path / "a.json"), "--include", str(tmp_path / "ab.json")]) == 2


def test_a_row_measured_on_a_subset_or_superset_of_instances_keeps_the_larger():
    from minikv.bench.compare_merge import merge

    def run(seeds, kv):
        result = fake_result()
        for r in result["rows"]:
            r["answers"] = [{"task": "niah_single_1", "seed": s, "score": 100.0} for s in seeds]
            r["kv_mean_tokens"] = kv
        result["oracle"] = {"64": kv / 100}
        return result

    small, large = run([0], 10.0), run([0, 1, 2], 30.0)
    merge(small, large, "large.json")  # the first run's row holds fewer: the larger replaces it
    assert [len(r["answers"]) for r in small["rows"]] == [3, 3] and small["rows"][0]["kv_mean_tokens"] == 30.0
    assert small["oracle"] == {"64": 0.3}  # the oracle goes with the full KV row it was measured on
    for r in small["rows"]:
        r["instances"] = {"niah_single_1": 3}
    assert "3 instance(s) per task" in markdown(small)  # as measured, whatever the settings' seeds say
    large, small = run([0, 1, 2], 30.0), run([0], 10.0)
    merge(large, small, "small.json")  # measured again on fewer: kept as it was
    assert [len(r["answers"]) for r in large["rows"]] == [3, 3] and large["rows"][0]["kv_mean_tokens"] == 30.0
    assert large["oracle"] == {"64": 0.3}


def test_the_smoke_preset_runs_one_budget_and_says_it_ranks_nothing():
    import argparse

    from minikv.bench.compare import add_arguments, settings_of

    p = argparse.ArgumentParser()
    add_arguments(p)
    s = settings_of(p.parse_args(["--preset", "smoke"]))
    assert s["budgets"] == [128] and len(s["seeds"]) == 2 and s["length"] < 1024 and "long" in s["tasks"]
    assert settings_of(p.parse_args(["--preset", "smoke", "--budget", "64"]))["budgets"] == [64]
    result = fake_result()
    annotate(result)
    assert "Smoke run" not in markdown(result)
    result["settings"]["preset"] = "smoke"
    assert markdown(result).startswith("**Smoke run** (--preset smoke)") and "rank anything" in markdown(result)


def test_mem_share_on_a_hybrid_model_counts_the_local_layers_windows():
    # Gemma 3's local layers keep a window of their own (the runtime's, not the policy's): a row's
    # KV is sampled over every layer, as stats() counts it, so full KV's own row on the tiny hybrid
    # model (local, global, local; window 16) holds (16 + 40 + 16) / 3 tokens per layer at 40, not 40
    import torch

    from minikv.bench.compare_run import bind
    from minikv.testing.models import tiny_model

    model = tiny_model("gemma3_hybrid", device="cpu")
    ids = torch.arange(3, 43).view(1, 40)
    b = bind(model, "full", 48, probe=False)
    model(ids, policy=b.policy)
    b.sample(40)
    assert b.seq == [40] and b.device == [pytest.approx((16 + 40 + 16) / 3)]
    assert b.device[0] == pytest.approx(b.policy.stats()["device_tokens"])

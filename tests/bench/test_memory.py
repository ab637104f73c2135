"""bench memory: the command runs end to end on SmolLM2 (a few tokens), writes its JSON and a PNG,
and its numbers are consistent: full KV is the line y = x, softfreeze's active KV never exceeds
it and adds up with the host tier."""
import json

from minikv.bench.__main__ import main


def test_memory_bench_writes_table_json_and_png(tmp_path, capsys):
    out, png = tmp_path / "memory.json", tmp_path / "memory.png"
    rc = main(["memory", "--new-tokens", "24", "--policy", "softfreeze:score=relative,tau=2", "--relevance-stats",
               "--png", str(png), "--json", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "softfreeze:score=relative,tau=2" in printed and "relevance" in printed
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    data = json.loads(out.read_text())
    full, sf = data["rows"]
    assert full["policy"] == "full" and full["compression"] == 0 and full["tpot_vs_full"] == 1
    assert full["totals"] == [t for t, a in zip(full["totals"], full["active_mean"]) if a == t]
    assert sf["totals"] == full["totals"]  # one point per forward: prefill + 23 decode steps
    assert len(sf["totals"]) == 24 and len(sf["active_per_layer"][0]) == 30
    assert all(a <= t for t, a in zip(sf["totals"], sf["active_mean"]))
    assert 0 < sf["compression"] < 1 and sf["events"]["freezes"] > 0
    assert sf["active_kv"] == sum(sf["active_per_layer"][-1]) / 30
    assert data["relevance"]["raw"]["q50"] > 0.5  # the raw Eq. 2 scale on SmolLM2 is far above tau = 0.5

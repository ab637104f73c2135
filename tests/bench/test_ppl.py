"""ppl benchmark logic: default rows, perplexity arithmetic, and a tiny end-to-end run on a random
model (no download): every row scored on every token, the window baseline on its positions."""
import json
import math

import pytest
import torch

from minikv.bench import ppl as bench
from minikv.policies import make


def test_default_rows_share_the_context_cap():
    rows = bench.default_policies(512)
    assert rows[0] == ("Full KV", "full")
    for label, spec in rows[1:]:
        p = make(spec)
        assert p.sink + p.window == 512
    specs = dict(rows)
    assert (make(specs["StreamingLLM"]).R, make(specs["StreamingLLM"]).slack, make(specs["StreamingLLM"]).max_drop) == (1, 0, 0)
    ours = make(specs["Lazy+Slack+Max_Drop"])
    assert (ours.R, ours.slack, ours.max_drop) == (32, 16, 32)
    assert make(specs["w/o Slack"]).slack == 0 and make(specs["w/o Max_Drop"]).max_drop == 0


def test_nll_and_ppl():
    logits = torch.tensor([0.0, math.log(3.0)])  # p = (1/4, 3/4)
    assert bench.nll_of(logits, 1) == pytest.approx(-math.log(0.75))
    assert bench.ppl([math.log(2.0), math.log(8.0)]) == pytest.approx(4.0)
    assert bench.ppl([0.0, math.log(8.0), 5.0], positions=[1]) == pytest.approx(8.0)


class TinyTokenizer:
    def encode(self, text, add_bos=None):
        return [ord(c) % 64 for c in text]


def test_tiny_end_to_end(tmp_path, monkeypatch):
    from minikv.config import ModelConfig
    from minikv.models.llama import LlamaForCausalLM

    cfg = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=2,
                      n_heads=4, n_kv_heads=2, head_dim=8, max_position_embeddings=256, rotary_dim=8)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.2)
    monkeypatch.setattr(bench, "load_model", lambda args: (model, TinyTokenizer()))
    out = tmp_path / "ppl.json"
    import argparse

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--tokens", "60", "--context", "16", "--baseline-every", "8", "--short", "20",
                              "--tpot-at", "30", "--tpot-span", "5", "--json", str(out)])
    assert bench.run(args) == 0
    data = json.loads(out.read_text())
    rows = {r["method"]: r for r in data["rows"]}
    assert data["baseline_positions"] == [7, 15, 23, 31, 39, 47, 55]
    full, stream = rows["Full KV"], rows["StreamingLLM"]
    assert len(full["step_times_s"]) == 59
    assert stream["ppl"] != full["ppl"] and stream["prune_events"] > 0
    assert full["kv_mb"] > stream["kv_mb"]
    base = rows["Window recompute (every 8)"]
    # the baseline's first position sees tokens 0..7, inside the cap: the same context as Full KV
    assert base["ppl_sub"] is not None and base["tpot_x_full"] > 0

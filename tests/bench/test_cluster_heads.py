"""cluster-heads: the command writes a clustering file keyed by the model's identity, in the format
the synckv policy reads, deterministically; the file shipped for SmolLM2 is one it made."""
import json

import pytest

from minikv.bench.__main__ import main
from minikv.policies.synckv_clusters import DATA_DIR, FORMAT

SHIPPED = DATA_DIR / "synckv_smollm2.json"


def run_command(tmp_path, name, *extra):
    out = tmp_path / name
    assert main(["cluster-heads", "--model", "smollm2", "--threads", "1", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_tiny_run_writes_a_file_for_this_model_like_the_shipped_one(tmp_path, capsys):
    """One document of 48 tokens, 3 steps: same format and model identity (config and weights
    checksums) as the shipped file, a clustering for every N_r, the summary tables printed."""
    doc = run_command(tmp_path, "tiny.json", "--docs", "1", "--doc-tokens", "48", "--steps", "3", "--topk", "8")
    shipped = json.loads(SHIPPED.read_text())
    assert doc["format"] == shipped["format"] == FORMAT
    assert doc["model"] == shipped["model"]
    assert set(doc["clusterings"]) == set(shipped["clusterings"]) == {"1", "2", "3"}
    assert doc["corpus"] == {"source": "pydoc_data.topics", "docs": 1, "doc_tokens": 48, "steps": 3, "topk": 8}
    for n, layers in doc["clusterings"].items():
        assert len(layers) == 30
        for layer in layers:
            assert sorted(h for c in layer["clusters"] for h in c) == [0, 1, 2] and len(layer["clusters"]) == int(n)
            assert all(r in c for r, c in zip(layer["r_heads"], layer["clusters"]))
    out = capsys.readouterr().out
    assert "clusters N_r=1" in out and "temporal locality" in out and "intra-layer similarity" in out


@pytest.mark.parametrize("args, message", [
    (["--docs", "0"], "--docs must be >= 1"),
    (["--n-r", "4"], "--n-r values must be in 1..3"),
    (["--doc-tokens", "9000"], "exceeds the model's context"),
])
def test_bad_arguments_exit_2_with_one_line(tmp_path, capsys, args, message):
    assert main(["cluster-heads", "--out", str(tmp_path / "x.json"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


@pytest.mark.slow
def test_shipped_file_is_what_the_command_produces(tmp_path):
    """Re-run on a small corpus (the shipped file's first 4 documents, 300 tokens each, its steps
    and k) twice: byte-for-byte the same file (determinism), and its clusters those of the
    shipped file for most layers (App. B.1's robustness: a different corpus moves a few heads)."""
    shipped = json.loads(SHIPPED.read_text())
    corpus = shipped["corpus"]
    extra = ["--docs", "4", "--doc-tokens", "300", "--steps", str(corpus["steps"]), "--topk", str(corpus["topk"])]
    a = run_command(tmp_path, "a.json", *extra)
    b = run_command(tmp_path, "b.json", *extra)
    assert a == b
    assert a["model"] == shipped["model"] and a["format"] == shipped["format"]
    for n in ("1", "2"):
        same = sum(x["clusters"] == y["clusters"] and x["r_heads"] == y["r_heads"]
                   for x, y in zip(a["clusterings"][n], shipped["clusterings"][n]))
        assert same >= AGREEMENT[n], f"N_r={n}: {same} of 30 layers agree"
    # N_r = 3 is every head its own cluster, whatever the corpus
    assert a["clusterings"]["3"] == shipped["clusterings"]["3"]

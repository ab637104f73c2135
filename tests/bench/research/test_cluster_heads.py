"""cluster-heads: the command writes a clustering file keyed by the model's identity, in the format
the synckv policy reads, deterministically; the file shipped for SmolLM2 is one it made."""
import json

import pytest

from minikv.bench.__main__ import main
from minikv.cli import run_command
from minikv.policies.synckv.clusters import DATA_DIR, FORMAT

SHIPPED = DATA_DIR / "synckv_smollm2.json"


def run_cluster_heads(tmp_path, name, *extra):
    out = tmp_path / name
    assert main(["cluster-heads", "--model", "smollm2", "--threads", "1", "--out", str(out), *extra]) == 0
    return json.loads(out.read_text())


def test_tiny_run_writes_a_file_for_this_model_like_the_shipped_one(tmp_path, capsys):
    """One document of 48 tokens, 3 steps: same format and model identity (config and weights
    checksums) as the shipped file, a clustering for every N_r, the summary tables printed."""
    doc = run_cluster_heads(tmp_path, "tiny.json", "--docs", "1", "--doc-tokens", "48", "--steps", "3", "--topk", "8")
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
    assert run_command(main, ["cluster-heads", "--out", str(tmp_path / "x.json"), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and message in err and "Traceback" not in err


@pytest.mark.slow
def test_shipped_file_is_what_the_command_produces(tmp_path):
    """Re-run the command on the shipped file's own corpus (its documents, tokens per document,
    steps and k: the paper's 50 x 1,000 tokens, 32 steps; about 4-18 minutes of one core): the
    same model identity, the same similarity up to two top-k memberships per entry, and the same
    clusters and R-heads in every layer, for every N_r. So the shipped file is reproducible.

    A similarity entry is a mean over k x steps x documents of overlap counts, so it moves in
    steps of 1/(k steps docs) (9.8e-6 here). On another CPU the float sums of attention run in
    another order, and a near-tie between two tokens' scores can put the other one in a top-k
    set: the shipped file, made on an AVX2 machine, and a rerun on an AVX-512 one differ by one
    such step in 14 of the 90 pairs of KV heads (30 layers x 3); a rerun on an Intel Xeon with
    AMX by up to two steps in 38 of the 270 entries. The clusterings are the same on all three."""
    shipped = json.loads(SHIPPED.read_text())
    c = shipped["corpus"]
    doc = run_cluster_heads(tmp_path, "again.json", "--docs", str(c["docs"]), "--doc-tokens", str(c["doc_tokens"]),
                      "--steps", str(c["steps"]), "--topk", str(c["topk"]), "--seed", str(shipped["seed"]))
    assert doc["model"] == shipped["model"] and doc["corpus"] == shipped["corpus"]
    one_membership = 1 / (c["topk"] * c["steps"] * c["docs"])
    for mine, theirs in zip(doc["similarity"], shipped["similarity"]):
        # + 1e-6: the file keeps six decimals
        assert max(abs(x - y) for r1, r2 in zip(mine, theirs) for x, y in zip(r1, r2)) <= 2 * one_membership + 1e-6
    assert doc["clusterings"] == shipped["clusterings"]

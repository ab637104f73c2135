"""dci-recall benchmark: bad arguments are one-line errors with exit status 2 (before any model
loads); tree_recall is exact with exhaustive parameters and counts the keys it scored."""
import torch

from minikv.bench.__main__ import main
from minikv.bench.research.dci_recall import tree_recall
from minikv.cli import run_command


def test_bad_arguments_exit_2(capsys):
    assert run_command(main, ["dci-recall", "--keys", "0"]) == 2
    assert run_command(main, ["dci-recall", "--k", "0"]) == 2
    assert run_command(main, ["dci-recall", "--keys", "10", "--k", "16"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert run_command(main, ["--check", "dci-recall", "--keys", "2000", "4000"]) == 0


def test_tree_recall_exhaustive_is_exact():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 700, 16, generator=g)
    q = torch.randn(4, 5, 16, generator=g)  # 4 query heads over 2 KV heads, 5 positions
    r, scored = tree_recall(q, keys, 8, fov=700, prop=1.0)
    assert r == 1.0 and scored == 1.0
    r, scored = tree_recall(q, keys, 8)
    assert 0 < r <= 1 and 0 < scored < 1

"""quant2-cost benchmark: bad arguments are one-line errors with exit status 2 (before any model
loads); the shortlist measure is exact where the box is tight and finds nothing to leave out on
random keys; the other scoring forms it times compute what coded_logits computes."""
import math

import pytest
import torch

from minikv.bench.__main__ import main
from minikv.bench.research.quant2_cost import FORMS, P, must_score, random_layer
from minikv.cli import run_command
from minikv.kernels.page_scores import GROUP_REDUCES, pack_codes
from minikv.kernels.page_scores.reference import coded_logits


def test_bad_arguments_exit_2(capsys):
    assert run_command(main, ["quant2-cost", "--lengths", "100"]) == 2
    assert run_command(main, ["quant2-cost", "--budget", "64"]) == 2
    assert run_command(main, ["quant2-cost", "--json", "/nonexistent-minikv-dir/out.json"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("error: ") for line in err)
    assert run_command(main, ["--check", "quant2-cost", "--lengths", "8000", "32000"]) == 0


@pytest.mark.parametrize("reduce", GROUP_REDUCES)
def test_a_tight_box_leaves_out_every_page_below_the_kth(reduce):
    """Pages of P equal keys: the box is the key, the bound is the page's mass, so an exact
    shortlist must score only the k pages at the top (distinct scores: no ties)."""
    g = torch.Generator().manual_seed(0)
    Hkv, G, n, D, k = 2, 3, 40, 8, 5
    keys = torch.randn(1, Hkv, n, 1, D, generator=g).expand(1, Hkv, n, P, D)
    lo, hi = keys.amin(3), keys.amax(3)
    q = torch.randn(1, Hkv * G, D, generator=g)
    assert must_score(q, lo, hi, pack_codes(keys, lo, hi), k, reduce) == pytest.approx(k / n)


@pytest.mark.parametrize("reduce", GROUP_REDUCES)
def test_random_keys_leave_nothing_out(reduce):
    q, lo, hi, codes = random_layer(2, 7, 64, 250)
    assert must_score(q, lo, hi, codes, 29, reduce) == 1.0


def test_the_timed_forms_compute_coded_logits():
    q, lo, hi, codes = random_layer(2, 3, 12, 20)
    qg = q.view(2, 3, 12)
    want = coded_logits(qg, lo, hi, codes)
    for name, form in FORMS.items():
        got = form(qg, lo, hi, codes)
        tol = 1e-3 if "approx" in name else 1e-5 * math.sqrt(12)
        torch.testing.assert_close(got, want, atol=tol, rtol=tol, msg=name)

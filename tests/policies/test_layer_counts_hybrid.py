"""On a model with local and global layers the layer counts of a policy's parameters (freekv's and
icecache's skip_layers, synckv's wide_layers) count the layers it governs, the global ones, as
their help says: on a six-layer model with global layers 1, 3 and 5, skip_layers=2 keeps full KV
in layers 1 and 3 and leaves layer 5 to the policy."""
from dataclasses import replace

import pytest
import torch

from minikv.policies import make
from minikv.policies.full import FullLayer
from minikv.policies.params import declarations, meaning
from minikv.policies.window import WindowLayer
from minikv.testing.models import tiny_model

from ..fixtures import DEVICE

LOCAL, GLOBAL = "sliding_attention", "full_attention"


@pytest.fixture(scope="module")
def six():
    """The tiny hybrid family's config with six layers, local and global in turn (window 16)."""
    cfg = tiny_model("gemma3_hybrid", device=DEVICE).cfg
    return replace(cfg, n_layers=6, layer_types=(LOCAL, GLOBAL) * 3)


@pytest.mark.parametrize("name", ["freekv", "icecache"])
def test_skip_layers_counts_the_global_layers(six, name):
    policy = make(f"{name}:skip_layers=2").bind(six, device=DEVICE, dtype=torch.float32, max_len=64)
    assert policy.global_layers == [1, 3, 5]
    assert all(isinstance(policy.layer(i), WindowLayer) for i in (0, 2, 4))
    assert isinstance(policy.layer(1), FullLayer) and isinstance(policy.layer(3), FullLayer)
    assert not isinstance(policy.layer(5), FullLayer)  # the policy's own layer
    # one more than the global layers is refused, though the model has six
    with pytest.raises(ValueError, match="skip_layers must be <="):
        make(f"{name}:skip_layers=4").bind(six, device=DEVICE, dtype=torch.float32, max_len=64)
    assert "global" in meaning(declarations(type(policy))["skip_layers"])


def test_wide_layers_help_says_it_counts_the_governed_layers():
    from minikv.policies.synckv.policy import SyncKV

    assert "global" in meaning(declarations(SyncKV)["wide_layers"])

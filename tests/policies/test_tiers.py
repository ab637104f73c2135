"""Tiers (policies/tiers.py) on its own: a tensor sent to the other tier is a copy that later
writes to the source do not reach, except a fresh temporary already where it is going; every
copy counts its bytes, whichever way it goes; and the backend each tier's operations run on."""
import pytest
import torch

from minikv.policies.tiers import Tiers, backend_on

from ..fixtures import DEVICE


def test_a_copy_to_the_other_tier_is_its_own_memory():
    tiers = Tiers(DEVICE)
    t = torch.arange(12, dtype=torch.float32, device=DEVICE).view(3, 4)
    host, back = tiers.to_host(t), tiers.to_device(t)
    assert host.device.type == "cpu" and back.device == t.device
    t.add_(100)  # the source moves on (a slot refilled): neither copy may follow it
    assert torch.equal(host, torch.arange(12, dtype=torch.float32).view(3, 4))
    assert torch.equal(back.cpu(), torch.arange(12, dtype=torch.float32).view(3, 4))
    assert (tiers.bytes_to_host, tiers.bytes_to_device) == (48, 48)


def test_a_fresh_temporary_already_on_its_tier_is_handed_over():
    tiers = Tiers("cpu")
    t = torch.ones(5, dtype=torch.bfloat16)
    assert tiers.to_host(t, fresh=True) is t and tiers.to_device(t, fresh=True) is t
    assert tiers.to_host(t) is not t and tiers.to_device(t) is not t
    assert (tiers.bytes_to_host, tiers.bytes_to_device) == (20, 20)  # counted either way
    assert not tiers.pin  # pinned host memory only beside CUDA


def test_a_host_tier_operation_runs_eager_beside_a_gpu():
    """Triton kernels address GPU memory only: beside a GPU the host tier's operations run eager;
    on a CPU-only machine both tiers are CPU memory and run the policy's backend."""
    assert backend_on("host", "triton", "cuda") == "eager" and backend_on("device", "triton", "cuda") == "triton"
    assert backend_on("host", "triton", "cpu") == "triton" and backend_on("device", "reference", "cpu") == "reference"
    with pytest.raises(ValueError, match="^tier must be 'host' or 'device', got 'disk'$"):
        backend_on("disk", "eager", "cpu")


def test_the_two_staging_buffers_are_taken_in_turn_and_counted():
    from minikv.policies.pool import Staging

    staging = Staging((3, 2, 4, 8), torch.bfloat16, Tiers(DEVICE))
    assert [staging.take() for _ in range(5)] == [0, 1, 0, 1, 0]
    per_buffer = 3 * 2 * 4 * 8 * 2
    assert staging.nbytes() == (2 * per_buffer, 2 * per_buffer)  # two on each tier
    assert all(t.dtype == torch.bfloat16 for t in staging.host + staging.dev)

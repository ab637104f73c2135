"""fast/hugepages.py: parameters and buffers in memory advised for transparent huge pages."""
from pathlib import Path

import torch

from minikv.fast import hugepages


def thp_available() -> bool:
    """Linux with transparent huge pages on (always or madvise)."""
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return thp.is_file() and "[never]" not in thp.read_text()


def mapping_flags(ptr: int) -> set[str] | None:
    """The VmFlags of the mapping holding address ptr (Linux), or None."""
    smaps = Path("/proc/self/smaps")
    if not smaps.is_file():
        return None
    lo = hi = None
    for line in smaps.read_text().splitlines():
        head = line.split()[0] if line.split() else ""
        if "-" in head and ":" not in head:
            a, b = (int(x, 16) for x in head.split("-"))
            lo, hi = a, b
        elif line.startswith("VmFlags:") and lo is not None and lo <= ptr < hi:
            return set(line.split()[1:])
    return None


def test_move_parameters_keeps_values_strides_and_ties_in_one_advised_mapping():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(300, 70), torch.nn.Linear(70, 50), torch.nn.Linear(50, 70),
                                torch.nn.Linear(70, 300, bias=False))
    model[3].weight = model[0].weight  # tied, as an output head
    model[1].weight.data = model[1].weight.data.t().contiguous().t()  # column-major (matvec_layout)
    model.register_parameter("bf16_scale", torch.nn.Parameter(torch.randn(33, dtype=torch.bfloat16)))
    x = torch.tensor([[3, 5]])
    out = model(x)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    strides = {name: p.stride() for name, p in model.named_parameters()}
    hugepages.move_parameters(model)
    params = list(model.named_parameters())
    for name, p in params:
        assert p.dtype == before[name].dtype and p.stride() == strides[name] and torch.equal(p, before[name])
        assert p.data_ptr() % 64 == 0
    assert model[3].weight is model[0].weight  # still one parameter
    assert params[0][1].data_ptr() % hugepages.HUGE_PAGE == 0  # the first starts on a huge page
    ends = [(p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for _, p in params]
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:]))  # laid out in order, no overlap
    assert torch.equal(model(x), out)  # the same module, computing the same
    if thp_available():
        # advised (hg) and private (no sh: shared memory gets no transparent huge pages)
        flags = mapping_flags(params[0][1].data_ptr())
        assert flags is not None and "hg" in flags and "sh" not in flags


def test_move_parameters_stores_the_chosen_matrices_column_major():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(70, 50), torch.nn.LayerNorm(50), torch.nn.Linear(50, 30))
    x = torch.randn(4, 70)
    out = model(x)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    hugepages.move_parameters(model, column_major=lambda p: p.shape == (50, 70))
    assert model[0].weight.stride() == (1, 50) and model[2].weight.stride() == (50, 1)
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    ends = sorted((p.data_ptr(), p.data_ptr() + p.numel() * p.element_size()) for p in model.parameters())
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:]))  # no overlap
    torch.testing.assert_close(model(x), out, rtol=1e-5, atol=1e-6)


def test_empty_puts_large_cpu_buffers_in_huge_pages_and_small_ones_in_the_allocator():
    big = hugepages.empty((3, 1000, 1000), torch.float32, "cpu")  # 12 MB
    assert big.shape == (3, 1000, 1000) and big.dtype == torch.float32 and big.is_contiguous()
    assert big.data_ptr() % hugepages.HUGE_PAGE == 0 and int(big.count_nonzero()) == 0  # zeroed
    big.fill_(2.0)
    assert float(big.sum()) == 6e6
    small = hugepages.empty((4, 5), torch.bfloat16, "cpu")
    assert small.shape == (4, 5) and small.dtype == torch.bfloat16
    if thp_available():
        assert "hg" in mapping_flags(big.data_ptr())
        assert "hg" not in (mapping_flags(small.data_ptr()) or set())  # the allocator's heap

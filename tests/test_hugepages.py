"""hugepages.py: copies and buffers in memory advised for transparent huge pages."""
from pathlib import Path

import torch

from minikv import hugepages


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


def test_in_huge_pages_copies_values_and_strides_into_one_advised_mapping():
    ts = [torch.randn(300, 200), torch.randn(50, 70).t(), torch.randn(7)[2:], torch.randn(6, 4)[:, 1:],
          torch.empty(0, 5), torch.randn(33, dtype=torch.bfloat16)]
    copies = hugepages.in_huge_pages(ts)
    for t, c in zip(ts, copies):
        assert c.dtype == t.dtype and c.shape == t.shape and c.stride() == t.stride() and torch.equal(c, t)
        assert c.data_ptr() % 64 == 0
    assert copies[0].data_ptr() % hugepages.HUGE_PAGE == 0  # the first starts on a huge page
    ends = [(c.data_ptr(), c.data_ptr() + c.numel() * c.element_size()) for c in copies if c.numel()]
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ends, ends[1:]))  # laid out in order, no overlap
    first = ts[0].clone()
    del ts, t
    assert torch.equal(copies[0], first)  # the copies own their memory: the originals can go
    if thp_available():
        # advised (hg) and private (no sh: shared memory gets no transparent huge pages)
        flags = mapping_flags(copies[0].data_ptr())
        assert flags is not None and "hg" in flags and "sh" not in flags


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

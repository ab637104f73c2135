"""What generate's timings and bandwidth figures rest on: a synchronised step timer on CUDA, the
bytes a decode step reads, the machine's read bandwidth, and the share of it decoding reaches."""
from __future__ import annotations

import statistics
import time

import torch


def synchronize(device) -> None:
    """Wait for the device's queued work, so that a timer read after it counts that work (CUDA
    runs kernels asynchronously; a no-op on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def weight_bytes_per_step(model) -> int:
    """Bytes of weights one decode step reads: every parameter once, except the input embedding,
    of which a step reads one row per sequence (unless it is tied to the output head, which reads
    it whole: parameters() lists a tied tensor once)."""
    embedding, head = model.embed.weight, model.lm_head.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embedding or p is head)
    return total + (embedding[0].numel() * embedding.element_size() if embedding is not head else 0)


def measure_read_bandwidth(device="cpu", mbytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s one large-tensor read reaches on `device` with torch's current thread count: the
    median of `repeats` timed sums over a float32 tensor of `mbytes` MB, far larger than the CPU's
    caches, so that every byte comes from memory. This is the line a decode step, which reads
    every weight once, can at best reach. On the CPU the tensor is in transparent huge pages, as
    the model's weights are (fast/hugepages.py): both sides of the ratio read the same kind
    of memory (huge pages read ~1.25x faster here than the allocator's)."""
    device = torch.device(device)
    from ..fast.hugepages import empty  # (fast/ is applied from outside: imported when measured)

    x = empty((mbytes * 2**20 // 4,), torch.float32, device).fill_(1.0)
    times = []
    for _ in range(repeats + 1):  # the first read warms up (page faults, kernel launch)
        synchronize(device)
        t0 = time.perf_counter()
        x.sum()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return x.numel() * x.element_size() / statistics.median(times[1:])


def decode_bandwidth(bytes_per_step: float, tpot_s: float, read_bandwidth: float | None = None) -> dict:
    """Achieved bandwidth of decoding (bytes read per step / time per step), and its share of the
    machine's read bandwidth (bytes/s, e.g. measure_read_bandwidth()) when given."""
    achieved = bytes_per_step / tpot_s
    out = {"bytes_per_token": bytes_per_step, "bandwidth_gb_s": achieved / 1e9}
    if read_bandwidth:
        out.update(read_bandwidth_gb_s=read_bandwidth / 1e9, bandwidth_share=achieved / read_bandwidth)
    return out

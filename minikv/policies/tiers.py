"""The two tiers KV can live in, and the one object that moves KV between them (Tiers).

`device` is where attention runs (the model's device); `host` is CPU memory, pinned when CUDA is
present. On a CPU-only machine both are CPU memory: the copies still happen and the accounting is
real, but nothing is saved. Every copy between the tiers (freekv's and icecache's page recalls,
synckv's bank fetches, softfreeze's offloads) goes through Tiers, which counts the bytes moved.

On CUDA, Tiers issues its asynchronous copies through the few stream calls of CudaStreams, so that
a test on a machine without a GPU can pass an object that records the order of operations
instead (Tiers.use_streams; tests/policies/test_recall_order.py), and check that every copy into a
pool is ordered after the previous one and before the attention that reads it, and that no
staging buffer is refilled while a copy still reads it:

    streams.stream()        a new side stream
    streams.event()         a new event (record(stream), synchronize())
    streams.current()       the stream work is issued on now (wait_stream, wait_event)
    streams.use(stream)     context manager: issue the enclosed work on `stream`
"""
from __future__ import annotations

import threading

import torch


class Tiers:
    """The two places KV can live, and the one object that moves KV between them.

    Every copy between the tiers is a call here, which counts its bytes (`bytes_to_host`,
    `bytes_to_device`), so no policy adds to the counters by hand:

        to_host(t), to_device(t)         a tensor to the other tier, as a new tensor
        write_host(dst, src)             into preallocated host memory (an offload)
        gather_to_device(src, rows, out) host rows straight into device rows (both CPU memory)
        copy_in(staging, gather, scatter, into, background)
                                         a recall: host rows through a staging buffer into
                                         device slots, asynchronous on CUDA
        wait(into)                       before reading those slots: the last copy_in has landed

    On CUDA, copy_in runs on the side stream (background) or the main one, ordered by events
    through the small stream API of CudaStreams (below); `use_streams` swaps in a recorder in
    tests. On the CPU the copies run in order on the calling thread."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.host = torch.device("cpu")
        self.pin = self.device.type == "cuda"
        self.bytes_to_host = 0
        self.bytes_to_device = 0
        self._counting = threading.Lock()  # a policy's worker thread copies too (freekv's rescore)
        self.use_streams(CudaStreams(self.device) if self.device.type == "cuda" else None)

    def _count(self, to_host: int = 0, to_device: int = 0) -> None:
        with self._counting:  # `+=` on an attribute is not atomic between threads
            self.bytes_to_host += to_host
            self.bytes_to_device += to_device

    def use_streams(self, streams) -> None:
        """CUDA's stream API, a recorder in tests, or None: every copy in order (the CPU)."""
        self.streams = streams
        self.side = streams.stream() if streams is not None else None
        self._events = {}  # (owner, name) -> event, made on first use

    def _event(self, owner, name="ready"):
        if (owner, name) not in self._events:
            self._events[owner, name] = self.streams.event()
        return self._events[owner, name]

    # fresh=True: t is a temporary nobody else holds (the result of a gather), so on a CPU-only
    # machine it is already the copy and is handed over as is; otherwise a real copy is made,
    # even when the device is the CPU. Bytes are counted either way.
    def to_host(self, t: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        self._count(to_host=_nbytes(t))
        if self.pin:  # blocking: the caller reads the result on the host right away
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            return out.copy_(t)
        return t if fresh and t.device.type == "cpu" else t.to("cpu", copy=True)

    def to_device(self, t: torch.Tensor, fresh: bool = False) -> torch.Tensor:
        self._count(to_device=_nbytes(t))
        if fresh and t.device == self.device:
            return t
        return t.to(self.device, non_blocking=self.pin, copy=True)

    def write_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """src (on the device) into dst, a view of preallocated host memory; blocking."""
        dst.copy_(src)
        self._count(to_host=_nbytes(src))

    def gather_to_device(self, src: torch.Tensor, rows: torch.Tensor, out: torch.Tensor) -> None:
        """out = src[rows]: host rows straight into device rows, one pass over the bytes (for
        when both tiers are CPU memory: no temporary in between)."""
        torch.index_select(src, 0, rows, out=out)
        self._count(to_device=_nbytes(out))

    def copy_in(self, staging, gather, scatter, into, background: bool = False) -> None:
        """A recall. gather(buffer) fills the first rows of a pinned staging buffer on the host and
        returns them; they cross to the device in one copy; scatter(rows) writes the device rows
        into their slots. `into` (the pool written) names a chain: every copy_in into it is
        ordered after the previous one, whichever stream each ran on, since two recalls may write
        the same slot and a late background write must never land over a newer one. The staging
        buffers (two, used in turn) are refilled only after the copy that last read them ended."""
        buf = staging.take()
        if self.streams is None:  # in order; on a CPU-only machine the staged rows are already "there"
            rows = gather(staging.host[buf])
            if self.device.type != "cpu":
                rows = staging.dev[buf][:len(rows)].copy_(rows)
            self._count(to_device=_nbytes(rows))
            scatter(rows)
            return
        S, free, ready = self.streams, self._event(staging, buf), self._event(into)
        free.synchronize()  # the copy that last read this buffer (any layer's) is done
        rows = gather(staging.host[buf])
        main = S.current()
        stream = self.side if background else main
        stream.wait_stream(main)  # what was issued before (this step's reads of the old slots) first
        stream.wait_event(ready)  # the previous copy into these slots, on whichever stream
        with S.use(stream):
            dev = staging.dev[buf][:len(rows)]
            dev.copy_(rows, non_blocking=True)
            scatter(dev)
            free.record(stream)
            ready.record(stream)
        self._count(to_device=_nbytes(rows))

    def wait(self, into) -> None:
        """Before attention reads `into`: the current stream waits for the last copy_in into it
        (each waited for the one before, so this covers them all)."""
        if self.streams is not None:
            self.streams.current().wait_event(self._event(into))


def backend_on(tier: str, backend: str, device) -> str:
    """The kernel backend an operation runs whose tensors live on `tier` ("host" or "device"),
    for a policy of `backend` on `device`. Triton kernels address GPU memory only, so beside a GPU
    a host-tier operation (icecache's DCI scores over the tree's keys, the gather of host pages
    into the pinned staging buffer) runs eager on the CPU; device-tier ones run `backend`. On a
    CPU-only machine both tiers are CPU memory and every operation runs `backend` (Triton's
    interpreter for triton)."""
    if tier not in ("host", "device"):
        raise ValueError(f"tier must be 'host' or 'device', got {tier!r}")
    return "eager" if tier == "host" and torch.device(device).type == "cuda" else backend


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CudaStreams:
    """The stream API of the module docstring, on CUDA."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    def stream(self):
        return torch.cuda.Stream(device=self.device)

    def event(self):
        return torch.cuda.Event()

    def current(self):
        return torch.cuda.current_stream(self.device)

    def use(self, stream):
        return torch.cuda.stream(stream)

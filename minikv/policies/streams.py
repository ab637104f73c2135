"""The few CUDA stream calls the asynchronous copies between the tiers make, behind one small object.

Tiers (base.py), which makes every copy between the tiers (freekv's and icecache's page
recalls, synckv's bank fetches), talks to streams and events only through this interface, so
that a test on a machine without a GPU can pass an object that records the order of operations
instead (Tiers.use_streams; tests/policies/test_recall_order.py), and check that every copy into a
pool is ordered after the previous one and before the attention that reads it, and that no
staging buffer is refilled while a copy still reads it.

    streams.stream()        a new side stream
    streams.event()         a new event (record(stream), synchronize())
    streams.current()       the stream work is issued on now (wait_stream, wait_event)
    streams.use(stream)     context manager: issue the enclosed work on `stream`
"""
from __future__ import annotations

import torch


class CudaStreams:
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

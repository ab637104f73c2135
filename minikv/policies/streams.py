"""The few CUDA stream calls the asynchronous recall path makes, behind one small object.

Policies that recall pages in the background (paged.py) talk to streams and events only through
this interface, so that a test on a machine without a GPU can pass an object that records the
order of operations instead (tests/policies/test_recall_order.py), and check that every copy into
a slot is ordered after the previous one and before the attention that reads it.

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

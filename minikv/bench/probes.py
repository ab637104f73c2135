"""Timers and probes the benchmarks install from outside: no policy carries a clock or a log.

A benchmark that wants to know where a decode step goes wraps the methods of the objects it
cares about (a bound policy's layers, its storage) for as long as it measures:

    totals = {}
    with timed(policy.layers, ["select", "recall", "attend"], totals):
        generate(...)
    totals["select"]  # seconds spent in every layer's select() together

The algorithms stay free of timing lines; a method that is not there on an object is skipped,
so one call covers policies whose layers differ. On CUDA the clock is read after a
synchronize, so a timed section includes the kernels it launched. A probe watches a method's
calls the same way:

    log = []
    with watched(policy, "freeze_and_thaw", lambda result, scores, now: log.extend(scores)):
        generate(...)  # softfreeze's s_j (Eq. 2) of every layer and step
"""
from __future__ import annotations

import functools
import threading
import time
from contextlib import contextmanager
from typing import Iterable

import torch


def _now(device_sync: bool) -> float:
    if device_sync:
        torch.cuda.synchronize()
    return time.perf_counter()


@contextmanager
def timed(objects: Iterable[object], names: Iterable[str], totals: dict[str, float], within: list | None = None,
          only_within: list | None = None):
    """Add the wall time of every call of `obj.<name>` (for each object and name) made on the
    calling thread to totals[name] (seconds) while the block runs; the original methods come back
    on exit. Calls on another thread (a selection worker's, policies/worker.py) run beside the
    model, off the critical path, and are not timed. within: a one-element list counting the
    calls of these methods under way; only_within: such a list, outside which calls are not timed
    (a layer's select inside its decode, not inside its prefill)."""
    sync = torch.cuda.is_available()
    patched: list[tuple[object, str]] = []
    model_thread = threading.get_ident()  # a selection worker's calls run beside it: not timed

    def wrap(method, name):
        @functools.wraps(method)
        def timed_method(*args, **kwargs):
            if threading.get_ident() != model_thread or (only_within is not None and not only_within[0]):
                return method(*args, **kwargs)
            t0 = _now(sync)
            if within is not None:
                within[0] += 1
            try:
                return method(*args, **kwargs)
            finally:
                if within is not None:
                    within[0] -= 1
                totals[name] = totals.get(name, 0.0) + _now(sync) - t0
        return timed_method

    try:
        for obj in objects:
            for name in names:
                method = getattr(obj, name, None)
                if callable(method):
                    setattr(obj, name, wrap(method, name))  # an instance attribute shadows the class's
                    patched.append((obj, name))
                    totals.setdefault(name, 0.0)
        yield totals
    finally:
        for obj, name in patched:
            delattr(obj, name)


@contextmanager
def watched(obj: object, name: str, callback):
    """Call callback(result, *args, **kwargs) after every call of `obj.<name>(*args, **kwargs)`
    while the block runs; the original method comes back on exit. A method the object does not
    have is left alone (the block runs unwatched)."""
    method = getattr(obj, name, None)
    if not callable(method):
        yield
        return

    @functools.wraps(method)
    def watched_method(*args, **kwargs):
        result = method(*args, **kwargs)
        callback(result, *args, **kwargs)
        return result

    setattr(obj, name, watched_method)
    try:
        yield
    finally:
        delattr(obj, name)

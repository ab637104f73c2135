"""What runs beside the model: a layer's selection for its next step, scheduled here, never in
the policy's rule (as nano-vllm keeps overlap in its engine and out of its block manager).

A layer whose decode step ends by choosing what its next step reads states that choice as two
plain functions, and its decode calls them in the paper's order:

    selection = self.select_next(*what_it_reads)   reads the step's query and the layer's
                                                   candidates; writes nothing
    self.recall_next(selection)                    brings the chosen KV to the device

That is the synchronous form, the class itself (the `reference` backend always runs it). Its
background form, `background(cls)`, is the same class with those two calls moved off the
critical path (FreeKV's speculative retrieval, "FreeKV: Boosting KV Cache Retrieval for
Efficient LLM Inference", G. Liu et al., ICLR 2026, https://arxiv.org/abs/2505.13109: step t's
selection runs while the model computes the following layers):

    select_next     submitted to the policy's worker (policies/worker.py) with copies of its
                    tensors (the model reuses its buffers); the model goes on
    recall_next     kept, not run: the layer lands it (joins the selection, then recalls) at
                    its next entry, before anything reads or writes its store: the next decode,
                    or the accounting end_step and stats() ask for (device_tokens & co.)

Both forms call the same two functions with the same arguments, and the recall lands before the
layer's store is next read or written, so they give the same results by construction, provided
select_next reads nothing the model writes in between (its docstring says what it reads;
tests/policies/test_worker.py checks the order and the logits, bit for bit).

Which form runs is decided here, when a policy is bound (`make_layers`, from Policy.bind), never
by the policy's rule: a policy says whether it overlaps (`Policy.overlaps()`, from its
parameters), a layer class names its two functions (`next_step = ("select_next",
"recall_next")`), and each such layer of an overlapping policy takes the background form, with
the policy's worker (`policy.worker`; `threads(policy)` counts its thread for the speed
benchmark).
"""
from __future__ import annotations

from functools import cache
from types import MethodType

import torch

from .worker import policy_worker


@cache
def background(cls: type, select: str = "select_next", recall: str = "recall_next") -> type:
    """The background form of the layer class `cls`, whose decode ends by
    `self.<recall>(self.<select>(...))`."""
    chosen, recalled = getattr(cls, select), getattr(cls, recall)

    def submit(self, *args):
        args = tuple(a.clone() if isinstance(a, torch.Tensor) else a for a in args)
        return self.policy.worker.submit(MethodType(chosen, self), *args)

    def keep(self, job) -> None:
        self.next_job = job

    def land(self) -> None:
        """The kept recall_next, with its selection (the worker's error re-raised here)."""
        job, self.next_job = getattr(self, "next_job", None), None
        if job is not None:
            recalled(self, job.join())

    def landing(name: str):
        method = getattr(cls, name)

        def entry(self, *args):
            self.land()
            return method(self, *args)
        entry.__name__ = entry.__qualname__ = name
        return entry

    entries = ("prefill", "decode", "device_tokens", "host_tokens", "attended_indices")
    body = {select: submit, recall: keep, "land": land, **{name: landing(name) for name in entries}}
    doc = f"{cls.__name__} in the background form (overlap.py)."
    return type(cls.__name__, (cls,), {"__module__": __name__, "__doc__": doc, **body})


def make_layers(policy) -> list:
    """A policy's layers as bind makes them (its make_layer's). Where the policy overlaps, it gets
    its worker (one per policy object, kept across binds: policy_worker) and each layer whose class
    names its `next_step` takes that class's background form: the same object, whose class gains
    the methods above and no state."""
    if not policy.overlaps():
        return [policy.make_layer(i) for i in range(policy.cfg.n_layers)]
    policy.worker = policy_worker(policy, True)  # reset: what it still runs reads the old layers
    layers = [policy.make_layer(i) for i in range(policy.cfg.n_layers)]
    for layer in layers:
        if getattr(layer, "next_step", None):
            layer.__class__ = background(type(layer), *layer.next_step)
    return layers

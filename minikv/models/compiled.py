"""A compiled decode step: what every block does around the policy, compiled with torch.compile.

A decode step feeds one token through the model. Per layer that is a handful of matrix-vector
products and some fifty small operations (norms, views, RoPE, residuals, the MLP's gate), each
a few microseconds of Python and dispatch, and all of them on one thread. Compiling removes
most of it: a block's `finish` (output projection, residual, norm, MLP, residual) and the
next block's `project` (norm, q/k/v, RoPE) become one call into code that inductor generated,
and the one-row products inside are written as multiply-and-sum (layers.matvec), which
inductor emits as a loop over the weight's rows split over the threads, reading the weights
faster than MKL's one-row SGEMM. The policy's attention stays eager between two such calls:
policies are Python with counters and data-dependent choices, and every policy runs unchanged.

`dynamic=True`: one compiled graph serves every layer and every step (another batch size or
model config compiles once more); the first compile takes some 20 s on a 2-core CPU (inductor's
own start, a C++ compiler run), later processes read inductor's disk cache. Opt in with
`load(..., compile=True)` or `--compile`; README "Speed" has the measurements.
"""
from __future__ import annotations

import sys
import time

import torch

from .layers import attend


def _head(final_norm, lm_head, x):
    # x (B, C) -> logits (B, V) float32
    return lm_head(final_norm(x)).float()


def _finish_then_project(block, next_block, x, y, rope):
    # block i's finish and block i + 1's project, one call: x (B, 1, C), y (B, Hq, 1, D) ->
    # (block i's output (B, 1, C), block i + 1's q, k, v)
    x = block.finish(x, y)
    return x, next_block.project(x, rope)


class CompiledDecode:
    """The compiled `project`, `finish`, `finish_then_project` and output head of one model
    (a step calls the first once, the third between two attentions, then the second and the
    head), each checked on a dummy step when built (so that a missing C++ compiler shows at
    load time, not halfway through a step whose K/V the policy has already stored)."""

    def __init__(self, model):
        block = type(model.blocks[0])
        self.project = torch.compile(block.project, dynamic=True)
        self.finish = torch.compile(block.finish, dynamic=True)
        self.finish_then_project = torch.compile(_finish_then_project, dynamic=True)
        self.head = torch.compile(_head, dynamic=True)
        self.warm_up(model)

    @torch.inference_mode()
    def warm_up(self, model) -> None:
        # two different blocks, as a step passes them: with one block twice dynamo would guard
        # on the two being the same and compile again (seconds) on the first real step
        cfg, block, other = model.cfg, model.blocks[0], model.blocks[-1]
        x = torch.zeros(1, 1, cfg.hidden_size, dtype=model.dtype, device=model.device)
        cos = torch.ones(1, 1, 1, cfg.rotary_dim, device=model.device)
        rope = (cos, torch.zeros_like(cos))
        q, _, _ = self.project(block, x, rope)
        self.finish(block, x, torch.zeros_like(q))
        if other is not block:
            self.finish_then_project(block, other, x, torch.zeros_like(q), rope)
        self.head(model.final_norm, model.lm_head, x[:, 0])

    def blocks(self, blocks, x, positions, rope, policy):
        """One decode step through all blocks: x (B, 1, C) -> (B, 1, C). Between two attentions
        runs one compiled call, a block's finish and the next one's project: 31 calls a step on
        a 30-layer model instead of 60, each call's dispatch and guards saved (SmolLM2, one
        thread: 2.3-2.9 ms a step)."""
        qkv = self.project(blocks[0], x, rope)
        last = len(blocks) - 1
        for i, block in enumerate(blocks):
            y = attend(*qkv, positions, policy.layer(i), decoding=True)
            if i < last:
                x, qkv = self.finish_then_project(block, blocks[i + 1], x, y, rope)
            else:
                x = self.finish(block, x, y)
        return x


def compile_decode(model) -> CompiledDecode | None:
    """The model's compiled decode step, or None (with one line on stderr saying why) where
    torch.compile cannot run, e.g. without a C++ compiler: decoding then stays eager. On a
    terminal, a line says that compiling has begun and one how long it took."""
    on_terminal = sys.stderr.isatty()
    if on_terminal:
        print("minikv: compiling the decode step (about 20 s the first time, a few once cached)", file=sys.stderr,
              flush=True)
    t0 = time.perf_counter()
    try:
        compiled = CompiledDecode(model)
    except Exception as e:  # inductor reports a missing compiler and the like as many types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"minikv: torch.compile failed ({reason[:200]}); decoding eagerly", file=sys.stderr)
        return None
    if on_terminal:
        print(f"minikv: decode step compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return compiled

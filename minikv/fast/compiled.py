"""A compiled decode step: what every block does around the policy, compiled by inductor.

A decode step feeds one token through the model. Per layer that is a handful of matrix-vector
products and some fifty small operations (norms, views, RoPE, residuals, the MLP's gate), each
a few microseconds of Python and dispatch, and all of them on one thread. Compiling removes
most of it: a block's `finish` (output projection, residual, norm, MLP, residual) and the
next block's `project` (norm, q/k/v, RoPE) become one call into code that inductor generated,
and the one-row products inside are written as multiply-and-sum (linear.matvec), which
inductor emits as a loop over the weight's rows split over the threads, reading the weights
faster than MKL's one-row SGEMM. The policy's attention stays eager between two such calls:
policies are Python with counters and data-dependent choices, and every policy runs unchanged.

How it is compiled: each of the four functions (`project`, `finish`, `finish_then_project`,
the output head) is traced once with torch.export over the first blocks, its parameters lifted
to inputs, and compiled by `torch._inductor.standalone_compile` for the batch's shapes. A call
then passes the parameters of the blocks it runs now: one graph serves every layer. There is
no torch.compile frame in between, so no guards are evaluated on a call: through
torch.compile, guard checks over the blocks' modules and dispatch cost ~70 us a call, 2-3 ms a
step (SmolLM2, one thread; README "Speed"). In exchange the caller keeps what guards would
check: the shapes and dtypes a graph was compiled for. Here the inputs of a step are fixed by
the model's config, its dtype and the batch size, which keys the graphs (a new batch size
compiles its own, some seconds; the first compile takes some 20 s on a 2-core CPU, later
processes read inductor's disk cache). Opt in with `load(..., compile=True)` or `--compile`;
`install` then replaces the model's `run_blocks` (on decode steps) and `head` (on one row per
sequence) from outside: the model's own code has no compiled branch.
"""
from __future__ import annotations

import sys
import time

import torch
import torch._inductor
import torch.nn as nn

from ..models.layers import attend


def _project(a, x, cos, sin):
    # block a's project: x (B, 1, C) -> q (B, Hq, 1, D), k, v (B, Hkv, 1, D)
    return a.project(x, (cos, sin))


def _finish(a, x, y):
    # block a's finish: x (B, 1, C), y (B, Hq, 1, D) attention's output -> (B, 1, C)
    return a.finish(x, y)


def _finish_then_project(a, b, x, y, cos, sin):
    # block a's finish and block b's (the next one's) project, one call:
    # x (B, 1, C), y (B, Hq, 1, D) -> (block a's output (B, 1, C), block b's q, k, v)
    x = a.finish(x, y)
    return x, *b.project(x, (cos, sin))


def _head(final_norm, lm_head, x):
    # x (B, C) -> logits (B, V) float32
    return lm_head(final_norm(x)).float()


class _Call(nn.Module):
    """fn over some modules, as a module whose forward takes only tensors (what export traces)."""

    def __init__(self, fn, *modules):
        super().__init__()
        self.fn, self.parts = fn, nn.ModuleList(modules)

    def forward(self, *tensors):
        return self.fn(*self.parts, *tensors)


class CompiledGraph:
    """fn(*modules, *tensors) compiled for the shapes of `example` tensors. Called as
    graph(modules, *tensors): the modules must have the structure of those it was traced over
    (same class, same parameter shapes), the tensors the example's shapes, dtypes and devices."""

    def __init__(self, fn, modules, example):
        self.fn = fn
        with torch.inference_mode(False), torch.no_grad():  # an inference graph, no autograd
            program = torch.export.export(_Call(fn, *modules), tuple(example))
            # the graph takes the lifted parameters (by their names in _Call) before the tensors
            self.names = [s.target for s in program.graph_signature.input_specs if s.kind.name != "USER_INPUT"]
            self.run = torch._inductor.standalone_compile(program.graph_module, self.inputs(modules, example),
                                                          dynamic_shapes="from_example_inputs")

    def inputs(self, modules, tensors) -> list:
        """The graph's inputs when it runs these modules on these tensors (make once, reuse)."""
        call = _Call(self.fn, *modules)
        state = {**dict(call.named_parameters(remove_duplicate=False)), **dict(call.named_buffers(remove_duplicate=False))}
        return [state[name] for name in self.names] + list(tensors)

    def __call__(self, weights: list, *tensors):
        return self.run(*weights, *tensors)


class CompiledDecode:
    """The compiled `project` (first block), `finish_then_project` (between two attentions),
    `finish` (last block) and output head of one model, for one batch size; each is checked on
    a dummy step when built (so that a missing C++ compiler shows at load time, not halfway
    through a step whose K/V the policy has already stored)."""

    def __init__(self, model, batch_size: int = 1):
        cfg, blocks = model.cfg, model.blocks
        B, dtype, device = batch_size, model.dtype, model.device
        x = torch.zeros(B, 1, cfg.hidden_size, dtype=dtype, device=device)
        y = torch.zeros(B, cfg.n_heads, 1, cfg.head_dim, dtype=dtype, device=device)
        cos = torch.ones(B, 1, 1, cfg.rotary_dim, device=device)
        sin = torch.zeros_like(cos)
        first, last = blocks[0], blocks[-1]
        self.project = CompiledGraph(_project, [first], [x, cos, sin])
        self.finish = CompiledGraph(_finish, [last], [x, y])
        self.head = CompiledGraph(_head, [model.final_norm, model.lm_head], [x[:, 0]])
        self.pair = CompiledGraph(_finish_then_project, [first, last], [x, y, cos, sin]) if len(blocks) > 1 else None
        # each call's parameters, gathered once (the model's weights are not replaced after load)
        self.project_weights = self.project.inputs([first], [])
        self.finish_weights = self.finish.inputs([last], [])
        self.head_weights = self.head.inputs([model.final_norm, model.lm_head], [])
        self.pair_weights = [self.pair.inputs([a, b], []) for a, b in zip(blocks, blocks[1:])] if self.pair else []
        # one dummy step: whatever inductor left for the first call (loading the compiled code) happens now
        self.project(self.project_weights, x, cos, sin)
        self.finish(self.finish_weights, x, y)
        self.logits(x[:, 0])
        if self.pair:
            self.pair(self.pair_weights[0], x, y, cos, sin)

    def blocks(self, x, positions, rope, policy):
        """One decode step through all blocks: x (B, 1, C) -> (B, 1, C). Between two attentions
        runs one compiled call, a block's finish and the next one's project: 31 calls a step on
        a 30-layer model instead of 60, each call's dispatch saved."""
        cos, sin = (t.contiguous() for t in rope)  # the layout the graphs were compiled for
        q, k, v = self.project(self.project_weights, x, cos, sin)  # a list of the graph's outputs
        for i, weights in enumerate(self.pair_weights):
            y = self.attend(q, k, v, positions, policy.layer(i))
            x, q, k, v = self.pair(weights, x, y, cos, sin)
        y = self.attend(q, k, v, positions, policy.layer(len(self.pair_weights)))
        return self.finish(self.finish_weights, x, y)[0]

    def attend(self, q, k, v, positions, layer_kv):
        # the policy's attention, its output checked against what the graphs were compiled for:
        # no guard does it, and compiled code handed another shape or dtype would read garbage
        y = attend(q, k, v, positions, layer_kv, decoding=True)
        if y.shape != q.shape or y.dtype != q.dtype:
            raise RuntimeError(f"{type(layer_kv).__name__}.decode returned {tuple(y.shape)} {y.dtype}, "
                               f"expected the query's {tuple(q.shape)} {q.dtype}")
        return y.contiguous()

    def logits(self, x):
        # x (B, C) -> logits (B, V) float32
        return self.head(self.head_weights, x.contiguous())[0]


class CompiledModel:
    """A model's compiled decode steps, one CompiledDecode per batch size, compiled on first use
    (batch size 1 at load, where the check that compiling works belongs)."""

    def __init__(self, model):
        self.model = model
        self.steps = {1: CompiledDecode(model, 1)}

    def step(self, batch_size: int) -> CompiledDecode:
        if batch_size not in self.steps:
            if sys.stderr.isatty():
                print(f"minikv: compiling the decode step for batch size {batch_size}", file=sys.stderr, flush=True)
            self.steps[batch_size] = CompiledDecode(self.model, batch_size)
        return self.steps[batch_size]

    def blocks(self, x, positions, rope, policy):
        # x (B, 1, C) -> (B, 1, C)
        return self.step(x.shape[0]).blocks(x, positions, rope, policy)

    def head(self, x):
        # x (B, C) -> logits (B, V) float32
        return self.step(x.shape[0]).logits(x)


def compile_decode(model) -> CompiledModel | None:
    """The model's compiled decode step, installed on it (`model.compiled`), or None (with one
    line on stderr saying why) where it cannot be compiled, e.g. without a C++ compiler:
    decoding then stays eager. On a terminal, a line says that compiling has begun and one how
    long it took."""
    on_terminal = sys.stderr.isatty()
    if on_terminal:
        print("minikv: compiling the decode step (about 20 s the first time, a few once cached)", file=sys.stderr,
              flush=True)
    t0 = time.perf_counter()
    try:
        if not hasattr(torch._inductor, "standalone_compile"):
            raise RuntimeError(f"the compiled decode step needs torch >= 2.8, this is {torch.__version__}")
        compiled = CompiledModel(model)
    except Exception as e:  # inductor reports a missing compiler and the like as many types
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"minikv: compiling the decode step failed ({reason[:200]}); decoding eagerly", file=sys.stderr)
        return None
    if on_terminal:
        print(f"minikv: decode step compiled in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    install(model, compiled)
    return compiled


def install(model, compiled: CompiledModel) -> None:
    """Route the model's decode steps through `compiled`: instance attributes that shadow
    DecoderLM.run_blocks and .head, falling back to them for prefill and whole-sequence logits."""
    eager_blocks, eager_head = model.run_blocks, model.head  # the class's methods, bound

    def run_blocks(x, positions, rope, policy=None, decoding=False, progress=None):
        # x (B, T, C) -> (B, T, C); a decode step (T = 1) runs the compiled graphs, with one RoPE
        # table for every layer (a list: layers rotate apart, Gemma 3's local ones: eager)
        if decoding and not isinstance(rope, list):
            return compiled.blocks(x, positions, rope, policy)
        return eager_blocks(x, positions, rope, policy, decoding, progress)

    def head(x):
        # x (B, C), one row per sequence -> logits (B, V) float32, compiled; else eager
        return compiled.head(x) if x.dim() == 2 else eager_head(x)

    model.run_blocks, model.head, model.compiled = run_blocks, head, compiled

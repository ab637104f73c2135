"""What a generate call returns and reports: GenerationResult (one sequence), BatchResults (a batch),
their statistics (timing, the policy's KV numbers and counters, threads, bandwidth), and the
Clock that times the run from outside the loop, and the prefill's progress counted in tokens."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .timing import decode_bandwidth, synchronize, weight_bytes_per_step


@dataclass
class GenerationResult:
    """One sequence's answer. For a single prompt `stats` holds everything (see generate); in a
    batch it holds this sequence's own counts and the batch's numbers are on the list."""

    text: str
    token_ids: list[int]
    stats: dict = field(default_factory=dict)


class BatchResults(list):
    """The answers to a batch of prompts, in order (a list of GenerationResult), and `.stats`:
    the batch's timing and KV numbers, once (the batch shares every forward)."""

    def __init__(self, results, stats: dict):
        super().__init__(results)
        self.stats = stats


class Clock:
    """The run's timings: from the start to the end of the prefill (time to first token), each
    decode step (the model's forward, called through `timed`), the whole run. Every reading
    waits for the device's queued work first (synchronize), so it counts that work."""

    def __init__(self, model):
        self.model, self.device = model, model.device
        self.step_times: list[float] = []
        synchronize(self.device)
        self.t0 = time.perf_counter()

    def prefill_done(self) -> None:
        synchronize(self.device)
        self.ttft = time.perf_counter() - self.t0

    def timed(self, *args, **kwargs):
        """The model's forward, timed: decode_n_tokens calls this in the model's place."""
        synchronize(self.device)
        t0 = time.perf_counter()
        logits = self.model(*args, **kwargs)
        synchronize(self.device)
        self.step_times.append(time.perf_counter() - t0)
        return logits

    def done(self) -> None:
        synchronize(self.device)
        self.total = time.perf_counter() - self.t0


def results(model, tokenizer, policy, prompts, new, eos_ids, max_new_tokens, clock: Clock, batched: bool):
    """One GenerationResult, or BatchResults for a batch (each row's own counts, the batch's once)."""
    stats = generation_stats(policy, prompts, new, clock.ttft, clock.step_times, clock.total, model)
    texts = [tokenizer.decode([t for t in row if t not in eos_ids]) for row in new]
    if not batched:
        return GenerationResult(texts[0], new[0], stats)
    rows = [GenerationResult(text, row, sequence_stats(p, row, eos_ids, max_new_tokens))
            for text, row, p in zip(texts, new, prompts)]
    return BatchResults(rows, stats)


def sequence_stats(prompt: list[int], new: list[int], eos_ids, max_new_tokens: int) -> dict:
    """One sequence of a batch: its own counts (its timing is the batch's)."""
    finish = "eos" if new and new[-1] in eos_ids else "length"
    return {"prompt_tokens": len(prompt), "new_tokens": len(new), "finish": finish}


def generation_stats(policy, prompts, new, ttft, step_times, total, model=None) -> dict:
    n_new = sum(len(row) for row in new)
    tpot = sum(step_times) / len(step_times) if step_times else None
    stats = {
        "prompt_tokens": sum(len(p) for p in prompts),
        "new_tokens": n_new,
        "ttft_s": ttft,
        "tpot_s": tpot,
        "tokens_per_s": len(new) / tpot if tpot else None,  # all rows advance one token per step
        "prefill_tokens_per_s": sum(len(p) for p in prompts) / ttft if ttft > 0 else None,
        "total_s": total,
    }
    stats.update(policy.stats())
    intra_op, worker = torch.get_num_threads(), policy.threads()  # intra-op + a selection worker's
    stats.update(intra_op_threads=intra_op, worker_threads=worker, threads=intra_op + worker)
    if model is not None and step_times:
        # what one decode step reads: the weights, and the KV the policy's attention read
        stats.update(decode_bandwidth(weight_bytes_per_step(model) + stats["kv_bytes_read_per_step"], tpot))
    return stats


def tokens_progress(progress, n_tokens: int):
    """The model reports its prefill per layer, (layers done, n_layers); a user counts tokens.
    The whole prompt goes through each layer in turn, so after i of n layers the work done is
    that of i/n of the prompt's tokens: progress(round(n_tokens * i / n), n_tokens)."""
    if progress is None:
        return None
    return lambda layer, n_layers: progress(round(n_tokens * layer / n_layers), n_tokens)

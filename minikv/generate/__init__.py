"""Text generation: one prefill over the prompt, then one decode step per new token.

    prefill()           the prompt in one forward; the policy stores the prompt's KV
    decode_one_token()  one token in, next-token logits out
    decode_n_tokens()   the loop: sample, stop at EOS, honour a policy's rewind request
    generate()          tokenize, bind the policy, run the above, gather stats

Also the command line: `python -m minikv.generate --model smollm2 --prompt "..."` (see --help).
"""
from __future__ import annotations

import math
import operator
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from ..policies import Policy, make
from ..policies.worker import thread_counts
from ..tokenizer.base import user_turn
from .timing import decode_bandwidth, measure_read_bandwidth, synchronize, weight_bytes_per_step  # noqa: F401


DEFAULT_MAX_NEW_TOKENS = 128  # the API's and the command line's default


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


# -- sampling ----------------------------------------------------------------------------------


def as_int(name: str, value, minimum: int | None = None) -> int:
    """An integer argument: int, numpy and 0-d tensor integers (operator.index); not a bool (True
    is not 1 token), a float or a string."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {value!r:.80}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value}")
    return value


def check_sampling(temperature: float, top_k: int | None, top_p: float | None) -> None:
    # `not (x >= 0)` rather than `x < 0`: NaN fails every comparison and must be refused too
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if top_k is not None:
        as_int("top_k", top_k, 1)
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def sample(logits: torch.Tensor, temperature=0.0, top_k=None, top_p=None, generator=None) -> torch.Tensor:
    # logits (B, V) float32 -> token ids (B,)
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        # nucleus: keep the smallest set of tokens whose probability reaches top_p
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative - sorted_logits.softmax(dim=-1) >= top_p  # mass before this token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    probs = logits.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


# -- the loop ----------------------------------------------------------------------------------


def prefill(model, ids: torch.Tensor, lengths: torch.Tensor, policy: Policy, progress=None) -> torch.Tensor:
    # ids (B, T) right-padded, lengths (B,) -> logits (B, V) at each row's last prompt token
    T = ids.shape[1]
    positions = torch.arange(T, device=ids.device).expand_as(ids)
    positions = torch.where(positions < lengths[:, None], positions, -1)  # -1 marks padding
    return model(ids, positions=positions, policy=policy, logits_at=lengths - 1,
                 progress=tokens_progress(progress, int(lengths.sum())))


def tokens_progress(progress, n_tokens: int):
    """The model reports its prefill per layer, (layers done, n_layers); a user counts tokens.
    The whole prompt goes through each layer in turn, so after i of n layers the work done is
    that of i/n of the prompt's tokens: progress(round(n_tokens * i / n), n_tokens)."""
    if progress is None:
        return None
    return lambda layer, n_layers: progress(round(n_tokens * layer / n_layers), n_tokens)


def decode_one_token(model, token: torch.Tensor, position: torch.Tensor, policy: Policy) -> torch.Tensor:
    # token (B,), position (B,) -> logits (B, V)
    return model(token[:, None], positions=position[:, None], policy=policy, logits_at=torch.zeros_like(token))


def decode_n_tokens(model, logits, lengths, policy, n, eos_ids, sampling, generator, on_token=None):
    """Sample up to n tokens per row after the prefill. Returns the new tokens per row and the
    time each decode step took."""
    B = logits.shape[0]
    out: list[list[int]] = [[] for _ in range(B)]
    done = torch.zeros(B, dtype=torch.bool, device=logits.device)
    position = lengths.clone()
    next_token = sample(logits, *sampling, generator=generator)
    step_times = []
    while True:
        for b in range(B):
            if not done[b]:
                tok = int(next_token[b])
                out[b].append(tok)
                if on_token is not None:
                    on_token(b, tok)
                if tok in eos_ids or len(out[b]) >= n:
                    done[b] = True
        if bool(done.all()):
            return out, step_times
        synchronize(logits.device)
        t0 = time.perf_counter()
        logits = decode_one_token(model, next_token, position, policy)
        synchronize(logits.device)
        step_times.append(time.perf_counter() - t0)
        position = position + 1
        next_token = sample(logits, *sampling, generator=generator)
        rewind = policy.last_action.rewind if policy.last_action is not None else 0
        if rewind:
            # the policy dropped the KV of the last `rewind` fed tokens: feed the first again
            if B != 1:
                raise RuntimeError("rewind is only defined for a single sequence")
            rewind = min(rewind, len(out[0]))
            next_token = torch.tensor([out[0][-rewind]], device=logits.device)
            del out[0][-rewind:]
            position = position - rewind
            if on_token is not None:
                on_token(0, -rewind)  # tells a streaming printer to take back `rewind` tokens


def is_batch(prompt) -> bool:
    """A list of prompts (strings or lists of ids), not one prompt of token ids."""
    if not isinstance(prompt, list) or not prompt:
        return False
    first = prompt[0]
    return isinstance(first, (str, bytes, list, tuple)) or (isinstance(first, torch.Tensor) and first.dim() > 0)


SPECIAL_TEXT = ("tokens", "literal")


def encode_prompt(tokenizer, prompt, chat: bool, vocab_size: int, special_text: str = "tokens") -> list[int]:
    """A prompt's ids. special_text: what special-token text in a str prompt ("<|im_end|>",
    "<s>") becomes: "tokens", those special tokens (as transformers encodes), or "literal", plain
    text, so that text from someone else cannot end the user's turn and forge a system turn."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):  # iterating bytes gives ints: garbage ids
        raise ValueError("a prompt is a str or a list of token ids, got bytes: decode them first "
                         "(prompt.decode('utf-8'))")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise ValueError("the prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as err:
            raise ValueError(f"the prompt is not UTF-8 text: character {err.start} is a lone surrogate") from None
        if special_text not in SPECIAL_TEXT:
            raise ValueError(f"special_text is 'tokens' or 'literal', got {special_text!r}")
        literal = special_text == "literal"
        if chat and literal:
            text, span = user_turn(tokenizer, prompt)
            return tokenizer.encode(text, add_bos=False, literal=span)
        if chat:
            text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
            return tokenizer.encode(text, add_bos=False)
        return tokenizer.encode(prompt, literal=(0, len(prompt)) if literal else None)
    try:
        ids = [operator.index(t) for t in prompt]  # ints, numpy and 0-d tensor ints; not 1.5 or "7"
    except TypeError:
        raise ValueError(f"token ids must be integers (a prompt is a str or token ids), got {prompt!r:.80}") from None
    if any(isinstance(t, bool) for t in prompt):
        raise ValueError("token ids must be integers, not booleans")
    if not ids:
        raise ValueError("the prompt is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:  # an embedding lookup would be an IndexError on a CPU and a device assert on CUDA
        raise ValueError(f"token id {bad[0]} is outside the model's vocabulary of {vocab_size} (ids 0..{vocab_size - 1})")
    return ids


def generate(model, tokenizer, prompt, policy="full", max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None, seed: int | None = None,
             chat: bool = False, stop_at_eos: bool = True, on_token=None, progress=None, special_text: str = "tokens"):
    """Generate from one prompt (a string or token ids) or a batch (a list of them).

    One prompt: a GenerationResult whose `stats` hold the run's timing, the policy's KV numbers
    and its counters. A batch: BatchResults, a list with one GenerationResult per prompt, each
    with its own `prompt_tokens`, `new_tokens` and `finish` ("eos" or "length"), and the batch's
    timing and KV numbers once, in `.stats`. `policy` is a spec string or an unbound Policy; it is
    bound here to this model and sequence length, so a Policy object serves one generate at a
    time: a second one while it runs (another thread) is refused with a RuntimeError; give each
    thread its own (a spec string, or minikv.make_policy). on_token(row, id) is called as tokens are
    produced (a negative id -n means: take back the last n tokens). progress(done, total) is
    called during the prefill, in prompt tokens (see tokens_progress). special_text="literal"
    keeps special-token text in a str prompt as text (encode_prompt): for text from others.
    """
    check_sampling(temperature, top_k, top_p)
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, 1)
    seed = None if seed is None else as_int("seed", seed)
    batched = is_batch(prompt)
    policy = make(policy) if isinstance(policy, str) else policy  # a bad spec fails before tokenizing
    vocab = model.cfg.vocab_size
    prompts = ([batch_prompt(tokenizer, p, i, chat, vocab, special_text) for i, p in enumerate(prompt)] if batched
               else [encode_prompt(tokenizer, prompt, chat, vocab, special_text)])
    with exclusive(policy):
        return _generate(model, tokenizer, policy, prompts, batched, max_new_tokens, (temperature, top_k, top_p),
                         seed, stop_at_eos, on_token, progress)


def batch_prompt(tokenizer, prompt, index: int, chat: bool, vocab_size: int, special_text: str) -> list[int]:
    try:
        return encode_prompt(tokenizer, prompt, chat, vocab_size, special_text)
    except ValueError as err:
        raise ValueError(f"prompt {index} of the batch: {err}") from None


_IN_USE = threading.Lock()  # guards the test-and-set of a policy's `_generating` mark


@contextmanager
def exclusive(policy: Policy):
    """A bound policy holds one sequence's cache: a second generate binding the same object while
    the first runs (another thread) would rebind it under the first and both would read each
    other's KV. Refused, with what to do instead."""
    with _IN_USE:
        if getattr(policy, "_generating", False):
            raise RuntimeError(f"policy {policy.name!r} is already generating (another thread holds this Policy "
                               "object); give each concurrent generate its own policy: a spec string or "
                               "minikv.make_policy(spec)")
        policy._generating = True
    try:
        yield
    finally:
        policy._generating = False


def _generate(model, tokenizer, policy, prompts, batched, max_new_tokens, sampling, seed, stop_at_eos, on_token,
              progress):
    context = model.cfg.max_position_embeddings
    longest = max(len(p) for p in prompts)
    if longest > context:
        raise ValueError(f"the prompt has {longest} tokens, {longest - context} more than the model's context of {context}")
    policy.bind(model.cfg, device=model.device, dtype=model.dtype, max_len=longest + max_new_tokens,
                batch_size=len(prompts))
    device = model.device
    ids = torch.zeros(len(prompts), longest, dtype=torch.long, device=device)
    for b, p in enumerate(prompts):
        ids[b, : len(p)] = torch.tensor(p)
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    generator = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
    eos_ids = set(tokenizer.eos_ids) if stop_at_eos else set()

    synchronize(device)
    t0 = time.perf_counter()
    logits = prefill(model, ids, lengths, policy, progress)
    synchronize(device)
    ttft = time.perf_counter() - t0
    new, step_times = decode_n_tokens(model, logits, lengths, policy, max_new_tokens, eos_ids, sampling,
                                      generator, on_token)
    synchronize(device)
    total = time.perf_counter() - t0
    stats = generation_stats(policy, prompts, new, ttft, step_times, total, model)
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
    stats.update(thread_counts(policy, torch.get_num_threads()))  # intra-op + a selection worker's
    if model is not None and step_times:
        # what one decode step reads: the weights, and the KV the policy's attention read
        stats.update(decode_bandwidth(weight_bytes_per_step(model) + stats["kv_bytes_read_per_step"], tpot))
    return stats

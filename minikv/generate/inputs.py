"""What generate checks before anything runs: the sampling parameters, the counts, the prompts (text
or token ids, one or a batch), and that a Policy object serves one generate at a time. Each
refusal is a ValueError (RuntimeError for a policy in use) that says what is wrong."""
from __future__ import annotations

import math
import operator
import threading
from contextlib import contextmanager

import torch

from ..policies import Policy, make
from ..tokenizer.base import user_turn


def check_request(model, tokenizer, prompt, policy, max_new_tokens, sampling, seed, chat, special_text="tokens"):
    """generate's arguments checked, in the order a user fixes them -> (prompts as lists of token
    ids, the policy object, max_new_tokens, seed). A bad spec fails before tokenizing."""
    check_sampling(*sampling)
    max_new_tokens = as_int("max_new_tokens", max_new_tokens, 1)
    seed = None if seed is None else as_int("seed", seed)
    policy = make(policy) if isinstance(policy, str) else policy
    vocab = model.cfg.vocab_size
    prompts = ([batch_prompt(tokenizer, p, i, chat, vocab, special_text) for i, p in enumerate(prompt)]
               if is_batch(prompt) else [encode_prompt(tokenizer, prompt, chat, vocab, special_text)])
    context, longest = model.cfg.max_position_embeddings, max(len(p) for p in prompts)
    if longest > context:
        raise ValueError(f"the prompt has {longest} tokens, {longest - context} more than the model's context of {context}")
    return prompts, policy, max_new_tokens, seed


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

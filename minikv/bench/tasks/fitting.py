"""Fitting a prompt to an exact token length, needles at stated depths, and the shared word lists.

A prompt is head + haystack + tail, as token ids. The head and the tail (instruction, question,
chat turn, answer prefix) are fixed; the needles are fixed; the haystack is a stream of units
(noise lines, distractor needles, list entries) taken whole until the next one does not fit, then
cut at a token to hit the length exactly (RULER binary-searches the haystack size and lands near
the length; minikv wants every policy to see the same exact length). Needles go in between whole
units, at the unit boundary nearest to depth x haystack tokens.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass

SENTINEL = "\x00CONTENT\x00"


def chat_frame(tokenizer) -> tuple[str, str]:
    """(text before, text after) the user's message in the model's chat template, the assistant
    turn opened. ("", "") when the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return "", ""
    text = tokenizer.apply_chat_template([{"role": "user", "content": SENTINEL}], add_generation_prompt=True)
    before, found, after = text.partition(SENTINEL)
    if not found:
        raise ValueError("the chat template does not reproduce the user's message verbatim")
    return before, after


def frame_text(frame: tuple[str, str], instruction: str, question: str, answer_prefix: str) -> tuple[str, str]:
    """(head text, tail text) of a task: the user turn holds instruction + haystack + question; the
    assistant turn starts with the answer prefix (RULER puts it after the model's turn marker)."""
    before, after = frame
    if before or after:
        return before + instruction, question + after + answer_prefix.lstrip()
    return instruction, question + answer_prefix


def encode_head(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text)  # BOS as the tokenizer's config says


def encode_tail(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_bos=False)


@dataclass
class Fitted:
    ids: list[int]
    needles: list[tuple[int, int]]  # token spans of the needles, in the order given
    depths: list[float]  # actual depth of each needle: tokens of haystack before it / haystack tokens
    units_whole: int  # haystack units kept whole (a last one may follow, cut)


def fit(tokenizer, head: list[int], unit, needles: list[tuple[float, str]], tail: list[int], length: int) -> Fitted:
    """head and tail: token ids; unit(i) -> the i-th haystack unit (text); needles: (depth, text)."""
    needle_ids = [tokenizer.encode(text, add_bos=False) for _, text in needles]
    for depth, _ in needles:
        if not 0.0 <= depth <= 1.0:
            raise ValueError(f"needle depth must be in [0, 1], got {depth}")
    n_fill = length - len(head) - len(tail) - sum(len(n) for n in needle_ids)
    if n_fill < 0:
        raise ValueError(f"length {length} is shorter than the prompt without haystack "
                         f"({length - n_fill} tokens)")
    cache: dict[str, list[int]] = {}
    filler: list[int] = []
    bounds = [0]  # token offsets of the boundaries between whole units
    i = 0
    while len(filler) < n_fill:
        text = unit(i)
        ids = cache.get(text)
        if ids is None:
            ids = cache[text] = tokenizer.encode(text, add_bos=False)
        filler += ids
        if len(filler) <= n_fill:
            bounds.append(len(filler))
        i += 1
    filler = filler[:n_fill]
    units_whole = len(bounds) - 1
    # each needle at the unit boundary nearest its depth; needles at one boundary keep their order
    order = sorted(range(len(needles)), key=lambda j: needles[j][0])
    cuts = {j: min(bounds, key=lambda b: (abs(b - needles[j][0] * n_fill), b)) for j in order}
    ids, spans, at = list(head), [None] * len(needles), 0
    for j in order:
        ids += filler[at:cuts[j]]
        at = cuts[j]
        spans[j] = (len(ids), len(ids) + len(needle_ids[j]))
        ids += needle_ids[j]
    ids += filler[at:] + tail
    assert len(ids) == length
    depths = [cuts[j] / n_fill if n_fill else 0.0 for j in range(len(needles))]
    return Fitted(ids, spans, depths, units_whole)


# -- haystacks ---------------------------------------------------------------------------------

# noise: RULER's repeated line ("The grass is green. ..."): every page of it looks alike, which
# flatters page-level retrieval. pydoc: natural English documentation text (the standard library's
# pydoc_data.topics, ~465 kB, no download), in paragraphs; the model was not tuned on it as filler
# and its pages differ, as the essay haystack of RULER's niah_single_2 does.
HAYSTACKS = ("noise", "pydoc")


@functools.lru_cache(maxsize=1)
def pydoc_paragraphs() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    paragraphs = []
    for key in sorted(topics):
        paragraphs += [p.strip() for p in topics[key].split("\n\n") if p.strip()]
    return tuple(paragraphs)


def pydoc_unit(rng):
    """unit(i): the i-th paragraph of pydoc text from a starting paragraph drawn from rng, wrapping
    around, so instances of different seeds read different text."""
    paragraphs = pydoc_paragraphs()
    start = rng.randrange(len(paragraphs))
    return lambda i: paragraphs[(start + i) % len(paragraphs)] + "\n\n"


def check_haystack(haystack: str) -> None:
    if haystack not in HAYSTACKS:
        raise ValueError(f"unknown haystack {haystack!r}; haystacks: {', '.join(HAYSTACKS)}")


# -- word lists (the wonderwords package RULER uses) -------------------------------------------


@functools.lru_cache(maxsize=None)
def word_list(kind: str) -> tuple[str, ...]:
    """wonderwords' nouns, adjectives or verbs (profanities left out), in the package's order."""
    try:
        from importlib.resources import files

        import wonderwords.assets  # noqa: F401
    except ImportError as e:  # pragma: no cover - the bench extra installs it
        raise ImportError("the RULER-style tasks need the `wonderwords` package: pip install 'minikv[bench]'") from e
    root = files("wonderwords.assets")
    bad = set(root.joinpath("profanitylist.txt").read_text().split("\n"))
    words = root.joinpath(f"{kind}list.txt").read_text().split("\n")
    return tuple(w.strip() for w in words if w.strip() and w.strip() not in bad)


def rng_for(task: str, seed: int, redraw: int = 0) -> random.Random:
    """A generator private to (task, seed, redraw): string seeds hash with SHA-512, stable across
    runs. redraw > 0 is a sub-seed of the seed (see Ambiguous); redraw 0 is the seed's own draw."""
    return random.Random(f"minikv-{task}-{seed}" + (f"-redraw{redraw}" if redraw else ""))


class Ambiguous(Exception):
    """A generator drew an instance whose answer is not unambiguous (cutting the haystack to the
    length changed which words are most frequent): make_instance draws it again from the next
    sub-seed of the same seed, so every seed gives an instance, the same one every time."""

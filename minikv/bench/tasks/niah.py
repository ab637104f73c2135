"""Needle-in-a-haystack tasks: passkey (the passkey benchmark's prompt) and RULER's NIAH family.

RULER's needle: "One of the special magic {type} for {key} is: {value}." Keys and values are words
(adjective-noun from wonderwords), 7-digit numbers or UUIDs. Haystacks: `noise` (RULER's repeated
"The grass is green. ..." line) or `needle` (distractor needles with other keys). As in RULER,
needles sit at uniformly drawn places; here each one's depth is drawn from the seed and stated in
the instance. The essay-haystack variants become noise-haystack ones (no download):

    niah_single_1    noise,  word key,  number value, 1 needle
    niah_multikey_2  needle haystack (distractors), word keys, number values
    niah_multikey_3  needle haystack, UUID keys, UUID values
    niah_multivalue  noise,  one word key with 4 number values (all 4 must be named)
    niah_multiquery  noise,  4 word keys, one number each, all 4 asked
"""
from __future__ import annotations

import uuid

from .. import passkey
from . import Instance
from .fitting import HAYSTACKS
from .fitting import encode_head, encode_tail, fit, frame_text, pydoc_unit, rng_for, word_list

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
NEEDLE = "One of the special magic {type_v} for {key} is: {value}."
INSTRUCTION = ("Some special magic {type_v} are hidden within the following text. Make sure to memorize it. "
               "I will quiz you about the {type_v} afterwards.\n")
QUESTION = "\nWhat are all the special magic {type_v} for {query} mentioned in the provided text?"
ANSWER_PREFIX = " The special magic {type_v} for {query} mentioned in the provided text are"


def singular(text: str) -> str:
    """RULER's template for one key and one value."""
    for plural, one in (("Some special magic", "A special magic"), ("are all", "is"), ("are hidden", "is hidden"),
                        ("text are", "text is"), ("What are", "What is")):
        text = text.replace(plural, one)
    return text


def draw(rng, kind: str) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "words":
        return f"{rng.choice(word_list('adjective'))}-{rng.choice(word_list('noun'))}"
    raise ValueError(kind)


def niah(name: str, own: str, type_k: str, type_v: str, n_keys: int, n_values: int, n_queries: int,
         max_new_tokens: int):
    """A RULER NIAH generator with these settings (the keys of RULER's synthetic.yaml). own: the
    haystack of RULER's task ("noise", which the generator's `haystack` may replace by natural text,
    or "needle": distractor needles)."""

    def generate(tokenizer, length: int, seed: int, frame, haystack: str = "noise", redraw: int = 0) -> Instance:
        rng = rng_for(name, seed, redraw)
        keys = []
        while len(keys) < max(n_keys, n_queries):
            k = draw(rng, type_k)
            if k not in keys:
                keys.append(k)
        values = [[draw(rng, type_v) for _ in range(n_values)] for _ in keys]
        needles = [NEEDLE.format(type_v=type_v, key=k, value=v) + "\n" for k, vs in zip(keys, values) for v in vs]
        depths = [rng.random() for _ in needles]
        queried = keys[:n_queries]
        answers = [v for vs in values[:n_queries] for v in vs]
        query = queried[0] if n_queries == 1 else ", ".join(queried[:-1]) + ", and " + queried[-1]
        instruction, question, prefix = INSTRUCTION, QUESTION, ANSWER_PREFIX
        shown_v = type_v
        if n_queries * n_values == 1:
            instruction, question, prefix = singular(instruction), singular(question), singular(prefix)
            shown_v = type_v[:-1]  # "numbers" -> "number"
        head, tail = frame_text(frame, instruction.format(type_v=shown_v),
                                question.format(type_v=shown_v, query=query), prefix.format(type_v=shown_v, query=query))
        if own == "needle":  # distractor needles are this task's haystack, whatever was asked
            unit, used = distractor_units(rng, type_k, type_v, set(keys)), "needle"
        else:
            unit, used = (pydoc_unit(rng) if haystack == "pydoc" else noise_unit), haystack
        f = fit(tokenizer, encode_head(tokenizer, head), unit, list(zip(depths, needles)),
                encode_tail(tokenizer, tail), length)
        return Instance(name, seed, length, f.ids, answers, max_new_tokens, f.needles, f.depths, query, used)

    generate.haystacks = ("needle",) if own == "needle" else HAYSTACKS
    return generate


def noise_unit(i: int) -> str:
    return NOISE + "\n"


def distractor_units(rng, type_k: str, type_v: str, taken: set):
    """unit(i): the i-th distractor needle, drawn once and remembered (so unit(i) is stable)."""
    drawn: list[str] = []

    def unit(i: int) -> str:
        while len(drawn) <= i:
            k = draw(rng, type_k)
            if k in taken:
                continue
            drawn.append(NEEDLE.format(type_v=type_v, key=k, value=draw(rng, type_v)) + "\n")
        return drawn[i]

    return unit


def passkey_task(tokenizer, length: int, seed: int, frame, haystack: str = "noise", redraw: int = 0) -> Instance:
    """The passkey benchmark's prompt, as it builds it (plain text, no chat turn): key drawn from
    the seed, depth drawn from the seed too; with the pydoc haystack, the filler is natural text
    from a place drawn from the seed."""
    rng = rng_for("passkey", seed, redraw)
    key = passkey.draw_key(rng.randrange(2**31))
    depth = round(rng.random(), 3)
    if haystack == "pydoc":
        ids = passkey.build_prompt(tokenizer, length, depth, key, "pydoc", start=rng.random())
    else:
        ids = passkey.build_prompt(tokenizer, length, depth, key)
    line = tokenizer.encode(passkey.needle(key), add_bos=False)
    start = next(i for i in range(len(ids) - len(line) + 1) if ids[i:i + len(line)] == line)
    return Instance("passkey", seed, length, ids, [key], 8, [(start, start + len(line))], [depth], "pass key", haystack)


passkey_task.haystacks = HAYSTACKS


TASKS = {
    "passkey": passkey_task,
    "niah_single_1": niah("niah_single_1", "noise", "words", "numbers", 1, 1, 1, 24),
    "niah_multikey_2": niah("niah_multikey_2", "needle", "words", "numbers", 1, 1, 1, 24),
    "niah_multikey_3": niah("niah_multikey_3", "needle", "uuids", "uuids", 1, 1, 1, 48),
    "niah_multivalue": niah("niah_multivalue", "noise", "words", "numbers", 1, 4, 1, 64),
    "niah_multiquery": niah("niah_multiquery", "noise", "words", "numbers", 4, 1, 4, 64),
}

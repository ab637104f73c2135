"""Multi-hop tracing and aggregation: RULER's variable tracking, common- and frequent-words extraction.

    vt   a chain "VAR A = 12345", "VAR B = VAR A", ... (1 chain, 4 hops: 5 names) hidden among
         noise lines at depths drawn from the seed, in order; one worked example (RULER's few-shot,
         3-letter names) comes first. Answer: all 5 names.
    cwe  a numbered list of words; 10 common words appear freq_cw times, the others freq_ucw times
         (RULER: 30 and 3 from 4k tokens, 6 and 1 below, with one worked example). Answer: the 10.
    fwe  coded text: 6-letter random words with Zipf counts (alpha = 2), the most frequent one
         replaced by '...' noise. Answer: the three most frequent coded words.

The haystack is cut to hit the length exactly, so the answers of cwe and fwe are counted on the
text that is really in the prompt and checked to be unambiguous; an ambiguous draw is drawn again
from the seed's next sub-seed (fitting.Ambiguous).
"""
from __future__ import annotations

import math
import string
from collections import Counter

from . import Instance
from .fitting import Ambiguous, encode_head, encode_tail, fit, frame_text, rng_for, word_list
from .niah import NOISE

VT_INSTRUCTION = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
VT_QUESTION = "\nQuestion: Find all variables that are assigned the value {query} in the text above."
VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
             "assigned the value {query}, they are: ")
CWE_INSTRUCTION = ("Below is a numbered list of words. In these words, some appear more often than others. "
                   "Memorize the ones that appear most often.\n")
CWE_QUESTION = "\nQuestion: What are the 10 most common words in the above list?"
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_INSTRUCTION = ("Read the following coded text and track the frequency of each coded word. Find the three most "
                   "frequently appeared coded words. ")
FWE_QUESTION = ("\nQuestion: Do not provide any explanation. Please ignore the dots '....'. What are the three most "
                "frequently appeared words in the above coded text?")
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"


# -- variable tracking ---------------------------------------------------------------------------


def vt_chain(rng, hops: int, letters: int) -> tuple[list[str], list[str], str]:
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    lines = [f"VAR {names[0]} = {value}"] + [f"VAR {names[j + 1]} = VAR {names[j]}" for j in range(hops)]
    return names, lines, value


def vt_body(tokenizer, rng, length: int, hops: int, letters: int, head: list[int], tail_of):
    """Fit one chain into noise; tail_of(value) gives the tail ids. Returns (fitted, names, value)."""
    names, lines, value = vt_chain(rng, hops, letters)
    depths = sorted(rng.random() for _ in lines)  # in order: hop j comes after hop j - 1
    f = fit(tokenizer, head, lambda i: NOISE + "\n", [(d, line + "\n") for d, line in zip(depths, lines)],
            tail_of(value), length)
    return f, names, value


def vt_task(tokenizer, length: int, seed: int, frame, hops: int = 4, redraw: int = 0) -> Instance:
    rng = rng_for("vt", seed, redraw)
    answer = VT_ANSWER.format(n=hops + 1, query="{query}")
    # RULER's worked example (500 tokens; short prompts get a quarter of their length): the task
    # without the chat turn, answered, then the real task
    example, ex_names, _ = vt_body(
        tokenizer, rng, min(500, length // 4), hops, 3, encode_tail(tokenizer, VT_INSTRUCTION),
        lambda v: encode_tail(tokenizer, VT_QUESTION.format(query=v) + answer.format(query=v)))
    example_ids = example.ids + encode_tail(tokenizer, " ".join(ex_names) + "\n\n")
    head = encode_head(tokenizer, frame[0]) + example_ids + encode_tail(tokenizer, VT_INSTRUCTION)

    def tail_of(value):
        _, tail = frame_text(frame, "", VT_QUESTION.format(query=value), answer.format(query=value))
        return encode_tail(tokenizer, tail)

    f, names, value = vt_body(tokenizer, rng, length, hops, 5, head, tail_of)
    return Instance("vt", seed, length, f.ids, names, 30, f.needles, f.depths, value)


# -- common words --------------------------------------------------------------------------------


def word_pool(rng) -> list[str]:
    pool = sorted(set(word_list("noun")) | set(word_list("adjective")) | set(word_list("verb")))
    rng.shuffle(pool)
    return pool


def cwe_list(rng, pool: list[str], n_words: int, n_cw: int, freq_cw: int, freq_ucw: int):
    """A shuffled list where n_cw words appear freq_cw times and n_words - n_cw others freq_ucw times."""
    chosen = rng.sample(pool, n_words)
    common, uncommon = chosen[:n_cw], chosen[n_cw:]
    words = common * freq_cw + uncommon * freq_ucw
    rng.shuffle(words)
    return words, common


def token_count(tokenizer, units: list[str]) -> int:
    """Tokens of the units, each encoded alone (as fit() encodes them)."""
    sizes: dict[str, int] = {}
    for u in units:
        if u not in sizes:
            sizes[u] = len(tokenizer.encode(u, add_bos=False))
    return sum(sizes[u] for u in units)


def numbered(words: list[str]) -> list[str]:
    return [f"{i + 1}. {w} " for i, w in enumerate(words)]


def cwe_task(tokenizer, length: int, seed: int, frame, n_cw: int = 10, redraw: int = 0) -> Instance:
    rng = rng_for("cwe", seed, redraw)
    pool = word_pool(rng)
    freq_cw, freq_ucw, example_size = (30, 3, (40, 10, 3)) if length >= 4096 else (6, 1, (20, 3, 1))
    ex_words, ex_common = cwe_list(rng, pool, example_size[0], n_cw, example_size[1], example_size[2])
    example = (CWE_INSTRUCTION + "".join(numbered(ex_words)).rstrip() + CWE_QUESTION + CWE_ANSWER + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex_common)) + "\n\n")
    head_text, tail = frame_text(frame, example + CWE_INSTRUCTION, CWE_QUESTION, CWE_ANSWER)
    head, tail = encode_head(tokenizer, head_text), encode_tail(tokenizer, tail)
    if n_cw * freq_cw > len(pool):
        raise ValueError("cwe: the word pool is too small")
    # grow the list until it overfills the room a little; fit() cuts the last entries
    room, n_words = length - len(head) - len(tail), n_cw + 8
    while True:
        words, common = cwe_list(rng_for("cwe-list", seed, redraw), pool, n_words, n_cw, freq_cw, freq_ucw)
        entries = numbered(words)
        if token_count(tokenizer, entries) >= room or n_words == len(pool):
            break
        n_words = min(len(pool), n_words + max(8, n_words // 4))
    if token_count(tokenizer, numbered(common * freq_cw)) > room:
        raise ValueError(f"cwe: {length} tokens cannot hold {n_cw} words x {freq_cw}")
    f = fit(tokenizer, head, lambda i: entries[i], [], tail, length)
    counts = Counter(words[: f.units_whole])
    top = sorted(common, key=lambda w: -counts[w])
    least_common = counts[top[-1]]
    if any(c >= least_common for w, c in counts.items() if w not in common):
        raise Ambiguous(f"cwe seed {seed} redraw {redraw}: cutting the list made the answer ambiguous")
    return Instance("cwe", seed, length, f.ids, common, 120, query="10 most common words")


# -- frequent words ------------------------------------------------------------------------------


def fwe_task(tokenizer, length: int, seed: int, frame, alpha: float = 2.0, max_new_tokens: int = 50,
             redraw: int = 0) -> Instance:
    rng = rng_for("fwe", seed, redraw)
    head_text, tail = frame_text(frame, FWE_INSTRUCTION, FWE_QUESTION, FWE_ANSWER)
    head, tail = encode_head(tokenizer, head_text), encode_tail(tokenizer, tail)
    room = max(1, length - len(head) - len(tail))
    vocab_size = max(8, (length - max_new_tokens) // 50)  # RULER's vocabulary size
    vocab: list[str] = []
    while len(vocab) < vocab_size:
        w = "".join(rng.choice(string.ascii_lowercase) for _ in range(6))
        if w not in vocab:
            vocab.append(w)
    vocab[0] = "..."  # the most frequent "word" is noise (RULER)
    zeta = sum(k ** -alpha for k in range(1, 100000))  # zeta(alpha), to 1e-5
    n_total = room
    while True:  # Zipf counts over enough words to overfill the room; fit() cuts the rest
        words = [w for k, w in enumerate(vocab, 1) for _ in range(int(n_total * k ** -alpha / zeta))]
        if token_count(tokenizer, [w + " " for w in words]) >= room:
            break
        n_total *= 2
    rng.shuffle(words)
    f = fit(tokenizer, head, lambda i: words[i] + " ", [], tail, length)
    counts = Counter(words[: f.units_whole])
    ranked = [w for w, _ in counts.most_common() if w != "..."]
    if len(ranked) < 4 or counts[ranked[2]] <= counts[ranked[3]]:
        raise Ambiguous(f"fwe seed {seed} redraw {redraw}: the three most frequent words are not unambiguous")
    return Instance("fwe", seed, length, f.ids, ranked[:3], max_new_tokens, query="three most frequent words")


TASKS = {"vt": vt_task, "cwe": cwe_task, "fwe": fwe_task}

"""Byte-level BPE on tiktoken (GPT-2, SmolLM2, Llama-3, Qwen2, Pythia): the pre-tokenizer regexes,
GPT-2's byte alphabet, and BPETokenizer, which maps Hugging Face's merge list onto tiktoken's ranks."""
from __future__ import annotations

import functools
import unicodedata

import tiktoken

from .base import Tokenizer

# Pre-tokenizer regexes: BPE never merges across the pieces these cut text into.
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = LLAMA3_PATTERN.replace(r"\p{N}{1,3}", r"\p{N}")


def digits_then_gpt2(digits: str = r"\p{N}") -> str:
    """One regex for Sequence[Digits, ByteLevel(use_regex)] (SmolLM2, StarCoder): digits are cut out
    first, then GPT-2's regex runs on what lies between them. No GPT-2 alternative can match a digit,
    so that equals GPT-2's regex with digits as their own alternative, except that a whitespace run
    before a digit ends its piece, so its lookahead must treat a digit like the end of the text."""
    return digits + "|" + GPT2_PATTERN.replace(r"| ?\p{N}+", "").replace(r"\s+(?!\S)", r"\s+(?![^\s\p{N}])")


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's table that gives every byte a printable character, so byte-level vocabularies can be
    JSON strings: printable Latin-1 bytes stand for themselves, the others (space, controls, ...)
    for U+0100 onwards in byte order (space -> 'Ġ', newline -> 'Ċ')."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(others)}}


class BPETokenizer(Tokenizer):
    """Byte-level BPE on tiktoken.

    tiktoken's mergeable_ranks map byte strings to ranks, and it merges, inside each pre-tokenizer
    piece, the adjacent pair whose concatenation has the lowest rank. Hugging Face merges the pair
    that comes first in merges.txt. So a token's rank is the position of the merge that creates it
    (bytes first), and ranks map back to the vocabulary's ids, which need not follow merge order.
    The two agree when each token has one merge making it and pieces reach vocabulary tokens only
    through their own merges: true of trained BPE vocabularies, checked against transformers on the
    reference corpus and (SmolLM2) on every vocabulary token.
    """

    def __init__(self, vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str,
                 normalizer: str | None = None, ignore_merges: bool = False, **common):
        self.vocab, self.merges, self.pattern = vocab, merges, pattern
        self.normalizer, self.ignore_merges = normalizer, ignore_merges
        u2b = {c: b for b, c in byte_to_unicode().items()}
        spell = {b: c for c, b in u2b.items()}

        def to_bytes(token: str) -> bytes:  # tokens outside the byte alphabet are plain text
            return bytes(u2b[c] for c in token) if all(c in u2b for c in token) else token.encode()

        ranks, rank_to_id = {}, []
        for b in range(256):  # every byte needs a rank; a byte's rank never decides a merge
            ranks[bytes([b])] = b
            rank_to_id.append(vocab.get(spell[b]))  # None: the vocabulary lacks this byte
        for a, b in merges:
            if a + b not in vocab:
                raise ValueError(f"merge {a!r} {b!r} makes {a + b!r}, which is not in the vocabulary")
            piece = to_bytes(a) + to_bytes(b)
            if piece not in ranks:
                ranks[piece] = len(rank_to_id)
                rank_to_id.append(vocab[a + b])
        self._rank_to_id = rank_to_id
        self._enc = tiktoken.Encoding("minikv", pat_str=pattern, mergeable_ranks=ranks, special_tokens={})
        # Hugging Face drops characters whose bytes are missing from the vocabulary (with no unk
        # token) *before* merging, so their neighbours may merge; tiktoken cannot skip bytes, so
        # text holding such a byte takes a slower path (see _encode_text).
        self._missing = bytes(b for b in range(256) if rank_to_id[b] is None)
        self._bytes = {i: to_bytes(t) for t, i in vocab.items()}
        common.setdefault("added", [])
        self._bytes.update({t.id: t.content.encode() for t in common["added"]})
        super().__init__(vocab_size=max(self._bytes) + 1, **common)

    def _encode_text(self, text: str) -> list[int]:
        if self.normalizer:
            text = unicodedata.normalize(self.normalizer, text)
        raw = text.encode(errors="replace")
        if len(raw.translate(None, self._missing)) == len(raw):
            return [self._rank_to_id[r] for r in self._enc.encode_ordinary(text)]
        import regex  # tiktoken's own dependency; the same pattern, cut in Python

        ranks = []
        for piece in regex.findall(self.pattern, text):
            kept = piece.encode().translate(None, self._missing)
            ranks += self._enc._encode_single_piece(kept) if kept else []
        return [self._rank_to_id[r] for r in ranks]

    def _token_bytes(self, token_id: int) -> bytes:
        return self._bytes.get(token_id, b"")  # like transformers, ids outside the vocabulary decode to ""

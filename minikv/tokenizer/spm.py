"""SentencePiece tokenizers (a tokenizer.model: Llama-2, Mistral) on the sentencepiece package."""
from __future__ import annotations

from .base import Tokenizer


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (tokenizer.model: Llama-2, Mistral): byte fallback, "▁" for spaces, and a
    dummy prefix "▁" before the text. Text between added tokens is encoded by sentencepiece itself,
    each segment with its dummy prefix, which is what llama.cpp, Meta's reference code and
    transformers' sentencepiece tokenizer with legacy=True do ("<s>[INST]" -> <s> "▁[" "INST" "]")."""

    def __init__(self, model_proto: bytes, **common):
        import sentencepiece

        self.model_proto = model_proto
        self._sp = sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        n = sp.get_piece_size()
        self._bytes = {}
        for i in range(n):
            piece = sp.id_to_piece(i)
            if sp.is_byte(i):  # "<0xE4>"
                self._bytes[i] = bytes([int(piece[3:5], 16)])
            else:  # control and unknown pieces decode to their text, as added tokens do
                self._bytes[i] = piece.replace("\u2581", " ").encode()
        common.setdefault("added", [])
        self._bytes.update({t.id: t.content.encode() for t in common["added"]})
        # The model proto says whether a dummy prefix is added; encoding "a" shows it without protobuf.
        dummy = sp.encode("a", out_type=str)[0].startswith("\u2581")
        super().__init__(vocab_size=max(max(self._bytes) + 1, n), strip_first_space=dummy, **common)

    def _encode_text(self, text: str) -> list[int]:
        return self._sp.encode(text) if text else []

    def _token_bytes(self, token_id: int) -> bytes:
        return self._bytes.get(token_id, b"")

"""A SentencePiece model file (a serialized sentencepiece ModelProto) written from a GGUF's
tokenizer.ggml.* metadata, so that the sentencepiece package encodes what the GGUF describes.

GGUF keeps a SentencePiece vocabulary as three lists (tokens, scores, token types, whose numbers
are SentencePiece's own: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte) and
a few flags; a tokenizer.model is those pieces plus a trainer and a normalizer spec, in protocol
buffers. The encoding is written here by hand (protobuf is not a dependency): a message is a run
of (field number << 3 | wire type) keys, each followed by a varint, 4 bytes or a length and bytes.
Field numbers are those of sentencepiece_model.proto.
"""
from __future__ import annotations

import struct

BPE = 2  # TrainerSpec.ModelType


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _int(field: int, value: int) -> bytes:  # int32, enum and bool: wire type 0 (varint)
    return _key(field, 0) + _varint(value & 0xFFFFFFFFFFFFFFFF if value < 0 else value)


def _bytes(field: int, data: bytes) -> bytes:  # strings and nested messages: wire type 2
    return _key(field, 2) + _varint(len(data)) + data


def _float(field: int, value: float) -> bytes:  # wire type 5, little-endian float32
    return _key(field, 5) + struct.pack("<f", value)


def sentencepiece_model(pieces: list[str], scores: list[float], types: list[int], *, bos_id: int, eos_id: int,
                        unk_id: int, pad_id: int, add_dummy_prefix: bool, byte_fallback: bool = True) -> bytes:
    """A BPE ModelProto: pieces with their scores (SentencePiece's BPE merges the adjacent pair
    whose joined piece scores highest) and types; no text normalization but spaces written "▁"."""
    # ModelProto.pieces (1): SentencePiece { piece = 1; score = 2; type = 3 }
    body = b"".join(_bytes(1, _bytes(1, p.encode()) + _float(2, s) + _int(3, t))
                    for p, s, t in zip(pieces, scores, types, strict=True))
    trainer = (_int(3, BPE) + _int(4, len(pieces)) + _int(35, byte_fallback)  # model_type, vocab_size, byte_fallback
               + _int(40, unk_id) + _int(41, bos_id) + _int(42, eos_id) + _int(43, pad_id))
    # NormalizerSpec: name, add_dummy_prefix (3), remove_extra_whitespaces (4), escape_whitespaces (5)
    normalizer = _bytes(1, b"identity") + _int(3, add_dummy_prefix) + _int(4, False) + _int(5, True)
    return body + _bytes(2, trainer) + _bytes(3, normalizer)

"""Tokenizers without the Hugging Face stack.

Byte-level BPE (GPT-2, SmolLM2, Llama-3, Qwen2, Pythia) runs on tiktoken, SentencePiece models
(Llama-2, Mistral) on the sentencepiece package, and chat templates on jinja2's sandbox, set up the
way transformers sets it up. The public names:

    load_tokenizer(model_dir) -> Tokenizer           tokenizer.json | tokenizer.model | vocab.json + merges.txt
    Tokenizer.from_gguf(path_or_reader) -> Tokenizer the tokenizer.ggml.* metadata of a GGUF file
    save_tokenizer_files(tokenizer_or_gguf, out_dir) writes tokenizer.json (or tokenizer.model) and
                                                     tokenizer_config.json, which load_tokenizer reads back
    tok.encode(text, add_bos=None) -> list[int]      tok.decode(ids, skip_special_tokens=False) -> str
    tok.stream() -> StreamDecoder                    .push(token_id) -> str, .flush() -> str
    tok.apply_chat_template(messages, add_generation_prompt=True) -> str
    tok.bos_id, tok.eos_ids, tok.vocab_size, tok.chat_template

Token ids equal those of transformers on the corpus in reference/tokenizers (made by
reference/make_tokenizers.py); tests/test_tokenizer.py holds the two together.
"""
from __future__ import annotations

import codecs
import contextlib
import functools
import json
import re
import unicodedata
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import tiktoken

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


# tokenizer.ggml.pre -> regex, as llama.cpp reads it (transformers ignores "smollm": see reference/).
GGUF_PRE_PATTERNS = {"default": GPT2_PATTERN, "gpt-2": GPT2_PATTERN, "gpt2": GPT2_PATTERN,
                     "smollm": digits_then_gpt2(), "starcoder": digits_then_gpt2(), "refact": digits_then_gpt2(),
                     "llama-bpe": LLAMA3_PATTERN, "llama3": LLAMA3_PATTERN, "llama-v3": LLAMA3_PATTERN,
                     "qwen2": QWEN2_PATTERN}
# Tokens that end an assistant turn in common chat formats; eos_ids holds those the template uses.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


@functools.lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's table that gives every byte a printable character, so byte-level vocabularies can be
    JSON strings: printable Latin-1 bytes stand for themselves, the others (space, controls, ...)
    for U+0100 onwards in byte order (space -> 'Ġ', newline -> 'Ċ')."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + n) for n, b in enumerate(others)}}


@dataclass(frozen=True)
class AddedToken:
    """A token matched whole in the text before any other tokenization (<|im_start|>, <s>)."""
    content: str
    id: int
    special: bool = True
    lstrip: bool = False  # also swallows the whitespace before it
    rstrip: bool = False  # ... and after it


class Tokenizer:
    """What every tokenizer shares: added-token splitting, BOS, decoding, streaming, chat templates.
    Subclasses supply _encode_text(segment) and _token_bytes(id)."""

    def __init__(self, added: list[AddedToken], bos_id: int | None, eos_id: int | None, add_bos: bool,
                 chat_template: str | None, vocab_size: int, extra_eos: tuple[int, ...] = (),
                 strip_first_space: bool = False):
        self.added, self.bos_id, self.eos_id, self.add_bos = added, bos_id, eos_id, add_bos
        self.chat_template, self.vocab_size = chat_template, vocab_size
        self.special_ids = {t.id for t in added if t.special}
        self._content = {t.id: t.content for t in added}
        self.strip_first_space = strip_first_space  # sentencepiece's dummy prefix, undone when decoding
        # Longest first, so that "<|im_start|>" wins over a shorter token that is its prefix.
        ordered = sorted(added, key=lambda t: -len(t.content))
        self._added_ids = [t.id for t in ordered]
        self._added_re = re.compile("|".join(
            ("\\s*" if t.lstrip else "") + f"({re.escape(t.content)})" + ("\\s*" if t.rstrip else "")
            for t in ordered)) if ordered else None
        # Turn-ending tokens the template writes stop generation like EOS does.
        by_content = {t.content: t.id for t in added}
        self.eos_ids = {i for i in (eos_id, *extra_eos) if i is not None} | {
            by_content[t] for t in END_OF_TURN if t in by_content and t in (chat_template or "")}

    @property
    def bos_token(self) -> str | None:
        return self._content.get(self.bos_id)

    @property
    def eos_token(self) -> str | None:
        return self._content.get(self.eos_id)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of text; added tokens written in the text become their ids. add_bos=None does
        what the tokenizer's config says (add_bos_token, or its post-processor)."""
        if add_bos if add_bos is not None else self.add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no BOS token; call encode(text, add_bos=False)")
            ids = [self.bos_id]
        else:
            ids = []
        start = 0
        for m in self._added_re.finditer(text) if self._added_re else ():
            if m.start() > start:
                ids += self._encode_text(text[start:m.start()])
            ids.append(self._added_ids[m.lastindex - 1])
            start = m.end()
        if start < len(text):
            ids += self._encode_text(text[start:])
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        stream = self.stream(skip_special_tokens)
        return "".join(stream.push(int(i)) for i in ids) + stream.flush()

    def stream(self, skip_special_tokens: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """Render the checkpoint's own Jinja chat template the way transformers does."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat template (looked for tokenizer_config.json 'chat_template', "
                             "chat_template.jinja, GGUF tokenizer.chat_template); format the prompt yourself")
        special = {k: v for k, v in (("bos_token", self.bos_token), ("eos_token", self.eos_token)) if v}
        return _compile_template(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, tools=None, documents=None,
            **{**special, **kwargs})

    @staticmethod
    def from_gguf(path_or_reader) -> BPETokenizer:
        return _bpe_from_gguf(path_or_reader)


class StreamDecoder:
    """Token ids in, text out, one token at a time, emitting only complete characters: a multi-byte
    UTF-8 character split over tokens (an emoji in byte-fallback pieces) waits for its last byte.
    Pushing every id then flushing gives exactly tok.decode(ids)."""

    def __init__(self, tok: Tokenizer, skip_special_tokens: bool = False):
        self._tok, self._skip = tok, skip_special_tokens
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        token_id = int(token_id)
        if self._skip and token_id in self._tok.special_ids:
            return ""
        text = self._utf8.decode(self._tok._token_bytes(token_id))
        if self._first:
            # SentencePiece writes "Hello" as "▁Hello" (its dummy prefix): the space that piece
            # brings is not part of the text, but later "▁world" pieces' spaces are.
            self._first = False
            if self._tok.strip_first_space and text[:1] == " " and token_id not in self._tok.special_ids:
                text = text[1:]
        return text

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


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


# ---------------------------------------------------------------------------------------- chat templates

@functools.lru_cache(maxsize=16)
def _compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """transformers' {% generation %}...{% endgeneration %} marks assistant text for training
        masks; rendering a prompt just renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


# ---------------------------------------------------------------------------------------- loading

def load_tokenizer(model_dir) -> Tokenizer:
    """The tokenizer of a Hugging Face style model directory: tokenizer.json when it is byte-level
    BPE, else tokenizer.model (SentencePiece), else GPT-2 style vocab.json + merges.txt; with
    tokenizer_config.json (and chat_template.jinja) for BOS/EOS, add_bos_token and the chat template."""
    d = Path(model_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"tokenizer directory {d} does not exist")
    cfg = {**_read_json(d / "special_tokens_map.json"), **_read_json(d / "tokenizer_config.json")}
    if (d / "chat_template.jinja").is_file():  # where transformers >= 4.43 saves it
        cfg["chat_template"] = (d / "chat_template.jinja").read_text(encoding="utf-8")
    if isinstance(cfg.get("chat_template"), list):  # named templates: [{"name": "default", "template": ...}]
        cfg["chat_template"] = {t["name"]: t["template"] for t in cfg["chat_template"]}.get("default")
    tj = _read_json(d / "tokenizer.json")
    with _malformed(d / "tokenizer.json"):
        byte_level = bool(tj) and _is_byte_level(tj)
    if tj and (byte_level or not (d / "tokenizer.model").is_file()):  # Llama-2 dirs hold both
        with _malformed(d / "tokenizer.json"):
            return _bpe_from_tokenizer_json(tj, cfg)
    if (d / "tokenizer.model").is_file():
        with _malformed(d / "tokenizer.model"):
            return _sentencepiece(d / "tokenizer.model", cfg)
    if (d / "vocab.json").is_file() and (d / "merges.txt").is_file():
        lines = (d / "merges.txt").read_text(encoding="utf-8").splitlines()
        merges = [tuple(ln.split(" ")) for ln in lines if ln and not ln.startswith("#version")]
        with _malformed(d / "merges.txt"):
            return _bpe(_read_json(d / "vocab.json"), merges, GPT2_PATTERN, cfg, [])
    raise FileNotFoundError(f"no tokenizer in {d}: looked for tokenizer.json, tokenizer.model, "
                            "vocab.json + merges.txt (with tokenizer_config.json)")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


@contextlib.contextmanager
def _malformed(path: Path):
    """A file whose structure is not what its format says (a key missing, a list where an
    object belongs) is one ValueError naming it, not a KeyError from deep inside the reader."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None
    except (KeyError, IndexError, TypeError, AttributeError, RuntimeError) as err:  # RuntimeError: sentencepiece's
        raise ValueError(f"{path}: malformed ({type(err).__name__}: {err})") from None


def _content(token) -> str | None:  # tokenizer_config writes tokens as "<s>" or {"content": "<s>", ...}
    return token.get("content") if isinstance(token, dict) else token


def _added_token(token_id: int, a: dict) -> AddedToken:
    if a.get("single_word"):
        raise ValueError(f"added token {a['content']!r} has single_word=true, which minikv does not support")
    return AddedToken(a["content"], token_id, a.get("special", False), a.get("lstrip", False), a.get("rstrip", False))


def _config_fields(cfg: dict, ids: dict[str, int], added: list[AddedToken], default_add_bos: bool,
                   default_bos: int | None = None) -> dict:
    """Tokenizer arguments from tokenizer_config.json: the tokens it names are matched in text too."""
    added = {t.id: t for t in added}
    for i, a in cfg.get("added_tokens_decoder", {}).items():
        added.setdefault(int(i), _added_token(int(i), a))
    by_content = {t.content: t.id for t in added.values()}
    for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
        name = _content(cfg.get(key))
        if name is not None and name not in by_content and name in ids:
            added[ids[name]] = AddedToken(name, ids[name])
            by_content[name] = ids[name]
    bos, eos = _content(cfg.get("bos_token")), _content(cfg.get("eos_token"))
    add_bos = cfg.get("add_bos_token")
    return dict(added=sorted(added.values(), key=lambda t: t.id), chat_template=cfg.get("chat_template"),
                bos_id=by_content.get(bos, default_bos), eos_id=by_content.get(eos),
                extra_eos=tuple(cfg.get("eos_token_ids", ())),  # minikv's own key, from save_tokenizer_files
                add_bos=default_add_bos if add_bos is None else bool(add_bos))


def _bpe(vocab, merges, pattern, cfg, added, normalizer=None, ignore_merges=False, add_bos=False, bos=None):
    fields = _config_fields(cfg, vocab, added, add_bos, bos)
    return BPETokenizer(vocab, merges, pattern, normalizer, ignore_merges, **fields)


def _sentencepiece(path: Path, cfg: dict) -> SentencePieceTokenizer:
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(path))
    ids = {sp.id_to_piece(i): i for i in range(sp.get_piece_size()) if sp.is_control(i) or sp.is_unknown(i)}
    fields = _config_fields(cfg, ids, [AddedToken(p, i) for p, i in ids.items()], True,
                            sp.bos_id() if sp.bos_id() >= 0 else None)
    if fields["eos_id"] is None and sp.eos_id() >= 0:
        fields["eos_id"] = sp.eos_id()
    return SentencePieceTokenizer(path.read_bytes(), **fields)


def _steps(node: dict | None, key: str) -> list[dict]:
    """A tokenizer.json component as a flat list (Sequence nodes hold theirs under `key`)."""
    if not node:
        return []
    return [s for sub in node[key] for s in _steps(sub, key)] if node["type"] == "Sequence" else [node]


def _is_byte_level(tj: dict) -> bool:
    return any(s["type"] == "ByteLevel" for s in _steps(tj.get("pre_tokenizer"), "pretokenizers"))


def _pattern_from_pre_tokenizer(pre: dict | None) -> str:
    """The one regex tiktoken needs, from the pre-tokenizer chains byte-level models use."""
    steps = _steps(pre, "pretokenizers")
    kinds = [s["type"] for s in steps]
    if kinds and kinds[-1] == "ByteLevel" and not steps[-1].get("add_prefix_space"):
        use_regex = steps[-1].get("use_regex", True)
        if kinds == ["ByteLevel"] and use_regex:
            return GPT2_PATTERN
        if kinds == ["Digits", "ByteLevel"] and use_regex:
            return digits_then_gpt2(r"\p{N}" if steps[0].get("individual_digits") else r"\p{N}+")
        split = steps[0]
        if kinds == ["Split", "ByteLevel"] and not use_regex and "Regex" in split["pattern"] \
                and split.get("behavior") == "Isolated" and not split.get("invert"):
            return split["pattern"]["Regex"]
    raise ValueError(f"unsupported pre_tokenizer {json.dumps(pre)}: minikv handles ByteLevel(use_regex=true), "
                     "Digits + ByteLevel(use_regex=true) and Split(Regex, Isolated) + ByteLevel(use_regex=false), "
                     "with add_prefix_space=false")


def _bpe_from_tokenizer_json(tj: dict, cfg: dict) -> BPETokenizer:
    model = tj["model"]
    if model.get("type") != "BPE" or not _is_byte_level(tj) or model.get("byte_fallback") or \
            model.get("continuing_subword_prefix") or model.get("end_of_word_suffix") or model.get("dropout"):
        settings = {k: v for k, v in model.items() if k not in ("vocab", "merges")}
        raise ValueError(f"tokenizer.json is not a plain byte-level BPE (model {settings}, pre_tokenizer "
                         f"{json.dumps(tj.get('pre_tokenizer'))}); SentencePiece style models (Metaspace, "
                         "byte_fallback) need their tokenizer.model")
    normalizers = [s["type"] for s in _steps(tj.get("normalizer"), "normalizers")]
    if normalizers not in ([], ["NFC"], ["NFD"], ["NFKC"], ["NFKD"]):
        raise ValueError(f"unsupported normalizer {json.dumps(tj['normalizer'])}: minikv handles none or one "
                         "of NFC, NFD, NFKC, NFKD")
    added = [_added_token(a["id"], a) for a in tj.get("added_tokens", [])]
    # Llama-3 style checkpoints add BOS through a TemplateProcessing post-processor.
    bos = None
    for step in _steps(tj.get("post_processor"), "processors"):
        if step["type"] == "TemplateProcessing" and "SpecialToken" in step["single"][0]:
            bos = step["special_tokens"][step["single"][0]["SpecialToken"]["id"]]["ids"][0]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return _bpe(model["vocab"], merges, _pattern_from_pre_tokenizer(tj.get("pre_tokenizer")), cfg, added,
                normalizers[0] if normalizers else None, bool(model.get("ignore_merges")), bos is not None, bos)


def _bpe_from_gguf(path_or_reader) -> BPETokenizer:
    from gguf import GGUFReader

    if isinstance(path_or_reader, GGUFReader):
        reader = path_or_reader
    else:
        from .gguf_import import open_gguf

        reader = open_gguf(Path(path_or_reader))  # the header checked before gguf's reader trusts it
    meta = {k[len("tokenizer."):]: f.contents() for k, f in reader.fields.items()
            if k.startswith("tokenizer.") and not k.endswith(".scores")}
    if meta.get("ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {meta.get('ggml.model')!r} is not supported: minikv reads byte-level "
                         "BPE ('gpt2') GGUF tokenizers; for SentencePiece ('llama') use the model's tokenizer.model")
    pre = meta.get("ggml.pre", "default")
    if pre not in GGUF_PRE_PATTERNS:
        raise ValueError(f"GGUF tokenizer.ggml.pre {pre!r} is not supported (known: {sorted(GGUF_PRE_PATTERNS)})")
    if "ggml.tokens" not in meta or "ggml.merges" not in meta:
        raise ValueError("GGUF metadata lacks tokenizer.ggml.tokens or tokenizer.ggml.merges")
    tokens = meta["ggml.tokens"]
    types = meta.get("ggml.token_type") or [1] * len(tokens)  # 3: control, 4: user-defined
    # Tokens are stored in the byte alphabet; one that is not (a control token holding a space) is
    # respelled into it, as transformers does.
    spell = byte_to_unicode()
    alphabet = set(spell.values())
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode()): i for i, t in enumerate(tokens)}
    added = [AddedToken(t, i, special=ty == 3) for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (3, 4)]
    return BPETokenizer(
        vocab, [tuple(m.split(" ")) for m in meta["ggml.merges"]], GGUF_PRE_PATTERNS[pre],
        ignore_merges=GGUF_PRE_PATTERNS[pre] is LLAMA3_PATTERN, added=added,
        bos_id=meta.get("ggml.bos_token_id"), eos_id=meta.get("ggml.eos_token_id"),
        extra_eos=tuple(meta[k] for k in ("ggml.eot_token_id", "ggml.eom_token_id") if k in meta),
        add_bos=bool(meta.get("ggml.add_bos_token", False)), chat_template=meta.get("chat_template"))


def save_tokenizer_files(tokenizer_or_gguf, out_dir) -> Path:
    """Write a tokenizer (or a GGUF's, given its path or GGUFReader) as files that load_tokenizer
    reads back into the same tokenizer and transformers can load: tokenizer.json (a plain
    vocab.json + merges.txt cannot say how to pre-tokenize, e.g. SmolLM2's digit split) or
    tokenizer.model, and tokenizer_config.json with the chat template, BOS/EOS and add_bos_token."""
    tok = tokenizer_or_gguf
    if not isinstance(tok, Tokenizer):
        tok = Tokenizer.from_gguf(tok)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    added = [{"id": t.id, "content": t.content, "single_word": False, "lstrip": t.lstrip, "rstrip": t.rstrip,
              "normalized": False, "special": t.special} for t in tok.added]
    cfg = {"add_bos_token": tok.add_bos, "bos_token": tok.bos_token, "eos_token": tok.eos_token,
           "eos_token_ids": sorted(tok.eos_ids), "chat_template": tok.chat_template,
           "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added}}
    if isinstance(tok, SentencePieceTokenizer):
        (out / "tokenizer.model").write_bytes(tok.model_proto)
        cfg["tokenizer_class"] = "LlamaTokenizer"
    else:
        byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
        if tok.pattern == GPT2_PATTERN:
            pre = byte_level
        elif tok.pattern in (digits_then_gpt2(), digits_then_gpt2(r"\p{N}+")):
            pre = {"type": "Sequence", "pretokenizers": [
                {"type": "Digits", "individual_digits": tok.pattern == digits_then_gpt2()}, byte_level]}
        else:
            pre = {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": tok.pattern}, "behavior": "Isolated", "invert": False},
                dict(byte_level, use_regex=False)]}
        post = dict(byte_level, trim_offsets=False)
        if tok.add_bos and tok.bos_token is not None:  # Llama-3 style: BOS comes from the post-processor
            bos = {"SpecialToken": {"id": tok.bos_token, "type_id": 0}}
            a, b = {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}
            post = {"type": "TemplateProcessing", "single": [bos, a], "pair": [bos, a, bos, b], "special_tokens": {
                tok.bos_token: {"id": tok.bos_token, "ids": [tok.bos_id], "tokens": [tok.bos_token]}}}
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                 "ignore_merges": tok.ignore_merges, "vocab": tok.vocab, "merges": [list(m) for m in tok.merges]}
        tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
              "normalizer": {"type": tok.normalizer} if tok.normalizer else None, "pre_tokenizer": pre,
              "post_processor": post, "decoder": dict(byte_level, add_prefix_space=True), "model": model}
        (out / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
        cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False, indent=1), encoding="utf-8")
    return out

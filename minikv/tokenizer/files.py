"""Tokenizer files, read and written:

    load_tokenizer(model_dir)        a Hugging Face style directory: tokenizer.json (byte-level BPE),
                                     tokenizer.model (SentencePiece) or vocab.json + merges.txt, with
                                     tokenizer_config.json for BOS/EOS, add_bos_token, chat template
    tokenizer_from_gguf(path_or_reader)  the tokenizer.ggml.* metadata of a GGUF
    save_tokenizer_files(tok, dir)   the files load_tokenizer (and transformers) read back

Files are downloaded, so untrusted: a malformed one is a ValueError naming it (`_malformed`).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path

from .base import AddedToken, Tokenizer
from .bpe import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, BPETokenizer, byte_to_unicode, digits_then_gpt2
from .spm import SentencePieceTokenizer

# tokenizer.ggml.pre -> regex, as llama.cpp reads it (transformers ignores "smollm": see reference/).
GGUF_PRE_PATTERNS = {"default": GPT2_PATTERN, "gpt-2": GPT2_PATTERN, "gpt2": GPT2_PATTERN,
                     "smollm": digits_then_gpt2(), "starcoder": digits_then_gpt2(), "refact": digits_then_gpt2(),
                     "llama-bpe": LLAMA3_PATTERN, "llama3": LLAMA3_PATTERN, "llama-v3": LLAMA3_PATTERN,
                     "qwen2": QWEN2_PATTERN}


def load_tokenizer(model_dir) -> Tokenizer:
    """The tokenizer of a Hugging Face style model directory: tokenizer.json when it is byte-level
    BPE, else tokenizer.model (SentencePiece), else GPT-2 style vocab.json + merges.txt; with
    tokenizer_config.json (and chat_template.jinja) for BOS/EOS, add_bos_token and the chat template."""
    tok = _load_tokenizer(Path(model_dir))
    tok.origin = str(model_dir)  # the model its chat template's errors name
    return tok


def _load_tokenizer(d: Path) -> Tokenizer:
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


def tokenizer_from_gguf(path_or_reader) -> BPETokenizer:
    """The tokenizer in a GGUF file's tokenizer.ggml.* metadata (a path or a gguf GGUFReader)."""
    from gguf import GGUFReader

    if isinstance(path_or_reader, GGUFReader):
        reader = path_or_reader
    else:
        from ..gguf_to_hf import open_gguf

        reader = open_gguf(Path(path_or_reader))  # the header checked before gguf's reader trusts it
    meta = {k[len("tokenizer."):]: f.contents() for k, f in reader.fields.items()
            if k.startswith("tokenizer.") and not k.endswith(".scores")}
    arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else None
    if meta.get("ggml.model") == "llama" and str(arch).startswith("gemma"):
        return _gemma_from_gguf(meta)
    if meta.get("ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer model {meta.get('ggml.model')!r} is not supported: minikv reads byte-level "
                         "BPE ('gpt2') GGUF tokenizers and Gemma's SentencePiece; for other SentencePiece ('llama') "
                         "vocabularies use the model's tokenizer.model")
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


def _gemma_from_gguf(meta: dict) -> SentencePieceTokenizer:
    """Gemma's SentencePiece BPE vocabulary from GGUF metadata, as a tokenizer.model (spm_proto.py).

    Two things the file does not say as Gemma's tokenizer.model did, decided as transformers'
    GGUF reader decides them (so that ids equal its own): the merge order is the order of the
    tokens in the file (score = -index), and a token of two or more spaces, stored with real
    spaces, is spelled with SentencePiece's "▁". Control tokens (<bos>, <start_of_turn>, ...)
    are matched whole in the text; BOS is added, as Gemma expects it, unless the file says not."""
    from .spm_proto import sentencepiece_model

    tokens, types = meta["ggml.tokens"], meta.get("ggml.token_type") or [1] * len(meta["ggml.tokens"])
    spaces = [bool(t) and not t.strip(" ") for t in tokens]
    pieces = ["\u2581" * len(t) if blank else t for t, blank in zip(tokens, spaces)]
    # the file marks those user-defined (matched longest first: 34 spaces -> 31 + 3); transformers
    # reaches them through merges (34 -> 16 + 18): normal pieces
    types = [1 if blank else ty for ty, blank in zip(types, spaces)]
    ids = {name: meta.get(f"ggml.{name}_token_id") for name in ("bos", "eos", "unknown", "padding")}
    proto = sentencepiece_model(pieces, [-float(i) for i in range(len(pieces))], types,
                                bos_id=ids["bos"], eos_id=ids["eos"], unk_id=ids["unknown"],
                                pad_id=-1 if ids["padding"] is None else ids["padding"],
                                add_dummy_prefix=bool(meta.get("ggml.add_space_prefix", False)))
    added = [AddedToken(t, i) for i, (t, ty) in enumerate(zip(tokens, types)) if ty in (2, 3)]
    return SentencePieceTokenizer(proto, added=added, bos_id=ids["bos"], eos_id=ids["eos"],
                                  add_bos=bool(meta.get("ggml.add_bos_token", True)),
                                  chat_template=meta.get("chat_template"),
                                  extra_eos=tuple(meta[k] for k in ("ggml.eot_token_id",) if k in meta))


def save_tokenizer_files(tokenizer_or_gguf, out_dir) -> Path:
    """Write a tokenizer (or a GGUF's, given its path or GGUFReader) as files that load_tokenizer
    reads back into the same tokenizer and transformers can load: tokenizer.json (a plain
    vocab.json + merges.txt cannot say how to pre-tokenize, e.g. SmolLM2's digit split) or
    tokenizer.model, and tokenizer_config.json with the chat template, BOS/EOS and add_bos_token."""
    tok = tokenizer_or_gguf
    if not isinstance(tok, Tokenizer):
        tok = tokenizer_from_gguf(tok)
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

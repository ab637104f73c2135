"""Tokenizers without the Hugging Face stack.

Byte-level BPE (GPT-2, SmolLM2, Llama-3, Qwen2, Pythia) runs on tiktoken, SentencePiece models
(Llama-2, Mistral) on the sentencepiece package, and chat templates on jinja2's sandbox, set up the
way transformers sets it up. The public names:

    load_tokenizer(model_dir) -> Tokenizer           tokenizer.json | tokenizer.model | vocab.json + merges.txt
    tokenizer_from_gguf(path_or_reader) -> Tokenizer the tokenizer.ggml.* metadata of a GGUF file
    save_tokenizer_files(tokenizer_or_gguf, out_dir) writes tokenizer.json (or tokenizer.model) and
                                                     tokenizer_config.json, which load_tokenizer reads back
    tok.encode(text, add_bos=None) -> list[int]      tok.decode(ids, skip_special_tokens=False) -> str
    tok.stream() -> StreamDecoder                    .push(token_id) -> str, .flush() -> str
    tok.apply_chat_template(messages, add_generation_prompt=True) -> str
    tok.bos_id, tok.eos_ids, tok.vocab_size, tok.chat_template

Where to read what:

    base.py            Tokenizer (added tokens, BOS, decoding, chat), StreamDecoder, AddedToken
    bpe.py             BPETokenizer: byte-level BPE on tiktoken; the pre-tokenizer regexes
    spm.py             SentencePieceTokenizer: a tokenizer.model on the sentencepiece package
    chat_template.py   the Jinja sandbox chat templates render in, as transformers sets it up
    files.py           load_tokenizer, tokenizer_from_gguf, save_tokenizer_files

Token ids equal those of transformers on the corpus in reference/tokenizers (made by
reference/make_tokenizers.py); tests/test_tokenizer.py holds the two together.
"""
from .base import END_OF_TURN, AddedToken, StreamDecoder, Tokenizer
from .bpe import GPT2_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, BPETokenizer, byte_to_unicode, digits_then_gpt2
from .files import GGUF_PRE_PATTERNS, load_tokenizer, save_tokenizer_files, tokenizer_from_gguf
from .spm import SentencePieceTokenizer

__all__ = ["AddedToken", "BPETokenizer", "END_OF_TURN", "GGUF_PRE_PATTERNS", "GPT2_PATTERN", "LLAMA3_PATTERN",
           "QWEN2_PATTERN", "SentencePieceTokenizer", "StreamDecoder", "Tokenizer", "byte_to_unicode",
           "digits_then_gpt2", "load_tokenizer", "save_tokenizer_files", "tokenizer_from_gguf"]

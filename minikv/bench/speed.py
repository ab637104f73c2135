"""speed: time to first token, time per output token and tokens/s, per policy and prompt length.

    python -m minikv.bench speed --prompt-lengths 500 2000 --policy full --policy streaming:window=252

Prompts are the first N tokens of the standard library's pydoc_data.topics text; generation
ignores EOS so every run decodes --new-tokens tokens. The first policy is the baseline of the
`vs first` column (its time per token divided by this row's: above 1 is faster).
"""
from __future__ import annotations

import json
import statistics

import torch

from ..generate import generate
from ..loading import load


def long_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def prompt_ids(tokenizer, n: int) -> list[int]:
    ids = tokenizer.encode(long_text())
    if n > len(ids):
        raise ValueError(f"prompt length {n} is longer than the text ({len(ids)} tokens)")
    return ids[:n]


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: full)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[500], help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per run (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before measuring")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="write the numbers to this file")


def measure(model, tokenizer, policy: str, ids: list[int], new_tokens: int, repeats: int, warmup: int) -> dict:
    runs = []
    for i in range(warmup + repeats):
        stats = generate(model, tokenizer, ids, policy=policy, max_new_tokens=new_tokens, stop_at_eos=False).stats
        if i >= warmup:
            runs.append(stats)
    return {
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "tpot_s": statistics.median(r["tpot_s"] for r in runs),
        "device_tokens_peak": runs[-1]["device_tokens_peak"],
        "device_bytes": runs[-1]["device_bytes"],
    }


def run(args) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    policies = args.policy or ["full"]
    model, tokenizer = load(args.model, device=args.device, dtype=args.dtype)
    rows = []
    for n in args.prompt_lengths:
        ids = prompt_ids(tokenizer, n)
        for policy in policies:
            row = {"policy": policy, "prompt_tokens": n, **measure(model, tokenizer, policy, ids, args.new_tokens,
                                                                  args.repeats, args.warmup)}
            row["tokens_per_s"] = 1.0 / row["tpot_s"]
            base = next((r for r in rows if r["prompt_tokens"] == n), row)
            row["vs_first"] = base["tpot_s"] / row["tpot_s"]
            rows.append(row)
    print(f"{'policy':<40} {'prompt':>7} {'TTFT s':>8} {'TPOT ms':>8} {'tok/s':>7} {'vs first':>8} {'peak dev tok':>12}")
    for r in rows:
        print(f"{r['policy']:<40} {r['prompt_tokens']:>7} {r['ttft_s']:>8.3f} {1000 * r['tpot_s']:>8.2f} "
              f"{r['tokens_per_s']:>7.1f} {r['vs_first']:>8.2f} {r['device_tokens_peak']:>12.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "new_tokens": args.new_tokens, "rows": rows}, f, indent=2)
    return 0

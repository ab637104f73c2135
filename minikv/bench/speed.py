"""speed: time to first token, time per output token and tokens/s, per policy and prompt length.

    python -m minikv.bench speed --prompt-lengths 500 2000 --policy full --policy streaming:window=252

Prompts are the first N tokens of the standard library's pydoc_data.topics text; generation
ignores EOS so every run decodes --new-tokens tokens. The first policy is the baseline of the
`vs first` column (its time per token divided by this row's: above 1 is faster). Policies take
turns run by run (--warmup untimed rounds, then --repeats timed ones) and medians are reported.
"""
from __future__ import annotations

import statistics

from ..generate import generate
from .common import add_common_arguments, load_model, print_table, text_ids, write_json


def add_arguments(p) -> None:
    add_common_arguments(p)
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: full)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[500], help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per run (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before measuring")


def summarize(runs: list[dict], new_tokens: int) -> dict:
    """Medians over the timed runs of one policy at one prompt length."""
    return {
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "tpot_s": statistics.median(r["tpot_s"] for r in runs),
        "device_tokens_peak": runs[-1]["device_tokens_peak"],
        "device_bytes": runs[-1]["device_bytes_allocated"],
        # policies that time their selection and recall (freekv) say what share of decoding it took
        "overhead_share": statistics.median(
            (r["select_s"] + r["recall_s"]) / (r["tpot_s"] * (new_tokens - 1)) for r in runs) if "select_s" in runs[-1] else None,
        # and each part on its own (the JSON rows): selection (a page-score pass, or a tree search) and recall
        "select_share": statistics.median(
            r["select_s"] / (r["tpot_s"] * (new_tokens - 1)) for r in runs) if "select_s" in runs[-1] else None,
        "recall_share": statistics.median(
            r["recall_s"] / (r["tpot_s"] * (new_tokens - 1)) for r in runs) if "recall_s" in runs[-1] else None,
    }


def run(args) -> int:
    policies = args.policy or ["full"]
    model, tokenizer = load_model(args)
    rows = []
    for n in args.prompt_lengths:
        ids = text_ids(tokenizer, n)
        runs = {policy: [] for policy in policies}
        # policies take turns, run by run, so that a noisy shared machine slows them alike
        for i in range(args.warmup + args.repeats):
            for policy in policies:
                stats = generate(model, tokenizer, ids, policy=policy, max_new_tokens=args.new_tokens,
                                 stop_at_eos=False).stats
                if i >= args.warmup:
                    runs[policy].append(stats)
        for policy in policies:
            row = {"policy": policy, "prompt_tokens": n, **summarize(runs[policy], args.new_tokens)}
            row["tokens_per_s"] = 1.0 / row["tpot_s"]
            row["tpot_ms"] = 1000 * row["tpot_s"]
            base = next((r for r in rows if r["prompt_tokens"] == n), row)
            row["vs_first"] = base["tpot_s"] / row["tpot_s"]
            rows.append(row)
    print_table(rows, [("policy", "policy", ""), ("prompt", "prompt_tokens", "d"), ("TTFT s", "ttft_s", ".3f"),
                       ("TPOT ms", "tpot_ms", ".2f"), ("tok/s", "tokens_per_s", ".1f"), ("vs first", "vs_first", ".2f"),
                       ("peak device tokens", "device_tokens_peak", ".0f"), ("select+recall share", "overhead_share", ".2f")])
    write_json(args.json, {"benchmark": "speed", "model": args.model, "new_tokens": args.new_tokens, "rows": rows})
    return 0

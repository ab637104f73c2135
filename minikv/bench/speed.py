"""speed: time to first token, time per output token and tokens/s, per policy and prompt length.

    python -m minikv.bench speed --prompt-lengths 500 2000 --policy full --policy streaming:window=252

Prompts are the first N tokens of the standard library's pydoc_data.topics text; generation
ignores EOS so every run decodes --new-tokens tokens. The first policy is the baseline of the
`vs first` column (its time per token divided by this row's: above 1 is faster). Policies take
turns run by run (--warmup untimed rounds, then --repeats timed ones) and medians are reported.

--lockstep: one prefill forward for all policies (bench passkey's SharedPrefill: their prefill
outputs must agree), then the policies decode in lockstep, step t of every policy before step
t + 1 of any, each greedy on its own tokens. On a machine whose load changes during a run this
keeps the TPOT ratios fair (every policy's step t runs within seconds of the others'), and it
costs one long prefill instead of one per policy and repeat. TTFT is not per policy then ('-').
"""
from __future__ import annotations

import statistics
import time

import torch

from ..generate import decode_one_token, generate
from ..policies import make
from .common import add_common_arguments, load_model, print_table, text_ids, write_json


def add_arguments(p) -> None:
    add_common_arguments(p)
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: full)")
    p.add_argument("--prompt-lengths", type=int, nargs="+", default=[500], help="prompt lengths in tokens")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens to generate per run (default 64)")
    p.add_argument("--repeats", type=int, default=3, help="runs per cell; the median is reported")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before measuring")
    p.add_argument("--lockstep", action="store_true",
                   help="one shared prefill, then every policy decodes step by step in turn (no TTFT per policy)")


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


def lockstep_runs(model, ids: list[int], specs: list[str], new_tokens: int) -> dict[str, dict]:
    """One shared prefill, then greedy decoding of every policy in lockstep -> {spec: stats}
    with tpot_s the mean step time, token_ids the new_tokens tokens, and the policy's own stats."""
    from .passkey import SharedPrefill

    policies = [make(s).bind(model.cfg, device=model.device, dtype=model.dtype, max_len=len(ids) + new_tokens)
                for s in specs]
    x = torch.tensor([ids], device=model.device)
    logits = model(x, policy=SharedPrefill(policies, specs), logits_at=torch.tensor([len(ids) - 1], device=model.device))
    token = [logits.argmax(-1)] * len(specs)
    times = [[] for _ in specs]
    produced = [[int(token[0])] for _ in specs]
    for step in range(new_tokens - 1):
        position = torch.tensor([len(ids) + step], device=model.device)
        for j, policy in enumerate(policies):
            t0 = time.perf_counter()
            out = decode_one_token(model, token[j], position, policy)
            times[j].append(time.perf_counter() - t0)
            token[j] = out.argmax(-1)
            produced[j].append(int(token[j]))
    found = {}
    for spec, policy, ts, toks in zip(specs, policies, times, produced):
        stats = policy.stats()
        stats.update(ttft_s=float("nan"), tpot_s=sum(ts) / len(ts), token_ids=toks)
        found[spec] = stats
    return found


def run(args) -> int:
    policies = args.policy or ["full"]
    model, tokenizer = load_model(args)
    rows = []
    for n in args.prompt_lengths:
        ids = text_ids(tokenizer, n)
        if args.lockstep:
            found = lockstep_runs(model, ids, policies, args.new_tokens)
            for policy in policies:
                row = {"policy": policy, "prompt_tokens": n, **summarize([found[policy]], args.new_tokens)}
                row["ttft_s"] = None
                row["tokens_per_s"] = 1.0 / row["tpot_s"]
                row["tpot_ms"] = 1000 * row["tpot_s"]
                base = next((r for r in rows if r["prompt_tokens"] == n), row)
                row["vs_first"] = base["tpot_s"] / row["tpot_s"]
                rows.append(row)
            continue
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

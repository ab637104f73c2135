"""memory: the active-KV trajectory of one generation, per layer and in total, against full KV.

    python -m minikv.bench memory --new-tokens 500 --png memory.png --json memory.json
    python -m minikv.bench memory --policy softfreeze:tau=1.0 --policy softfreeze:history=64

Reproduces Table 1 and Figure 1 of the soft-freeze paper ("Adaptive Soft Rolling KV Freeze with
Entropy-Guided Recovery", Metinov et al., arXiv:2512.11221): a greedy generation of
--new-tokens tokens from an open prompt (EOS ignored), once with the full cache (the baseline,
also the time reference) and once per policy, on the same prompt in the same process. Per policy
it reports the tokens in the sequence, the active KV at the end (tokens per KV head that attention
reads on the device tier, mean over layers), compression = 1 - active / total at the end and
averaged over the steps, and the time per output token against full KV (`TPOT x full`, this /
full: below 1 is faster). The PNG plots the mean
active KV per step (with the band between the least and the most active layer) and the full KV
line. Runs alternate policies `--repeats` times; times are medians.

The trajectory is read after every step by a probe on policy.end_step (bench/probes.py), the
same for every policy. The end value of softfreeze's compression swings with its freeze cycles (with d = 1 many tokens
freeze and thaw on the same steps): read it beside the mean over the steps. --relevance-stats also prints
the distribution of the s_j softfreeze judges by (Eq. 2's with score=raw), to judge its threshold tau.
"""
from __future__ import annotations

import statistics
from contextlib import nullcontext
from pathlib import Path

import torch

from ..atomic import atomic_open, atomic_write
from ..cli import dumps
from ..generate import generate
from ..loading import MODEL_HELP, load
from ..policies import make
from .probes import watched

PROMPT = "Write a long essay about the history of the printing press and its influence on science and society."


def add_arguments(p) -> None:
    p.add_argument("--model", default="smollm2", help=MODEL_HELP)
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: softfreeze)")
    p.add_argument("--prompt", default=PROMPT, help="the open prompt (a chat turn unless --no-chat)")
    p.add_argument("--no-chat", action="store_true", help="feed the prompt as plain text, no chat template")
    p.add_argument("--new-tokens", type=int, default=500, help="tokens to generate (default 500, as Table 1)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per policy; medians reported")
    p.add_argument("--relevance-stats", action="store_true", help="print quantiles of softfreeze's raw s_j")
    p.add_argument("--png", default=None, help="write the Figure 1 style plot here")
    p.add_argument("--device", default=None)
    p.add_argument("--dtype", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--json", default=None, help="write the numbers to this file")
    p.add_argument("--compile", action="store_true", help="decode with the compiled step (torch.compile; docs/speed.md)")


def run_one(model, tok, spec, args, relevance_log=None) -> dict:
    policy = make(spec)
    trajectory = []  # (tokens in the cache, active tokens per layer) after each step

    def after_step(action, *args, **kwargs):
        layers = policy.layers
        tokens = getattr(layers[0], "n_tok", None)  # softfreeze's rewalk takes tokens back
        tokens = prompt_len + policy.steps - 1 if tokens is None else tokens
        trajectory.append((tokens, [layer.device_tokens() for layer in layers]))

    def judged(result, scores, now):  # softfreeze's raw s_j (Eq. 2) of every layer, each step
        relevance_log.extend(s.detach().float().cpu() for s in scores)

    chat = not args.no_chat
    prompt_len = len(tok.encode(tok.apply_chat_template([{"role": "user", "content": args.prompt}], add_generation_prompt=True),
                                add_bos=False) if chat else tok.encode(args.prompt))
    # full KV holds every token: its trajectory is known, and a probe would slow its timing
    with watched(policy, "end_step", after_step) if policy.name != "full" else nullcontext(), \
            watched(policy, "freeze_and_thaw", judged) if relevance_log is not None else nullcontext():
        result = generate(model, tok, args.prompt, policy=policy, max_new_tokens=args.new_tokens, chat=chat,
                          stop_at_eos=False)
    s = result.stats
    total = s["prompt_tokens"] + s["new_tokens"] - 1  # the last sampled token is never fed
    if policy.name == "full":
        totals = list(range(s["prompt_tokens"], total + 1))
        active = [[t] * len(policy.layers) for t in totals]
    else:
        totals, active = [t for t, _ in trajectory], [a for _, a in trajectory]
    means = [sum(a) / len(a) for a in active]
    return dict(policy=spec, total_tokens=total, active_kv=s["device_tokens"], compression=1 - s["device_tokens"] / total,
                mean_compression=1 - sum(means) / sum(totals), tpot_s=s["tpot_s"], total_s=s["total_s"],
                totals=totals, active_mean=means, active_per_layer=active, text=result.text,
                events={k: s[k] for k in ("freezes", "thaws", "spikes", "soft_resets", "window_resets", "full_resets",
                                          "rewalks", "rewalks_refused", "bytes_to_host", "bytes_to_device") if k in s})


def plot(rows, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    base = rows[0]
    ax.plot(base["totals"], base["totals"], "--", color="tab:orange", label="Full KV (baseline)")
    for r in rows[1:]:
        lo = [min(a) for a in r["active_per_layer"]]
        hi = [max(a) for a in r["active_per_layer"]]
        line, = ax.plot(r["totals"], r["active_mean"], label=f"{r['policy']} (mean over layers)")
        ax.fill_between(r["totals"], lo, hi, color=line.get_color(), alpha=0.15, label="least / most active layer")
    ax.set_xlabel("tokens in the sequence (prompt + generated)")
    ax.set_ylabel("active KV tokens (per KV head, per layer)")
    ax.set_title("Active KV cache during generation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=Path(path).suffix[1:] or "png", dpi=120)
    plt.close(fig)


def quantiles(values: torch.Tensor) -> dict:
    qs = [0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99]
    return {f"q{int(q * 100):02d}": float(x) for q, x in zip(qs, torch.quantile(values, torch.tensor(qs)))}


def check(args) -> None:
    """The flags that need no model (python -m minikv.bench calls this before loading it)."""
    if args.new_tokens < 2:
        raise ValueError(f"--new-tokens must be >= 2 (a time per token needs a decode step), got {args.new_tokens}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty")


def run(args) -> int:
    check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    specs = ["full"] + (args.policy or ["softfreeze"])
    model, tok = load(args.model, device=args.device, dtype=args.dtype, compile=args.compile)
    runs: dict[str, list[dict]] = {spec: [] for spec in specs}
    relevance: list[torch.Tensor] = []
    for i in range(args.repeats):  # alternate, so that machine noise hits every policy alike
        for spec in specs:
            log = relevance if (args.relevance_stats and i == 0) else None
            runs[spec].append(run_one(model, tok, spec, args, log))
    rows = []
    for spec in specs:
        row = dict(runs[spec][-1])
        row["tpot_s"] = statistics.median(r["tpot_s"] for r in runs[spec])
        rows.append(row)
    base = rows[0]["tpot_s"]
    for r in rows:
        r["tpot_vs_full"] = r["tpot_s"] / base
    print(f"{'method':<44} {'total':>6} {'active KV':>9} {'compr.':>7} {'mean compr.':>11} {'TPOT ms':>8} {'TPOT x full':>11}")
    for r in rows:
        print(f"{r['policy']:<44} {r['total_tokens']:>6} {r['active_kv']:>9.1f} {100 * r['compression']:>6.1f}% "
              f"{100 * r['mean_compression']:>10.1f}% {1000 * r['tpot_s']:>8.2f} {r['tpot_vs_full']:>11.2f}")
    for r in rows[1:]:
        if r["events"]:
            print(f"{r['policy']}: " + ", ".join(f"{k} {v}" for k, v in r["events"].items()))
    stats = None
    if relevance:
        raw = torch.cat([s.float() for s in relevance])
        rel = torch.cat([s.float() / s.float().mean() for s in relevance])
        stats = dict(raw=quantiles(raw), relative=quantiles(rel), raw_below_0_5=float((raw < 0.5).float().mean()),
                     relative_below_0_5=float((rel < 0.5).float().mean()))
        print("relevance s_j (the spec's score) quantiles: ", {k: round(v, 2) for k, v in stats["raw"].items()})
        print("relevance s_j / mean over active, relative:", {k: round(v, 2) for k, v in stats["relative"].items()})
        print(f"fraction below 0.5: raw {stats['raw_below_0_5']:.4f}, relative {stats['relative_below_0_5']:.4f}")
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")
    if args.json:
        atomic_write(args.json, dumps(dict(rows=rows, relevance=stats, new_tokens=args.new_tokens, prompt=args.prompt),
                                      indent=1))
    return 0

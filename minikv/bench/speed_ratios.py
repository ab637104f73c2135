"""The ratios `bench speed` reports: each run's time per token over full KV's measured in the same
run, on as many threads (a policy with a worker thread against full KV on its threads plus one),
and the figure that plots them against the prompt length (full KV the 1.0 line)."""
from __future__ import annotations

import sys
from pathlib import Path

from ..atomic import atomic_open


def split_threads(spec: str, default: int) -> tuple[str, int]:
    """A run's label 'SPEC@N' -> (SPEC, N): the intra-op threads it decodes on (default: `default`)."""
    body, at, n = spec.rpartition("@")
    if not at:
        return spec, default
    if not n.strip().isdigit() or int(n) < 1:
        raise ValueError(f"{spec!r}: the threads after @ must be an integer >= 1, got {n!r}")
    return body, int(n)


def same_threads_baseline(rows: list[dict], row: dict, base: str) -> dict:
    """The row a row's ratio divides by: the `full` run on as many threads (a policy with a worker
    against full KV on its threads plus one), else the `full` run on the most threads below the
    row's (a policy that oversubscribes the cores against full KV on them), else the baseline
    policy's row."""
    full = [r for r in rows if split_threads(r["policy"], 1)[0].split(":")[0].strip() == "full"]
    same = [r for r in full if r.get("threads") == row.get("threads")]
    if same:
        return same[0]
    fewer = [r for r in full if None not in (r.get("threads"), row.get("threads")) and r["threads"] < row["threads"]]
    return max(fewer, key=lambda r: r["threads"]) if fewer else next(r for r in rows if r["policy"] == base)


def baseline_policy(policies: list[str]) -> str:
    """The denominator of every ratio: `full` when it runs, else the first policy."""
    return next((p for p in policies if split_threads(p, 1)[0].split(":")[0].strip() == "full"), policies[0])


def ratio_curves(rows: list[dict], policies: list[str], base: str) -> dict[str, tuple[list[int], list[float]]]:
    """What the figure plots: for each policy, (prompt lengths, TPOT / the baseline's TPOT at that
    length), the baseline's measured in the same run (with --lockstep, step by step beside it),
    so a change of the machine's load between lengths cancels; the baseline is full KV on as many
    threads where the run has it (same_threads_baseline), and is 1.0 throughout."""
    lengths = {r["prompt_tokens"] for r in rows if r["policy"] == base}
    curves = {}
    for policy in policies:
        mine = [r for r in rows if r["policy"] == policy and r["prompt_tokens"] in lengths]
        ratios = []
        for r in mine:
            same_length = [o for o in rows if o["prompt_tokens"] == r["prompt_tokens"]]
            ratios.append(r["tpot_s"] / same_threads_baseline(same_length, r, base)["tpot_s"])
        curves[policy] = ([r["prompt_tokens"] for r in mine], ratios)
    return curves


def plot_context(rows: list[dict], policies: list[str], path: str, title: str, base: str | None = None) -> None:
    """TPOT as a ratio to the baseline's (full KV's) against prompt length, one line per policy,
    the baseline the 1.0 line (ratio_curves; matplotlib, imported only here). The table keeps
    the milliseconds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = base or baseline_policy(policies)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy, (lengths, ratios) in ratio_curves(rows, policies, base).items():
        is_base = split_threads(policy, 1)[0] == base
        style = dict(color="black", linestyle="--", linewidth=1) if is_base else dict(marker="o")
        ax.plot(lengths, ratios, label=f"{policy} (= 1)" if is_base else policy, **style)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel(f"time per output token / {base}'s, same run")
    ax.set_ylim(bottom=0)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_open(path, "wb") as f:
        fig.savefig(f, format=Path(path).suffix[1:] or "png", dpi=120)
    plt.close(fig)
    print(f"wrote {path}", file=sys.stderr)

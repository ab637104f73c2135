"""bench compare's figures (matplotlib, the bench extra): accuracy and attention recall against
the budget, accuracy and perplexity against Mem%, decode time against device memory."""
from __future__ import annotations

from pathlib import Path

from ..atomic import atomic_open
from .compare_report import budget_cell, label, row_budget


def figures(result: dict, out: Path) -> list[Path]:
    try:
        import matplotlib
    except ImportError as e:
        raise ValueError("figures need matplotlib: pip install 'minikv[bench]'") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r.get("error")]
    written = []
    by_policy: dict[str, list[dict]] = {}
    for r in rows:
        by_policy.setdefault(label(r), []).append(r)

    def lines(ax, value, ylabel: str, title: str, error=lambda r: None):
        for name, rs in by_policy.items():
            pts = sorted((row_budget(r), value(r), error(r)) for r in rs
                         if row_budget(r) is not None and value(r) is not None)
            style = "--" if rs[0].get("source", "minikv") != "minikv" else "-"
            if pts and all(e is not None for _, _, e in pts):  # the 95% intervals as error bars
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], capsize=3, fmt=style, marker="o", label=name,
                            yerr=[[p[1] - p[2][0] for p in pts], [p[2][1] - p[1] for p in pts]])
            elif pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
            elif rs[0]["policy"] == "full" and value(rs[0]) is not None:
                ax.axhline(value(rs[0]), color="black", ls=":", label=f"{name} (all tokens)")
            elif value(rs[0]) is not None and rs[0].get("kv_mean_tokens"):  # no budget: where its memory went
                ax.plot([rs[0]["kv_mean_tokens"]], [value(rs[0])], "*", ms=12, label=f"{name} (mean KV used)")
        ax.set_xscale("log", base=2)
        budgets = sorted({row_budget(r) for r in rows if row_budget(r) is not None})
        if budgets:
            ax.set_xticks(budgets, [str(b) for b in budgets])
            ax.minorticks_off()
        ax.set_xlabel("budget: tokens per KV head on the device")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        _legend(ax)

    s = result.get("settings", {})
    if any(r.get("mean") is not None for r in rows):
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        lines(ax, lambda r: r.get("mean"), "mean score (string_match_all, %), 95% interval",
              f"Accuracy against budget, RULER-style suite at {s.get('length', '?')} tokens",
              error=lambda r: r.get("mean_ci"))
        written.append(_save(fig, out / "accuracy.png", plt))

    def against_memory(ax, curves: dict, ylabel: str, title: str):
        """One line per policy: (Mem%, value, 95% interval or None) points."""
        for name, pts in curves.items():
            style = "--" if by_policy[name][0].get("source", "minikv") != "minikv" else "-"
            if all(p[2] is not None for p in pts):
                ax.errorbar([p[0] for p in pts], [p[1] for p in pts], capsize=3, fmt=style, marker="o", label=name,
                            yerr=[[p[1] - p[2][0] for p in pts], [p[2][1] - p[1] for p in pts]])
            else:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=name)
        ax.set_xscale("log")
        ax.set_xlabel("Mem%: KV attention reads on the device, mean, % of full KV (log scale)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        _legend(ax)

    curves = memory_curves(rows)
    if curves["accuracy"]:
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        against_memory(ax, curves["accuracy"], "mean score (%), 95% interval",
                       f"Accuracy against memory at {s.get('length', '?')} tokens")
        written.append(_save(fig, out / "accuracy_mem.png", plt))
    if len(curves["ppl"]) > 1:
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        against_memory(ax, curves["ppl"], "perplexity / full KV's (log scale)",
                       f"Perplexity against memory, {s.get('long_prompt', '?')}-token prompt + "
                       f"{s.get('long_steps', '?')} tokens")
        ax.set_yscale("log")  # 0.9x and 1.2x stay apart beside a policy at 15x
        written.append(_save(fig, out / "ppl_mem.png", plt))
    pts = [(r, r["long"]) for r in rows if r.get("long") and r.get("tpot_ratio")]
    if pts:
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        for name, rs in by_policy.items():
            mine = [(100 * r["long"]["kv_share_peak"], r["tpot_ratio"], budget_cell(r)) for r in rs
                    if r.get("long") and r.get("tpot_ratio") and r["long"].get("kv_share_peak") is not None]
            if mine:
                ax.scatter([m[0] for m in mine], [m[1] for m in mine], label=name)
                for x, y, b in mine:
                    ax.annotate(b, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
        ax.set_xlabel(f"peak device KV, % of full KV ({s.get('long_prompt', '?')}-token prompt)")
        ax.set_ylabel("time per output token / full KV's")
        ax.set_title("Decode time against device memory at the long prompt")
        ax.grid(alpha=0.3)
        _legend(ax)
        written.append(_save(fig, out / "tpot_memory.png", plt))
    if any(r.get("recall") is not None for r in rows):
        fig, ax = plt.subplots(figsize=(9.5, 4.5))
        lines(ax, lambda r: r.get("recall"), "attention recall (share of full attention's mass)",
              "Attention recall against budget")
        oracle = sorted((int(b), v) for b, v in result.get("oracle", {}).items())
        if oracle:
            ax.plot(*zip(*oracle), "k--", marker="x", label="oracle: best top-b tokens")
            _legend(ax)
        written.append(_save(fig, out / "recall.png", plt))
    return written


def memory_curves(rows: list[dict]) -> dict[str, dict[str, list[tuple]]]:
    """Per policy (label), sorted by Mem%: "accuracy" points (Mem%, mean score, its 95% interval)
    of the task suite, and "ppl" points (Mem% of the long pass, perplexity / full KV's, None)."""
    full_ppl = next((r["long"]["ppl"] for r in rows if r["policy"] == "full" and (r.get("long") or {}).get("ppl")), None)
    out: dict[str, dict[str, list[tuple]]] = {"accuracy": {}, "ppl": {}}
    for r in rows:
        if r.get("mean") is not None and r.get("kv_share_mean"):
            out["accuracy"].setdefault(label(r), []).append((100 * r["kv_share_mean"], r["mean"], r.get("mean_ci")))
        long = r.get("long") or {}
        if full_ppl and long.get("ppl") and long.get("kv_share_mean"):
            out["ppl"].setdefault(label(r), []).append((100 * long["kv_share_mean"], long["ppl"] / full_ppl, None))
    return {kind: {name: sorted(pts) for name, pts in curves.items()} for kind, curves in out.items()}


def _legend(ax) -> None:
    # beside the axes, not over them: with a dozen rows a legend inside hides points
    ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _save(fig, path: Path, plt) -> Path:
    fig.tight_layout()
    with atomic_open(path, "wb") as f:  # a failed write leaves the previous figure whole
        fig.savefig(f, format=path.suffix[1:], dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path

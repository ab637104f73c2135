"""The compare benchmark's output: derived numbers and Markdown tables (no model runs here; the
figures are compare_figures.py's).

    annotate(result)          per row: mean scores over the tasks full KV can do, TPOT ratio to full
    markdown(result) -> str   one table per task group, plus the long-prompt table
"""
from __future__ import annotations

from .intervals import mean_interval

GROUPS = [
    ("Retrieval: passkey and needles in a haystack", "retrieval",
     ["passkey", "niah_single_1", "niah_multikey_2", "niah_multikey_3", "niah_multivalue", "niah_multiquery"]),
    ("Multi-hop tracing and aggregation", "aggregation", ["vt", "cwe", "fwe"]),
]
WEAK = 20.0  # full KV below this on a task: the task measures nothing at this length


def _reference(rows: list[dict], source: str) -> dict | None:
    return next((r for r in rows if r.get("source") == source and r.get("policy") == "full" and not r.get("error")), None)


def base_task(key: str) -> str:
    return key.partition("@")[0]  # "niah_single_1@pydoc" -> "niah_single_1"


def _per_instance(r: dict) -> dict[str, list[float]]:
    """Each task's per-instance scores, from the row's answers (rows of older runs have none)."""
    out: dict[str, list[float]] = {}
    for a in r.get("answers") or []:
        out.setdefault(a["task"], []).append(a["score"])
    return out


def _mean(r: dict, tasks: list[str]) -> tuple[float | None, list[float] | None]:
    scores = r.get("scores") or {}
    if not tasks:
        return None, None
    mean = sum(scores[t] for t in tasks) / len(tasks)
    each = _per_instance(r)
    ci = list(mean_interval({t: each[t] for t in tasks})) if all(each.get(t) for t in tasks) else None
    return mean, ci


def annotate(result: dict) -> None:
    rows = result["rows"]
    full = _reference(rows, "minikv") or _reference(rows, rows[0].get("source")) if rows else None
    weak = sorted(t for t, s in (full or {}).get("scores", {}).items() if s < WEAK)
    result["weak_tasks"] = weak
    for r in rows:
        scores = r.get("scores") or {}
        r["mean"], r["mean_ci"] = _mean(r, [t for t in scores if t not in weak])
        for _, key, tasks in GROUPS:
            mine = [t for t in scores if base_task(t) in tasks and t not in weak]
            r[f"mean_{key}"], r[f"mean_{key}_ci"] = _mean(r, mine)
        base = _reference(rows, r.get("source"))
        mine, theirs = (r.get("long") or {}).get("tpot_s"), (base or {}).get("long", {}).get("tpot_s")
        # against full KV of the row's own run when it says (rows merged from several runs)
        r["tpot_ratio"] = (r.get("long") or {}).get("tpot_x_full") or (mine / theirs if mine and theirs else None)


def label(r: dict) -> str:
    """The row's policy, with the parameters its spec sets besides the budget (its own column):
    two variants of one policy at one budget must not read alike."""
    if r.get("source", "minikv") != "minikv":
        return f"{r['policy']} ({r['source']})"
    in_column = row_budget(r) is not None  # the budget is in its own column
    extra = [p for p in _spec_params(r) if not (in_column and p.startswith("budget="))]
    return r["policy"] + (f":{','.join(extra)}" if extra else "")


def _spec_params(r: dict) -> list[str]:
    """The "key=value" items of the row's spec."""
    _, _, params = (r.get("spec") or r["policy"]).partition(":")
    return [p.strip() for p in params.split(",") if p.strip()]


def _cell(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def _score(value, ci, spec: str = ".0f") -> str:
    """A score with its 95% interval: '85 (64-95)'."""
    if value is None:
        return "-"
    return format(value, spec) + (f" ({ci[0]:.0f}-{ci[1]:.0f})" if ci else "")


def row_budget(r: dict) -> int | None:
    """The row's budget: the one compare swept, or the one its spec sets itself."""
    if r.get("budget") is not None or r.get("source", "minikv") != "minikv":
        return r.get("budget")
    found = [p.split("=", 1)[1].strip() for p in _spec_params(r) if p.startswith("budget=")]
    return int(found[0]) if found and found[0].isdigit() else None


def budget_cell(r: dict) -> str:
    """The budget column: the row's budget, "all" for full KV, "own" for a policy's own sizes."""
    if row_budget(r) is None:
        return "all" if r["policy"] == "full" else "own"
    return str(row_budget(r))


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" if i < 2 else "---:" for i in range(len(header))) + "|"]
    out += ["| " + " | ".join(line) + " |" for line in lines]
    return "\n".join(out)


def _instances(rows: list[dict], settings: dict) -> str:
    """Instances per task as measured (a run stopped early, or merged runs, may hold fewer than its
    seeds): '20', or '3-5' when tasks differ."""
    counts = {n for r in rows for n in (r.get("instances") or {}).values()}
    if not counts:
        return str(len(settings.get("seeds", [])))
    return str(min(counts)) if len(counts) == 1 else f"{min(counts)}-{max(counts)}"


def _runs(result: dict) -> str:
    """Where and how long the run, and each run merged into it, ran: grouped by machine."""
    runs = [(result.get("machine"), result.get("wall_s"))] + [(i.get("machine"), i.get("wall_s"))
                                                            for i in result.get("included", [])]
    groups: dict[str, list] = {}
    for m, wall in runs:
        m = m or {}
        where = f"{m.get('cpu', '?')}, {m.get('cpu_threads', '?')} thread(s), {m.get('gpu') or 'no GPU'}"
        groups.setdefault(where, []).append(wall)
    parts = []
    for where, walls in groups.items():
        known = sorted(w / 60 for w in walls if w is not None)
        if not known:
            wall = "wall time not recorded"
        elif len(known) == 1:
            wall = f"{known[0]:.1f} min wall"
        else:
            wall = f"{known[0]:.1f}-{known[-1]:.1f} min wall each, {sum(known):.0f} in all"
        unknown = len(walls) - len(known)
        if known and unknown:
            wall += f" ({unknown} not recorded)"
        parts.append(f"{where}: {len(walls)} run(s), {wall}" if len(walls) > 1 else f"{where}, {wall}")
    return "Run on " + "; ".join(parts) + "."


def markdown(result: dict) -> str:
    s, rows, weak = result.get("settings", {}), [r for r in result["rows"] if not r.get("error")], result.get("weak_tasks", [])
    parts = [f"Model {result.get('model', '?')}, task prompts of {s.get('length', '?')} tokens, "
             f"{_instances(rows, s)} instance(s) per task and haystack, greedy; a cell is the mean score "
             f"with its 95% interval in brackets (Wilson for hit-or-miss tasks, else a bootstrap over instances). "
             f"Haystack: RULER's repeated noise line, or the task's own distractors or word lists; a column "
             f"`task@pydoc` used natural text (pydoc_data) instead. "
             f"budget = tokens per KV head attention reads on the device ('own': the policy's defaults). "
             f"KV mean/peak: device tokens per KV head really read, over the tasks; Mem%: mean as a share of full KV. "
             f"TPOT x full: time per output token at the long prompt over full KV's, same run. " + _runs(result)]
    if result.get("complete") is False:  # saved on the way, or left by an interrupted run
        parts.insert(0, "**Partial run**: it stopped before its end (interrupted, or failed); the tables hold the "
                        "task instances measured until then, and a task or the long pass that never ran has no "
                        "column.")
    elif s.get("preset") == "smoke":
        long = " and the long pass" if "long" in s.get("tasks", ["long"]) else ""
        parts.insert(0, f"**Smoke run** (--preset smoke): every row ran through every task{long}, on "
                        "too few instances to rank anything; compare policies with --preset quick or full.")
    for title, key, tasks in GROUPS:
        keys = sorted({k for r in rows for k in (r.get("scores") or {})}, key=lambda k: (base_task(k), k))
        present = [k for t in tasks for k in keys if base_task(k) == t]
        if not present:
            continue
        header = ["policy", "budget"] + [t + (" †" if t in weak else "") for t in present] + \
                 ["mean", "KV mean", "KV peak", "Mem%", "TPOT x full"]
        lines = [[label(r), budget_cell(r)] + [_score((r.get("scores") or {}).get(t), (r.get("intervals") or {}).get(t))
                                          for t in present] +
                 [_score(r.get(f"mean_{key}"), r.get(f"mean_{key}_ci"), ".1f"), _cell(r.get("kv_mean_tokens"), ".0f"),
                  _cell(r.get("kv_peak_tokens"), ".0f"),
                  _cell(100 * r["kv_share_mean"] if r.get("kv_share_mean") is not None else None, ".0f"),
                  _cell(r.get("tpot_ratio"), ".2f")] for r in rows if r.get("scores")]
        parts.append(f"### {title}\n\n" + _table(header, lines))
    if weak:
        parts.append(f"† full KV scores below {WEAK:.0f} on this task at {s.get('length', '?')} tokens: "
                     f"it is shown but left out of the means.")
    long_rows = [r for r in rows if r.get("long") or r.get("recall") is not None]
    if long_rows or result.get("oracle"):
        header = ["policy", "budget", "PPL", "TPOT ms", "TPOT x full", "peak KV", "Mem%", "peak Mem%", "MB to device",
                  "MB to host", "attention recall"]
        lines = []
        for r in long_rows:
            lg = r.get("long") or {}
            lines.append([label(r), budget_cell(r), _cell(lg.get("ppl"), ".2f"),
                          _cell(1000 * lg["tpot_s"] if lg.get("tpot_s") else None), _cell(r.get("tpot_ratio"), ".2f"),
                          _cell(lg.get("device_tokens_peak"), ".0f"),
                          _cell(100 * lg["kv_share_mean"] if lg.get("kv_share_mean") is not None else None, ".0f"),
                          _cell(100 * lg["kv_share_peak"] if lg.get("kv_share_peak") is not None else None, ".0f"),
                          _cell(lg["bytes_to_device"] / 2**20 if lg.get("bytes_to_device") is not None else None),
                          _cell(lg["bytes_to_host"] / 2**20 if lg.get("bytes_to_host") is not None else None),
                          _cell(r.get("recall"), ".3f")])
        for b, rec in sorted(result.get("oracle", {}).items(), key=lambda kv: int(kv[0])):
            lines.append(["oracle (best top-b)", str(b)] + ["-"] * 8 + [_cell(rec, ".3f")])
        title = (f"### Long prompt: {s.get('long_prompt', '?')} tokens of pydoc_data.topics, then "
                 f"{s.get('long_steps', '?')} tokens fed one at a time" if any(r.get("long") for r in long_rows)
                 else "### Attention recall (no long pass in this run)")
        parts.append(title + "\n\n" + _table(header, lines) +
                     "\n\nPPL over the tokens fed one at a time; Mem%: the KV read after each forward of the "
                     "pass (the prefill's included), as a share of full KV; attention recall over every decode "
                     "step of the tasks (layers that report attended_indices); oracle: the best b tokens per KV "
                     "head under full KV's attention.")
    errors = [r for r in result["rows"] if r.get("error")]
    if errors:
        parts.append("Rows that did not run:\n\n" + "\n".join(f"- `{r['spec']}`: {r['error']}" for r in errors))
    return "\n\n".join(parts) + "\n"

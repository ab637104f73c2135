"""Merging compare runs (`--include`): runs split over processes or days make one table.

A row another run adds (another policy, kvpress's presses) is appended. A row both runs measured
(one policy at one budget, usually full KV) pools its task instances when the runs hold different
ones (other seeds, other tasks), as if one run had measured them all; when one run's instances
include the other's, the row measured on more of them is kept (two runs of other policies on one
prompt set each carry their full KV). Pooling needs the same model, prompt length and chat
template; any other overlap of instances is refused: an instance must not count twice.
"""
from __future__ import annotations

from pathlib import Path

from .intervals import interval

SAME = ("length", "chat")  # settings that must agree for two runs' instances to pool


def row_key(row: dict) -> tuple:
    return row.get("source", "minikv"), row.get("spec", row.get("policy")), row.get("budget")


def instance_keys(row: dict) -> set[tuple]:
    return {(a["task"], a["seed"]) for a in row.get("answers") or ()}


def merge(result: dict, extra: dict, path: str) -> None:
    """Merge the rows of `extra` (read from `path`) into `result`, in place."""
    rows = {row_key(r): r for r in result["rows"]}
    n_full = [len(instance_keys(full_row(res))) for res in (result, extra)]  # the oracle's weights
    how = {}  # row key -> "pooled" or "replaced"
    for row in extra["rows"]:
        row.setdefault("source", extra.get("source", Path(path).stem))
        mine = rows.get(row_key(row))
        if mine is None:
            result["rows"].append(row)
            continue
        have, new = instance_keys(mine), instance_keys(row)
        if new <= have:  # the same prompts measured again (another run's full KV), or fewer
            continue
        if have & new and not have < new:
            raise ValueError(f"{path}: row {row_key(row)[1]} measured {len(have & new)} of the same task instances "
                             "as an earlier run, and others besides: pool only runs over different seeds or tasks")
        check_poolable(result, extra, path)
        if have & new or not have:  # it holds every instance of the first run's row, and more
            mine.clear()
            mine.update(row)
            how[row_key(row)] = "replaced"
        else:
            pool(mine, row)
            how[row_key(row)] = "pooled"
    if how:
        merge_settings(result["settings"], extra.get("settings") or {})
    full = how.get(row_key(full_row(result)))
    if full == "pooled":
        result["oracle"] = pool_oracle(result.get("oracle") or {}, extra.get("oracle") or {}, *n_full)
    elif full == "replaced":  # the oracle goes with the full KV row it was measured on
        result["oracle"] = extra.get("oracle") or {}


def full_row(result: dict) -> dict:
    return next((r for r in result["rows"] if r.get("spec") == "full" and r.get("source", "minikv") == "minikv"), {})


def check_poolable(result: dict, extra: dict, path: str) -> None:
    if result.get("model") != extra.get("model"):
        raise ValueError(f"{path}: measured model {extra.get('model')!r}, this run {result.get('model')!r}: "
                         "rows of different models do not pool")
    mine, theirs = result.get("settings") or {}, extra.get("settings") or {}
    for key in SAME:
        if mine.get(key) != theirs.get(key):
            raise ValueError(f"{path}: {key} {theirs.get(key)!r}, this run {mine.get(key)!r}: its instances do not "
                             "pool with this run's")


def pool(mine: dict, other: dict) -> None:
    """Pool `other`'s instances into `mine` (same policy and budget, different instances)."""
    if mine.get("error") or other.get("error"):
        mine["error"] = mine.get("error") or other.get("error")
    # weights: the samples each run averaged over, where it recorded them (else its instances)
    a, b = len(mine.get("answers") or ()), len(other.get("answers") or ())
    wa, wb = mine.get("kv_samples", a), other.get("kv_samples", b)
    device = mine["kv_mean_tokens"] * wa + other["kv_mean_tokens"] * wb
    seq_a = mine.get("seq_tokens", mine["kv_mean_tokens"] * wa / mine["kv_share_mean"])
    seq_b = other.get("seq_tokens", other["kv_mean_tokens"] * wb / other["kv_share_mean"])
    mine["kv_mean_tokens"] = device / (wa + wb)
    mine["kv_share_mean"] = device / (seq_a + seq_b)
    mine["kv_samples"], mine["seq_tokens"] = wa + wb, seq_a + seq_b
    mine["kv_peak_tokens"] = max(mine["kv_peak_tokens"], other["kv_peak_tokens"])
    mine["kv_share_peak"] = max(mine["kv_share_peak"], other["kv_share_peak"])
    ra, rb = mine.get("recall_steps", a), other.get("recall_steps", b)
    if mine.get("recall") is not None and other.get("recall") is not None:
        mine["recall"] = (mine["recall"] * ra + other["recall"] * rb) / (ra + rb)
        mine["recall_steps"] = ra + rb
    if other.get("long") and not mine.get("long"):
        mine["long"] = other["long"]
    mine["answers"] = mine["answers"] + other["answers"]
    by_task: dict[str, list[float]] = {}
    for answer in mine["answers"]:
        by_task.setdefault(answer["task"], []).append(answer["score"])
    mine["scores"] = {t: sum(v) / len(v) for t, v in by_task.items()}
    mine["intervals"] = {t: list(interval(v)) for t, v in by_task.items()}
    mine["instances"] = {t: len(v) for t, v in by_task.items()}


def merge_settings(mine: dict, theirs: dict) -> None:
    mine["tasks"] = list(dict.fromkeys((mine.get("tasks") or []) + (theirs.get("tasks") or [])))
    for key in ("seeds", "budgets", "haystacks"):
        mine[key] = sorted(set(mine.get(key) or ()) | set(theirs.get(key) or ()))


def pool_oracle(mine: dict, theirs: dict, n_mine: int, n_theirs: int) -> dict:
    """The oracle recall at each budget (a mean over full KV's instances), weighted by instances."""
    out = dict(mine)
    for budget, value in theirs.items():
        out[budget] = (mine[budget] * n_mine + value * n_theirs) / (n_mine + n_theirs) if budget in mine else value
    return out

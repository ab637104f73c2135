"""gpu-check's report: rows printed as they come and written to its JSON file after each, and the
time share of each part (bench/gpu_check.py)."""
from __future__ import annotations

import sys
import time

from .common import print_table, write_json


class Report:
    """The rows of every part, printed one line each as they come and written to `path` (JSON)
    after each, so that a run stopped at any point leaves what it measured; each part may start
    rows for budget[part] seconds from its first row."""

    def __init__(self, sizes, path: str | None, quick: bool = False):
        self.sizes, self.path, self.start, self.part_start = sizes, path, time.monotonic(), {}
        self.data = {"quick": quick, "ok": True, "complete": True, "not_run": [], "notes": {}}

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def out_of_time(self, part: str, what: str) -> bool:
        began = self.part_start.setdefault(part, time.monotonic())
        limit = self.sizes.budget.get(part)
        if limit is None or time.monotonic() - began < limit:
            return False
        self.data["complete"] = False
        self.data["not_run"].append(f"{part}: {what} and after (its {limit} s were spent)")
        print(f"[{self.elapsed():5.0f} s] {part}: out of its {limit} s, not run from {what} on", flush=True)
        self.save()
        return True

    def note(self, part: str, **facts) -> None:
        self.data["notes"][part] = facts
        print(f"[{self.elapsed():5.0f} s] {part}: " + ", ".join(f"{k} {v}" for k, v in facts.items()), flush=True)
        self.save()

    def guarded(self, fn, **keys) -> dict:
        """keys | fn(), or keys and the error of fn (a failed row: the run goes on to the next)."""
        try:
            return keys | fn()
        except Exception as err:  # noqa: BLE001  (reported in the row, which fails the check)
            return keys | {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:300]}

    def add(self, part: str, row: dict) -> dict:
        self.data.setdefault(part, []).append(row)
        self.data["ok"] = self.data["ok"] and row.get("ok", True)
        shown = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items())
        print(f"[{self.elapsed():5.0f} s] {part}: {shown}", flush=True)
        self.save()
        return row

    def table(self, part: str, columns, title: str) -> None:
        print_table(self.data.get(part, []), columns, title=title)
        sys.stdout.flush()

    def save(self) -> None:
        self.data["elapsed_s"] = self.elapsed()
        write_json(self.path, self.data)

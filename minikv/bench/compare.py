"""compare: every policy at every budget, one model, one machine, one run: accuracy, memory, speed.

    python -m minikv.bench compare --threads 1 --out compare/            # --preset quick
    python -m minikv.bench compare --preset full --threads 1 --out compare/ --include kvpress.json
    python -m minikv.bench compare --policy freekv --budget 128 --tasks niah_single_1 vt
    python -m minikv.bench compare --from compare/compare.json --include kvpress.json --out compare/

Every registered policy runs (full is the reference and always runs). A policy that takes a
`budget` parameter runs once per --budget (tokens per KV head that attention reads on the device);
one without (softfreeze) runs once at its defaults, and its row reports the memory it really used.
Per row, over the task suite (RULER-style, generated offline at --length tokens, see
minikv/bench/tasks; greedy decoding, chat template):
  scores    RULER's string_match_all per task, in percent; `mean` over the tasks where full KV
            scores at least 20 (a task full KV fails at this length measures nothing: marked)
  KV        device KV attention really read (tokens per KV head, mean over layers), sampled after
            every forward of every task: mean and peak, and Mem% = mean as a share of full KV
  recall    for policies whose layers report attended_indices(): the share of full attention's
            mass on the tokens they read (recall_probe.py); `oracle` rows: the best top-b
            selection, on full KV's attention
  long      one prefill of --long-prompt tokens of pydoc_data.topics, then --long-steps tokens fed
            one at a time: TPOT (mean step), its ratio to full's (same run), peak device KV, bytes
            moved between tiers, and the perplexity of those tokens (the cache decoding sees)
Prompt by prompt, every row runs on one shared prefill where its policy allows (compare_run.py),
and the long pass runs all rows in lockstep, so the TPOT ratios hold on a machine whose load
drifts. Writes Markdown tables (stdout and --out/compare.md), --out/compare.json (every number,
the machine) and the figures (--out/*.png, matplotlib). --include FILE.json merges rows of another
run of the same schema: reference/compare_kvpress.py writes kvpress's, marked by their source; a
second minikv run (other --policy) adds its rows, each keeping its TPOT ratio to its own full KV;
a row both runs measured on different instances (a run split by seeds or tasks) pools them
(compare_merge.py).
"""
from __future__ import annotations

import gc
import json
import math
import sys
import time
from pathlib import Path

import torch

from ..policies import available, make
from ..policies.base import _REGISTRY, parameters
from . import compare_report as report
from .recall_probe import renumbers_positions
from .common import add_common_arguments, environment, load_model, text_ids
from .compare_merge import merge
from .compare_run import Bound, answer, bind, lockstep_long_pass, prefill_all
from .passkey import with_budget
from .intervals import interval
from .tasks import HAYSTACKS, haystacks, make_instance, string_match_all, task_names

COMMAND = "compare"
PRESETS = {
    # quick: about 2 CPU-minutes per row on one thread (README: measured time)
    "quick": {"length": 1024, "seeds": [0, 1, 2], "haystacks": ["noise"], "long_prompt": 2048, "long_steps": 32},
    # full: what the README's table shows; four times the quick preset's prompt length, 20 instances
    # per task and haystack, so that a 95% interval is about +-20 points at worst, not +-50
    "full": {"length": 4096, "seeds": list(range(20)), "haystacks": ["noise", "pydoc"], "long_prompt": 8000,
             "long_steps": 64},
}
BUDGETS = [64, 128, 256, 512]


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="sizes of the run (default quick)")
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: every registered policy)")
    p.add_argument("--budget", type=int, action="append", help=f"budget, repeatable (default {BUDGETS})")
    p.add_argument("--tasks", nargs="+", help=f"task subset (default all): {' '.join(task_names())} long")
    p.add_argument("--length", type=int, help="task prompt length in tokens (preset's)")
    p.add_argument("--seeds", type=int, nargs="+", help="task instances per task, by seed (preset's)")
    p.add_argument("--haystack", nargs="+", choices=HAYSTACKS,
                   help="haystacks of the tasks that offer a choice: noise (RULER's repeated line) and/or pydoc "
                        "(natural text); results name a pydoc column task@pydoc (preset's)")
    p.add_argument("--long-prompt", type=int, help="prompt tokens of the long pass (preset's)")
    p.add_argument("--long-steps", type=int, help="tokens fed one at a time after it (preset's)")
    p.add_argument("--no-chat", action="store_true", help="plain prompts, no chat template")
    p.add_argument("--include", action="append", default=[], metavar="FILE.json", help="merge rows of another run")
    p.add_argument("--from", dest="from_json", metavar="FILE.json", help="render a saved run instead of running")
    p.add_argument("--out", metavar="DIR", help="write compare.md, compare.json and the figures here")
    add_common_arguments(p)


# -- what runs ---------------------------------------------------------------------------------


def configs(specs: list[str] | None, budgets: list[int]) -> list[dict]:
    """(spec, policy name, budget) per row: full first, a row per budget for policies taking one."""
    rows = [{"spec": "full", "policy": "full", "budget": None}]
    for spec in specs or available():
        name = spec.partition(":")[0].strip()
        if name not in _REGISTRY:
            raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
        make(spec)  # a bad parameter fails now, not after an hour
        takes = "budget" in parameters(_REGISTRY[name]) and "budget=" not in spec.replace(" ", "")
        for b in budgets if takes else [None]:
            s = with_budget(spec, b)
            if all(r["spec"] != s for r in rows):
                rows.append({"spec": s, "policy": name, "budget": b})
    return rows


class Progress:
    """Work done / to do, weighted by tokens processed, with an ETA, on stderr."""

    def __init__(self, total: float):
        self.total, self.done, self.t0 = total, 0.0, time.perf_counter()

    def step(self, cost: float, message: str) -> None:
        self.done += cost
        elapsed = time.perf_counter() - self.t0
        eta = elapsed * (self.total - self.done) / self.done if self.done else float("nan")
        print(f"[{100 * self.done / self.total:5.1f}%  {fmt_time(elapsed)} elapsed, ETA {fmt_time(eta)}] {message}",
              file=sys.stderr, flush=True)


def fmt_time(s: float) -> str:
    return "?" if not math.isfinite(s) else f"{int(s // 60)}m{int(s % 60):02d}s"


def task_cost(inst, n_rows: int, n_own_prefill: int) -> float:
    # a decode step costs about 20 prompt tokens on a CPU; one shared prefill, one per other row
    return inst.length * (1 + n_own_prefill) + 20 * inst.max_new_tokens * n_rows


def own_prefills(cfgs: list[dict]) -> int:
    """Rows whose policy cannot share the prefill (it renumbers positions: streaming)."""
    return sum(renumbers_positions(make(c["policy"])) for c in cfgs)  # a class's trait: default parameters


# -- the run -----------------------------------------------------------------------------------


class Tally:
    """One row's task results, gathered prompt by prompt."""

    def __init__(self):
        self.scores: dict[str, list[float]] = {}
        self.answers, self.device, self.seq = [], [], []
        self.recall_sum = self.recall_n = 0.0
        self.oracle: dict[int, list[float]] = {}

    def add(self, inst, text: str, b) -> float:
        score = string_match_all([text], [inst.answers])
        self.scores.setdefault(inst.key, []).append(score)
        self.answers.append({"task": inst.key, "seed": inst.seed, "haystack": inst.haystack, "answer": text,
                             "score": score})
        self.device += b.device
        self.seq += b.seq
        if b.probe is not None and b.probe.recall is not None:
            self.recall_sum += b.probe.sum
            self.recall_n += b.probe.count
        for budget, r in (b.probe.oracle.items() if b.probe is not None else ()):
            self.oracle.setdefault(budget, []).append(r)
        return score

    def summary(self) -> dict:
        if not self.device:
            return {}
        shares = [d / s for d, s in zip(self.device, self.seq)]
        return {"scores": {t: sum(v) / len(v) for t, v in self.scores.items()},
                "intervals": {t: list(interval(v)) for t, v in self.scores.items()},
                "instances": {t: len(v) for t, v in self.scores.items()}, "answers": self.answers,
                "kv_mean_tokens": sum(self.device) / len(self.device), "kv_peak_tokens": max(self.device),
                "kv_samples": len(self.device), "seq_tokens": sum(self.seq), "recall_steps": self.recall_n,
                "kv_share_mean": sum(self.device) / sum(self.seq), "kv_share_peak": max(shares),
                "recall": self.recall_sum / self.recall_n if self.recall_n else None,
                "oracle": {b: sum(v) / len(v) for b, v in self.oracle.items()}}


def bind_rows(model, rows: list[dict], max_len: int, oracle_budgets, probe: bool) -> dict[int, Bound]:
    """Bind every row not failed yet; a policy refusing its budget or this length fails its row only."""
    bound = {}
    for i, row in enumerate(rows):
        if row["error"] is None:
            try:
                budgets = oracle_budgets if row["spec"] == "full" else ()
                bound[i] = bind(model, row["spec"], max_len, budgets, probe)
            except (ValueError, RuntimeError) as e:
                fail(row, e)
    return bound


def fail(row: dict, e: Exception) -> None:
    row["error"] = f"{type(e).__name__}: {e}"
    print(f"  {row['spec']}: {row['error']}", file=sys.stderr, flush=True)


def prefill_rows(model, rows, bound: dict[int, Bound], ids, max_len, oracle_budgets, probe) -> dict[int, torch.Tensor]:
    keys = list(bound)
    live = [bound[i] for i in keys]

    def rebind(j):
        return bind(model, rows[keys[j]]["spec"], max_len, oracle_budgets if rows[keys[j]]["spec"] == "full" else (), probe)

    logits = prefill_all(model, live, ids, rebind)
    bound.update(zip(keys, live))  # rebinding replaced some
    return dict(zip(keys, logits))


def run_compare(model, tok, args, settings: dict) -> dict:
    cfgs = configs(args.policy, settings["budgets"])
    instances = [make_instance(t, tok, settings["length"], s, chat=settings["chat"], haystack=h)
                 for t in settings["tasks"] if t != "long" for h in task_haystacks(t, settings["haystacks"])
                 for s in settings["seeds"]]
    long_ids = text_ids(tok, settings["long_prompt"] + settings["long_steps"]) if "long" in settings["tasks"] else None
    own = own_prefills(cfgs)
    long_cost = (settings["long_prompt"] * (1 + own) + 20 * settings["long_steps"] * len(cfgs)) if long_ids else 0
    progress = Progress(sum(task_cost(i, len(cfgs), own) for i in instances) + long_cost)
    print(f"compare: {len(cfgs)} rows x ({len(instances)} task instances{' + long pass' if long_ids else ''}), "
          "one prefill per prompt shared by the rows that can share it", file=sys.stderr, flush=True)
    rows = [{"source": "minikv", **cfg, "error": None} for cfg in cfgs]
    result = {"benchmark": "compare", "model": args.model, "settings": settings, "rows": rows, "oracle": {},
              "machine": machine()}
    tallies = [Tally() for _ in rows]
    oracle_budgets = settings["budgets"]
    for inst in instances:
        max_len = len(inst.ids) + inst.max_new_tokens
        bound = bind_rows(model, rows, max_len, oracle_budgets, probe=True)
        logits = prefill_rows(model, rows, bound, inst.ids, max_len, oracle_budgets, True)
        heard = []
        for i, b in bound.items():
            try:
                text = answer(model, tok, b, logits[i], len(inst.ids), inst.max_new_tokens)
            except (ValueError, RuntimeError) as e:  # one policy failing must not sink the run
                fail(rows[i], e)
                continue
            heard.append(f"{rows[i]['spec']} {tallies[i].add(inst, text, b):.0f}")
        del bound, logits
        gc.collect()  # a policy and its layers point at each other: free this prompt's caches now
        progress.step(task_cost(inst, len(cfgs), own), f"{inst.key} seed {inst.seed}: " + ", ".join(heard))
        for row, tally in zip(rows, tallies):
            row.update(tally.summary())
        if args.out:  # partial results survive a crash
            save(result, args)
    for row in rows:
        oracle = row.pop("oracle", {})
        if row["spec"] == "full":
            result["oracle"] = oracle
    if long_ids:
        run_long_pass(model, rows, long_ids, settings["long_prompt"])
        progress.step(long_cost, "long pass: " + ", ".join(
            f"{r['spec']} {1000 * r['long']['tpot_s']:.0f} ms" for r in rows if r.get("long")))
    return result


def run_long_pass(model, rows: list[dict], ids: list[int], n_prompt: int) -> None:
    bound = bind_rows(model, rows, len(ids), (), probe=False)
    keys = list(bound)
    live = [bound[i] for i in keys]

    def rebind(j):
        return bind(model, rows[keys[j]]["spec"], len(ids), (), False)

    for i, stats in zip(keys, lockstep_long_pass(model, ids, n_prompt, live, rebind)):
        rows[i]["long"] = stats
    full = rows[0].get("long") if rows[0]["spec"] == "full" else None
    for row in rows:  # the ratio to this run's full KV, kept with the row when runs are merged
        if row.get("long") and full:
            row["long"]["tpot_x_full"] = row["long"]["tpot_s"] / full["tpot_s"]


def machine() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {**environment(), "cpu": cpu}


def save(result: dict, args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.json").write_text(json.dumps(result, indent=1))


def load_rows(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path} is not a compare JSON (no 'rows' list)")
    return data


def task_haystacks(task: str, asked: list[str]) -> list[str]:
    """The asked haystacks the task offers; a task with no choice runs once on its own ("noise"
    stands for it: make_instance's default)."""
    offered = [h for h in asked if h in haystacks(task)]
    return offered if set(haystacks(task)) & set(HAYSTACKS) else ["noise"]


def settings_of(args) -> dict:
    preset = PRESETS[args.preset]
    tasks = args.tasks or task_names() + ["long"]
    unknown = [t for t in tasks if t not in task_names() + ["long"]]
    if unknown:
        raise ValueError(f"unknown task(s) {', '.join(unknown)}; tasks: {' '.join(task_names())} long")
    budgets = args.budget or BUDGETS
    if any(b < 1 for b in budgets):
        raise ValueError("budgets must be positive")
    s = {"preset": args.preset, "tasks": tasks, "budgets": sorted(set(budgets)), "chat": not args.no_chat,
         "length": args.length or preset["length"], "seeds": args.seeds or preset["seeds"],
         "haystacks": args.haystack or preset["haystacks"],
         "long_prompt": args.long_prompt or preset["long_prompt"], "long_steps": args.long_steps or preset["long_steps"]}
    if s["long_steps"] < 2:
        raise ValueError("--long-steps must be at least 2")
    return s


def check(args) -> None:
    """The flags that need no model (python -m minikv.bench calls this before loading it)."""
    for path in args.include + ([args.from_json] if args.from_json else []):
        load_rows(path)
    if not args.from_json:
        configs(args.policy, settings_of(args)["budgets"])


def run(args) -> int:
    try:
        if args.from_json:
            result = load_rows(args.from_json)
        else:
            settings = settings_of(args)
            configs(args.policy, settings["budgets"])  # bad specs fail before the model loads
            model, tok = load_model(args)
            result = run_compare(model, tok, args, settings)
        for path in args.include:
            extra = load_rows(path)
            merge(result, extra, path)
            result.setdefault("included", []).append({"file": path, "machine": extra.get("machine"),
                                                      "settings": extra.get("settings")})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    report.annotate(result)
    text = report.markdown(result)
    print(text)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.out:
        save(result, args)
        (Path(args.out) / "compare.md").write_text(text)
        report.figures(result, Path(args.out))
    return 0

"""compare: every policy at every budget, one model, one machine, one run: accuracy, memory, speed.

    python -m minikv.bench compare --threads 1 --out compare/            # --preset quick
    python -m minikv.bench compare --preset full --threads 1 --out compare/ --include kvpress.json
    python -m minikv.bench compare --policy freekv --budget 128 --tasks niah_single_1 vt
    python -m minikv.bench compare --from compare/compare.json --include kvpress.json --out compare/
    python -m minikv.bench compare --import my_policy --policy mine --preset smoke --threads 1

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

import json
import sys
from pathlib import Path

from ..atomic import atomic_write
from ..cli import dumps, interrupted

from ..policies import available, make
from ..policies.base import _REGISTRY, parameters
from . import compare_report as report
from .common import add_common_arguments, environment, load_model, text_ids
from .compare_figures import figures
from .compare_merge import merge
from .compare_run import run_rows
from .passkey import with_budget
from .tasks import HAYSTACKS, haystacks, make_instance, task_names

COMMAND = "compare"
OUTPUT_DIRS = ("out",)  # --out is a directory (python -m minikv.bench checks it before the model loads)
PRESETS = {
    # quick: about 2 CPU-minutes per row on one thread (README: measured time)
    "quick": {"length": 1024, "seeds": [0, 1, 2], "haystacks": ["noise"], "long_prompt": 2048, "long_steps": 32},
    # full: what docs/compare.md's tables show; four times the quick preset's prompt length, 20 instances
    # per task and haystack, so that a 95% interval is about +-20 points at worst, not +-50
    "full": {"length": 4096, "seeds": list(range(20)), "haystacks": ["noise", "pydoc"], "long_prompt": 8000,
             "long_steps": 64},
    # smoke: does a new policy run through every task and the long pass? About a minute per row on one
    # thread; two instances per task rank nothing (its output says so)
    "smoke": {"length": 768, "seeds": [0, 1], "haystacks": ["noise"], "long_prompt": 1024, "long_steps": 16,
              "budgets": [128]},
}
BUDGETS = [64, 128, 256, 512]


def add_arguments(p) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="quick", help="sizes of the run (default quick)")
    p.add_argument("--policy", action="append", help="policy spec, repeatable (default: every registered policy)")
    p.add_argument("--budget", type=int, action="append",
                   help=f"budget, repeatable (default {BUDGETS}; --preset smoke: {PRESETS['smoke']['budgets']})")
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


# -- the run -----------------------------------------------------------------------------------


def run_compare(model, tok, args, settings: dict) -> dict:
    cfgs = configs(args.policy, settings["budgets"])
    instances = [make_instance(t, tok, settings["length"], s, chat=settings["chat"], haystack=h)
                 for t in settings["tasks"] if t != "long" for h in task_haystacks(t, settings["haystacks"])
                 for s in settings["seeds"]]
    long_ids = text_ids(tok, settings["long_prompt"] + settings["long_steps"]) if "long" in settings["tasks"] else None
    # "complete": false until every prompt and the long pass ran: a file saved on the way (or left
    # by an interrupted run) says it is partial, and --from renders it as such
    result = {"benchmark": "compare", "model": args.model, "settings": settings, "complete": False,
              "rows": [{"source": "minikv", **cfg, "error": None} for cfg in cfgs], "oracle": {},
              "machine": machine()}
    saves = []

    def saved():  # partial results survive a crash, prompt by prompt
        try:
            save(result, args)
        except OSError as err:  # a full disk: the last save is whole (atomic), say so
            raise type(err)(err.errno, f"{err.strerror}; {where_saved(args, bool(saves), 'before it')}") from None
        saves.append(True)

    try:
        run_rows(model, tok, result, instances, long_ids, settings["long_prompt"], saved=saved)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(where_saved(args, bool(saves))) from None
    result["complete"] = True
    if all(row["error"] for row in result["rows"]):
        raise ValueError(f"no row ran, every policy failed (first: {result['rows'][0]['spec']}, "
                         f"{result['rows'][0]['error']})")
    return result


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


def saved_paths(args) -> list[str]:
    """Where the run's JSON goes: --out DIR/compare.json and --json FILE, as given."""
    return ([str(Path(args.out) / "compare.json")] if args.out else []) + ([args.json] if args.json else [])


def where_saved(args, any_saved: bool, when: str = "so far") -> str:
    """For the line an interrupt (or a failed save) prints: where the rows measured so far are."""
    if not saved_paths(args):
        return "nothing was saved: --out DIR keeps the rows as they are measured"
    if not any_saved:
        return "no prompt was finished, nothing was saved"
    return f"the rows measured {when} are in {' and '.join(saved_paths(args))}"


def save(result: dict, args) -> None:
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
    for path in saved_paths(args):
        atomic_write(path, dumps(result, indent=1))  # a failed save leaves the last one whole


def load_rows(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f"{path} is not a compare JSON (no 'rows' list)")
    for i, row in enumerate(data["rows"]):
        if not isinstance(row, dict) or not isinstance(row.get("policy"), str):
            raise ValueError(f"{path} is not a compare JSON: row {i} is {str(row)[:60]}, not an object with a "
                             "'policy' name")
    for key in ("settings", "oracle", "machine"):
        if not isinstance(data.get(key, {}), dict):
            raise ValueError(f"{path} is not a compare JSON: '{key}' is not an object")
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
    budgets = args.budget or preset.get("budgets", BUDGETS)
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
            if extra.get("complete") is False:  # a partial run merged in: the whole is partial
                result["complete"] = False
            result.setdefault("included", []).append({"file": path, "machine": extra.get("machine"),
                                                      "settings": extra.get("settings"),
                                                      "wall_s": extra.get("wall_s")})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        return interrupted(str(e))
    report.annotate(result)
    text = report.markdown(result)
    print(text)
    save(result, args)
    if args.out:
        atomic_write(Path(args.out) / "compare.md", text)
        figures(result, Path(args.out))
    return 0

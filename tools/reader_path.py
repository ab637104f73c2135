"""The lines a reader follows for one decode step, per policy, with `backend=reference`.

    python tools/reader_path.py                 # the working tree: per policy, shared + its own
    python tools/reader_path.py --files         # and each file's count
    python tools/reader_path.py --before REV    # REV's path (this file as it was at REV) beside it

The rule: a reader who follows the reading guide (docs/reading.md) through one decode step opens
the files listed below, and reads each whole; a file counts every line it has (blank lines, comments and
docstrings included, as `wc -l` counts), once, however many calls lead into it. A kernel counts
by its readable form (kernels/<op>/reference.py); the fast forms (`*_fast.py`, kernels' fused.py,
the dispatch in kernels' __init__.py), the model's config and rotary tables, validation and
statistics modules are off the path: a reader can skip them on a first reading. So is what a
decode step does not run: work done once at bind (a policy's parameters and construction, synckv's
clustering read from its file) or at prefill (icecache's Algorithm 2 build, a paged store's prompt). SHARED is what
every policy's step goes through; each policy's list is what its own step adds. The lists follow
the layout: a change that moves a step to another file changes them with it.
"""
from __future__ import annotations

import argparse
import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# the generation loop, the model's forward and block, the contract, the tiers, the smallest policy
SHARED = ["minikv/generate/__init__.py", "minikv/models/decoder.py", "minikv/models/llama.py",
          "minikv/models/layers.py", "minikv/policies/contract.py", "minikv/policies/tiers.py",
          "minikv/policies/full.py", "minikv/kernels/decode_attention/reference.py"]
PAGED = ["minikv/policies/paged.py", "minikv/policies/pool.py"]
POLICIES = {
    "h2o": ["minikv/policies/h2o.py"],
    "streaming": ["minikv/policies/streaming.py", "minikv/kernels/rope_delta/reference.py"],
    "softfreeze": ["minikv/policies/softfreeze/schedule.py", "minikv/policies/softfreeze/policy.py",
                   "minikv/policies/softfreeze/recovery.py", "minikv/kernels/attention_relevance/reference.py"],
    "freekv": ["minikv/policies/freekv.py", "minikv/policies/host_pages.py", *PAGED,
               "minikv/kernels/page_scores/reference.py", "minikv/kernels/paged_attention/reference.py",
               "minikv/kernels/page_layout/reference.py", "minikv/kernels/page_gather/reference.py"],
    "synckv": ["minikv/policies/synckv/policy.py", "minikv/policies/synckv/layer.py",
               "minikv/policies/synckv/bank.py", "minikv/policies/pool.py",
               "minikv/kernels/attention_topk/reference.py",
               "minikv/kernels/gathered_attention/reference.py"],
    "icecache": ["minikv/policies/icecache/layer.py", "minikv/policies/icecache/tree.py",
                 "minikv/policies/icecache/search.py", *PAGED, "minikv/kernels/paged_attention/reference.py",
                 "minikv/kernels/page_layout/reference.py", "minikv/kernels/page_gather/reference.py"],
}


def git_show(rev: str, path: str) -> str:
    done = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: {path} is not in {rev}: {done.stderr.strip()}")
    return done.stdout


def lists_at(rev: str) -> tuple[list[str], dict[str, list[str]]]:
    """SHARED and POLICIES as this file declared them at rev: its list and dict literals, evaluated
    in order (a later one may splice an earlier one, *PAGED), nothing else of it run."""
    env: dict = {}
    for node in ast.parse(git_show(rev, "tools/reader_path.py")).body:
        if (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
                and isinstance(node.value, (ast.List, ast.Dict))):
            env[node.targets[0].id] = eval(compile(ast.Expression(body=node.value), rev, "eval"), {}, env)  # noqa: S307
    return env["SHARED"], env["POLICIES"]


def counts(shared: list[str], policies: dict[str, list[str]], rev: str | None) -> dict[str, int]:
    """path -> lines, read from the working tree (rev None) or from git at rev."""
    paths = sorted(set(shared).union(*policies.values()))
    text = {p: git_show(rev, p) if rev else (ROOT / p).read_text() for p in paths}
    return {p: len(t.splitlines()) for p, t in text.items()}


def table(shared, policies, lines) -> dict[str, tuple[int, int]]:
    """policy -> (its own lines beyond the shared path, shared + its own); "shared" -> the path."""
    base = sum(lines[p] for p in shared)
    rows = {"shared": (base, base)}
    for name, own in policies.items():
        extra = sum(lines[p] for p in dict.fromkeys(own) if p not in shared)
        rows[name] = (extra, base + extra)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", action="store_true", help="also print each file's count")
    parser.add_argument("--before", metavar="REV", help="a git revision whose path to print beside the working tree's")
    args = parser.parse_args(argv)
    now = table(SHARED, POLICIES, lines := counts(SHARED, POLICIES, None))
    then = None
    if args.before:
        old_shared, old_policies = lists_at(args.before)
        then = table(old_shared, old_policies, old_lines := counts(old_shared, old_policies, args.before))
    head = "| path | lines beyond shared | with shared |" + (f" before ({args.before}) |" if then else "")
    print(head)
    print("| --- | ---: | ---: |" + (" ---: |" if then else ""))
    for name, (own, total) in now.items():
        before = f" {then[name][0]:,} / {then[name][1]:,} |" if then and name in then else (" |" if then else "")
        print(f"| {name} | {own:,} | {total:,} |{before}")
    if args.files:
        for title, table_lines, shared, policies in [("now", lines, SHARED, POLICIES)] + (
                [(f"at {args.before}", old_lines, old_shared, old_policies)] if then else []):
            print(f"\n{title}: shared " + ", ".join(f"{Path(p).relative_to('minikv')} {table_lines[p]}" for p in shared))
            for name, own in policies.items():
                print(f"  {name}: " + ", ".join(f"{Path(p).relative_to('minikv')} {table_lines[p]}"
                                               for p in own if p not in shared))
    return 0


if __name__ == "__main__":
    sys.exit(main())

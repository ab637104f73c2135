"""Planted mutants of icecache:paper's steps, each judged by one test file run alone
(docs/mutation.md, "icecache:paper's planted mutants").

    python tools/plant_icecache.py                       # every mutant against test_icecache_paper.py
    python tools/plant_icecache.py --only union-round-robin --tests tests/policies/test_icecache.py

Each mutant is one plausible wrong implementation of a paper step, written as a text replacement
in one module. For each, the repository's tracked files are copied under --work, the replacement
made (it must match exactly once), and each test file named by --tests runs alone there with
pytest -x. The run ends with one Markdown row per mutant: which files kill it.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ICE = "minikv/policies/icecache"
TESTS = ["tests/policies/test_icecache_paper.py"]

# name -> (what it breaks, module, the text, its replacement), or a list of (text, replacement)
MUTANTS = {
    "parent-farthest": (
        "wrong parents: the descent takes the farthest candidate of each node", f"{ICE}/pdci.py",
        "nxt[who] = children[sim.masked_fill(~cand, -math.inf).argmax(dim=1)]",
        "nxt[who] = children[sim.masked_fill(~cand, math.inf).argmin(dim=1)]"),
    "parent-exact": (
        "wrong parents: the exact nearest point one level up (the default's scan), not QUERY's descent",
        f"{ICE}/pdci.py",
        "    def _find_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:\n"
        "        return self._greedy_parents(level, keys, run)",
        "    def _find_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:\n"
        "        return DCIForest._find_parents(self, level, keys, run)"),
    "query-projection-negated": (
        "a negated query projection: -U.T_Q(q)", f"{ICE}/pdci.py",
        "return (q @ self.U[:, :-1].T) / q.norm(dim=-1, keepdim=True).clamp_min(1e-30)",
        "return -(q @ self.U[:, :-1].T) / q.norm(dim=-1, keepdim=True).clamp_min(1e-30)"),
    "query-unnormalised": (
        "T_Q(q) without its division by the norm of q", f"{ICE}/pdci.py",
        "return (q @ self.U[:, :-1].T) / q.norm(dim=-1, keepdim=True).clamp_min(1e-30)", "return q @ self.U[:, :-1].T"),
    "key-projection-missing": (
        "a missing projection: T_K without its last coordinate, sqrt(1 - k.k / c^2)", f"{ICE}/pdci.py",
        "self.U[:, -1].double() * tail[:, None]", "0 * tail[:, None]"),
    "pages-in-token-order": (
        "pages not clustered: a build cuts the keys in token order", f"{ICE}/tree.py",
        "        order = by_proj[self.parent[h, by_proj].argsort(stable=True)]  # grouped by parent, then projection\n"
        "        par = self.parent[h, order]",
        "        order = torch.arange(n)\n"
        "        par = torch.zeros(n, dtype=torch.int64)"),
    "union-round-robin": (
        "the union replaced by round-robin first k: each query head K pages, the first K distinct kept",
        f"{ICE}/policy.py",
        [("merge = merge_union if pol.gqa == \"union\" else merge_group", "merge = merge_group"),
         ("k = K // self.G if pol.gqa == \"union\" else K", "k = K")]),
    "promotion-counter": (
        "promotion deterministic: the counter (1 in 100, then 1 in 5) under promotion=random",
        f"{ICE}/policy.py",
        "shape[\"levels\"] = promotion_levels(policy.max_len, policy.ratio, promotion_stream(policy.seed, index))",
        "pass"),
    "promotion-every-1-over-r": (
        "promotion deterministic: every round(1 / r)-th point one level up", f"{ICE}/tree.py",
        "        while stream.random() < r:  # while Random(0, 1) < r: promote to the next higher level\n"
        "            level += 1",
        "        if (len(levels) + 1) % round(1 / r) == 0:\n"
        "            level += 1"),
    "one-composite": (
        "the P-DCI bounds of the first composite index only", f"{ICE}/pdci.py",
        "for l in range(forest.L):  # composite l's candidates", "for l in range(1):  # composite l's candidates"),
    "bound-min": (
        "the simple indices' bounds aggregated by min, not max (not a lower bound of the distance)",
        f"{ICE}/pdci.py",
        "bound = (forest.key_projections(h, ids) - pq).abs().view(-1, forest.L, forest.m).amax(dim=2)",
        "bound = (forest.key_projections(h, ids) - pq).abs().view(-1, forest.L, forest.m).amin(dim=2)"),
    "descent-level-fov": (
        "Algorithm 4's S <- S' replaced by the fov best of the level (the default's descent)",
        f"{ICE}/pdci.py",
        "        top = rank_in_node(node, -scores) < k  # each node's k best: S''",
        "        top = rank_in_node(torch.zeros_like(node), -scores) < k"),
    "flag-off": (
        "P takes only the last level's S' (Flag ignored)", f"{ICE}/pdci.py",
        "        best, best_score = torch.cat((best, ids)), torch.cat((best_score, scores))  # P <- P + S'",
        "        best, best_score = (ids, scores) if level == 1 else (best, best_score)"),
}


def plant(work: Path, module: str, edits: list[tuple[str, str]]) -> None:
    if work.exists():
        shutil.rmtree(work)
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, capture_output=True,
                           text=True, check=True).stdout.split()
    for f in files:
        if (ROOT / f).is_file():
            (work / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, work / f)
    text = (work / module).read_text()
    for old, new in edits:
        if text.count(old) != 1:
            raise SystemExit(f"error: the mutant's text occurs {text.count(old)} times in {module}, not once")
        text = text.replace(old, new)
    (work / module).write_text(text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", nargs="+", default=TESTS, help="test files, each run alone")
    p.add_argument("--only", nargs="+", choices=sorted(MUTANTS), help="these mutants only")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minikv-planted")
    args = p.parse_args()
    rows = []
    for name in args.only or MUTANTS:
        what, module, *edits = MUTANTS[name]
        plant(args.work, module, edits[0] if len(edits) == 1 else [tuple(edits)])  # a list, or one (old, new)
        killed = []
        for test in args.tests:
            run = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test],
                                 cwd=args.work, capture_output=True, text=True,
                                 env={**os.environ, "PYTHONPATH": str(args.work)})
            if run.returncode not in (0, 1):
                raise SystemExit(f"error: {test} under {name} exited {run.returncode}:\n{run.stdout[-2000:]}")
            if run.returncode == 1:  # the file, and the innermost line of the first failure
                failed = [line[1:].strip() for line in run.stdout.splitlines() if line.startswith(">")]
                killed.append(f"{Path(test).name} (`{failed[-1] if failed else 'error'}`)")
        rows.append(f"| `{name}` | {what} | {module.split('/')[-1]} | {', '.join(killed) or 'survives'} |")
        print(rows[-1], flush=True)
    print("\n| mutant | the wrong step | module | killed by (run alone; the line that failed) |\n"
          "| --- | --- | --- | --- |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Planted mutants of the paper steps against each policy's transcription test, run alone
(docs/mutation.md, "Planted mutants: each paper's wrong steps").

    python tools/paper_mutants.py                 # every mutant (minutes on two cores)
    python tools/paper_mutants.py synckv freekv   # the mutants of some policies
    python tools/paper_mutants.py --list          # the mutants, their edits and their test files

Each mutant is one plausible wrong implementation of a step of a paper, written as an edit of
the library: the exact text replaced, which must occur once (a tuple of texts and a tuple of
replacements: several edits of one file, all made). For each, a copy of the repository's tracked
files gets the edit and `pytest -x` runs the policy's tests/policies/test_<policy>_paper.py alone
on it: killed when the test fails. The run ends with one Markdown row per mutant; the exit code is
1 if a mutant survived or an edit no longer applies. A mutant may name another test instead
(freekv's group-consistent oracle in test_freekv.py).
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
P, K, ICE = "minikv/policies", "minikv/kernels", "minikv/policies/icecache"
ORACLE = "tests/policies/test_freekv.py::test_the_group_consistent_oracle_takes_each_heads_softmax_before_the_mean"
# policy -> [(the wrong step, file, text, replacement[, the test that judges it: default, the
# policy's test_<policy>_paper.py])]; text and replacement may be tuples (several edits)
MUTANTS = {
    "freekv": [
        ("group mean without the per-head softmax, against the group-consistent oracle",
         f"{K}/page_scores/reference.py", "reduced = (e / e.sum(-1, keepdim=True).clamp_min(1e-38)).sum(2) / G",
         "reduced = logits.sum(2) / G", ORACLE),
        ("group mean without the per-head softmax (mean of P_h)", f"{K}/page_scores/reference.py",
         "reduced = (e / e.sum(-1, keepdim=True).clamp_min(1e-38)).sum(2) / G",
         "reduced = logits.sum(2) / G"),
        ("drift test inverted (C_m >= tau corrects)", f"{P}/freekv.py",
         "return (sim.view(-1, self.G).sum(1) / self.G < self.policy.tau).tolist()",
         "return (sim.view(-1, self.G).sum(1) / self.G >= self.policy.tau).tolist()"),
        ("group max of the cosine instead of its mean", f"{P}/freekv.py",
         "return (sim.view(-1, self.G).sum(1) / self.G < self.policy.tau).tolist()",
         "return (sim.view(-1, self.G).amax(1) < self.policy.tau).tolist()"),
        ("Quest's bound with q and the box swapped (q_d lo_d for q_d > 0)", f"{K}/page_scores/reference.py",
         "raw = torch.bmm(qg.clamp_min(0), hi_t).add_(torch.bmm(qg.clamp_max(0), lo_t))",
         "raw = torch.bmm(qg.clamp_min(0), lo_t).add_(torch.bmm(qg.clamp_max(0), hi_t))"),
    ],
    "synckv": [
        ("anticipation period off by one (t mod m = 1)", f"{P}/synckv/layer.py",
         "elif self.step % self.policy.m == 0:", "elif self.step % self.policy.m == 1:"),
        ("anticipation one step late (t mod m = 0 counted from 0)", f"{P}/synckv/layer.py",
         "elif self.step % self.policy.m == 0:", "elif (self.step - 1) % self.policy.m == 0 and self.step > 1:"),
        ("Eq. 6 over the tokens before the current one only", f"{P}/synckv/layer.py",
         "self.fetch_dynamic(self.top_dynamic(q_r, lse_r, self.start))",
         "self.fetch_dynamic(self.top_dynamic(q_r, lse_r, self.start - 1))"),
        ("NR-heads read the new token (a window of one)", f"{P}/synckv/layer.py",
         "return self.window_tokens() if self.window else range(0)",
         "return self.window_tokens() if self.window else range(self.length - 1, self.length)"),
        ("Eq. 4 split reversed (the static set the less attended)", f"{P}/synckv/layer.py",
         "self.static[c], dyn = chosen[:self.k_static], chosen[self.k_static:]",
         "dyn, self.static[c] = chosen[:self.k_dyn], chosen[self.k_dyn:]"),
    ],
    "softfreeze": [
        ("Eq. 3 rounded instead of floored", f"{P}/softfreeze/schedule.py",
         "return torch.floor(torch.sqrt(c.double()) / k).long()",
         "return torch.round(torch.sqrt(c.double()) / k).long()"),
        ("Eq. 3 as ceil", f"{P}/softfreeze/schedule.py",
         "return torch.floor(torch.sqrt(c.double()) / k).long()",
         "return torch.ceil(torch.sqrt(c.double()) / k).long()"),
        ("Eq. 3 without the square root (linear growth)", f"{P}/softfreeze/schedule.py",
         "return torch.floor(torch.sqrt(c.double()) / k).long()",
         "return torch.floor(c.double() / k).long()"),
        ("window K one token short (line 3)", f"{P}/softfreeze/schedule.py",
         "low = A[(s < tau) & (A < self.n_tok - p.window)]",
         "low = A[(s < tau) & (A < self.n_tok - p.window + 1)]"),
    ],
    "streaming": [
        ("hard cap H dropped (Eq. 8 without min(., H))", f"{P}/streaming.py",
         "return min(max(L - max_drop, C), H)", "return max(L - max_drop, C)"),
        ("Max_Drop dropped (always down to C)", f"{P}/streaming.py",
         "return min(max(L - max_drop, C), H)", "return C"),
        ("lazy trigger off by one (overflow > R)", f"{P}/streaming.py",
         "if L - C < R:  # lines 9-11", "if L - C <= R:  # lines 9-11"),
        ("sinks not kept (line 17)", f"{P}/streaming.py",
         "S = min(p.sink, target)\n        n_recent, src", "S = 0\n        n_recent, src"),
    ],
    "h2o": [
        ("heavy hitters evicted instead of kept (the smallest F stay)", f"{P}/h2o.py",
         "ranked = score.masked_fill(recent, float(\"inf\"))", "ranked = (-score).masked_fill(recent, float(\"inf\"))"),
        ("scores not accumulated (this step's attention only)", f"{P}/h2o.py",
         "self.score[:, :n + 1] += w.view(Hkv, -1, n + 1).sum(dim=1)",
         "self.score[:, :n + 1] = w.view(Hkv, -1, n + 1).sum(dim=1)"),
        ("recent window not protected", f"{P}/h2o.py",
         "ranked = score.masked_fill(recent, float(\"inf\"))", "ranked = score"),
        ("GQA pooled by one query head", f"{P}/h2o.py",
         "self.score[:, :n + 1] += w.view(Hkv, -1, n + 1).sum(dim=1)",
         "self.score[:, :n + 1] += w.view(Hkv, -1, n + 1)[:, 0]"),
    ],
    "icecache": [
        ("wrong parents: the descent takes the farthest candidate of each node", f"{ICE}/pdci.py",
         "nxt[who] = children[sim.masked_fill(~cand, -math.inf).argmax(dim=1)]",
         "nxt[who] = children[sim.masked_fill(~cand, math.inf).argmin(dim=1)]"),
        ("wrong parents: the exact nearest point one level up (the default's scan), not QUERY's descent",
         f"{ICE}/pdci.py",
         "    def _find_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:\n"
         "        return self._greedy_parents(level, keys, run)",
         "    def _find_parents(self, level: int, keys: torch.Tensor, run: torch.Tensor) -> torch.Tensor:\n"
         "        return DCIForest._find_parents(self, level, keys, run)"),
        ("a negated query projection: -U.T_Q(q)", f"{ICE}/pdci.py",
         "return (q @ self.U[:, :-1].T) / q.norm(dim=-1, keepdim=True).clamp_min(1e-30)",
         "return -(q @ self.U[:, :-1].T) / q.norm(dim=-1, keepdim=True).clamp_min(1e-30)"),
        ("T_Q(q) without its division by the norm of q", f"{ICE}/pdci.py",
         "return (q @ self.U[:, :-1].T) / q.norm(dim=-1, keepdim=True).clamp_min(1e-30)",
         "return q @ self.U[:, :-1].T"),
        ("a missing projection: T_K without its last coordinate, sqrt(1 - k.k / c^2)", f"{ICE}/pdci.py",
         "self.U[:, -1].double() * tail[:, None]", "0 * tail[:, None]"),
        ("pages not clustered: a build cuts the keys in token order", f"{ICE}/build.py",
         "        order = by_proj[self.parent[h, by_proj].argsort(stable=True)]  # grouped by parent, then projection\n"
         "        par = self.parent[h, order]",
         "        order = torch.arange(n)\n"
         "        par = torch.zeros(n, dtype=torch.int64)"),
        ("the union replaced by round-robin first k: each query head K pages, the first K distinct kept",
         f"{ICE}/policy.py",
         ("merge=pdci.merge_union if union else search.merge_group,",
          "k=self.n_select // G if union else self.n_select,"),
         ("merge=search.merge_group,", "k=self.n_select,")),
        ("promotion deterministic: the counter (1 in 100, then 1 in 5) under promotion=random", f"{ICE}/policy.py",
         "shape[\"levels\"] = promotion_levels(self.max_len, self.ratio, promotion_stream(self.seed, index))", "pass"),
        ("promotion deterministic: every round(1 / r)-th point one level up", f"{ICE}/promotion.py",
         "        while stream.random() < r:  # while Random(0, 1) < r: promote to the next higher level\n"
         "            level += 1",
         "        if (len(levels) + 1) % round(1 / r) == 0:\n"
         "            level += 1"),
        ("the P-DCI bounds of the first composite index only", f"{ICE}/pdci.py",
         "for l in range(forest.L):  # composite l's candidates", "for l in range(1):  # composite l's candidates"),
        ("the simple indices' bounds aggregated by min, not max (not a lower bound of the distance)", f"{ICE}/pdci.py",
         "bound = (forest.key_projections(h, ids) - pq).abs().view(-1, forest.L, forest.m).amax(dim=2)",
         "bound = (forest.key_projections(h, ids) - pq).abs().view(-1, forest.L, forest.m).amin(dim=2)"),
        ("Algorithm 4's S <- S' replaced by the fov best of the level (the default's descent)", f"{ICE}/pdci.py",
         "        top = rank_in_node(node, -scores) < k  # each node's k best: S''",
         "        top = rank_in_node(torch.zeros_like(node), -scores) < k"),
        ("P takes only the last level's S' (Flag ignored)", f"{ICE}/pdci.py",
         "        best, best_score = torch.cat((best, ids)), torch.cat((best_score, scores))  # P <- P + S'",
         "        best, best_score = (ids, scores) if level == 1 else (best, best_score)"),
    ],
}


def copy_tree(dest: Path) -> None:
    """The repository's tracked and untracked-not-ignored files, copied to dest."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=ROOT, check=True,
                           capture_output=True, text=True).stdout.split("\n")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def run_one(work: Path, test: str, file: str, old: str | tuple, new: str | tuple) -> str:
    """'killed', 'survived' or 'stale' (a text no longer occurs once in file)."""
    target = work / file
    text = mutated = (ROOT / file).read_text()
    for o, n in zip(*((old, new) if isinstance(old, tuple) else ((old,), (new,)))):
        if mutated.count(o) != 1:
            return "stale"
        mutated = mutated.replace(o, n)
    target.write_text(mutated)
    try:
        env = {**os.environ, "PYTHONPATH": str(work), "OMP_NUM_THREADS": "1"}
        r = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", test], cwd=work,
                           env=env, capture_output=True, text=True)
        return "killed" if r.returncode == 1 else "survived" if r.returncode == 0 else f"error (pytest {r.returncode})"
    finally:
        target.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policies", nargs="*", help=f"some of {', '.join(MUTANTS)} (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    args = ap.parse_args(argv)
    bad = [p for p in args.policies if p not in MUTANTS]
    if bad:
        print(f"error: no mutants for {', '.join(bad)}; the policies are {', '.join(MUTANTS)}", file=sys.stderr)
        return 2
    chosen = args.policies or list(MUTANTS)
    if args.list:
        for policy in chosen:
            for step, file, old, new, *test in MUTANTS[policy]:
                print(f"{policy}: {step}\n  {file}: {old!r}\n  -> {new!r}" + (f"\n  judged by {test[0]}" if test else ""))
        return 0
    rows, failed = [], False
    with tempfile.TemporaryDirectory(prefix="minikv-paper-mutants-") as tmp:
        work = Path(tmp)
        copy_tree(work)
        for policy in chosen:
            for step, file, old, new, *test in MUTANTS[policy]:
                test = test[0] if test else f"tests/policies/test_{policy}_paper.py"
                status = run_one(work, test, file, old, new)
                failed |= status != "killed"
                rows.append(f"| {policy} | {step} | `{file}` | {test.split('/')[-1]} | {status} |")
                print(rows[-1], flush=True)
    print("\n| policy | the wrong step | edited | run alone | result |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

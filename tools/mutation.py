"""Mutation testing of the paper steps (docs/mutation.md): mutmut over the kernels' readable
references and the policies' readable modules, each scope against its own tests only.

    python tools/mutation.py                      # every scope (hours on two cores)
    python tools/mutation.py kernels streaming    # some scopes: a group name or a module name
    python tools/mutation.py --list               # the scopes, their files and tests

Each scope runs in its own copy of the repository under --work (default: minikv-mutation
in the system's temporary directory, tempfile.gettempdir()),
whose pyproject.toml gets a [tool.mutmut] section naming the scope's files and tests, so one
scope's run never reads another's tests. mutmut 3 (the `dev` extra) then runs, for each mutant,
only the tests that call the mutated function, in a child forked from a process that already
imported torch, with `-x`. The run ends with the kill rate per module (Markdown rows) and the
surviving mutants' diffs (written to --survivors).
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ["attention_relevance", "attention_topk", "dci_scores", "decode_attention", "gathered_attention",
           "page_gather", "page_layout", "page_scores", "paged_attention", "rope_delta"]
POL, T = "minikv/policies", "tests/policies"
# scope -> (modules to mutate, the tests that judge them: pytest arguments). A policy is judged by
# its transcription test (test_*_paper.py) and its tests on small random layers, not by its SmolLM2
# runs (minutes) nor its triton-backend runs (Triton's interpreter on the CPU: slow, and they judge
# the kernels, which their own scopes do); each policy scope's tests run in seconds.
NOT_MODELS = ["-k", "not smollm2 and not triton"]
# --help, written from the parameters' declarations (params.describe); full KV over a batch of
# prompts of different lengths (its ragged rows: on SmolLM2, the one model run the shared scope takes)
HELP = [f"tests/test_cli.py::test_generate_help_{t}" for t in
        ("lists_policies_defaults_and_the_same_max_new_tokens_as_the_api",
         "lists_every_parameter_with_its_bounds_and_meaning")]
RAGGED = ["tests/test_generate.py::test_batch_of_different_lengths_equals_single_runs"]
SCOPES = {
    **{f"kernels/{op}": ([f"minikv/kernels/{op}/reference.py"], [f"tests/kernels/test_{op}.py"])
       for op in KERNELS},
    "streaming": ([f"{POL}/streaming.py"], [f"{T}/test_streaming.py", *NOT_MODELS]),
    "h2o": ([f"{POL}/h2o.py"], [f"{T}/test_h2o.py"]),
    # one_pass: the fast layer's score against the reference's (layer_fast, not mutated here)
    "softfreeze": ([f"{POL}/softfreeze/{m}.py" for m in ("schedule", "policy", "accounting")],
                   [f"{T}/test_softfreeze_schedule.py", f"{T}/test_softfreeze_paper.py", f"{T}/test_softfreeze_kills.py",
                    "-k", "not one_pass"]),
    "freekv": ([f"{POL}/freekv.py", f"{POL}/freekv_policy.py", f"{POL}/freekv_counts.py", f"{POL}/paged_checks.py"],
               [f"{T}/test_freekv_paper.py", f"{T}/test_freekv.py", f"{T}/test_freekv_kills.py", *NOT_MODELS]),
    # paged.py serves freekv and icecache: both policies' tests judge it
    "paged": ([f"{POL}/paged.py", f"{POL}/paged_prefill.py", f"{POL}/host_pages.py", f"{POL}/paged_stats.py"], [f"{T}/test_paged.py", f"{T}/test_paged_kills.py", f"{T}/test_freekv_paper.py",
                                    f"{T}/test_freekv_kills.py", f"{T}/test_icecache.py", f"{T}/test_icecache_kills.py",
                                    *NOT_MODELS]),
    "icecache": ([f"{POL}/icecache/{m}.py" for m in ("layer", "tree", "search", "build", "promotion", "policy", "counts")],
                 [f"{T}/test_icecache_paper.py", f"{T}/test_dci.py", f"{T}/test_icecache.py",
                  f"{T}/test_icecache_kills.py", *NOT_MODELS]),
    "synckv": ([f"{POL}/synckv/{m}.py" for m in ("bank", "clusters", "binding", "layer", "accounting", "policy")],
               [f"{T}/test_synckv_paper.py", f"{T}/test_synckv_clusters.py", f"{T}/test_synckv.py",
                f"{T}/test_synckv_kills.py", *NOT_MODELS]),
    # what every policy stands on (not a paper's step): the contract, parameters, tiers, pools, the
    # worker thread, full KV; judged by the contract matrix, the spec, worker, recall-order, paged
    # store, tiers, accounting and plugin tests, two policies' kill tests (their bytes and dtypes),
    # --help and a ragged batch
    "shared": ([f"{POL}/{m}.py" for m in ("contract", "checks", "registry", "stats", "params", "tiers", "pool",
                                          "pool_fast", "worker", "overlap", "full")],
               [f"{T}/test_contract.py", f"{T}/test_spec.py", f"{T}/test_worker.py", f"{T}/test_recall_order.py",
                f"{T}/test_paged.py", f"{T}/test_tiers.py", f"{T}/test_accounting.py", f"{T}/test_freekv_kills.py",
                f"{T}/test_icecache_kills.py", "tests/test_plugins.py", *HELP, *RAGGED, *NOT_MODELS]),
}
SCOPES["kernels/page_scores"][1].extend(["tests/kernels/test_quant2_codes.py", f"{T}/test_freekv_kills.py"])
SCOPES["kernels/dci_scores"][1].append("tests/kernels/test_dci_scores_kills.py")
GROUPS = {"kernels": [s for s in SCOPES if s.startswith("kernels/")]}
MUTMUT = [sys.executable, "-m", "mutmut"]
# a mutant's tests get 2 * 5 * (their clean CPU time + 1 s) (mutmut's default: 2 * 15 * ...), then
# count as a timeout (killed: a mutant that makes the tests ten times slower is not the same program)
TIMEOUT_MULTIPLIER = 5
# mutmut's limit is CPU time, which a mutant that deadlocks (a thread waiting for a result never
# sent) does not spend: a watchdog in each mutant's test run ends it with mutmut's timeout status
# (36) once a minute passes with less than a second of CPU: a run waiting on itself, not a slow one.
HANG_S = 60
HANG_WATCHDOG = f"""

# tools/mutation.py: a mutant's test run that hangs ends as a timeout (added to the copy only)
@pytest.fixture(autouse=True, scope="session")
def _mutation_hang_watchdog():
    import os
    import threading
    import time

    def watch():
        last = time.process_time()
        while True:
            time.sleep({HANG_S})
            if time.process_time() - last < 1.0:
                os._exit(36)
            last = time.process_time()

    if "__mutmut_" in os.environ.get("MUTANT_UNDER_TEST", ""):
        threading.Thread(target=watch, daemon=True).start()
    yield
"""


def mutmut_section(modules: list[str], tests: list[str]) -> str:
    toml = lambda xs: "[" + ", ".join(f'"{x}"' for x in xs) + "]"  # noqa: E731
    return (f"\n[tool.mutmut]\nsource_paths = [\"minikv\"]\nonly_mutate = {toml(modules)}\n"
            f"also_copy = [\"reference\"]\ntimeout_multiplier = {TIMEOUT_MULTIPLIER}\npytest_add_cli_args = [\"-x\", \"-q\", \"-p\", \"no:cacheprovider\"]\n"
            f"pytest_add_cli_args_test_selection = {toml(tests)}\n")


def run_scope(scope: str, work: Path, children: int, only: list[str], ignore: list[str]) -> list[str]:
    """Run mutmut on one scope in its own copy (the mutants matching `only`, if given; the tests
    less `ignore`); -> the `name: status` lines of the mutants checked, and the survivors' diffs."""
    modules, tests = SCOPES[scope]
    tests = [t for t in tests if t not in ignore]
    here = work / scope.replace("/", "-")
    shutil.rmtree(here, ignore_errors=True)
    skip = shutil.ignore_patterns("__pycache__", ".hypothesis")
    for part in ("minikv", "tests", "reference"):  # reference/: the tests' model directories
        shutil.copytree(ROOT / part, here / part, ignore=skip)
    with open(here / "tests" / "conftest.py", "a") as conftest:
        conftest.write(HANG_WATCHDOG)
    (here / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text() + mutmut_section(modules, tests))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # mutmut puts its mutants first
    env.update(OMP_NUM_THREADS="1", HYPOTHESIS_PROFILE="mutation")  # ci's examples, no shrinking
    print(f"== {scope}: {' '.join(modules)} against {' '.join(tests)}", file=sys.stderr, flush=True)
    with open(here / "mutmut.log", "w") as log:
        if subprocess.run([*MUTMUT, "run", "--max-children", str(children), *only], cwd=here, env=env, stdout=log,
                          stderr=subprocess.STDOUT).returncode:
            sys.exit(f"error: mutmut failed on scope {scope}; its output: {here / 'mutmut.log'}")
    out = subprocess.run([*MUTMUT, "results", "--all", "true"], cwd=here, env=env, capture_output=True,
                         text=True, check=True).stdout
    lines = [ln.strip() for ln in out.splitlines() if ": " in ln and not ln.endswith(": not checked")]
    for name in [ln.split(": ")[0] for ln in lines if not ln.endswith(": killed")]:
        diff = subprocess.run([*MUTMUT, "show", name], cwd=here, env=env, capture_output=True, text=True).stdout
        lines.append("\n" + diff)
    return lines


def module_of(name: str) -> str:
    """minikv.policies.streaming.xǁStreamingLayerǁdecode__mutmut_3 -> minikv.policies.streaming"""
    return re.split(r"\.x[_ǁ]", name, maxsplit=1)[0]


def report(lines: list[str]) -> str:
    """Markdown rows: module | mutants | killed | survived | other (timeouts count as killed)."""
    by = {}
    for ln in lines:
        if re.match(r"^[\w.]+\.x[_ǁ]\S+: ", ln):
            name, status = ln.split(": ", 1)
            by.setdefault(module_of(name), Counter())["killed" if status == "timeout" else status] += 1
    rows = ["| module | mutants | killed | survived | other | kill rate |", "|---|---|---|---|---|---|"]
    for mod, c in sorted(by.items()):
        n, other = sum(c.values()), sum(v for k, v in c.items() if k not in ("killed", "survived"))
        rows.append(f"| {mod} | {n} | {c['killed']} | {c['survived']} | {other} | {100 * c['killed'] / n:.0f}% |")
    return "\n".join(rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("scopes", nargs="*", help=f"scopes or groups (default: all); groups: {', '.join(GROUPS)}")
    p.add_argument("--list", action="store_true", help="print the scopes and exit")
    p.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "minikv-mutation",
                   help="where the copies go (default: minikv-mutation in the temporary directory)")
    p.add_argument("--survivors", type=Path, default=Path("out/mutation-survivors.txt"),
                   help="every mutant's status and the survivors' diffs")
    p.add_argument("--only", nargs="+", default=[], metavar="GLOB",
                   help="only the mutants whose names match (mutmut's names, e.g. '*.x_pack_codes__mutmut_*')")
    p.add_argument("--ignore", nargs="+", default=[], metavar="TEST_FILE",
                   help="judge without these test files (the run before a kill test)")
    p.add_argument("--children", type=int, default=1, help="mutants run at once (mutmut --max-children)")
    args = p.parse_args()
    scopes = [s for name in args.scopes or list(SCOPES) for s in GROUPS.get(name, [name])]
    bad = [s for s in scopes if s not in SCOPES]
    if bad or args.children < 1:
        print(f"error: unknown scope {bad[0]!r}; --list shows them" if bad else "error: --children must be >= 1",
              file=sys.stderr)
        return 2
    if args.list:
        for s in scopes:
            print(f"{s}: {' '.join(SCOPES[s][0])} <- {' '.join(SCOPES[s][1])}")
        return 0
    lines = [ln for s in scopes for ln in run_scope(s, args.work, args.children, args.only, args.ignore)]
    args.survivors.parent.mkdir(parents=True, exist_ok=True)
    args.survivors.write_text("\n".join(lines) + "\n")
    print(report(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""python -m minikv.bench <benchmark> [options]: every benchmark prints its table on stdout and its
progress on stderr; --json FILE writes its numbers. `python -m minikv.bench --help` lists them, in
two groups: those a user runs to choose a policy (minikv/bench/) and the research probes
(minikv/bench/research/), which look inside one policy's step.

Every ratio a benchmark prints is `this / full` (e.g. "TPOT x full": below 1 is faster than the
full cache). Flags are checked before the model loads: the shared ones (--model --device --dtype
--threads --policy) and every output path (--json, --png, --out: a file, or a directory where the
module's OUTPUT_DIRS names it) here, a benchmark's own in its `check(args)` when it has one. Errors take
minikv's one path (minikv.cli): one line `error: ...` on stderr, exit code 2."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
import textwrap

import minikv.bench as bench_pkg
from minikv.cli import check_common, check_output_paths, run_command
from minikv.plugins import add_import_argument, import_from_argv


# The two kinds of benchmark, told apart by where they live: those a user runs to choose a policy
# (minikv/bench/), and the research probes that look inside one policy's step (bench/research/).
GROUPS = {"to choose a policy": "minikv.bench", "research probes (minikv/bench/research/)": "minikv.bench.research"}


def benchmarks(package: str | None = None) -> dict:
    """name -> module of each benchmark: a module of `package` (None: both groups) that defines
    `add_arguments` and `run`; its name is COMMAND or the module's, with - for _."""
    found = {}
    for name in [package] if package else GROUPS.values():
        for info in pkgutil.iter_modules(importlib.import_module(name).__path__):
            if info.ispkg or info.name.startswith("_") or info.name == "common":
                continue
            module = importlib.import_module(f"{name}.{info.name}")
            if hasattr(module, "run") and hasattr(module, "add_arguments"):
                found[getattr(module, "COMMAND", info.name.replace("_", "-"))] = module
    return found


def summary(module) -> str:
    """The first paragraph of a benchmark's docstring, without its own name ("compare: ...")."""
    return " ".join((module.__doc__ or "").strip().split("\n\n")[0].split()).partition(": ")[2]


def listing() -> str:
    """--help's list of benchmarks, by group."""
    lines = []
    for title, package in GROUPS.items():
        lines.append(f"{title}:")
        for name, module in sorted(benchmarks(package).items()):
            lines += textwrap.wrap(summary(module), 100, initial_indent=f"  {name:<15}", subsequent_indent=" " * 17)
    return "\n".join(lines)


def main(argv=None) -> int:
    import_from_argv(argv)  # --import MODULE: its policies in --help, --policy and compare's rows
    parser = argparse.ArgumentParser(prog="python -m minikv.bench", description=__doc__, epilog=listing(),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="check the benchmark's flags (policy specs, device, model path, ...) and exit "
                             "without loading the model or running anything")
    add_import_argument(parser)  # before the benchmark's name, or after it (below)
    # the benchmarks are listed by group in the epilog, not one by one under BENCHMARK
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK",
                                help="one of those listed below; BENCHMARK --help says what it measures")
    for name, module in sorted(benchmarks().items()):
        p = sub.add_parser(name, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        add_import_argument(p)
        p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    check_common(args)
    check_output_paths(args, dirs=getattr(args._module, "OUTPUT_DIRS", ()))
    if hasattr(args._module, "check"):
        args._module.check(args)
    if args.check:
        print(f"{args.benchmark}: flags are valid", file=sys.stderr)
        return 0
    return args._module.run(args) or 0


if __name__ == "__main__":
    sys.exit(run_command(main))

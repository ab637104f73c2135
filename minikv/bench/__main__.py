"""python -m minikv.bench <benchmark> [options]: every benchmark prints its table on stdout and its
progress on stderr; --json FILE writes its numbers. `python -m minikv.bench --help` lists them.

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

import minikv.bench as bench_pkg
from minikv.cli import check_common, check_output_paths, run_command
from minikv.plugins import add_import_argument, import_from_argv


def benchmarks() -> dict:
    found = {}
    for info in pkgutil.iter_modules(bench_pkg.__path__):
        if info.name.startswith("_") or info.name == "common":
            continue
        module = importlib.import_module(f"minikv.bench.{info.name}")
        if hasattr(module, "run") and hasattr(module, "add_arguments"):
            found[getattr(module, "COMMAND", info.name.replace("_", "-"))] = module
    return found


def main(argv=None) -> int:
    import_from_argv(argv)  # --import MODULE: its policies in --help, --policy and compare's rows
    parser = argparse.ArgumentParser(prog="python -m minikv.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="check the benchmark's flags (policy specs, device, model path, ...) and exit "
                             "without loading the model or running anything")
    add_import_argument(parser)  # before the benchmark's name, or after it (below)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module in sorted(benchmarks().items()):
        doc = (module.__doc__ or name).strip().splitlines()[0]
        p = sub.add_parser(name, help=doc, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
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

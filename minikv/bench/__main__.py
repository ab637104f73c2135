"""python -m minikv.bench <benchmark> [options]: every benchmark prints a table; --json FILE
writes its numbers. `python -m minikv.bench --help` lists them."""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import minikv.bench as bench_pkg


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
    parser = argparse.ArgumentParser(prog="python -m minikv.bench", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True)
    for name, module in sorted(benchmarks().items()):
        doc = (module.__doc__ or name).strip().splitlines()[0]
        p = sub.add_parser(name, help=doc, description=module.__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        module.add_arguments(p)
        p.set_defaults(_module=module)
    args = parser.parse_args(argv)
    return args._module.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())

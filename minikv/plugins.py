"""Policies from outside minikv: modules named on the command line, and installed entry points.

A module that defines a policy with `@minikv.register_policy` makes it available by importing it:

    python -m minikv.generate --import my_h2o --policy myh2o --prompt "..."
    python -m minikv.bench compare --import my_h2o --policy myh2o --preset smoke

`--import MODULE` (repeatable) takes a module name (found on sys.path, the current directory
included) or the path of a .py file; the commands import it before they parse their flags, so the
policy is in `--help` and `--policy` accepts it. A package can instead declare its module in the
entry-point group `minikv.policies` (pyproject.toml: [project.entry-points."minikv.policies"]
myh2o = "my_package.h2o"); minikv imports those the first time it lists or makes a policy, so they
also reach `minikv.make_policy` and minikv.hf. docs/extending.md walks through one.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import warnings
from importlib.metadata import entry_points
from pathlib import Path

GROUP = "minikv.policies"
FLAG = "--import"
HELP = ("import MODULE (a module name or a .py file) before anything else: the policies it registers with "
        "@minikv.register_policy become available (repeatable; docs/extending.md)")

_loaded_entry_points = False


def import_module(name: str):
    """Import a module by name, or a .py file by path; any failure is an ImportError naming it."""
    try:
        path = Path(name)
        if name.endswith(".py"):
            if not path.is_file():
                raise FileNotFoundError(f"no such file: {name}")
            spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[path.stem] = module
            spec.loader.exec_module(module)
            return module
        if str(Path.cwd()) not in sys.path and "" not in sys.path:
            sys.path.insert(0, str(Path.cwd()))  # as python -m does: the current directory's modules
        return importlib.import_module(name)
    except Exception as err:  # noqa: BLE001  (whatever the module raises, the user's: one line)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ImportError(f"{FLAG} {name}: {type(err).__name__}: {first}") from err


def modules_in(argv: list[str]) -> list[str]:
    """The MODULEs of every `--import MODULE` / `--import=MODULE` in argv, in order."""
    found = []
    for i, arg in enumerate(argv):
        if arg == FLAG and i + 1 < len(argv):
            found.append(argv[i + 1])
        elif arg.startswith(FLAG + "="):
            found.append(arg[len(FLAG) + 1:])
    return found


def import_from_argv(argv: list[str] | None) -> None:
    """Import what argv's --import flags name (sys.argv when None), before the flags are parsed."""
    load_entry_points()
    for name in modules_in(sys.argv[1:] if argv is None else list(argv)):
        import_module(name)


def add_import_argument(parser) -> None:
    """--import, for argparse to accept and list (the import itself ran before parsing)."""
    parser.add_argument(FLAG, dest="imports", action="append", default=[], metavar="MODULE", help=HELP)


def load_entry_points() -> None:
    """Import every module of the entry-point group minikv.policies, once. A broken one is a
    warning naming it: one bad package must not take every command down."""
    global _loaded_entry_points
    if _loaded_entry_points:
        return
    _loaded_entry_points = True
    for ep in entry_points(group=GROUP):
        try:
            ep.load()
        except Exception as err:  # noqa: BLE001
            warnings.warn(f"entry point {ep.name} = {ep.value} ({GROUP}) failed to import: "
                          f"{type(err).__name__}: {err}", stacklevel=2)

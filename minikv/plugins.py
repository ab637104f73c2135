"""Policies from outside minikv: modules named on the command line, and installed entry points.

A module that defines a policy with `@minikv.register_policy` makes it available by importing it:

    python -m minikv.generate --import my_h2o --policy myh2o --prompt "..."
    python -m minikv.bench compare --import my_h2o --policy myh2o --preset smoke

`--import MODULE` (repeatable) takes a module name (found on sys.path, the current directory
included), the path of a .py file or of a package directory (imported as `minikv_plugins.<stem>`,
so that a file named random.py shadows no module); the commands import it before they parse
their flags, so the policy is in `--help` and `--policy` accepts it. A package can instead declare its module in the
entry-point group `minikv.policies` (pyproject.toml: [project.entry-points."minikv.policies"]
myh2o = "my_package.h2o"); minikv imports those the first time it lists or makes a policy, so they
also reach `minikv.make_policy` and minikv.hf. docs/extending.md walks through one.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
import warnings
from importlib.metadata import entry_points
from pathlib import Path

GROUP = "minikv.policies"
FLAG = "--import"
HELP = ("import MODULE (a module name, a .py file or a package directory) before anything else: the policies it registers with "
        "@minikv.register_policy become available (repeatable; docs/extending.md)")

_loaded_entry_points = False
_imported: list = []  # the modules --import brought in, for culprit()


NAMESPACE = "minikv_plugins"  # a file given by path is imported as minikv_plugins.<stem>


def import_module(name: str):
    """Import a module by name, or a .py file or a package directory by path; any failure is an
    ImportError naming it."""
    try:
        if _is_module_name(name) and not Path(name).is_file():
            if str(Path.cwd()) not in sys.path and "" not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # as python -m does: the current directory's modules
            module = importlib.import_module(name)
        else:
            module = import_path(Path(name))
        _imported.append(module)
        return module
    except Exception as err:  # noqa: BLE001  (whatever the module raises, the user's: one line)
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise ImportError(f"{FLAG} {name}: {type(err).__name__}: {first}") from err


def _is_module_name(name: str) -> bool:
    """`pkg.mod`, as `import` takes it (not a path: `./x`, `x.py`, `dir/`; a file named like a
    module, `notes.txt`, is a path too)."""
    return not name.endswith(".py") and all(part.isidentifier() for part in name.split("."))


def import_path(path: Path):
    """A .py file (or a package directory: its __init__.py) as module minikv_plugins.<stem>, a
    name of its own: under its bare stem, a plugin named random.py or json.py would replace the
    standard library's module of that name for the whole process."""
    if path.is_dir():
        init = path / "__init__.py"
        if not init.is_file():
            raise FileNotFoundError(f"directory {path} has no __init__.py: give a .py file or a package directory")
        file, search = init, [str(path.resolve())]
    elif path.is_file():
        if path.suffix != ".py":
            raise ValueError(f"{path} is not a .py file: give a module name, a .py file or a package directory")
        file, search = path, None
    else:
        raise FileNotFoundError(f"no such file: {path}")
    stem = path.resolve().name.removesuffix(".py")
    base = f"{NAMESPACE}.{stem if stem.isidentifier() else 'plugin'}"
    module_name, n = base, 1
    while module_name in sys.modules:  # two files of one name in different directories
        if getattr(sys.modules[module_name], "__file__", None) == str(file.resolve()):
            return sys.modules[module_name]  # imported already (--import twice)
        n += 1
        module_name = f"{base}_{n}"
    spec = importlib.util.spec_from_file_location(module_name, file.resolve(), submodule_search_locations=search)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and pickle look the module up by its name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[module_name]
        raise
    return module


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


def culprit(err: BaseException) -> str | None:
    """Which plugin raised `err`, if one did: the innermost frame of its traceback in a module from
    outside minikv (one that registered a policy, or that --import brought in), as "policy 'name'
    (module M, FILE line N)"; None when no plugin's code is on the traceback."""
    files = _plugin_files()
    found = None
    for frame in traceback.extract_tb(err.__traceback__):
        who = files.get(os.path.realpath(frame.filename))
        if who:
            found = f"{who}, {frame.filename} line {frame.lineno}"
    return found and f"{found})"


def _plugin_files() -> dict[str, str]:
    """realpath of a plugin's file -> what it is: "policy 'name' (module M" or "plugin (module M"."""
    from .policies.base import _REGISTRY

    out = {}
    for name, cls in _REGISTRY.items():
        if cls.__module__ != "minikv" and not cls.__module__.startswith("minikv."):
            file = getattr(sys.modules.get(cls.__module__), "__file__", None)
            if file:
                out.setdefault(os.path.realpath(file), f"policy {name!r} (module {cls.__module__}")
    for module in _imported:
        if getattr(module, "__file__", None):
            out.setdefault(os.path.realpath(module.__file__), f"plugin (module {module.__name__}")
    return out

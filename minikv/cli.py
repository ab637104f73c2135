"""What every command (`python -m minikv.generate`, `python -m minikv.bench ...`) shares: one error
path, and the checks that need no model, so that a bad flag fails before the model loads.

    sys.exit(run_command(main, argv))       # main(argv) -> exit code

The library raises ValueError (a value it cannot use), OSError (FileNotFoundError: a missing file)
or ImportError (a missing optional package) for what a user can fix. A command turns those into
one line, `error: <message>`, on stderr and exits with 2, as argparse does for a malformed flag.
Ctrl-C exits with 130. Anything else is a bug in minikv: one line naming the exception, exit 1.
MINIKV_TRACEBACK=1 in the environment shows the full traceback instead, for any of them.
"""
from __future__ import annotations

import os
import sys
import warnings

import torch

USER_ERRORS = (ValueError, OSError, ImportError)  # FileNotFoundError, ModuleNotFoundError included


def one_line(err: BaseException) -> str:
    """The exception's message on one line (multi-line messages are joined with '; ')."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return "; ".join(lines) or type(err).__name__


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def run_command(main, argv=None) -> int:
    """Run main(argv) and map what it raises to one line on stderr and an exit code."""
    warnings.formatwarning = _one_line_warning  # a command's warnings are one line too, like its errors
    show_traceback = os.environ.get("MINIKV_TRACEBACK", "0") not in ("", "0")
    try:
        return main(argv) or 0
    except KeyboardInterrupt:
        if show_traceback:
            raise
        print("interrupted", file=sys.stderr)
        return 130
    except torch.cuda.OutOfMemoryError as err:  # a RuntimeError, but one the user can act on
        if show_traceback:
            raise
        print(f"error: out of memory on the device: {one_line(err)}", file=sys.stderr)
        return 2
    except USER_ERRORS as err:
        if show_traceback:
            raise
        print(f"error: {one_line(err)}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001  (a bug: say what, keep it to one line)
        if show_traceback:
            raise
        print(f"error: internal error, {type(err).__name__}: {one_line(err)} "
              "(this is a bug in minikv; MINIKV_TRACEBACK=1 shows where)", file=sys.stderr)
        return 1


# -- checks that need no model -----------------------------------------------------------------


def check_threads(threads: int | None) -> None:
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_policies(specs) -> list:
    """Build every policy spec (unbound): unknown names, unknown or malformed parameters and values
    a policy refuses on their own fail here. Returns the policies."""
    from .policies import make

    return [make(spec) for spec in specs]


def check_common(args) -> None:
    """The flags commands share, when the command has them: --model --device --dtype --threads
    --policy. Raises ValueError / FileNotFoundError before anything heavy is done."""
    from .loading import locate, parse_dtype, resolve_device

    if getattr(args, "model", None) is not None:
        locate(args.model)
    if getattr(args, "device", None) is not None:
        resolve_device(args.device)
    if getattr(args, "dtype", None) is not None:
        parse_dtype(args.dtype)
    check_threads(getattr(args, "threads", None))
    policy = getattr(args, "policy", None)
    if policy:
        check_policies([policy] if isinstance(policy, str) else policy)

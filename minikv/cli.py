"""What every command (`python -m minikv.generate`, `python -m minikv.bench ...`) shares: one error
path, and the checks that need no model, so that a bad flag fails before the model loads.

    sys.exit(run_command(main, argv))       # main(argv) -> exit code

The library raises ValueError (a value it cannot use), OSError (FileNotFoundError: a missing file)
or ImportError (a missing optional package) for what a user can fix. A command turns those into
one line, `error: <message>`, on stderr and exits with 2, as argparse does for a malformed flag.
Ctrl-C exits with 130 and one line, `interrupted` (and where partial results are, if any); SIGTERM
(what `timeout`, `kill`, schedulers and container runtimes send) does the same with `terminated`
and 143 (128 + the signal's number, as a shell reports it); a second signal while the process
ends is ignored. A reader that stops reading (`| head`) ends the command quietly with 0, as for
`head`-style pipelines; a closed stdout or stderr is read as /dev/null. Anything else is a bug:
in a plugin when its code raised it (minikv.plugins.culprit: one line naming the policy, its
module and the line, exit 2), else in minikv (one line naming the exception, exit 1).
MINIKV_TRACEBACK=1 in the environment shows the full traceback instead, for any of them.
"""
from __future__ import annotations

import json
import math
import os
import signal
import sys
import threading
import warnings

import torch

USER_ERRORS = (ValueError, OSError, ImportError)  # FileNotFoundError, ModuleNotFoundError included


def one_line(err: BaseException) -> str:
    """The exception's message on one line (multi-line messages are joined with '; ')."""
    lines = [ln.strip() for ln in str(err).splitlines() if ln.strip()]
    return "; ".join(lines) or type(err).__name__


def _one_line_warning(message, category, filename, lineno, line=None) -> str:
    return f"warning: {message}\n"


def _end_progress_bars() -> None:
    """Close the progress bars an exception left open (a generator's bar stays open until it is
    collected), so that the line said next starts a line of its own, not the bar's."""
    tqdm = getattr(sys.modules.get("tqdm"), "tqdm", None)
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.close()


def say(line: str) -> None:
    """One line on stderr, on a line of its own."""
    _end_progress_bars()
    print(line, file=sys.stderr, flush=True)


SIGNALS = (signal.SIGINT, signal.SIGTERM)  # both end a command the same way: what it has kept, one line
_received = []  # the signal that raised the KeyboardInterrupt being handled (none: a KeyboardInterrupt of Python's)


def interrupted(where: str = "") -> int:
    """After a Ctrl-C or SIGTERM: one line on stderr (`where`: what was kept, where). Returns the
    exit code: 130 after SIGINT, 143 after SIGTERM."""
    signum = _received[-1] if _received else signal.SIGINT
    word = "terminated" if signum == signal.SIGTERM else "interrupted"
    say(f"{word}: {where}" if where else word)
    return 128 + signum


def _reopen_closed_streams() -> None:
    """A command started with stdout or stderr closed (`>&-`) writes into /dev/null instead of
    failing on None; a closed stdin stays None: read_stdin() says so."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w"))


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`| head -c 5`): what it wanted it has; end quietly, and
    point stdout at /dev/null so that the interpreter's final flush does not fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 0


def _first_interrupt(signum, frame):
    for sig in SIGNALS:  # the process is ending: a second Ctrl-C or SIGTERM must not interrupt that
        signal.signal(sig, signal.SIG_IGN)
    _received.append(signum)
    raise KeyboardInterrupt


def _interrupt_once() -> dict:
    """From here on, the first Ctrl-C or SIGTERM raises KeyboardInterrupt (the command keeps what
    it has and says so in one line) and the signals after it are ignored. Before here, while
    `python -m minikv....` imports torch, minikv/__init__.py ends the process with one line on
    either. Returns the handlers it replaced, by signal."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    replaced = {}
    for sig in SIGNALS:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN:  # started in the background of a shell (SIGINT), or nohup'd: not ours
            continue
        signal.signal(sig, _first_interrupt)
        replaced[sig] = previous
    return replaced


def _restore_interrupt(replaced: dict) -> None:
    """The handlers before run_command (under `python -m`, minikv/__init__.py's one line, which
    holds while the interpreter exits), unless a signal came: then the process is ending."""
    for sig, previous in replaced.items():
        if previous is not None and signal.getsignal(sig) is _first_interrupt:
            signal.signal(sig, previous)


def stdout_reader_gone():
    """A function telling whether stdout is a pipe whose reader has closed it (`| head -c 5` that
    has what it wanted), without writing to it: a command that prints only at the end (--json)
    asks it as it works and stops early. Always False where stdout is no pipe."""
    import select
    import stat

    try:
        fd = sys.stdout.fileno()
        if not stat.S_ISFIFO(os.fstat(fd).st_mode) or not hasattr(select, "poll"):
            return lambda: False
    except (AttributeError, OSError, ValueError):  # no real file behind stdout (a test's StringIO)
        return lambda: False
    poll = select.poll()
    poll.register(fd, select.POLLERR)  # a pipe's write end reports POLLERR once its read end is closed

    def gone() -> bool:
        return any(event & select.POLLERR for _, event in poll.poll(0))

    return gone


def run_command(main, argv=None) -> int:
    """Run main(argv) and map what it raises to one line on stderr and an exit code."""
    warnings.formatwarning = _one_line_warning  # a command's warnings are one line too, like its errors
    show_traceback = os.environ.get("MINIKV_TRACEBACK", "0") not in ("", "0")
    _received.clear()
    previous = _interrupt_once()
    _reopen_closed_streams()
    try:
        code = main(argv) or 0
        sys.stdout.flush()  # a closed pipe shows here, not in the interpreter's exit
        return code
    except KeyboardInterrupt as err:
        if show_traceback:
            raise
        return interrupted(str(err))
    except BrokenPipeError:
        return _reader_gone()
    except torch.cuda.OutOfMemoryError as err:  # a RuntimeError, but one the user can act on
        if show_traceback:
            raise
        say(f"error: out of memory on the device: {one_line(err)}")
        return 2
    except USER_ERRORS as err:
        if show_traceback:
            raise
        say(f"error: {one_line(err)}")
        return 2
    except Exception as err:  # noqa: BLE001  (a bug: say what, keep it to one line)
        if show_traceback:
            raise
        from .plugins import culprit

        who = culprit(err)
        if who:  # a bug in a plugin's code, not in minikv's: say whose
            say(f"error: {who} raised {type(err).__name__}: {one_line(err)} "
                "(a bug in that plugin, not in minikv; MINIKV_TRACEBACK=1 shows where)")
            return 2
        say(f"error: internal error, {type(err).__name__}: {one_line(err)} "
            "(this is a bug in minikv; MINIKV_TRACEBACK=1 shows where)")
        return 1
    finally:
        _restore_interrupt(previous)


# -- checks that need no model -----------------------------------------------------------------


def check_threads(threads: int | None) -> int | None:
    """--threads: at least 1; more than the cores this process may run on is capped at them, with
    a warning (threads beyond the cores only contend: 4 tokens took 194 s at --threads 10000 on
    2 cores). Returns the thread count to use."""
    if threads is None:
        return None
    if threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    cores = usable_cores()
    if threads > cores:
        warnings.warn(f"--threads {threads} is more than the {cores} CPU cores this process can use; using {cores}")
        return cores
    return threads


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask; os.cpu_count() where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - macOS, Windows
        return os.cpu_count() or 1


def check_positive(name: str, value: int | None) -> None:
    if value is not None and value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def check_policies(specs) -> list:
    """Build every policy spec (unbound): unknown names, unknown or malformed parameters and values
    a policy refuses on their own fail here. Returns the policies."""
    from .policies import make

    return [make(spec) for spec in specs]


# -- output paths, checked before the work ---------------------------------------------------


def check_output_paths(args, dirs=()) -> None:
    """Every output path a command has (--json FILE, --png FILE, --out FILE; the names in `dirs`
    are directories, e.g. compare's --out DIR): each can be written, now, before the model loads,
    so that no run ends in an error after its work. A file is opened for
    appending (created, then removed, if it did not exist), so nothing in it is lost; a directory
    is not created yet, but where it would be must take files."""
    for name in ("json", "png", "out"):
        path = getattr(args, name, None)
        if not isinstance(path, str):  # absent, not given, or a switch (generate's --json)
            continue
        flag = f"--{name}"
        if name in dirs:
            check_writable_dir(flag, path)
        else:
            check_writable_file(flag, path)


def check_writable_file(flag: str, path: str) -> None:
    if not path:
        raise ValueError(f"{flag} is empty; give a file name")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a directory; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        raise ValueError(f"{flag} {path} cannot be written: {err.strerror or err}") from None
    if not existed:
        os.remove(path)


def check_writable_dir(flag: str, path: str) -> None:
    """The directory exists and takes a new file, or can be made: its nearest existing ancestor
    is a directory that takes one (nothing is created: --check leaves no trace)."""
    if not path:
        raise ValueError(f"{flag} is empty; give a directory")
    existing = os.path.abspath(path)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        what = "is a file" if existing == os.path.abspath(path) else f"is under {existing}, which is a file"
        raise ValueError(f"{flag} {path} {what}, not a directory")
    probe = os.path.join(existing, f".minikv-write-check-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as err:
        raise ValueError(f"{flag} {path}: cannot write in {existing}: {err.strerror or err}") from None


# -- strict JSON -----------------------------------------------------------------------------


def finite(obj):
    """obj with every NaN and infinity replaced by None (JSON's null), in dicts, lists and tuples:
    JSON has no NaN; Python writes one that JSON.parse, jq and most other parsers refuse."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def dumps(obj, **kwargs) -> str:
    """json.dumps, strict: NaN and infinities as null (finite), and an error rather than invalid JSON."""
    return json.dumps(finite(obj), allow_nan=False, **kwargs)


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
    if getattr(args, "threads", None) is not None:
        args.threads = check_threads(args.threads)  # capped at the cores
    policy = getattr(args, "policy", None)
    if policy:
        check_policies([policy] if isinstance(policy, str) else policy)

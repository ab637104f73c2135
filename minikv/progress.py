"""Progress reporting for long work (GGUF import, long prefills, benchmarks), on stderr."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(iterable=None, desc: str = "", total: int | None = None, enabled: bool | None = True, **kwargs):
    """enabled=None: only when stderr is a terminal."""
    disable = None if enabled is None else not enabled
    return tqdm(iterable, desc=desc, total=total, disable=disable, file=sys.stderr, leave=False,
                dynamic_ncols=True, **kwargs)

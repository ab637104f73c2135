"""Progress reporting for long work (GGUF import, long prefills, benchmarks), on stderr."""
from __future__ import annotations

import sys

from tqdm.auto import tqdm


def progress_bar(iterable=None, desc: str = "", total: int | None = None, enabled: bool = True, **kwargs):
    return tqdm(iterable, desc=desc, total=total, disable=not enabled, file=sys.stderr, leave=False,
                dynamic_ncols=True, **kwargs)

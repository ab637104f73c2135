"""The parameter checks of the page-based policies (freekv, icecache), run when a policy is made
or bound, never in a decode step: whole pages for budget, sink and window, and freekv's budget
and layers."""
from __future__ import annotations


def check_page_geometry(page_size, budget, sink, window) -> None:
    """The parameter checks every page-based policy shares: whole pages for budget, sink and
    window, and a window of at least one page (the partly filled last page is always read)."""
    if not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size must be a positive int, got {page_size!r}")
    for name, value in (("budget", budget), ("sink", sink), ("window", window)):
        if not isinstance(value, int) or value < 0 or value % page_size:
            raise ValueError(f"{name} must be a non-negative multiple of page_size={page_size}, got {value!r}")
    if window < page_size:
        raise ValueError(f"window must be >= page_size={page_size} (the partly filled last page), got {window}")


def check_freekv(policy) -> None:
    """freekv's parameters, when it is made: whole pages, and a budget that holds the sink, the
    window, the partly filled last page and at least one selected page."""
    check_page_geometry(policy.page_size, policy.budget, policy.sink, policy.window)
    least = policy.sink + policy.window + 2 * policy.page_size
    if policy.budget < least:
        raise ValueError(f"budget must be >= sink + window + 2 * page_size = {least} "
                         f"(the partly filled last page and at least one selected page), got {policy.budget}")


def check_freekv_model(policy, cfg) -> None:
    """freekv against the model it is bound to."""
    if policy.skip_layers > cfg.n_layers:
        raise ValueError(f"skip_layers must be <= the model's {cfg.n_layers} layers, got {policy.skip_layers}")
    if cfg.sliding_window is not None and cfg.sliding_window < policy.max_len:
        raise ValueError("freekv does not combine with a sliding-window model (Mistral) shorter than max_len")

"""Chat templates: the checkpoint's own Jinja template, rendered in jinja2's immutable sandbox with
the extensions, filters and globals transformers gives it (a template comes from a downloaded
file: the sandbox keeps it from reaching Python objects), and with bounds on its work, which the
sandbox alone does not give: `{% for i in range(99999) %}{% for j in range(99999) %}` would run
for hours, `"x" * 10**10` would take all memory.

    render(source, **variables) -> str   or ValueError (the template's own error, or a bound passed)
"""
from __future__ import annotations

import functools
import json
import threading
import time
from datetime import datetime

MAX_STEPS = 1_000_000  # range() items, calls and `*` / `**` of one render (a real template takes a few thousand)
MAX_SECONDS = 10.0  # wall time of one render
MAX_CHARS = 1 << 20  # rendered characters beyond 4x the messages' own (a prompt is the messages plus markup)


class TemplateTooCostly(Exception):
    """A render passed a bound: the template's fault, raised out of the sandbox as its error."""


class _Budget(threading.local):
    steps = 0
    deadline = float("inf")

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps > MAX_STEPS:
            raise TemplateTooCostly(f"it ran more than {MAX_STEPS:,} steps (loops, calls) while rendering one prompt")
        if self.steps % 1024 < n and time.monotonic() > self.deadline:
            raise TemplateTooCostly(f"it ran longer than {MAX_SECONDS:.0f} s while rendering one prompt")


_budget = _Budget()


class _Range:
    """range(), counting each item it gives against the render's budget (a sequence: `|length`
    and `loop.length` work on it as on a range)."""

    def __init__(self, *args):
        self._r = range(*args)

    def __len__(self):
        return len(self._r)

    def __getitem__(self, i):
        return self._r[i]

    def __iter__(self):
        for x in self._r:
            _budget.tick()
            yield x


def render(source: str, **variables) -> str:
    """The template rendered with `variables`, within the bounds above. Raises the template's
    error as it is (jinja2.TemplateError and others) or TemplateTooCostly."""
    template = compile_template(source)
    chars = sum(len(str(m.get("content", ""))) for m in variables.get("messages") or () if isinstance(m, dict))
    limit = MAX_CHARS + 4 * chars
    _budget.steps, _budget.deadline = 0, time.monotonic() + MAX_SECONDS
    out, n = [], 0
    try:
        for piece in template.generate(**variables):
            n += len(piece)
            if n > limit:
                raise TemplateTooCostly(f"it wrote more than {limit:,} characters for one prompt")
            out.append(piece)
    finally:
        _budget.deadline = float("inf")
    return "".join(out)


@functools.lru_cache(maxsize=16)
def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """transformers' {% generation %}...{% endgeneration %} marks assistant text for training
        masks; rendering a prompt just renders its body."""
        tags = {"generation"}

        def parse(self, parser):
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        """Every call and every `*` / `**` counts against the render's budget; a repetition or a
        power whose result would be huge is refused before it is computed."""
        intercepted_binops = frozenset(["*", "**"])

        def call(self, __context, __obj, *args, **kwargs):
            _budget.tick()
            return super().call(__context, __obj, *args, **kwargs)

        def call_binop(self, context, operator, left, right):
            _budget.tick()
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_CHARS:
                        raise TemplateTooCostly(f"it repeats a sequence of {len(seq)} {n:,} times")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(right) > 1024 \
                    and abs(left) > 1:
                raise TemplateTooCostly(f"it raises {left} to the power {right}")
            return super().call_binop(context, operator, left, right)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, range=_Range,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)

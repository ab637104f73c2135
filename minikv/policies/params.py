"""Policy parameters, declared once: each is a dataclass field made by `param` (its default, its
bounds, its one-line meaning), and everything else derives from those declarations: the spec
parser (`make("freekv:budget=256")` reads each value as its field's type), the checks every
policy gets for free (`check_fields`: type, finite, bounds, choices; a policy's `__post_init__`
adds only what relates two parameters) and the policy listing of `--help` (`describe`).

The paper as a preset: each policy class names, in `PAPER`, the values of its parameters that
select exactly its paper's rules (`paper_rules`), and in `PAPER_SIZES` the sizes the paper ran
at (a budget, a cluster count: `paper_sizes`); `preset=paper` (or the spec alias `NAME:paper`)
takes both (`apply_preset`). A rule the preset sets may not be given another value beside it
(`preset_conflicts`); a size may (`freekv:paper,budget=512`: the paper's rules at another size,
as the papers' own ablations vary them). docs/design.md, "The paper as a
preset", gives each default that departs from the preset, with the measurement behind it.

The meanings the policies share (docs/design.md, "The policy contract") are written once, in
SHARED; a field named budget, sink, window, page_size, skip_layers or backend takes its meaning
from there unless it says otherwise.

Sizes are bounded by the context the policy is bound to, not here: a budget, window or history
larger than prompt + new tokens is accepted and capped at bind, where that length is known, so
it costs no more than the context needs.
"""
from __future__ import annotations

import math
from dataclasses import MISSING, Field, field, fields

SHARED = {
    "budget": "most tokens per KV head per layer that attention reads on the device, sink and window "
              "included; capped by the context, so a larger budget costs what full KV costs",
    "sink": "first tokens of the sequence, always attended",
    "window": "most recent tokens, always attended",
    "page_size": "tokens per page",
    "skip_layers": "the first layers the policy governs, which keep full KV; on a model with local and global "
                   "layers these count the global ones (Gemma 3: 3 of its 18, so skip_layers=2 leaves one)",
    "backend": "reference (the readable forms), eager (the fast CPU forms), triton (the kernels) or a name "
               "given to minikv.kernels.register_backend",
    "preset": "paper: exactly the paper's rules (the spec NAME:paper is the same); none: the defaults",
}
PRESETS = ("paper",)

TRUE_WORDS, FALSE_WORDS = ("true", "on", "yes", "1"), ("false", "off", "no", "0")


def param(default, help: str | None = None, *, low=None, high=None, above=None, multiple_of: str | None = None,
          choices: tuple | None = None) -> Field:
    """A policy parameter: a dataclass field with its bounds and its one-line meaning (help; None:
    the shared meaning of its name). low/high are inclusive bounds, above an exclusive lower
    bound; multiple_of names another field the value must be a multiple of (budget of page_size);
    choices lists the values a string parameter takes."""
    return field(default=default, metadata=dict(help=help, low=low, high=high, above=above,
                                                multiple_of=multiple_of, choices=choices))


def declarations(cls) -> dict[str, Field]:
    """name -> field of every parameter of a policy class, in declaration order (backend and
    preset last)."""
    out = {f.name: f for f in fields(cls) if f.init}
    out["backend"] = out.pop("backend")
    out["preset"] = out.pop("preset")
    return out


def meaning(f: Field) -> str:
    return f.metadata.get("help") or SHARED.get(f.name, "")


def value_type(f: Field) -> tuple[str | None, bool]:
    """(the parameter's base type: 'bool', 'int', 'float', 'str' or None if unknown, whether None
    is allowed), from its annotation (a string under `from __future__ import annotations`) or
    else from its default."""
    ann = f.type
    text = ann if isinstance(ann, str) else getattr(ann, "__name__", str(ann))
    text = text.replace("Optional[", "").replace("]", "")
    parts = {t.strip() for t in text.split("|") if t.strip()}
    nullable = "None" in parts or f.default is None
    parts.discard("None")
    if parts == {"int", "float"}:
        parts = {"float"}
    if len(parts) == 1 and next(iter(parts)) in ("bool", "int", "float", "str"):
        return next(iter(parts)), nullable
    if f.default is not None and f.default is not MISSING:
        return type(f.default).__name__, nullable
    return None, nullable


def parse_value(text: str, kind: str | None = None, nullable: bool = False, where: str = "value"):
    """A spec's value as the parameter's type. Booleans take only true/false, on/off, yes/no,
    1/0; an int parameter given 1 gets 1. kind=None (type unknown): the first of bool word,
    none, int, float that fits, else the string."""
    low = text.strip().lower()
    if low == "none" and (nullable or kind is None):
        return None
    if kind == "bool":
        if low in TRUE_WORDS or low in FALSE_WORDS:
            return low in TRUE_WORDS
        raise ValueError(f"{where} is a boolean: use true/false, on/off, yes/no or 1/0, got {text!r}")
    if kind in ("int", "float"):
        try:
            return int(text) if kind == "int" else float(text)
        except ValueError:
            article = "an integer" if kind == "int" else "a number"
            raise ValueError(f"{where} must be {article}{' or none' if nullable else ''}, got {text!r}") from None
    if kind == "str":
        return text
    if low in ("true", "false", "on", "off", "yes", "no"):
        return low in TRUE_WORDS
    for convert in (int, float):
        try:
            return convert(text)
        except ValueError:
            pass
    return text


# -- the checks every policy gets ----------------------------------------------------------------


def bounds_text(f: Field) -> str:
    """The field's type and bounds in words: 'int >= 1', 'float in (0, 1]', 'one of a, b'."""
    kind, nullable = value_type(f)
    m = f.metadata
    if m.get("choices"):
        text = "one of " + ", ".join(map(str, m["choices"]))
    else:
        lo = m.get("low") if m.get("above") is None else m["above"]
        left = "[" if m.get("above") is None else "("
        if lo is not None and m.get("high") is not None:
            text = f"{kind} in {left}{lo}, {m['high']}]"
        elif lo is not None:
            text = f"{kind} {'>=' if left == '[' else '>'} {lo}"
        elif m.get("high") is not None:
            text = f"{kind} <= {m['high']}"
        else:
            text = kind or "value"
        if m.get("multiple_of"):
            text += f", a multiple of {m['multiple_of']}"
    return text + (" or none" if nullable else "")


def check_field(policy, f: Field):
    """The value of field f of policy, checked against its declaration and converted (an int
    given to a float parameter becomes a float). Raises ValueError naming the parameter, what it
    must be and what it means."""
    value = getattr(policy, f.name)
    kind, nullable = value_type(f)
    m = f.metadata

    def refuse(must: str | None = None):
        must = must or ("" if m.get("choices") else "an " if (kind or "x")[0] in "aeiou" else "a ") + bounds_text(f)
        raise ValueError(f"policy {policy.name!r}: {f.name} must be {must} ({meaning(f)}), got {value!r}")

    if value is None:
        return None if nullable else refuse()
    if kind == "bool":
        return value if isinstance(value, bool) else refuse()
    if kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
        refuse()
    if kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            refuse()
        if not math.isfinite(value):
            refuse("a finite " + bounds_text(f))
        value = float(value)
    if kind == "str" and not isinstance(value, str):
        refuse()
    if m.get("choices") and value not in m["choices"]:
        refuse()
    if m.get("low") is not None and value < m["low"] or m.get("high") is not None and value > m["high"]:
        refuse()
    if m.get("above") is not None and not value > m["above"]:
        refuse()
    if m.get("multiple_of"):
        unit = getattr(policy, m["multiple_of"])
        if value % unit:
            refuse(f"a non-negative multiple of {m['multiple_of']}={unit}")
    return value


def check_fields(policy) -> None:
    """Every parameter of policy against its declaration: type, finite, bounds, choices. Fields
    another one is a multiple of (page_size) are checked first."""
    fs = declarations(type(policy))
    units = {f.metadata.get("multiple_of") for f in fs.values()} - {None}
    for f in sorted(fs.values(), key=lambda f: f.name not in units):
        setattr(policy, f.name, check_field(policy, f))


# -- the paper as a preset ----------------------------------------------------------------------


def paper_rules(cls) -> dict:
    """The parameter values that select exactly the paper's rules for a policy class: its
    `PAPER` (empty where the defaults are the paper's, or where there is no paper)."""
    return dict(getattr(cls, "PAPER", {}))


def paper_sizes(cls) -> dict:
    """The sizes the paper ran at, which preset=paper takes unless given: its `PAPER_SIZES`
    (a value None is one the policy resolves at bind, from the model, as its paper does)."""
    return dict(getattr(cls, "PAPER_SIZES", {}))


def preset_conflicts(cls, given: dict) -> None:
    """Refuse preset=paper beside one of the paper's parameters given another value: the result
    would not be the paper's rules. given: the keywords the policy class is called with (a
    spec's parsed items, or a direct call's)."""
    if given.get("preset") != "paper":
        return
    for key, want in paper_rules(cls).items():
        if key in given and given[key] != want:
            raise ValueError(f"policy {cls.name!r}: preset=paper sets {key}={show(want)} (the paper's rule), "
                             f"got {key}={show(given[key])}; drop one of them")


def apply_preset(policy, given=None) -> None:
    """preset=paper: each rule the paper sets and the caller left at its default takes the
    paper's value (make has refused the ones given otherwise), and each of the paper's sizes
    the caller did not give (given: the keywords the policy class was called with; None: a size
    left at its default counts as not given)."""
    if policy.preset != "paper":
        return
    fs = {f.name: f for f in fields(policy)}
    for key, want in paper_rules(type(policy)).items():
        if getattr(policy, key) == fs[key].default:
            setattr(policy, key, want)
    for key, want in paper_sizes(type(policy)).items():
        left = key not in given if given is not None else getattr(policy, key) == fs[key].default
        if left:
            setattr(policy, key, want)


# -- the listing of --help -----------------------------------------------------------------------


def show(value) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def describe(cls) -> list[str]:
    """One line per parameter: name=default, type and bounds, meaning; the preset's line lists
    the values preset=paper sets."""
    fs = declarations(cls)
    width = max(len(f"{n}={show(f.default)}") for n, f in fs.items())
    rules = ", ".join(f"{k}={show(v)}" for k, v in paper_rules(cls).items())
    sizes = ", ".join(f"{k}={show(v) if v is not None else 'none (from the model, at bind)'}"
                      for k, v in paper_sizes(cls).items())
    if rules or sizes:
        rules = "; here paper sets " + rules + ("; and sizes, which a value given replaces: " + sizes if sizes else "")
    else:
        rules = "; here the defaults are the paper's rules" if cls.has_paper else "; no paper here: paper is the defaults"
    return [f"{n + '=' + show(f.default):<{width}}  {bounds_text(f)}: {meaning(f)}" + (rules if n == "preset" else "")
            for n, f in fs.items()]

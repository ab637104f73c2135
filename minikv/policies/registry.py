"""The policy registry and spec strings: `register` (public as minikv.register_policy) makes a
Policy subclass known by its name; `make("name:key=value,...")` builds one, each value parsed as
its parameter's declared type (params.py); `available()` lists the names, those of installed
packages' entry points included (plugins.py).
"""
from __future__ import annotations

from .contract import Policy
from .params import PRESETS, declarations, parse_value, value_type

_REGISTRY: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Class decorator: make a Policy subclass available by its `name` to make(), --policy,
    bench compare and minikv.hf (public as minikv.register_policy; docs/extending.md). A policy
    is a dataclass: write @register_policy above @dataclass(eq=False, kw_only=True)."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise TypeError(f"register_policy takes a subclass of minikv.policies.Policy, got {cls!r}")
    if not cls.name or not cls.name.replace("_", "").isalnum():
        raise ValueError(f"{cls.__name__}.name must be a word (letters, digits, _), got {cls.name!r}")
    old = _REGISTRY.get(cls.name)
    if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
        raise ValueError(f"policy name {cls.name!r} is taken by {old.__module__}.{old.__qualname__}")
    _REGISTRY[cls.name] = cls
    return cls


register_policy = register


def discover() -> None:
    """Import the policies installed packages declare (entry-point group minikv.policies), once."""
    from ..plugins import load_entry_points

    load_entry_points()


def available() -> list[str]:
    discover()
    return sorted(_REGISTRY)


def parameters(cls: type[Policy]) -> dict:
    """name -> dataclass field of each parameter of a policy class (params.declarations)."""
    return declarations(cls)


def make(spec: "str | Policy", **overrides) -> Policy:
    """Build a policy from a spec string "name:key=value,key=value" (or pass a Policy through);
    "name:paper,..." is "name:preset=paper,..." (params.py, the paper as a preset).

    Unknown names or parameters raise ValueError listing what exists; each value is parsed as
    its parameter's type (its declaration, params.py), so `speculative=maybe` or `window=abc`
    fail here, with no model, as does whatever the policy's checks refuse.
    """
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a policy spec is a non-empty string like 'streaming:sink=4', got {spec!r}")
    name, _, rest = spec.strip().partition(":")
    name = name.strip()
    if name not in _REGISTRY:
        discover()
    if name not in _REGISTRY:
        raise ValueError(f"unknown policy {name!r}; available: {', '.join(available())}")
    cls = _REGISTRY[name]
    known = parameters(cls)
    kwargs = {}
    for item in filter(None, (s.strip() for s in rest.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq and key in PRESETS:  # the alias NAME:paper for NAME:preset=paper
            key, eq, value = "preset", "=", key
        if not eq:
            raise ValueError(f"policy parameter {item!r} in {spec!r} is not of the form key=value")
        if key not in known:
            raise ValueError(f"policy {name!r} has no parameter {key!r}; parameters: {', '.join(known)}")
        if key in kwargs:  # not the last one silently: which did the user mean?
            raise ValueError(f"policy {name!r}: parameter {key!r} is given twice in {spec!r}")
        kind, nullable = value_type(known[key])
        kwargs[key] = parse_value(value.strip(), kind, nullable, where=f"policy {name!r}: {key}")
    for key in overrides:
        if key not in known:
            raise ValueError(f"policy {name!r} has no parameter {key!r}; parameters: {', '.join(known)}")
    kwargs.update(overrides)
    return cls(**kwargs)  # Policy.__new__ refuses a parameter given against preset=paper

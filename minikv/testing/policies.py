"""check_policy: the policy contract (policies/contract.py) as one matrix, for minikv's policies and yours.

    from minikv.testing import check_policy
    check_policy("h2o")            # a registered name, a spec ("h2o:budget=16,window=4") or the class

It raises PolicyContractError (an AssertionError) naming the check, the model and the spec, or
returns a dict of what it ran. The data it needs is declared on the policy class (contract.Policy,
"What check_policy reads"): a covering spec, a small spec and its budget, the stats keys the
policy adds, whether it offloads, whether its prefill equals token-by-token decoding. On tiny
random models of every family minikv loads (built here, seeded: nothing to download) and, when
present, SmolLM2, it checks:

    covering     a budget covering the context gives full KV's logits
    budget       at the small spec, no decode step's attention reads more than the budget
    stats        stats() carries the base keys and the declared ones
    attended     each decode step's layer output equals dense attention over attended_indices()
                 (None: every token), for every backend the policy implements (reference, eager,
                 triton: in Triton's interpreter without CUDA)
    offload      a policy that offloads moves KV to the host, and every K or V row that comes back
                 to the device through its Tiers is bit for bit a row it was given
    prefill      where declared: the prompt's logits equal those of feeding it token by token
    per-run state  one policy object run twice gives what a fresh one gives (stats and logits):
                 what a run changes lives on the layers, which bind rebuilds
    oracle       given oracle=: at every decode step of the small spec's run, each layer and KV
                 head attends exactly the tokens your transcription of the paper says (oracle.py)
    reference    backend=reference greedy-decodes the default backend's tokens
    refusals     a value a parameter's declaration refuses is a ValueError naming the parameter;
                 a batch past max_batch, and a sliding-window model it cannot serve, are refused
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ..kernels import BACKENDS, check_backend, policy_backends
from ..policies.contract import Policy
from ..policies.registry import _REGISTRY, discover, make, parameters
from ..policies.params import value_type
from .models import FAMILIES, tiny_model
from .recorder import fail as _fail
from .runs import NEW, PROMPT, device_of, greedy, random_ids, run
from .tolerances import default_device

BASE_STATS = ("policy", "device_tokens", "host_tokens", "device_tokens_peak", "kv_bytes_read_per_step",
              "device_bytes", "host_bytes", "device_bytes_allocated", "host_bytes_allocated", "bytes_to_host",
              "bytes_to_device", "device_tokens_per_layer", "host_tokens_per_layer")

def check_policy(spec_or_class, *, oracle=None, families=tuple(FAMILIES), smollm2="auto", backends=None,
                 device=None) -> dict:
    """Run the contract matrix (module docstring) for one policy. spec_or_class: a registered name,
    a spec (it replaces the declared small spec, and its `budget` the declared small budget) or a
    Policy subclass. oracle: your transcription of the paper (oracle.py, Step), run beside the
    small spec's run on every tiny model: it fails at the first decode step, layer and KV head
    whose attended tokens differ from the oracle's. smollm2: "auto" (when the bundled model is
    present), False, or a loaded (model, tokenizer). backends: those to check the attended outputs
    on (default: every backend the policy implements that runs here). device: where the models and
    policies run (default: default_device(), the GPU when there is one; a loaded SmolLM2 runs
    where it was loaded). Returns {check: [where it ran]}."""
    cls, small, budget = _resolve(spec_or_class)
    if oracle is not None and not cls.reports_attended:
        raise ValueError(f"oracle= is compared with attended_indices(), which {cls.__name__} declares it does "
                         f"not report (reports_attended = False)")
    device = default_device() if device is None else torch.device(device)
    covering = _own(cls, cls.covering_spec or cls.name)
    ran: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as work:
        _refusals(cls)
        ran["refusals"] = [cls.name]
        for family in families:
            model = tiny_model(family, device=device)
            where = f"{cls.name} on the tiny {family} model"
            spec = cls.spec_for_model(small, model.cfg, Path(work))
            if not _accepts(cls, spec, model, where):
                ran.setdefault("sliding-window refusal", []).append(family)
                continue
            ids = random_ids(model)
            _covering(cls, model, ids, cls.spec_for_model(covering, model.cfg, Path(work)), where)
            _small(cls, model, ids, spec, budget, where, oracle)
            if cls.prefill_equals_decoding:
                _prefill(model, ids, spec, where)
            checks = ("covering", "budget", "stats", "attended", "offload") + ("prefill",) * cls.prefill_equals_decoding
            for check in checks + ("oracle",) * (oracle is not None):
                ran.setdefault(check, []).append(family)
            if family == families[0]:
                _per_run_state(model, ids, spec, where)
                ran["per-run state"] = [family]
                for backend in _backends(cls, backends):
                    steps = 1 if backend == "triton" else NEW  # the interpreter: seconds per step
                    run(model, ids[:, :PROMPT + steps], _with(spec, backend=backend), f"{where}, backend={backend}",
                         attended=cls.reports_attended)
                    ran.setdefault("attended", []).append(f"{family}, backend={backend}")
                _same_tokens(model, ids[:, :PROMPT], spec, 8, where)
                ran.setdefault("reference", []).append(family)
        real = _smollm2(smollm2, device)
        if real is not None:
            model, tok = real
            ids = torch.tensor([tok.encode("The three primary colours are red, yellow and blue. " * 5)],
                               device=device_of(model))  # ~60 tokens
            where = f"{cls.name} on SmolLM2"
            spec = cls.spec_for_model(small, model.cfg, Path(work))
            _covering(cls, model, ids, cls.spec_for_model(covering, model.cfg, Path(work)),
                      where, prompt=ids.shape[1] - 4, tol=1e-4)
            _same_tokens(model, ids, spec, 4, where)
            ran["covering"].append("smollm2")
            ran["reference"].append("smollm2")
    return ran


# -- the checks ----------------------------------------------------------------------------------


def _covering(cls, model, ids, spec, where, prompt=PROMPT, tol=1e-5):
    """tol: 1e-5 on the tiny models; SmolLM2's logits are some 100 times larger (1e-4)."""
    expect, _ = run(model, ids, "full", where, prompt=prompt)
    got, _ = run(model, ids, spec, where, prompt=prompt)
    if not torch.allclose(got, expect, rtol=tol, atol=tol):
        _fail(where, f"covering: {spec} does not give full KV's logits (max difference "
                     f"{(got - expect).abs().max():.3g})")


def _small(cls, model, ids, spec, budget, where, oracle=None):
    _, policy = run(model, ids, spec, where, budget=budget, attended=cls.reports_attended,
                     rows_back=True, oracle=oracle)
    s = policy.stats()
    missing = sorted((set(BASE_STATS) | set(cls.stats_keys)) - set(s))
    if missing:
        _fail(where, f"stats: {spec}'s stats() lacks {', '.join(missing)}")
    if cls.offloads and not (s["host_tokens"] > 0 and s["bytes_to_host"] > 0 and s["bytes_to_device"] > 0):
        _fail(where, f"offload: {cls.__name__}.offloads is True but {spec} moved no KV to the host and back")


def _prefill(model, ids, spec, where):
    T, device = PROMPT, device_of(model)
    whole = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=T)
    expect = model(ids[:, :T], policy=whole)[0]  # (T, V)
    one, got = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=T), []
    for t in range(T):
        got.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]], device=device), policy=one)[0, -1])
    if not torch.allclose(torch.stack(got), expect, rtol=1e-4, atol=1e-4):
        _fail(where, f"prefill: {spec}'s prefill differs from feeding the prompt token by token "
                     f"(declared prefill_equals_decoding = True)")


def _per_run_state(model, ids, spec, where):
    """One policy object run twice (two generate calls bind it twice) runs as a fresh one each
    time: what a run changes lives on the layers, which bind rebuilds. A stat or a logit that
    differs between the object's two runs, but not between two fresh objects' runs (timings do),
    is state carried on the Policy from one run to the next."""
    again = make(spec)
    first, _ = run(model, ids, again, where)
    before = again.stats()
    second, _ = run(model, ids, again, where)
    fresh, other = run(model, ids, spec, where)
    after, control = again.stats(), other.stats()
    for key, value in before.items():
        if repr(after.get(key)) != repr(value) and repr(control.get(key)) == repr(value):
            _fail(where, f"per-run state: {spec} run a second time reports {key} = {after.get(key)!r}, "
                         f"{value!r} the first time: state kept on the Policy carries from one run (one generate "
                         f"call) to the next; keep it on the layers, which bind rebuilds")
    if not torch.equal(second, first) and torch.equal(fresh, first):
        _fail(where, f"per-run state: {spec} run a second time gives other logits than the first time (max "
                     f"difference {(second - first).abs().max():.3g}): state kept on the Policy carries from "
                     f"one run to the next; keep it on the layers, which bind rebuilds")


def _same_tokens(model, ids, spec, new, where):
    """backend=reference decodes the default's tokens, and keeps as many on each tier."""
    default, d = greedy(model, ids, spec, new)
    reference, r = greedy(model, ids, _with(spec, backend="reference"), new)
    if reference != default:
        _fail(where, f"reference: backend=reference decodes {reference}, the default backend {default} ({spec})")
    for key in ("device_tokens", "host_tokens"):
        if r[key] != d[key]:
            _fail(where, f"reference: {key} is {r[key]} with backend=reference, {d[key]} with the default ({spec})")


def _refusals(cls):
    for key, value in _bad_values(cls):
        try:
            make(f"{cls.name}:{key}={value}")
        except ValueError as err:
            if key not in str(err):
                _fail(cls.name, f"refusals: {cls.name}:{key}={value} is refused without naming {key}: {err}")
        else:
            _fail(cls.name, f"refusals: {cls.name}:{key}={value} is accepted; its declaration refuses it")
    if cls.max_batch is not None:
        cfg = tiny_model("llama_gqa").cfg
        try:  # refused before anything is allocated: any device will do
            make(cls.name).bind(cfg, device=default_device(), dtype=torch.float32, max_len=16,
                                batch_size=cls.max_batch + 1)
        except ValueError as err:
            if "batch" not in str(err):
                _fail(cls.name, f"refusals: a batch past max_batch is refused without saying so: {err}")
        else:
            _fail(cls.name, f"refusals: a batch of {cls.max_batch + 1} is accepted (max_batch = {cls.max_batch})")


def _bad_values(cls):
    """(parameter, a value its declaration refuses) for every parameter of a policy class."""
    for key, f in parameters(cls).items():
        kind, _ = value_type(f)
        m = f.metadata
        if kind == "float":
            yield from ((key, "nan"), (key, "inf"))
        if kind in ("int", "float") and m["low"] is not None:
            yield key, str(m["low"] - 1)
        if kind in ("int", "float") and m["high"] is not None:
            yield key, str(m["high"] * 2 + 1)
        if kind in ("int", "float", "bool"):
            yield key, "abc"
        if m["choices"]:
            yield key, "no_such_choice"


def _accepts(cls, spec, model, where) -> bool:
    """False when the policy refuses the model's sliding window (then with a message saying so)."""
    try:
        make(spec).bind(model.cfg, device=device_of(model), dtype=torch.float32, max_len=PROMPT + NEW)
    except ValueError as err:
        if model.cfg.sliding_window is None or "sliding" not in str(err):
            _fail(where, f"bind: {spec} is refused: {err}")
        return False
    return True


# -- helpers -------------------------------------------------------------------------------------


def _resolve(spec_or_class) -> tuple[type[Policy], str, int | None]:
    """(the policy class, the small spec to run, its budget: the declared one, or for a spec given
    here the `budget` its policy derives)."""
    discover()
    if isinstance(spec_or_class, type) and issubclass(spec_or_class, Policy):
        cls, spec = spec_or_class, None
    elif isinstance(spec_or_class, str):
        name, _, rest = spec_or_class.partition(":")
        make(spec_or_class)  # unknown names and bad values fail here
        cls, spec = _REGISTRY[name.strip()], spec_or_class if rest.strip() else None
    else:
        raise TypeError(f"check_policy takes a policy name, spec or class, got {spec_or_class!r}")
    if _REGISTRY.get(cls.name) is not cls:
        raise ValueError(f"{cls.__name__} is not registered: decorate it with @minikv.register_policy")
    if spec is not None:
        return cls, spec, getattr(make(spec), "budget", None)
    return cls, _own(cls, cls.small_spec or cls.name), cls.small_budget


def _own(cls, spec: str) -> str:
    """A declared spec under cls's own name where it names a class cls derives from (a subclass
    inherits its parent's covering_spec and small_spec, and runs them as itself)."""
    name, colon, rest = spec.partition(":")
    parent = _REGISTRY.get(name.strip())
    return f"{cls.name}{colon}{rest}" if parent is not None and parent is not cls and issubclass(cls, parent) else spec


def _with(spec: str, **items) -> str:
    extra = ",".join(f"{k}={v}" for k, v in items.items())
    return f"{spec}{',' if ':' in spec else ':'}{extra}"


def _backends(cls, asked):
    """The backends to check: those asked, else the built-in ones the policy implements."""
    out = []
    for backend in asked or [b for b in policy_backends(cls.kernels) if b in BACKENDS]:
        try:
            check_backend(backend, cls.kernels, cls.name)
        except ValueError:
            continue  # triton with no CUDA and no interpreter
        out.append(backend)
    return out






def _smollm2(smollm2, device):
    if smollm2 is False or smollm2 is None:
        return None
    if smollm2 != "auto":
        return smollm2
    from ..loading import load

    try:
        return load("smollm2", device=device, dtype=torch.float32, progress=False)
    except (OSError, ValueError):
        return None

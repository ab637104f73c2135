"""check_policy: the policy contract (policies/base.py) as one matrix, for minikv's policies and yours.

    from minikv.testing import check_policy
    check_policy("h2o")            # a registered name, a spec ("h2o:budget=16,window=4") or the class

It raises PolicyContractError (an AssertionError) naming the check, the model and the spec, or
returns a dict of what it ran. The data it needs is declared on the policy class (base.Policy,
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
    reference    backend=reference greedy-decodes the default backend's tokens
    refusals     a value a parameter's declaration refuses is a ValueError naming the parameter;
                 a batch past max_batch, and a sliding-window model it cannot serve, are refused
"""
from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from ..kernels import BACKENDS, check_backend, policy_backends
from ..policies.base import Policy, _REGISTRY, discover, make, parameters
from ..policies.params import value_type
from ..policies.window import governed_config
from .models import FAMILIES, tiny_model
from .recorder import Recorder, fail as _fail
from .tolerances import default_device

PROMPT, NEW = 80, 40  # tokens of the tiny models' runs: 120 of their 128 positions
BASE_STATS = ("policy", "device_tokens", "host_tokens", "device_tokens_peak", "kv_bytes_read_per_step",
              "device_bytes", "host_bytes", "device_bytes_allocated", "host_bytes_allocated", "bytes_to_host",
              "bytes_to_device", "device_tokens_per_layer", "host_tokens_per_layer")

def check_policy(spec_or_class, *, families=tuple(FAMILIES), smollm2="auto", backends=None, device=None) -> dict:
    """Run the contract matrix (module docstring) for one policy. spec_or_class: a registered name,
    a spec (it replaces the declared small spec, and its `budget` the declared small budget) or a
    Policy subclass. smollm2: "auto"
    (when the bundled model is present), False, or a loaded (model, tokenizer). backends: those to
    check the attended outputs on (default: every backend the policy implements that runs here).
    device: where the models and policies run (default: default_device(), the GPU when there is
    one; a loaded SmolLM2 runs where it was loaded). Returns {check: [where it ran]}."""
    cls, small, budget = _resolve(spec_or_class)
    device = default_device() if device is None else torch.device(device)
    ran: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as work:
        _refusals(cls)
        ran["refusals"] = [cls.name]
        for family in families:
            model = tiny_model(family, device=device)
            where = f"{cls.name} on the tiny {family} model"
            governed = governed_config(model.cfg, PROMPT + NEW)  # a hybrid model's global layers
            spec = cls.spec_for_model(small, governed, Path(work))
            if not _accepts(cls, spec, model, where):
                ran.setdefault("sliding-window refusal", []).append(family)
                continue
            ids = _random_ids(model)
            _covering(cls, model, ids, cls.spec_for_model(cls.covering_spec or cls.name, governed, Path(work)), where)
            _small(cls, model, ids, spec, budget, where)
            if cls.prefill_equals_decoding:
                _prefill(model, ids, spec, where)
            for check in ("covering", "budget", "stats", "attended", "offload") + ("prefill",) * cls.prefill_equals_decoding:
                ran.setdefault(check, []).append(family)
            if family == families[0]:
                for backend in _backends(cls, backends):
                    steps = 1 if backend == "triton" else NEW  # the interpreter: seconds per step
                    _run(model, ids[:, :PROMPT + steps], _with(spec, backend=backend), f"{where}, backend={backend}",
                         attended=cls.reports_attended)
                    ran.setdefault("attended", []).append(f"{family}, backend={backend}")
                _same_tokens(model, ids[:, :PROMPT], spec, 8, where)
                ran.setdefault("reference", []).append(family)
        real = _smollm2(smollm2, device)
        if real is not None:
            model, tok = real
            ids = torch.tensor([tok.encode("The three primary colours are red, yellow and blue. " * 5)],
                               device=_device(model))  # ~60 tokens
            where = f"{cls.name} on SmolLM2"
            spec = cls.spec_for_model(small, model.cfg, Path(work))
            _covering(cls, model, ids, cls.spec_for_model(cls.covering_spec or cls.name, model.cfg, Path(work)),
                      where, prompt=ids.shape[1] - 4, tol=1e-4)
            _same_tokens(model, ids, spec, 4, where)
            ran["covering"].append("smollm2")
            ran["reference"].append("smollm2")
    return ran


# -- the checks ----------------------------------------------------------------------------------


def _covering(cls, model, ids, spec, where, prompt=PROMPT, tol=1e-5):
    """tol: 1e-5 on the tiny models; SmolLM2's logits are some 100 times larger (1e-4)."""
    expect, _ = _run(model, ids, "full", where, prompt=prompt)
    got, _ = _run(model, ids, spec, where, prompt=prompt)
    if not torch.allclose(got, expect, rtol=tol, atol=tol):
        _fail(where, f"covering: {spec} does not give full KV's logits (max difference "
                     f"{(got - expect).abs().max():.3g})")


def _small(cls, model, ids, spec, budget, where):
    _, policy = _run(model, ids, spec, where, budget=budget, attended=cls.reports_attended,
                     rows_back=True)
    s = policy.stats()
    missing = sorted((set(BASE_STATS) | set(cls.stats_keys)) - set(s))
    if missing:
        _fail(where, f"stats: {spec}'s stats() lacks {', '.join(missing)}")
    if cls.offloads and not (s["host_tokens"] > 0 and s["bytes_to_host"] > 0 and s["bytes_to_device"] > 0):
        _fail(where, f"offload: {cls.__name__}.offloads is True but {spec} moved no KV to the host and back")


def _prefill(model, ids, spec, where):
    T, device = PROMPT, _device(model)
    whole = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=T)
    expect = model(ids[:, :T], policy=whole)[0]  # (T, V)
    one, got = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=T), []
    for t in range(T):
        got.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]], device=device), policy=one)[0, -1])
    if not torch.allclose(torch.stack(got), expect, rtol=1e-4, atol=1e-4):
        _fail(where, f"prefill: {spec}'s prefill differs from feeding the prompt token by token "
                     f"(declared prefill_equals_decoding = True)")


def _same_tokens(model, ids, spec, new, where):
    """backend=reference decodes the default's tokens, and keeps as many on each tier."""
    default, d = _greedy(model, ids, spec, new)
    reference, r = _greedy(model, ids, _with(spec, backend="reference"), new)
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
        make(spec).bind(model.cfg, device=_device(model), dtype=torch.float32, max_len=PROMPT + NEW)
    except ValueError as err:
        if model.cfg.sliding_window is None or "sliding" not in str(err):
            _fail(where, f"bind: {spec} is refused: {err}")
        return False
    return True


# -- runs ----------------------------------------------------------------------------------------


def _run(model, ids, spec, where, prompt=PROMPT, budget=None, attended=False, rows_back=False):
    """Prefill `prompt` tokens, feed the rest one by one, checking what was asked on every step ->
    (logits (steps, V), the policy)."""
    device = _device(model)
    policy = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=ids.shape[1])
    # policy.cfg: the layers the policy governs (a hybrid model's global ones, no window left)
    seen = Recorder(policy, policy.cfg, where, spec, attended) if attended or rows_back else None
    out = [model(ids[:, :prompt], policy=policy)[:, -1]]
    for t in range(prompt, ids.shape[1]):
        out.append(model(ids[:, t:t + 1], positions=torch.tensor([[t]], device=device), policy=policy)[:, -1])
        if budget is not None:
            _check_budget(policy, budget, where, spec)
    return torch.stack(out), policy


def _check_budget(policy, budget, where, spec):
    most = 0
    for layer in policy.layers:
        read = layer.attended_indices()
        for h in layer.budget_heads():
            most = max(most, layer.device_tokens() if read is None else int((read[h] >= 0).sum()))
    if not 0 < most <= budget:
        _fail(where, f"budget: a decode step of {spec} read {most} tokens for one KV head (declared small_budget {budget})")


def _greedy(model, ids, spec, new) -> tuple[list[int], dict]:
    device = _device(model)
    policy = make(spec).bind(model.cfg, device=device, dtype=torch.float32, max_len=ids.shape[1] + new)
    T, tokens = ids.shape[1], []
    nxt = model(ids, policy=policy)[:, -1].argmax(-1)
    for t in range(T, T + new - 1):
        tokens.append(int(nxt))
        nxt = model(nxt[:, None], positions=torch.tensor([[t]], device=device), policy=policy)[:, -1].argmax(-1)
    return tokens + [int(nxt)], policy.stats()


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
    return cls, cls.small_spec or cls.name, cls.small_budget


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


def _device(model) -> torch.device:
    return model.embed.weight.device


def _random_ids(model, n=PROMPT + NEW, seed=1):
    # drawn on the CPU's generator (the same ids on every device), then moved to the model
    ids = torch.randint(0, model.cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))
    return ids.to(_device(model))


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

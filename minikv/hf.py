"""minikv's KV-cache policies inside Hugging Face transformers models (transformers 5).

    import minikv.hf
    with minikv.hf.policy(model, "freekv:budget=256") as run:
        out = model.generate(input_ids, max_new_tokens=64)
    run.stats()                       # the policy's stats(), as minikv's own runtime reports them

    cache = minikv.hf.cache(model, "streaming:budget=512", max_new_tokens=64)  # or a cache
    out = model.generate(input_ids, **{minikv.hf.cache_argument(model): cache}, max_new_tokens=64)

`cache_argument` names the forward's Cache argument: `cache` from transformers 5.24,
`past_key_values` before. transformers is an optional extra (`pip install minikv[hf]`); only this
module imports it, and only when it is imported itself. A transformers layer hands k and v to its
cache and the query to its attention function; a policy needs both at once. Where to read what:

    PolicyCache, PolicyLayer   a Cache that stores nothing: `update` notes the new k and returns
                               it; get_seq_length counts the tokens seen; get_mask_sizes
                               describes exactly what `update` returned
    attention                  the "minikv" attention function (AttentionInterface): the
                               policy's prefill or decode; plain SDPA without a PolicyCache
    PolicyCache.begin, end     from hooks on the forward: bind the policy at the first forward,
                               hand the next-token logits to `policy.end_step` after each
    _rope_positions            a hook on the rotary embedding: `policy.rope_positions` (streaming)
    PolicyRun.generate         a rewind (softfreeze's rewalk) restarts `generate` from the kept
                               tokens, same cache; in a loop of your own, read `cache.last_action`

Decisions (docs/design.md, "The flow of one request"): attention checks by identity that its keys
are those `update` just returned; the policy masks itself, so a padding mask is refused; the hooks
find the PolicyCache by its type, not by the argument's name, which transformers changed in 5.24.
"""
from __future__ import annotations

import inspect
import math
import threading
import typing
from contextlib import contextmanager

import torch

try:
    import transformers
    from transformers import AttentionInterface, Cache
    from transformers.cache_utils import CacheLayerMixin
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("minikv.hf needs transformers 5: pip install 'minikv[hf]'") from err

from .config import ModelConfig, _rope_params
from .models.rope import rope_inv_freq
from .policies import Policy, make

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"minikv.hf needs transformers >= 5 (its Cache-layer API), found {transformers.__version__}")

ATTENTION = "minikv"  # the name under which the attention function is registered
_active = threading.local()  # .cache: the PolicyCache of the forward now running, if any


class _Rewind(Exception):
    """Raised out of a forward inside `policy(...)` when the policy rewound: generate restarts."""


# -- the model's shape, for binding ---------------------------------------------------------------


def model_config(config) -> tuple[ModelConfig, bool]:
    """minikv's ModelConfig for a transformers config, and whether minikv computes the same RoPE
    frequencies (only policies that re-rotate keys need them)."""
    c = config.get_text_config(decoder=True)
    raw = c.to_dict()
    n_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    params = raw.get("rope_parameters") or {}
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", raw.get("rotary_pct", 1.0)))
    rotary_dim = int(head_dim * partial)
    theta, scaling = _rope_params(raw)
    try:
        rope_inv_freq(rotary_dim, theta, scaling)
        rope_known = True
    except (ValueError, KeyError):  # a RoPE type minikv does not implement (yarn, dynamic, ...)
        scaling, rope_known = None, False
    types = set(getattr(c, "layer_types", None) or [])
    if types - {"full_attention", "sliding_attention"} or len(types) > 1:
        raise ValueError(f"minikv.hf: layers of types {sorted(types)}; minikv policies hold models whose "
                         "layers all use the same attention (all full, or all one sliding window)")
    window = getattr(c, "sliding_window", None) if (not types or types == {"sliding_attention"}) else None
    cfg = ModelConfig(
        model_type=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=getattr(c, "intermediate_size", 4 * c.hidden_size), n_layers=c.num_hidden_layers,
        n_heads=n_heads, n_kv_heads=getattr(c, "num_key_value_heads", None) or n_heads, head_dim=head_dim,
        max_position_embeddings=c.max_position_embeddings, rope_theta=theta, rope_scaling=scaling,
        rotary_dim=rotary_dim, sliding_window=window,
    )
    return cfg, rope_known


def renumbers(policy: Policy) -> bool:
    """Does the policy rotate q and k at positions other than the absolute ones?"""
    return type(policy).rope_positions is not Policy.rope_positions


# -- the cache ------------------------------------------------------------------------------------


class PolicyLayer(CacheLayerMixin):
    """One layer of a PolicyCache: notes the new k, returns it; the policy stores it at attention."""

    is_compileable = False
    is_sliding = False
    is_croppable = False

    def __init__(self, cache: "PolicyCache", index: int):
        super().__init__()
        self.cache, self.index = cache, index
        self.pending = None  # the key tensor update() returned, until attention consumes it

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        # key_states, value_states (B, Hkv, T, D), RoPE applied
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if _active_cache() is not self.cache:
            raise RuntimeError("minikv.hf: a PolicyCache was used by a model it is not attached to; "
                               "make it with minikv.hf.cache(model, ...) for that model")
        self.pending = key_states
        return key_states, value_states

    def get_seq_length(self) -> int:
        return self.cache.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # update() returns the new tokens only: keys seen .. seen + query_length - 1
        return query_length, self.cache.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        raise ValueError("minikv.hf: a PolicyCache follows one generation; make a new one")

    def _refuse(self, *args, **kwargs):
        raise ValueError("minikv.hf: a policy cache cannot be cropped, reordered or repeated "
                         "(beam search, assisted decoding and contrastive search are not supported)")

    crop = reorder_cache = batch_repeat_interleave = batch_select_indices = offload = prefetch = _refuse


class PolicyCache(Cache):
    """A transformers Cache whose storage is a minikv policy. Give it to one generation."""

    def __init__(self, model, spec, *, max_new_tokens: int | None = None, max_len: int | None = None):
        self.cfg, self.rope_known = model_config(model.config)
        super().__init__(layers=[PolicyLayer(self, i) for i in range(self.cfg.n_layers)])
        self.policy = make(spec)
        self.model = model
        self.max_new_tokens, self.max_len = max_new_tokens, max_len
        self.seen = 0  # tokens whose KV the policy holds (or dropped): positions continue here
        self.tokens = None  # (B, seen) ids fed so far, for a rewind's restart
        self.positions = None  # (B, T) absolute positions of the forward now running
        self.last_action = None  # the policy's StepAction after the last forward
        self.in_generate = False  # inside minikv.hf.policy's generate: a rewind restarts it

    def __repr__(self):
        return f"PolicyCache({self.policy.name}, seen={self.seen})"

    def stats(self) -> dict:
        if not self.policy.bound:
            raise ValueError("minikv.hf: the policy is bound at the first forward; no stats before it")
        return self.policy.stats()

    # -- one forward -----------------------------------------------------------------------------
    def begin(self, ids, embeds, position_ids) -> None:
        B, T = (ids if ids is not None else embeds).shape[:2]
        if not self.policy.bound:
            self._bind(B, T)
        elif self.policy.batch_size != B:
            raise ValueError(f"minikv.hf: batch size changed from {self.policy.batch_size} to {B}")
        elif T != 1:
            raise ValueError(f"minikv.hf: after the prompt, a policy takes one token per forward, got {T} "
                             "(chunked prefill and assisted decoding are not supported)")
        device = (ids if ids is not None else embeds).device
        self.positions = (torch.arange(T, device=device) + self.seen).expand(B, T)
        if position_ids is not None and not torch.equal(position_ids.to(device).expand(B, T), self.positions):
            raise ValueError(f"minikv.hf: position_ids start at {int(position_ids.flatten()[0])}, but the cache "
                             f"has seen {self.seen} tokens (left padding and gaps are not supported)")
        if ids is not None:  # after a rewind, tokens ends with the token fed again now: drop that copy
            kept = self.tokens[:, : self.seen] if self.tokens is not None else ids[:, :0]
            self.tokens = torch.cat((kept, ids.to(kept.device)), 1)

    def _bind(self, B: int, T: int) -> None:
        if self.max_len is None and self.max_new_tokens is None:
            raise ValueError("minikv.hf: give max_new_tokens (or max_len) so the policy can size its cache")
        max_len = self.max_len if self.max_len is not None else T + self.max_new_tokens
        p = self.policy
        p.bind(self.cfg, device=self.model.device, dtype=self.model.dtype, max_len=max_len, batch_size=B)
        if renumbers(p):
            if not self.rope_known:
                raise ValueError(f"minikv.hf: policy {p.name!r} renumbers positions, and minikv does not "
                                 "implement this model's RoPE scaling; use a policy that keeps positions")
            _check_rope(self.model, p)

    def attend(self, i: int, q, k, v, mask, kwargs) -> torch.Tensor:
        # q (B, Hq, T, D); k, v (B, Hkv, T, D) -> (B, T, Hq, D), the layout attention functions return
        if mask is not None:
            raise ValueError("minikv.hf: the attention mask masks some tokens (padding?); minikv policies "
                             "take unpadded sequences")
        if kwargs.get("sliding_window") != self.cfg.sliding_window:
            raise ValueError(f"minikv.hf: layer {i} uses a sliding window of {kwargs.get('sliding_window')}, "
                             f"the model config says {self.cfg.sliding_window}")
        layer = self.policy.layer(i)
        if self.policy.steps == 0:
            out = layer.prefill(q, k, v, self.positions)
        else:
            out = layer.decode(q, k, v, self.positions)
        return out.transpose(1, 2).contiguous()

    def end(self, logits) -> None:
        """After a forward: the policy's per-step bookkeeping, then a rewind if it asks for one."""
        T = self.positions.shape[1]
        last = logits[:, -1].float() if logits is not None else None  # (B, V)
        action = self.policy.end_step(last)
        self.policy.last_action = self.last_action = action
        self.seen += T
        n = action.rewind if action is not None else 0
        if n:
            # the policy dropped the KV at positions seen-n .. seen-1; the first of them is fed again
            self.seen -= n
            if self.tokens is not None:
                self.tokens = self.tokens[:, : self.seen + 1]
            if self.in_generate:
                raise _Rewind(n)


def _check_rope(model, policy) -> None:
    """A renumbering policy rotates keys with minikv's RoPE: it must be the model's."""
    found = False
    for module in _rotary_modules(model):
        inv = getattr(module, "inv_freq", None)
        if inv is None:
            continue
        found = True
        scale = getattr(module, "attention_scaling", 1.0)
        ours = policy.rope.inv_freq.to(inv.device, inv.dtype)
        if inv.shape != ours.shape or not torch.allclose(inv, ours, rtol=1e-6, atol=0) or scale != 1.0:
            raise ValueError(f"minikv.hf: policy {policy.name!r} renumbers positions, and this model's RoPE "
                             f"({type(module).__name__}) differs from minikv's; use a policy that keeps positions")
    if not found:
        raise ValueError(f"minikv.hf: policy {policy.name!r} renumbers positions, and no rotary embedding "
                         "module was found in this model to rotate at the new positions")


# -- the attention function, the hooks -----------------------------------------------------------


def _active_cache():
    return getattr(_active, "cache", None)


def attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """The "minikv" attention function: the policy's attention when a PolicyCache is running."""
    cache = _active_cache()
    i = getattr(module, "layer_idx", None)
    if cache is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    layer = cache.layers[i] if isinstance(i, int) and 0 <= i < len(cache.layers) else None
    if layer is None or layer.pending is not key:
        raise RuntimeError(f"minikv.hf: attention of layer {i} did not receive the keys its cache layer "
                           "returned; this architecture is not supported")
    layer.pending = None
    D = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, D ** -0.5, rel_tol=1e-6):
        raise ValueError(f"minikv.hf: attention scale {scaling} is not 1/sqrt(head_dim); not supported")
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or dropout:
        raise ValueError("minikv.hf: logit softcapping, attention sinks and dropout are not supported")
    return cache.attend(i, query, key, value, attention_mask, kwargs), None


def _rotary_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]


def _policy_cache(args, kwargs) -> PolicyCache | None:
    """The PolicyCache among a forward's arguments, whatever transformers calls that argument."""
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, PolicyCache)), None)


def cache_argument(model) -> str:
    """The name of the argument through which the model's forward, and so `generate`, takes its
    Cache: the parameter of `forward` annotated as a Cache (`past_key_values` until transformers
    5.23, `cache` from 5.24, where the old name still works with a deprecation warning)."""
    for name, p in inspect.signature(model.forward).parameters.items():
        if p.annotation is Cache or Cache in typing.get_args(p.annotation):
            return name
    raise ValueError(f"minikv.hf: {type(model).__name__}.forward declares no Cache argument; "
                     "it cannot run a policy")


def _before_forward(module, args, kwargs):
    cache = _policy_cache(args, kwargs)
    if cache is None:
        _active.cache = None
        return None
    ids = kwargs.get("input_ids", args[0] if args else None)
    cache.begin(ids, kwargs.get("inputs_embeds"), kwargs.get("position_ids"))
    _active.cache = cache
    return None


def _after_forward(module, args, kwargs, output):
    cache = _policy_cache(args, kwargs)
    if cache is None or _active_cache() is not cache:
        return None
    _active.cache = None
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, tuple) and output and output[0].shape[-1] == cache.cfg.vocab_size:
        logits = output[0]
    cache.end(logits)
    return None


def _rope_positions(module, args, kwargs):
    # the rotary embedding's forward(x, position_ids): rotate at the positions the policy asks for
    cache = _active_cache()
    if cache is None or not renumbers(cache.policy):
        return None
    if "position_ids" in kwargs:
        kwargs = {**kwargs, "position_ids": cache.policy.rope_positions(kwargs["position_ids"])}
    else:
        args = (args[0], cache.policy.rope_positions(args[1]), *args[2:])
    return args, kwargs


def attach(model) -> None:
    """Route the model's attention through minikv (idempotent; `detach` undoes it). Without a
    PolicyCache the model runs exactly as with SDPA."""
    if getattr(model, "_minikv_hooks", None):
        return
    if not model._can_set_attn_implementation():
        raise ValueError(f"minikv.hf: {type(model).__name__} does not dispatch attention through "
                         "transformers' AttentionInterface; it cannot be routed through a policy")
    AttentionInterface.register(ATTENTION, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, sdpa_mask)  # masks as for SDPA (used only without a policy)
    previous = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION)
    hooks = [model.register_forward_pre_hook(_before_forward, with_kwargs=True),
             model.register_forward_hook(_after_forward, with_kwargs=True)]
    hooks += [m.register_forward_pre_hook(_rope_positions, with_kwargs=True) for m in _rotary_modules(model)]
    model._minikv_hooks = (hooks, previous)


def detach(model) -> None:
    """Undo `attach`: remove the hooks, give the model back its previous attention."""
    hooks, previous = getattr(model, "_minikv_hooks", None) or ((), None)
    for h in hooks:
        h.remove()
    if previous is not None:
        model.set_attn_implementation(previous)
    model._minikv_hooks = None


def cache(model, spec, *, max_new_tokens: int | None = None, max_len: int | None = None) -> PolicyCache:
    """A PolicyCache for one generation with policy `spec` (a spec string or an unbound Policy),
    to pass to `generate` or the model's forward under the name `cache_argument(model)` gives.
    Attaches the model (see `attach`). The policy is bound at the first forward, sized for the
    prompt plus max_new_tokens (or max_len tokens in all)."""
    attach(model)
    c = PolicyCache(model, spec, max_new_tokens=max_new_tokens, max_len=max_len)
    model._minikv_cache = c
    return c


def stats(model) -> dict:
    """The stats() of the policy behind the model's last PolicyCache."""
    c = getattr(model, "_minikv_cache", None)
    if c is None:
        raise ValueError("minikv.hf: this model has not run under a minikv policy")
    return c.stats()


# -- the context manager ---------------------------------------------------------------------------


class PolicyRun:
    """What `with minikv.hf.policy(model, spec) as run:` gives: the last generation's cache."""

    def __init__(self, model, spec):
        self.model, self.spec = model, spec
        self.cache: PolicyCache | None = None

    @property
    def policy(self) -> Policy | None:
        return self.cache.policy if self.cache is not None else None

    def stats(self) -> dict:
        if self.cache is None:
            raise ValueError("minikv.hf: no generation has run under this policy yet")
        return self.cache.stats()

    def generate(self, original, args, kwargs):
        if any(isinstance(v, Cache) for v in kwargs.values()):
            return original(*args, **kwargs)  # the caller brought a cache of their own
        kwargs = dict(kwargs)
        if args:  # generate(inputs, generation_config, ...): only the first is usual positionally
            kwargs["inputs"], args = args[0], args[1:]
        ids = kwargs.get("inputs", kwargs.get("input_ids"))
        prompt = ids.shape[1] if ids is not None else kwargs["inputs_embeds"].shape[1]
        gen = kwargs.get("generation_config") or self.model.generation_config
        new = kwargs.get("max_new_tokens", gen.max_new_tokens)
        max_len = None if new is not None else kwargs.get("max_length", gen.max_length)
        self.cache = c = cache(self.model, self.spec, max_new_tokens=new, max_len=max_len)
        c.in_generate = True
        try:
            while True:
                try:
                    return original(*args, **{cache_argument(self.model): c}, **kwargs)
                except _Rewind:
                    kwargs = self._restart(kwargs, prompt, new)
        finally:
            c.in_generate = False

    def _restart(self, kwargs, prompt: int, new: int | None) -> dict:
        """generate again from the tokens kept after a rewind; the cache continues."""
        c = self.cache
        if kwargs.get("streamer") is not None or kwargs.get("return_dict_in_generate"):
            raise ValueError(f"minikv.hf: policy {c.policy.name!r} rewound {c.last_action.rewind} tokens, "
                             "which a streamer or return_dict_in_generate cannot take back; disable the "
                             "policy's rewind (softfreeze: max_rewalks=0)")
        if c.tokens is None:
            raise ValueError("minikv.hf: a rewind restarts generate from token ids; inputs_embeds cannot")
        kwargs = {k: v for k, v in kwargs.items() if k not in ("inputs", "input_ids", "inputs_embeds")}
        kwargs["inputs"] = c.tokens
        kwargs["attention_mask"] = torch.ones_like(c.tokens)
        if new is not None:
            kwargs["max_new_tokens"] = new - (c.tokens.shape[1] - prompt)
        return kwargs


@contextmanager
def policy(model, spec):
    """Inside the block, `model.generate(...)` runs every attention layer through a fresh binding
    of policy `spec` (a spec string such as "freekv:budget=256", or an unbound Policy). Yields a
    PolicyRun: `run.stats()` is the last generation's policy stats."""
    make(spec)  # a bad spec fails here, not at the first generate
    was_attached = bool(getattr(model, "_minikv_hooks", None))
    attach(model)
    run = PolicyRun(model, spec)
    original = model.generate
    model.generate = lambda *args, **kwargs: run.generate(original, args, kwargs)
    try:
        yield run
    finally:
        del model.generate  # the instance attribute: the class's method shows through again
        if not was_attached:
            detach(model)

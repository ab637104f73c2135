"""How a transformers model reaches its PolicyCache: the "minikv" attention function registered
with AttentionInterface, hooks on the forward (begin, end) and on the rotary embedding (a
renumbering policy's positions), and `attach` / `detach`, which install and remove them. `cache`
and `stats` are the entry points without the context manager (run.py)."""
from __future__ import annotations

import inspect
import math
import typing

from transformers import AttentionInterface, Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .policy_cache import PADDING, PolicyCache, _active, _active_cache, _rotary_modules, renumbers

ATTENTION = "minikv"  # the name under which the attention function is registered


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
    if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None or dropout:
        raise ValueError("minikv.hf: logit softcapping, attention sinks and dropout are not supported")
    D = query.shape[-1]
    if scaling is not None and not math.isclose(scaling, D ** -0.5, rel_tol=1e-6):
        # every policy scales scores by 1/sqrt(D); a model with another scale (Gemma 3's
        # query_pre_attn_scalar^-1/2) gets it by scaling q, as minikv's gemma3 family does
        query = query * (scaling * math.sqrt(D))
    return cache.attend(i, query, key, value, attention_mask, kwargs), None


def mask(*args, **kwargs):
    """The "minikv" mask function: none under a PolicyCache, whose policy masks causally and its
    windows by position (a sliding window's mask, which transformers builds for a prompt longer
    than the window, is the policy's own work); a padding mask is refused. SDPA's otherwise."""
    if _active_cache() is None:
        return sdpa_mask(*args, **kwargs)
    padding = kwargs.get("attention_mask")  # (B, kv_length) bool, True where a token is real
    if padding is not None and not bool(padding.all()):
        raise ValueError(PADDING)
    return None


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
    # the rotary embedding's forward(x, position_ids[, layer_type]): rotate at the positions the
    # policy asks for; the local layers whose windows the runtime keeps, at the absolute ones
    # (Gemma 3's rotary takes the layer type; _check_rope refuses a model whose rotary does not)
    cache = _active_cache()
    if cache is None or not renumbers(cache.policy):
        return None
    if cache.policy.windows and kwargs.get("layer_type", args[2] if len(args) > 2 else None) == "sliding_attention":
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
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION, mask)  # SDPA's masks without a policy
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
    vars(model).pop("_minikv_hooks", None)


def cache(model, spec, *, max_new_tokens: int | None = None, max_len: int | None = None) -> PolicyCache:
    """A PolicyCache for one generation with policy `spec` (a spec string or an unbound Policy),
    to pass to `generate` or the model's forward under the name `cache_argument(model)` gives.
    Attaches the model (see `attach`). The policy is bound at the first forward, sized for the
    prompt plus max_new_tokens (or max_len tokens in all)."""
    c = PolicyCache(model, spec, max_new_tokens=max_new_tokens, max_len=max_len)  # a model it cannot hold: refused first
    attach(model)
    model._minikv_cache = c
    return c


def stats(model) -> dict:
    """The stats() of the policy behind the model's last PolicyCache."""
    c = getattr(model, "_minikv_cache", None)
    if c is None:
        raise ValueError("minikv.hf: this model has not run under a minikv policy")
    return c.stats()

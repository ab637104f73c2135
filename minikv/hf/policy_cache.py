"""PolicyCache: a transformers Cache whose storage is a minikv policy, one generation long.

Its layers (PolicyLayer) store nothing: `update` notes the new k and returns it, and the policy
stores k and v when the "minikv" attention function (wiring.py) hands it the query too.
`begin` and `end` run from hooks on the model's forward (wiring.py): the first forward binds the
policy, each one ends with `policy.end_step` on the next-token logits, and a rewind (softfreeze's
rewalk) rolls the cache back.
"""
from __future__ import annotations

import inspect
import threading

import torch
from transformers import Cache
from transformers.cache_utils import CacheLayerMixin

from ..config import LAYER_TYPES, ModelConfig, _rope_params
from ..models.rope import rope_inv_freq
from ..policies import Policy, make

PADDING = "minikv.hf: the attention mask masks some tokens (padding?); minikv policies take unpadded sequences"
_active = threading.local()  # .cache: the PolicyCache of the forward now running, if any (wiring.py sets it)


def _active_cache():
    return getattr(_active, "cache", None)


class _Rewind(Exception):
    """Raised out of a forward inside `policy(...)` when the policy rewound: generate restarts."""


# -- the model's shape, for binding ---------------------------------------------------------------


def model_config(config) -> tuple[ModelConfig, bool]:
    """minikv's ModelConfig for a transformers config, and whether minikv computes the same RoPE
    frequencies (only policies that re-rotate keys need them). A model that is not a decoder of
    attention layers (an encoder-decoder such as T5, a state-space model such as Mamba) is a
    ValueError that says so."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"minikv.hf: {config.model_type} is an encoder-decoder model; minikv policies hold the "
                         "self-attention KV of decoder-only models")
    c = config.get_text_config(decoder=True)
    if not getattr(c, "num_attention_heads", None) or not getattr(c, "num_hidden_layers", None):
        raise ValueError(f"minikv.hf: {c.model_type} has no attention layers (its config has no num_attention_heads); "
                         "minikv policies hold the KV of attention layers")
    raw = c.to_dict()
    n_heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_heads
    params = raw.get("rope_parameters") or {}
    if "full_attention" in params:  # one RoPE per layer type (Gemma 3): a policy rotates the global layers
        params = params["full_attention"] or {}
        raw = {**raw, "rope_parameters": params}
    partial = raw.get("partial_rotary_factor", params.get("partial_rotary_factor", raw.get("rotary_pct", 1.0)))
    rotary_dim = int(head_dim * partial)
    theta, scaling = _rope_params(raw)
    try:
        rope_inv_freq(rotary_dim, theta, scaling)
        rope_known = True
    except (ValueError, KeyError):  # a RoPE type minikv does not implement (yarn, dynamic, ...)
        scaling, rope_known = None, False
    types = tuple(getattr(c, "layer_types", None) or ())
    if set(types) - set(LAYER_TYPES):
        raise ValueError(f"minikv.hf: layers of types {sorted(set(types))}; minikv policies hold full_attention "
                         "layers and keep sliding_attention ones to their window, no other kind")
    # sliding_attention layers (all of Mistral's, Gemma 3's local ones) keep their window: in the
    # runtime's rings when it is shorter than the sequence (policies/window.py), the policy
    # governs the rest
    window = getattr(c, "sliding_window", None) if not types or "sliding_attention" in types else None
    cfg = ModelConfig(
        model_type=c.model_type, vocab_size=c.vocab_size, hidden_size=c.hidden_size,
        intermediate_size=getattr(c, "intermediate_size", 4 * c.hidden_size), n_layers=c.num_hidden_layers,
        n_heads=n_heads, n_kv_heads=kv_heads(c), head_dim=head_dim,
        max_position_embeddings=c.max_position_embeddings, rope_theta=theta, rope_scaling=scaling,
        rotary_dim=rotary_dim, sliding_window=window, layer_types=types if len(set(types)) > 1 else None,
    )
    return cfg, rope_known


MHA_ONLY = ("gpt_neox",)  # architectures whose attention has as many KV heads as query heads, always


def kv_heads(c) -> int:
    """KV heads of a transformers text config: num_key_value_heads, where the architecture reads
    it (a gpt_neox config may carry one its attention ignores)."""
    if c.model_type in MHA_ONLY:
        return c.num_attention_heads
    return getattr(c, "num_key_value_heads", None) or c.num_attention_heads


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
        if key_states.shape[1] != self.cache.cfg.n_kv_heads:
            raise ValueError(f"minikv.hf: layer {self.index} has {key_states.shape[1]} KV heads, the model config "
                             f"{self.cache.cfg.n_kv_heads} (num_key_value_heads); this architecture is not supported")
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
        self.bound = False  # bound at this cache's first forward (a Policy object may come bound from an earlier one)

    def __repr__(self):
        return f"PolicyCache({self.policy.name}, seen={self.seen})"

    def stats(self) -> dict:
        if not self.bound:
            raise ValueError("minikv.hf: the policy is bound at the first forward; no stats before it")
        return self.policy.stats()

    # -- one forward -----------------------------------------------------------------------------
    def begin(self, ids, embeds, position_ids) -> None:
        B, T = (ids if ids is not None else embeds).shape[:2]
        if not self.bound:  # this generation's first forward: bind, as minikv.generate binds, afresh
            self._bind(B, T)
            self.bound = True
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
            raise ValueError(PADDING)
        if kwargs.get("sliding_window") != self.cfg.layer_window(i):
            raise ValueError(f"minikv.hf: layer {i} uses a sliding window of {kwargs.get('sliding_window')}, "
                             f"the model config says {self.cfg.layer_window(i)}")
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
        self.policy.end_step(last)
        action = self.last_action = self.policy.last_action
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
        # one table (inv_freq), or one per layer type (Gemma 3: full_attention_inv_freq, ...), of
        # which the global layers' is the one the policy renumbers
        kind = "" if hasattr(module, "inv_freq") else "full_attention_"
        inv = getattr(module, f"{kind}inv_freq", None)
        if inv is None:
            continue
        found = True
        if policy.windows and "layer_type" not in inspect.signature(module.forward).parameters:
            raise ValueError(f"minikv.hf: policy {policy.name!r} renumbers the global layers' positions, and this "
                             f"model rotates its local and global layers with one table ({type(module).__name__}); "
                             "use a policy that keeps positions")
        scale = getattr(module, f"{kind}attention_scaling", 1.0)
        ours = policy.rope.inv_freq.to(inv.device, inv.dtype)
        if inv.shape != ours.shape or not torch.allclose(inv, ours, rtol=1e-6, atol=0) or scale != 1.0:
            raise ValueError(f"minikv.hf: policy {policy.name!r} renumbers positions, and this model's RoPE "
                             f"({type(module).__name__}) differs from minikv's; use a policy that keeps positions")
    if not found:
        raise ValueError(f"minikv.hf: policy {policy.name!r} renumbers positions, and no rotary embedding "
                         "module was found in this model to rotate at the new positions")


def _rotary_modules(model):
    return [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]

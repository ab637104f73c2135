"""The context manager `policy(model, spec)`: inside it, `model.generate` runs under a fresh
PolicyCache per call, and restarts from the kept tokens when the policy rewinds."""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers import Cache

from ..policies import Policy, make
from .policy_cache import PolicyCache, _Rewind, model_config
from .wiring import attach, cache, cache_argument, detach


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
    of policy `spec` (a spec string such as "freekv:budget=256", or an unbound Policy): the
    full-attention layers through the policy, sliding-window ones through the window the runtime
    keeps (one as long as the sequence is no window: the policy governs it too). Yields a
    PolicyRun: `run.stats()` is the last generation's policy stats. Blocks nest: inside an inner
    block its policy applies, and the outer one again after it; when the outermost block ends,
    the model is as it was before it (attention, hooks, `generate`), but for the last cache, which
    `minikv.hf.stats(model)` reads."""
    make(spec)  # a bad spec fails here, not at the first generate
    model_config(model.config)  # so does a model without attention layers
    saved = vars(model).get("generate")  # an outer block's, or none (the class's method)
    was_attached = bool(getattr(model, "_minikv_hooks", None))
    attach(model)
    run = PolicyRun(model, spec)
    original = model.generate  # an outer block's generate hands a call with our cache straight through
    model.generate = lambda *args, **kwargs: run.generate(original, args, kwargs)
    try:
        yield run
    finally:
        if not was_attached:
            detach(model)
        if saved is not None:
            model.generate = saved
        else:
            del model.generate  # the instance attribute: the class's method shows through again

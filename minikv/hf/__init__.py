"""minikv's KV-cache policies inside Hugging Face transformers models (transformers 5).

    import minikv.hf
    with minikv.hf.policy(model, "freekv:budget=256") as run:
        out = model.generate(input_ids, max_new_tokens=64)
    run.stats()                       # the policy's stats(), as minikv's own runtime reports them

    cache = minikv.hf.cache(model, "streaming:budget=512", max_new_tokens=64)  # or a cache
    out = model.generate(input_ids, **{minikv.hf.cache_argument(model): cache}, max_new_tokens=64)

`cache_argument` names the forward's Cache argument: `cache` from transformers 5.24,
`past_key_values` before. transformers is an optional extra (`pip install minikv[hf]`); only this
package imports it, and only when it is imported itself. A transformers layer hands k and v to its
cache and the query to its attention function; a policy needs both at once. Where to read what:

    policy_cache.py   PolicyCache, PolicyLayer: a Cache that stores nothing: `update` notes the
                      new k and returns it; get_seq_length counts the tokens seen; get_mask_sizes
                      describes exactly what `update` returned. PolicyCache.begin, end: bind the
                      policy at the first forward, hand the next-token logits to `policy.end_step`
                      after each
    wiring.py         attention: the "minikv" attention function (AttentionInterface), the
                      policy's prefill or decode; plain SDPA without a PolicyCache; mask: no mask
                      under one (the policy masks). The hooks on the forward that call begin and
                      end; _rope_positions, a hook on the rotary embedding: `policy.rope_positions`
                      (streaming). attach, detach, cache
    run.py            policy(model, spec), PolicyRun.generate: a rewind (softfreeze's rewalk)
                      restarts `generate` from the kept tokens, same cache; in a loop of your own,
                      read `cache.last_action`

Decisions (docs/design.md, "The flow of one request", "Local and global layers"): attention checks
by identity that its keys are those `update` just returned; the policy masks itself, so a padding
mask is refused; the hooks find the PolicyCache by its type, not by the argument's name, which
transformers changed in 5.24. On a model whose layer_types mix sliding_attention and
full_attention (Gemma 3), the sliding layers keep their window in the runtime's rings and the
policy governs the full-attention layers, as in minikv's own runtime.
"""
try:
    import transformers
except ImportError as err:  # pragma: no cover - exercised only without the extra
    raise ImportError("minikv.hf needs transformers 5: pip install 'minikv[hf]'") from err

if int(transformers.__version__.split(".")[0]) < 5:
    raise ImportError(f"minikv.hf needs transformers >= 5 (its Cache-layer API), found {transformers.__version__}")

from .policy_cache import PolicyCache, PolicyLayer, model_config, renumbers  # noqa: E402
from .run import PolicyRun, policy  # noqa: E402
from .wiring import ATTENTION, attach, attention, cache, cache_argument, detach, stats  # noqa: E402

__all__ = ["ATTENTION", "PolicyCache", "PolicyLayer", "PolicyRun", "attach", "attention", "cache", "cache_argument",
           "detach", "model_config", "policy", "renumbers", "stats"]

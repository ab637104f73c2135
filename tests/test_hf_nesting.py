"""minikv.hf.policy blocks inside one another: the inner policy applies inside, the outer one
again after it, and the model leaves the outermost block exactly as it entered it; a gpt_neox
config carrying a num_key_value_heads its attention ignores runs (needs the hf extra)."""
import pytest
import torch

pytestmark = [pytest.mark.hf, pytest.mark.filterwarnings("error::FutureWarning")]

OUTER = "streaming:sink=2,window=6,R=2,slack=0,max_drop=0"
INNER = "freekv:page_size=4,sink=4,window=8,budget=24"


@pytest.fixture(scope="module")
def tiny_llama(reference_dir):
    from transformers import AutoModelForCausalLM

    path = reference_dir / "models" / "llama_gqa3"
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def gen(hf, ids):
    return hf.generate(ids, max_new_tokens=10, do_sample=False, eos_token_id=None)


def state(hf):
    """What a block may change on the model: attention, hooks, instance attributes."""
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in hf.modules())
    return hf.config._attn_implementation, hooks, sorted(k for k in vars(hf) if k != "_minikv_cache")


def alone(hf, ids, spec):
    import minikv.hf

    with minikv.hf.policy(hf, spec) as run:
        return gen(hf, ids), run.stats()


@pytest.mark.parametrize("inner_spec", [INNER, OUTER])  # another policy, and the same one nested
def test_nested_blocks_apply_the_inner_policy_inside_and_restore_the_outer(tiny_llama, inner_spec):
    import minikv.hf

    hf = tiny_llama
    ids = torch.tensor([(torch.arange(30) * 3 % 97).tolist()])
    want_outer, outer_stats = alone(hf, ids, OUTER)
    want_inner, inner_stats = alone(hf, ids, inner_spec)
    plain = gen(hf, ids)
    before = state(hf)
    with minikv.hf.policy(hf, OUTER) as outer:
        assert torch.equal(gen(hf, ids), want_outer)
        with minikv.hf.policy(hf, inner_spec) as inner:
            assert torch.equal(gen(hf, ids), want_inner)
        assert inner.stats() == inner_stats and inner.policy.name == inner_spec.partition(":")[0]
        assert torch.equal(gen(hf, ids), want_outer)  # the outer policy again, with fresh numbers
        assert outer.stats() == outer_stats and outer.policy is not inner.policy
    assert state(hf) == before
    assert "generate" not in vars(hf) and "_minikv_hooks" not in vars(hf)
    assert torch.equal(gen(hf, ids), plain)


def test_an_error_in_an_inner_block_restores_both(tiny_llama):
    import minikv.hf

    hf = tiny_llama
    before = state(hf)
    with pytest.raises(KeyError):
        with minikv.hf.policy(hf, OUTER):
            with minikv.hf.policy(hf, INNER):
                raise KeyError("inside")
    assert state(hf) == before


def test_gpt_neox_with_an_unused_num_key_value_heads_runs():
    """GPTNeoX attention has as many KV heads as query heads whatever num_key_value_heads says."""
    import minikv.hf
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    config = GPTNeoXConfig(vocab_size=101, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, max_position_embeddings=256)
    config.num_key_value_heads = 2  # as some converted configs carry: GPTNeoX does not read it
    hf = GPTNeoXForCausalLM(config).eval()
    ids = torch.tensor([(torch.arange(20) * 5 % 97).tolist()])
    plain = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    with minikv.hf.policy(hf, "full") as run:
        out = hf.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=None)
    assert torch.equal(out, plain)
    assert run.policy.cfg.n_kv_heads == 4


# -- issue 52: a Policy object in a second block; models without decoder attention -------------------


def test_a_policy_object_serves_a_second_block_as_minikv_generate_rebinds_it(tiny_llama):
    import minikv.hf
    from minikv.policies import make

    ids = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45]])
    policy = make(INNER)
    with minikv.hf.policy(tiny_llama, policy) as run:
        first = gen(tiny_llama, ids)
    used = run.stats()["device_tokens_peak"]
    with minikv.hf.policy(tiny_llama, policy) as run:  # bound by the first block: bound again here
        second = gen(tiny_llama, ids)
        assert gen(tiny_llama, ids).tolist() == first.tolist()  # and again within the block
    assert second.tolist() == first.tolist() == alone(tiny_llama, ids, INNER)[0].tolist()
    assert run.stats()["device_tokens_peak"] == used and run.policy is policy


def tiny(kind):
    from transformers import MambaConfig, MambaForCausalLM, T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    if kind == "mamba":
        return MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, state_size=4)).eval()
    return T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, d_kv=8, num_layers=1,
                                               num_heads=2)).eval()


@pytest.mark.parametrize("kind, says", [("mamba", "mamba has no attention layers"),
                                        ("t5", "t5 is an encoder-decoder model")])
def test_a_model_without_decoder_attention_is_a_value_error_that_says_why(kind, says):
    import minikv.hf

    model = tiny(kind)
    before = (model.config._attn_implementation, vars(model).keys() - {"_minikv_cache"})
    with pytest.raises(ValueError, match=f"^minikv.hf: {says}"):
        with minikv.hf.policy(model, "full"):
            pass
    with pytest.raises(ValueError, match=f"^minikv.hf: {says}"):
        minikv.hf.cache(model, "full", max_new_tokens=4)
    assert (model.config._attn_implementation, vars(model).keys() - {"_minikv_cache"}) == before  # left as it was

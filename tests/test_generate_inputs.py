"""generate's arguments are what they say (issue 42): a prompt is a str or token ids, counts are
integers (numpy's included, bool not), a batch names its bad prompt, and one Policy object serves
one generate at a time."""
import threading

import numpy as np
import pytest

import minikv


def test_a_bytes_prompt_is_refused_not_read_as_token_ids(smollm2):
    model, tok = smollm2
    for prompt in (b"The capital", bytearray(b"The capital")):
        with pytest.raises(ValueError, match="a prompt is a str or a list of token ids, got bytes"):
            minikv.generate(model, tok, prompt, max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt 1 of the batch: a prompt is a str"):
        minikv.generate(model, tok, ["The capital", b"of France"], max_new_tokens=1)
    with pytest.raises(ValueError, match="token ids must be integers, not booleans"):
        minikv.generate(model, tok, [1, True], max_new_tokens=1)


def test_integer_arguments_take_numpy_integers_and_refuse_bool(smollm2):
    model, tok = smollm2
    ids = tok.encode("The capital of France is")
    out = minikv.generate(model, tok, ids, max_new_tokens=np.int64(3), stop_at_eos=False)
    assert len(out.token_ids) == 3
    again = minikv.generate(model, tok, [np.int64(t) for t in ids], max_new_tokens=3, stop_at_eos=False,
                            temperature=0.7, top_k=np.int32(5), seed=np.int64(1))
    assert len(again.token_ids) == 3  # one prompt of numpy ids, not a batch
    for name, value in (("max_new_tokens", True), ("max_new_tokens", 2.0), ("top_k", True), ("seed", False)):
        kwargs = {"temperature": 0.7} if name != "max_new_tokens" else {}
        with pytest.raises(ValueError, match=f"{name} must be an integer"):
            minikv.generate(model, tok, ids, **{"max_new_tokens": 2, **kwargs, name: value})


def test_the_batch_says_which_prompt_is_empty(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="prompt 2 of the batch: the prompt is empty"):
        minikv.generate(model, tok, ["Hello", "The capital", "   "], max_new_tokens=1)
    with pytest.raises(ValueError, match="prompt 0 of the batch: the prompt is empty"):
        minikv.generate(model, tok, [[], [1, 2]], max_new_tokens=1)


def test_one_policy_object_refuses_a_second_concurrent_generate(smollm2):
    model, tok = smollm2
    policy = minikv.make_policy("streaming:sink=4,window=28")
    want = minikv.generate(model, tok, "The capital of France is", policy="streaming:sink=4,window=28",
                           max_new_tokens=6, stop_at_eos=False)
    inside, release, results, errors = threading.Event(), threading.Event(), [], []

    def first():
        def on_token(row, token):
            inside.set()
            release.wait(60)  # holds the policy until the second generate has been tried

        results.append(minikv.generate(model, tok, "The capital of France is", policy=policy, max_new_tokens=6,
                                       stop_at_eos=False, on_token=on_token))

    t = threading.Thread(target=first)
    t.start()
    assert inside.wait(120)
    try:
        with pytest.raises(RuntimeError, match="already generating .* its own policy"):
            minikv.generate(model, tok, "Another prompt entirely", policy=policy, max_new_tokens=2)
    finally:
        release.set()
        t.join(120)
    assert results[0].token_ids == want.token_ids and not errors  # the first run was not disturbed
    after = minikv.generate(model, tok, "The capital of France is", policy=policy, max_new_tokens=6,
                            stop_at_eos=False)  # one after the other is fine
    assert after.token_ids == want.token_ids

"""The generation loop: sampling, stopping, batches, errors, and the real model's first answer."""
import json
import subprocess
import sys

import pytest
import torch

import minikv
from minikv.generate import check_sampling, decode_n_tokens, sample
from minikv.policies import StepAction

from .fixtures import CPU_ONLY

# -- sampling, no model ------------------------------------------------------------------------


def test_greedy_is_argmax():
    logits = torch.randn(3, 50)
    assert torch.equal(sample(logits), logits.argmax(-1))


def test_top_k_only_draws_from_the_k_best():
    logits = torch.randn(1, 100)
    best = set(torch.topk(logits[0], 5).indices.tolist())
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(logits, temperature=1.0, top_k=5, generator=g)) for _ in range(200)}
    assert draws <= best and len(draws) > 1


def test_top_p_keeps_the_smallest_nucleus():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    g = torch.Generator().manual_seed(0)
    draws = {int(sample(probs.log(), temperature=1.0, top_p=0.75, generator=g)) for _ in range(300)}
    assert draws == {0, 1}  # 0.5 < 0.75 needs the second token; 0.8 >= 0.75 stops there


def test_seed_repeats():
    logits = torch.randn(2, 30)
    a = [sample(logits, 0.8, None, 0.9, torch.Generator().manual_seed(7)) for _ in range(3)]
    assert all(torch.equal(a[0], x) for x in a)


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=1.0, top_p=0.0), "top_p"),
    (dict(temperature=1.0, top_p=1.5), "top_p"),
    (dict(temperature=1.0, top_k=0), "top_k"),
])
def test_impossible_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(kwargs.get("temperature", 0.0), kwargs.get("top_k"), kwargs.get("top_p"))


# -- the real model ----------------------------------------------------------------------------


def test_a_rewind_feeds_the_first_dropped_token_again_at_its_old_position():
    """A policy that dropped the KV of its last r tokens says so through the contract
    (policy.last_action, set in its end_step: here by the stand-in model, which plays both); the
    loop takes the r tokens back (on_token(row, -r)) and feeds the first of them again at the
    position it had, then goes on from there."""
    fed, seen = [], []

    class Rewinding:  # what the loop reads of a policy
        last_action = None

    def model(ids, positions, policy, logits_at):  # ids (1, 1), positions (1, 1) -> logits (1, V)
        p = int(positions[0, 0])
        fed.append((int(ids[0, 0]), p))
        policy.last_action = StepAction(rewind=2) if len(fed) == 3 else None  # after feeding 17 at 7
        return torch.nn.functional.one_hot(torch.tensor([11 + p]), 100).float()  # greedy: 11 + p

    first = torch.nn.functional.one_hot(torch.tensor([15]), 100).float()  # the prompt's 5 tokens: 15 at 5
    out = decode_n_tokens(model, first, torch.tensor([5]), Rewinding(), 5, set(), (0.0, None, None), None,
                          on_token=lambda row, tok: seen.append(tok))
    assert out == [[15, 16, 17, 18, 19]]
    assert fed == [(15, 5), (16, 6), (17, 7), (16, 6), (17, 7), (18, 8)]
    assert seen == [15, 16, 17, -2, 16, 17, 18, 19]


def test_chat_answers_paris(smollm2):
    model, tok = smollm2
    result = minikv.generate(model, tok, "What is the capital of France?", chat=True, max_new_tokens=24)
    assert "Paris" in result.text
    assert result.token_ids[-1] in tok.eos_ids  # stopped at the end of its turn, not at the limit
    stats = result.stats
    for key in ("prompt_tokens", "new_tokens", "ttft_s", "tpot_s", "tokens_per_s", "device_tokens",
                "host_tokens", "device_tokens_peak", "device_bytes", "host_bytes"):
        assert key in stats
    assert stats["new_tokens"] == len(result.token_ids)
    assert stats["device_tokens"] == stats["prompt_tokens"] + stats["new_tokens"] - 1  # last token never fed
    assert stats["host_tokens"] == 0


def test_greedy_matches_transformers(smollm2, reference_dir):
    """Token for token the greedy chat continuation Hugging Face computed from the same GGUF."""
    from safetensors.torch import load_file

    model, tok = smollm2
    ref = load_file(str(reference_dir / "models" / "smollm2" / "expected.safetensors"))
    prompt = ref["chat_prompt_ids"][0].tolist()
    expected = ref["chat_greedy_ids"][0].tolist()
    result = minikv.generate(model, tok, prompt, max_new_tokens=len(expected), stop_at_eos=False)
    assert result.token_ids == expected


def test_seeded_sampling_repeats_and_ignore_eos(smollm2):
    model, tok = smollm2
    run = lambda seed: minikv.generate(model, tok, "Once upon a time", max_new_tokens=12, temperature=0.9,  # noqa: E731
                                       top_p=0.95, seed=seed, stop_at_eos=False)
    a, b, c = run(1), run(1), run(2)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    assert a.token_ids != c.token_ids


def test_batch_of_different_lengths_equals_single_runs(smollm2):
    model, tok = smollm2
    prompts = ["The capital of Italy is", "Water boils at a temperature of one hundred", "Hi"]
    batch = minikv.generate(model, tok, prompts, max_new_tokens=8, stop_at_eos=False)
    for prompt, got in zip(prompts, batch):
        alone = minikv.generate(model, tok, prompt, max_new_tokens=8, stop_at_eos=False)
        assert got.token_ids == alone.token_ids


def test_prompt_errors(smollm2):
    model, tok = smollm2
    with pytest.raises(ValueError, match="empty"):
        minikv.generate(model, tok, "   ")
    with pytest.raises(ValueError, match="unknown policy 'nope'"):
        minikv.generate(model, tok, "hi", policy="nope")
    too_long = [5] * (model.cfg.max_position_embeddings + 3)
    with pytest.raises(ValueError, match="3 more than the model's context of 8192"):
        minikv.generate(model, tok, too_long)
    with pytest.raises(ValueError, match="exceeds the model's context of 8192 tokens by 10"):
        minikv.generate(model, tok, [5] * 8000, max_new_tokens=202)


def test_cli_streams_and_reports_json(smollm2):
    cmd = [sys.executable, "-m", "minikv.generate", "--model", "smollm2", "--chat", "--max-new-tokens", "12",
           "--prompt", "What is the capital of France?"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert "Paris" in text
    out = subprocess.run(cmd + ["--json"], capture_output=True, text=True, check=True).stdout
    data = json.loads(out)
    assert "Paris" in data["text"] and data["stats"]["new_tokens"] == len(data["token_ids"])
    bad = subprocess.run(cmd[:-2] + ["--prompt", "x", "--top-p", "2"], capture_output=True, text=True)
    assert bad.returncode != 0 and "top_p must be in (0, 1]" in bad.stderr


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -1.0])
def test_temperature_must_be_finite_and_non_negative(temperature):
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        check_sampling(temperature, None, None)


def test_token_ids_outside_the_vocabulary_are_a_clean_error(reference_dir):
    """Ids through the API (generate with ids, or the model forward) are checked: an embedding
    lookup out of range is an IndexError on a CPU and a device assert on CUDA."""
    from minikv.loading import load_model

    # CPU_ONLY: the checks before the lookup, on the device where it would be an IndexError
    model = load_model(reference_dir / "models" / "llama_gqa3", device=CPU_ONLY, dtype=torch.float32)
    V = model.cfg.vocab_size
    for ids in ([1, 2, V], [-1, 3]):
        with pytest.raises(ValueError, match=f"outside the model's vocabulary of {V}"):
            minikv.generate(model, None, ids, max_new_tokens=2)
        with pytest.raises(ValueError, match=f"outside the model's vocabulary of {V}"):
            model(torch.tensor([ids]))
    with pytest.raises(ValueError, match="token ids must be integers"):
        minikv.generate(model, None, [1, 2.5], max_new_tokens=2)
